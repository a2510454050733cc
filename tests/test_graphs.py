"""Graph tests on the fake process group: world size 8 in one process, no real communication."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch import nn
from torch._C import DispatchKey
from torch._dynamo.backends.common import aot_autograd

import simplefsdp
from simplefsdp import compile_sharded
from simplefsdp.ir.capture import cyclic_gc_paused
from simplefsdp.models.llama import build_model

ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def forward_backward_graphs(model: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.fx.Graph, torch.fx.Graph]:
    """The forward and backward graphs AOTAutograd hands to the compiler (min-cut partitioner, as Inductor)."""
    graphs = []

    def keep(graph_module, _example_inputs):
        graphs.append(graph_module.graph)
        return make_boxed_func(graph_module.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(*inputs).sum().backward()
    forward, backward = graphs
    return forward, backward


def count(graph: torch.fx.Graph, op) -> int:
    return sum(node.target is op for node in graph.nodes)


def regathered_params(model: nn.Module) -> int:
    """The parameters of every block but the last (``layers.*``), which the backward gathers again."""
    last = f"layers.{len(model.layers) - 1}."
    return sum(name.startswith("layers.") and not name.startswith(last) for name, _ in model.named_parameters())


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_backward_regathers_only_when_resharding(fake_world, reshard_after_forward):
    torch.manual_seed(0)
    model = compile_sharded(build_model("debug"), reshard_after_forward=reshard_after_forward, compile=False)
    num_params = len(list(model.parameters()))
    forward, backward = forward_backward_graphs(model, torch.randint(0, 256, (2, 16)))
    assert count(forward, ALL_GATHER) == num_params
    assert count(backward, REDUCE_SCATTER) == num_params
    # The blocks' parameters are gathered again for backward; the last block's, which the backward needs first, and
    # those outside the blocks (embedding, norm, output) stay gathered, as torchtitan keeps its last block's and FSDP2
    # its root's; the embedding's backward reads only the token ids anyway.
    assert count(backward, ALL_GATHER) == (regathered_params(model) if reshard_after_forward else 0)


def test_accumulating_without_sync_still_reshards_after_forward(fake_world):
    """With gradient sync off the backward re-gathers as with sync on (ZeRO-3 memory: the only extra memory is the
    accumulated gradients) and reduces nothing."""
    torch.manual_seed(0)
    model = compile_sharded(build_model("debug"), compile=False)
    model.set_requires_gradient_sync(False)
    num_params = len(list(model.parameters()))
    forward, backward = forward_backward_graphs(model, torch.randint(0, 256, (2, 16)))
    assert count(forward, ALL_GATHER) == num_params
    assert count(backward, ALL_GATHER) == regathered_params(model)  # as with sync on
    assert count(backward, REDUCE_SCATTER) == 0


class MaskedBias(nn.Module):
    """A parameter that reaches the output only through ``torch.where`` with a scalar, as T5's relative attention
    bias reaches its decoder's attention scores."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(4, 4, dtype=torch.bool, device=x.device).tril()
        return x + torch.where(causal, self.bias, -1e4)


def test_a_parameter_read_through_a_decomposed_op_is_reduce_scattered_when_traced_on_meta():
    """``where(mask, x, scalar)`` decomposes for autograd; on meta tensors torch 2.13's Python dispatcher ran its meta
    kernel instead and dropped the gradient (and DTensor's backward failed). The capture decomposes it, and leaves
    torch's dispatch tables as it found them."""
    report = simplefsdp.inspect(MaskedBias(), (torch.randn(2, 4, 4),), world_size=2, buckets=None, device="meta")
    assert [node.collective.kind for node in report.schedules[1].collectives()] == ["reduce_scatter"]
    assert DispatchKey.AutogradMeta not in torch.ops.aten.where.ScalarOther.py_kernels


class TiedOutput(nn.Module):
    """An embedding whose table is also the output layer (GPT-2's tying): the root gathers it once per call, in a
    forward pre-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.output = nn.Linear(8, 16, bias=False)
        self.output.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(self.embed(tokens)))


def test_inspect_of_a_tied_model_prices_its_whole_step():
    """The root's pre-hook (the tied table's gather) is traced into the model's graph, as in ``compile_sharded``'s
    compiled call, so the captured backward is the model's, not the hook's: a reduce-scatter per parameter, the tied
    one once, and the forward gathers each parameter once."""
    report = simplefsdp.inspect(TiedOutput(), (torch.randint(0, 16, (2, 4)),), world_size=2, buckets=None)
    forward, backward = ([node.collective.kind for node in schedule.collectives()] for schedule in report.schedules)
    assert forward == ["all_gather"] * 3  # embed.weight (= output.weight), hidden.weight, hidden.bias
    assert backward.count("reduce_scatter") == 3


@pytest.mark.parametrize("enabled", [True, False])
def test_tracing_pauses_the_cyclic_gc_and_leaves_it_as_it_was(enabled):
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), cyclic_gc_paused():
            raise RuntimeError("a failed trace")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
