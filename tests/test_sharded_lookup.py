"""The embedding looked up where its rows are sharded (``runtime/sharded_lookup.py``): which collectives its graphs
hold, and training on 2 gloo ranks bitwise equal to eager FSDP2, which gathers the table."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

from ranks import run_on_ranks
from simplefsdp import compile_sharded
from simplefsdp.models.llama import build_model
from test_graphs import ALL_GATHER, REDUCE_SCATTER, forward_backward_graphs, regathered_params

VOCABULARY, DIM = 4096, 64  # 8 ranks x 32 tokens, 4 times over, is 1024 rows: the lookup pays


def collectives(graph: torch.fx.Graph, op) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of the output of each call of ``op`` in ``graph``."""
    return [(node.meta["val"].dtype, node.meta["val"].numel()) for node in graph.nodes if node.target is op]


def test_the_table_is_never_gathered_and_its_gradient_never_reduce_scattered(fake_world):
    model = compile_sharded(build_model("debug", vocab_size=VOCABULARY), compile=False)
    forward, backward = forward_backward_graphs(model, torch.randint(0, VOCABULARY, (2, 16)))
    tokens, table = 8 * 2 * 16, VOCABULARY * DIM
    others = len(list(model.parameters())) - 1
    # forward: every rank's ids gathered; each rank's embeddings of them reduce-scattered back; every other parameter
    assert collectives(forward, ALL_GATHER).count((torch.int64, tokens)) == 1
    assert collectives(forward, REDUCE_SCATTER) == [(torch.float32, 2 * 16 * DIM)]
    assert len(collectives(forward, ALL_GATHER)) == others + 1
    # backward: the embeddings' gradient gathered, the blocks but the last re-gathered, every gradient but the
    # table's reduced
    assert collectives(backward, ALL_GATHER).count((torch.float32, tokens * DIM)) == 1
    assert len(collectives(backward, ALL_GATHER)) == regathered_params(model) + 1
    assert len(collectives(backward, REDUCE_SCATTER)) == others
    # of the table's size: the output layer's weight alone (kept gathered outside the blocks, as FSDP2's root's)
    assert collectives(forward, ALL_GATHER).count((torch.float32, table)) == 1
    assert collectives(backward, REDUCE_SCATTER).count((torch.float32, table // 8)) == 1  # a shard of 8


def test_the_table_is_gathered_when_asked_and_where_the_tokens_outnumber_its_rows(fake_world):
    table = (torch.float32, VOCABULARY * DIM)
    for options, batch in (({"sharded_lookup": False}, 2), ({}, 9)):  # 8 ranks x 9 x 16 tokens, x 4, > 4096
        model = compile_sharded(build_model("debug", vocab_size=VOCABULARY), compile=False, **options)
        forward, _ = forward_backward_graphs(model, torch.randint(0, VOCABULARY, (batch, 16)))
        assert collectives(forward, ALL_GATHER).count(table) == 2, options  # the table and the output layer
        assert not collectives(forward, REDUCE_SCATTER), options


def test_aotautograds_cache_keeps_a_model_with_a_lookup(fake_world):
    """So a warm start loads the model's graphs instead of tracing them again (torch 2.13 bypasses the cache for a
    graph holding an ``autograd.Function``, as the lookup's averaging once was: 42 s against 25 s to the first step of
    an 80-layer Hugging Face Llama on 2 ranks)."""
    counters.clear()
    model = compile_sharded(build_model("debug", vocab_size=VOCABULARY))
    model(torch.randint(0, VOCABULARY, (2, 16))).sum().backward()
    cache = counters["aot_autograd"]
    assert cache["autograd_cache_bypass"] == 0 and cache["total"] >= 1, dict(cache)
    assert cache["autograd_cache_saved"] + cache["autograd_cache_hit"] == cache["total"], dict(cache)


def test_a_table_tied_to_the_output_layer_is_gathered(fake_world):
    """The output layer reads the same parameter, gathered once per call for both (``gather_tied_once_per_call``)."""
    model = compile_sharded(build_model("debug", vocab_size=VOCABULARY, tie_embeddings=True), compile=False)
    assert "_ranks_agree_on_shapes" not in vars(model.tok_embeddings)


class Embedded(nn.Module):
    """An embedding with a padding row, outside two blocks, and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 16, padding_idx=3)  # 2 ranks x 10 tokens, 4 times over, is 80 rows
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 512)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return self.out(hidden)


def _train(wrapper: str) -> tuple[list[torch.Tensor], torch.Tensor, list[tuple[int, ...]]]:
    """Three AdamW steps on this rank's ids (few distinct ones, the padding id among them, so that rows repeat within
    and across ranks); the losses, the table's last gradient and the input shape of every all-gather of the last
    step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Embedded()
    if wrapper == "fsdp2":
        for layer in model.layers:
            fully_shard(layer)
        model = fully_shard(model)
    else:
        model = compile_sharded(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        ids = torch.randint(0, 8, (2, 5), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        ids[0, 0] = 3
        with torch.profiler.profile(record_shapes=True) as profile:
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
        gradient = model.embed.weight.grad.full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    gathered = [tuple(event.input_shapes[0]) for event in profile.events()
                if event.name == "_c10d_functional::all_gather_into_tensor"]
    return losses, gradient, gathered


def _both() -> dict:
    return {wrapper: _train(wrapper) for wrapper in ("simplefsdp", "fsdp2")}


def test_training_is_bitwise_eager_fsdp2s():
    """On 2 ranks a row's gradient sums each rank's tokens in token order, each halved (exact, barring subnormals),
    then the two ranks (in either order: one addition): FSDP2's arithmetic, which halves the sum, so the losses and
    gradients are bitwise equal under ``aot_eager``."""
    for rank in run_on_ranks(2, _both):
        (losses, gradient, gathered), (fsdp2_losses, fsdp2_gradient, _) = rank["simplefsdp"], rank["fsdp2"]
        # the ids (2 x 5) and the embeddings' gradient (10 x 16) gathered; of shards of 256 x 16, the output layer's
        # alone (once: kept gathered outside the blocks), not the table's
        assert (10,) in gathered and (10, 16) in gathered and gathered.count((256, 16)) == 1, gathered
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(losses, fsdp2_losses))
        assert torch.equal(gradient, fsdp2_gradient)
        assert torch.count_nonzero(gradient[3]) == 0  # the padding row
