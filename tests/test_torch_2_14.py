"""Graph shapes torch 2.14 makes or needs, checked on torch 2.13 too: the suite runs on 2.13.0, so each shape is
checked directly, on graphs traced on the fake process group.

- torch 2.14 lowers Inductor's ``control_deps`` by realizing every argument and every output, which a subgraph (a
  region's block) and a ``None`` gradient cannot be: until ``passes/inductor_internals.py`` reshaped a pinned region
  call, every multi-rank run with blocks compiled once failed there ("realize NYI on Subgraph").
- torch 2.14's partitioner can save a gathered weight for the backward before its wait (the all-gather's result is a
  graph output): Inductor's bucketing wants the wait as the one user (``passes/bucket_apply.py: _one_wait``).
"""

import operator

import pytest
import torch
from torch import fx
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import compile_sharded
from simplefsdp.ir.capture import capture_graphs
from simplefsdp.ir.schedule import pinned
from simplefsdp.models.llama import build_model
from simplefsdp.passes.bucket_apply import _one_wait
from simplefsdp.passes.bucket_plan import find_blocks
from simplefsdp.passes.install import OverlapPasses
from simplefsdp.passes.region_inputs import recompute_region_inputs
from simplefsdp.runtime.fake_world import fake_world

all_gather = torch.ops._c10d_functional.all_gather_into_tensor.default
wait_tensor = torch.ops._c10d_functional.wait_tensor.default


@pytest.fixture(scope="module")
def reordered():
    """The debug Llama's forward and backward, blocks compiled once, after our passes, on 8 fake ranks. Three
    layers: the backward gathers the first two again (the last keeps its gathers), so a prefetch hides behind the
    middle block's region call."""
    torch.manual_seed(0)
    model = build_model("debug", n_layers=3)
    with fake_world(8):
        compile_sharded(model, mesh=init_device_mesh("cpu", (8,)), compile=False, compile_blocks_once=True)
        graphs = capture_graphs(model, (torch.randint(0, 256, (2, 16)),), fused_attention=False,
                                joint_pass=recompute_region_inputs)
        passes = OverlapPasses("block", reorder=True, blocks=find_blocks(model))
        for gm, phase in ((graphs.forward, "forward"), (graphs.backward, "backward")):
            list(passes.stages(gm, phase))
    return graphs.forward, graphs.backward


def pinned_region_calls(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.GraphModule]]:
    """Each pinned node of ``gm`` whose wrapped op is a region call, with the graph that wraps it."""
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and pinned(node):
            wrapped = getattr(gm, node.args[1].target)
            if any(inner.target is torch.ops.higher_order.invoke_subgraph for inner in wrapped.graph.nodes):
                calls.append((node, wrapped))
    return calls


def test_pinned_region_calls_pass_no_subgraph_and_return_nones_as_constants(reordered):
    nones = 0
    for gm in reordered:
        calls = pinned_region_calls(gm)
        assert calls, "the reorder pass pins a region call in each graph (a prefetch hides behind it)"
        for node, wrapped in calls:
            subgraphs = [arg for arg in node.args[2:] if isinstance(arg, fx.Node) and arg.op == "get_attr"]
            assert not subgraphs, node.format_node()
            for inner in wrapped.graph.find_nodes(op="get_attr"):  # Inductor resolves it on the outer graph
                assert isinstance(getattr(gm, inner.target), fx.GraphModule)
                assert getattr(wrapped, inner.target) is getattr(gm, inner.target)
            values, returned = node.meta["val"], wrapped.graph.output_node().args[0]
            if any(value is None for value in values):  # returned item by item, a None as a constant
                assert [item is None for item in returned] == [value is None for value in values]
                assert all(item.target is operator.getitem for item in returned if item is not None)
                nones += 1
        gm.graph.lint()
    assert nones, "a backward region call returns a None gradient (the rope buffer's)"



def test_a_gathered_weight_saved_unwaited_is_read_from_its_wait():
    """The forward of a kept (not resharded) weight as torch 2.14 partitions it, two parameters bucketed into one
    all-gather: each all-gather's result is also a graph output, which now reads its wait."""
    graph = fx.Graph()
    shards = [graph.placeholder(f"shard_{index}") for index in range(2)]
    gathered, waited = [], []
    for shard in shards:
        gathered.append(graph.call_function(all_gather, (shard, 8, "0")))
        waited.append(graph.call_function(wait_tensor, (gathered[-1],)))
    graph.output((*[graph.call_function(torch.ops.aten.mul.Tensor, (tensor, 2)) for tensor in waited], *gathered))
    for collective in gathered:
        _one_wait(graph, collective)
    assert [list(collective.users) for collective in gathered] == [[wait] for wait in waited]
    assert graph.output_node().args[0][2:] == tuple(waited)
