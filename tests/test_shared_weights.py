"""Weights read more than once (tied, or a module called twice; and Hugging Face's GPT-2) get the right gradient, with
and without gradient accumulation, in every mode, under Inductor and with activation checkpointing, and with each
block compiled once (a weight tied inside a block; GPT-2's blocks); a tied weight and any pending accumulated sum are
reduced once.

One 2-rank launch runs every case; each case accumulates over 1, 2 and 4 micro-batches (sync off for all but the
last) and compares every gradient with one process's gradient on the whole global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zoo
from collectives import CountCollectives
from ranks import run_on_ranks
from scenarios import U, gamma
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from simplefsdp import MixedPrecision, compile_sharded
from simplefsdp.runtime.activation_checkpoint import apply_activation_checkpointing

VOCAB, DIM, MICRO_BATCH, TOKENS = 64, 16, 2, 9
MICRO_BATCHES = (1, 2, 4)

# fp32 bound on the norm-wise relative difference of a gradient computed with the batch split over micro-batches
# and ranks against one process on the whole batch: the per-token terms are summed in another order, at most
# 4 micro-batches x 2 ranks x 2 sequences x 8 tokens = 128 terms (gamma_128, Higham section 3.1), along a chain of
# about 10 dependent reductions (embedding, mid (twice), output, softmax's sum, and the mirror in backward);
# elementwise ops (tanh, exp) may round differently in another kernel: 2u each on ~10 ops.
BOUND = 10 * gamma(128) + 10 * 2 * U


class TiedEmbedding(nn.Module):
    """GPT-2's tying: the output layer's weight is the embedding's."""

    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.embedding, self.mid = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.embedding.weight
        self.activation_checkpointing = activation_checkpointing

    def block(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing:
            return checkpoint(lambda h: torch.tanh(self.mid(h)), hidden, use_reentrant=False)
        return torch.tanh(self.mid(hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.block(self.embedding(tokens)))


class CalledTwice(TiedEmbedding):
    """Untied, but ``mid`` is called twice in one forward: weights shared by call (ALBERT, a looped block)."""

    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__(activation_checkpointing)
        self.output.weight = nn.Parameter(self.embedding.weight.detach().clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.block(self.block(self.embedding(tokens))))


class TiedInBlocks(nn.Module):
    """Repeated blocks, each reading one weight twice (``up`` and ``down`` tied, ALBERT-style within a block): with
    ``compile_blocks_once`` a block gathers it once and its region reads it twice."""

    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.embedding, self.output = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.layers = nn.ModuleList(TiedBlock() for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.output(hidden)


class TiedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False)
        self.down.weight = self.up.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.tanh(self.up(hidden)))


class GPT2(nn.Module):
    """Hugging Face's GPT-2 (tiny, ``tests/zoo.py``): its output layer is its token embedding."""

    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.model = zoo.build("gpt2", layers=1)
        if activation_checkpointing:  # train's per-block checkpointing (Hugging Face's own: see CASES)
            apply_activation_checkpointing(self.model.transformer.h, "full")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


CASES = {  # name: (model class, activation checkpointing, compile_sharded options)
    "tied-fully_shard-inductor-checkpointed": (TiedEmbedding, True, {}),
    "twice-fully_shard-inductor": (CalledTwice, False, {}),
    "tied-fully_shard-aot_eager": (TiedEmbedding, False, {"backend": "aot_eager"}),
    "tied-replicate-inductor": (TiedEmbedding, False, {"mode": "replicate"}),
    "tied-hybrid_shard-inductor-checkpointed": (TiedEmbedding, True, {"mode": "hybrid_shard"}),
    "twice-replicate-aot_eager-checkpointed": (CalledTwice, True, {"backend": "aot_eager", "mode": "replicate"}),
    "twice-hybrid_shard-aot_eager": (CalledTwice, False, {"backend": "aot_eager", "mode": "hybrid_shard"}),
    "twice-fully_shard-eager-checkpointed": (CalledTwice, True, {"compile": False}),
    "gpt2-fully_shard-inductor": (GPT2, False, {}),
    "tied_in_blocks-fully_shard-aot_eager-blocks_once": (TiedInBlocks, False,
                                                         {"backend": "aot_eager", "compile_blocks_once": True}),
    "gpt2-fully_shard-aot_eager-blocks_once": (GPT2, False, {"backend": "aot_eager", "compile_blocks_once": True}),
    # Hugging Face's own gradient checkpointing recomputes GPT-2's dropout, and AOTAutograd 2.13 then saves the DTensor
    # mesh among the tensors for backward and fails; simplefsdp's per-block checkpointing saves random ops instead
    "gpt2-replicate-aot_eager-checkpointed": (GPT2, True, {"backend": "aot_eager", "mode": "replicate"}),
    "gpt2-hybrid_shard-aot_eager": (GPT2, False, {"backend": "aot_eager", "mode": "hybrid_shard"}),
}


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _case(model_class, activation_checkpointing: bool, options: dict) -> dict:
    torch.manual_seed(0)
    model = model_class(activation_checkpointing)
    reference = copy.deepcopy(model)
    if options.get("mode") == "hybrid_shard":  # 2 replicas of 1 shard: the replicas' all-reduce
        options = {**options, "mesh": init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))}
    compile_sharded(model, **options)
    world, rank = dist.get_world_size(), dist.get_rank()
    errors, reductions = {}, {}
    # The first pass compiles every variant (sync on, off, pending); the second one, which is read, only runs them.
    for count in MICRO_BATCHES + MICRO_BATCHES:
        data = torch.randint(0, VOCAB, (world * count * MICRO_BATCH, TOKENS),
                             generator=torch.Generator().manual_seed(count))
        for index, micro_batch in enumerate(data.chunk(world)[rank].chunk(count)):
            model.set_requires_gradient_sync(index == count - 1)
            loss = _loss(model, micro_batch) / count  # Dynamo runs a call under a dispatch mode eagerly: count after
            with CountCollectives() as counter:
                loss.backward()
        reductions[count] = sum(n for name, n in counter.counts.items() if "reduce" in name)
        reference.zero_grad()
        _loss(reference, data).backward()
        expected = dict(reference.named_parameters())
        errors[count] = {name: ((p.grad.full_tensor() - expected[name].grad).norm() / expected[name].grad.norm()).item()
                         for name, p in model.named_parameters()}
        model.zero_grad()
    return {"errors": errors, "reductions": reductions, "parameters": len(list(model.parameters()))}


def _all_cases() -> dict:
    return {name: _case(*case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_on_ranks(2, _all_cases)[0]


@pytest.mark.parametrize("case", CASES)
def test_gradient_of_a_shared_weight_matches_one_process(results, case):
    bound = zoo.zoo_bound(chain=1) if case.startswith("gpt2") else BOUND  # its one block: derived in zoo.py
    for count, errors in results[case]["errors"].items():
        for name, error in errors.items():
            assert error <= bound, f"{count} micro-batch(es): {name} differs by {error:.2e} (bound {bound:.2e})"


@pytest.mark.parametrize("case", [name for name in CASES if "twice" not in name and "aot_eager" in name])
def test_a_tied_parameter_is_reduced_once_per_synced_backward(results, case):
    """Compiled without our passes (aot_eager) nothing is bucketed: one reduction per parameter, the tied one too
    (a compiled call gathers it once). The sum over a pending accumulation is reduced once as well."""
    result = results[case]
    assert all(count == result["parameters"] for count in result["reductions"].values()), result["reductions"]


@pytest.mark.parametrize("case", [name for name in CASES if "twice" in name])
def test_a_pending_sum_is_reduced_once_for_a_module_called_twice(results, case):
    """A module called twice is gathered and reduced at each call when its gradient goes straight to the reduction
    (one reduction per call: the same sum), but its pending sum after accumulation is reduced once."""
    result = results[case]
    assert all(count == result["parameters"] for n, count in result["reductions"].items() if n > 1), result


def _bf16_accumulation(reduce_every_micro_batch: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = compile_sharded(CalledTwice(), backend="aot_eager",
                            mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    data = torch.randint(0, VOCAB, (8 * MICRO_BATCH, TOKENS), generator=torch.Generator().manual_seed(8))
    for index, micro_batch in enumerate(data.chunk(8)):
        model.set_requires_gradient_sync(reduce_every_micro_batch or index == 7)
        (_loss(model, micro_batch) / 8).backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def _deferred_and_every() -> tuple[dict, dict]:
    return _bf16_accumulation(False), _bf16_accumulation(True)


def test_deferred_bf16_gradients_accumulate_in_the_reduce_dtype():
    """bf16 compute, fp32 reduce: 8 micro-batches accumulated unreduced then reduced once equal the same 8 reduced
    one by one and summed in fp32, within fp32 rounding: sums of the same 8 x 2 ranks bf16-exact terms in another
    order (gamma_16). Rounding the accumulated sum to bf16 before its reduction would differ by ~2^-9."""
    for deferred, every in run_on_ranks(2, _deferred_and_every)[:1]:
        for name, grad in every.items():
            difference = ((deferred[name] - grad).norm() / grad.norm()).item()
            assert difference <= 2 * gamma(16), f"{name}: {difference:.2e}"
