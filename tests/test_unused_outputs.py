"""A forward output the loss does not read gives its parameters no gradient, as in plain PyTorch and FSDP2
(FSDP2's ``test_unused_forward_output``): after ``zero_grad(set_to_none=True)`` their ``grad`` stays None."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from torch import fx, nn

from simplefsdp import compile_sharded
from simplefsdp.passes.dead_gathers import drop_dead_gathers, plan_dead_gathers
from simplefsdp.runtime.unused_outputs import drop_region_inputs, unread_region_inputs

DIM, LOCAL_BATCH, WORLD = 8, 2, 2
# (the loss reads both outputs, zero_grad's set_to_none after the step) per step: the second output goes unread with
# its parameters' grad a zero tensor (step 1, which must stay a zero tensor, and momentum moves them), then None
# (steps 2 and 4, which must stay None: SGD leaves them be), and is read again in between (step 3).
STEPS = [(True, False), (False, True), (False, False), (True, True), (False, False)]


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.first(x)), torch.relu(self.second(x))


def _model() -> TwoOutputs:
    """Weights in eighths below 1/2 and inputs in quarters below 1: with the loss a mean over 64 or 32 elements (on a
    rank 32 or 16, then the ranks' average of 2), lr 1/8 and momentum 1/2, every value of 5 steps is a dyadic rational
    of at most 20 significant bits (gradients k/2^8, momentum buffers k/2^12, weights k/2^15 below 1, outputs k/2^17
    below 8), so every fp32 sum and product is exact in any order: the sharded and compiled runs must equal plain
    PyTorch bitwise."""
    torch.manual_seed(0)
    model = TwoOutputs()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randint(-4, 5, param.shape) / 8)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(-2, 3, (LOCAL_BATCH * WORLD, DIM), generator=torch.Generator().manual_seed(step)) / 4


def _train(model: nn.Module, rows: slice) -> list[dict[str, torch.Tensor | None]]:
    """Each step's parameters and gradients (None where a parameter has none), full tensors."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1 / 8, momentum=1 / 2)
    record = []
    for step, (reads_both, set_to_none) in enumerate(STEPS):
        first, second = model(_batch(step)[rows])
        (torch.cat([first, second]) if reads_both else first).mean().backward()
        grads = {f"{name}.grad": _full(param.grad) for name, param in model.named_parameters()}
        optimizer.step()
        record.append({**grads, **{name: _full(param.detach()) for name, param in model.named_parameters()}})
        optimizer.zero_grad(set_to_none=set_to_none)
    return record


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``tensor`` (the optimizer and ``zero_grad`` change it in place), whole where it is a DTensor."""
    if tensor is None:
        return None
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def _sharded(backend: str) -> list[dict[str, torch.Tensor | None]]:
    model = compile_sharded(_model(), backend=backend)
    rank = dist.get_rank()
    return _train(model, slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH))


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_parameters_of_an_unread_output_get_no_gradient(backend):
    # the loss on both outputs is a mean of the two concatenated: the same mean over rows and features either way
    expected = _train(_model(), slice(None))
    assert expected[2]["second.weight.grad"] is None and torch.equal(expected[1]["second.weight.grad"],
                                                                     torch.zeros(DIM, DIM))
    for rank_record in run_on_ranks(WORLD, _sharded, backend):
        for step, (actual, reference) in enumerate(zip(rank_record, expected)):
            for name, value in reference.items():
                assert (actual[name] is None) == (value is None), f"step {step}: {name} is {actual[name]}"
                assert value is None or torch.equal(actual[name], value), f"step {step}: {name} differs"


def test_a_region_input_its_subgraph_never_reads_is_dropped_from_the_region_and_its_calls():
    """The plan names the input a region only aliases (as a block's region aliases each input), by position; dropped,
    the graph computes the same outputs, and the unread input has no user left (its gradient: None, as eager's)."""
    region = torch.compiler.nested_compile_region(lambda used, unread: (torch.ops.aten.alias(unread), used * 2)[1])
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(x, w):
        return region(x, w), region(x + 1, w)

    inputs = (torch.ones(2), torch.full((2,), 3.0))
    expected = torch.compile(forward, backend=capture, fullgraph=True)(*inputs)
    gm = graphs[0]
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    unread = gm.graph.find_nodes(op="placeholder")[1]  # w, in the position Dynamo gave it among a call's operands
    assert unread_region_inputs(gm) == {calls[0].args[0].target: (calls[0].args[2:].index(unread),)}
    drop_region_inputs(gm, unread_region_inputs(gm))
    assert unread_region_inputs(gm) == {}
    assert [len(node.users) for node in gm.graph.find_nodes(op="placeholder")] == [2, 0]
    assert all(map(torch.equal, gm(*inputs), expected))


def test_an_all_gather_nothing_reads_is_dropped_and_one_read_stays():
    """What ``drop_region_inputs`` leaves in the traced forward, an all-gather whose wait nothing reads, is not sent."""
    graph = fx.Graph()
    read, unread = graph.placeholder("read"), graph.placeholder("unread")
    functional = torch.ops._c10d_functional
    gather, wait = functional.all_gather_into_tensor.default, functional.wait_tensor.default
    kept = graph.call_function(wait, (graph.call_function(gather, (read, 2, "0")),))
    dropped = graph.call_function(gather, (unread, 2, "0"))
    graph.call_function(wait, (dropped,))
    graph.output(kept)
    assert plan_dead_gathers(graph) == (dropped.name,)
    drop_dead_gathers(graph, plan_dead_gathers(graph))
    graph.lint()
    assert [node.args[0] for node in graph.nodes if node.target is gather] == [read]
    assert len(graph.find_nodes(op="call_function", target=wait)) == 1
