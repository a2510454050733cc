"""Let the partitioner recompute what a compiled-once block reads: its gathered parameters (resharding after forward).

A region's forward returns the gathered weights its backward needs as saved outputs, which the outer partitioner can
only keep; ``recompute_region_inputs`` points each use of such an output at the region's input, the must-recompute
gather, so backward gathers again. Run on the joint graph, before partitioning."""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass


def recompute_region_inputs(gm: fx.GraphModule) -> int:
    """Replace every use of an ``invoke_subgraph`` output that its subgraph returns unchanged from an input by that
    input; return how many outputs were rewired."""
    rewired = 0
    for call in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        subgraph = getattr(gm, call.args[0].target).graph
        placeholders = {node: index for index, node in enumerate(subgraph.find_nodes(op="placeholder"))}
        returned = subgraph.find_nodes(op="output")[0].args[0]
        for user in list(call.users):
            if user.target is operator.getitem and returned[user.args[1]] in placeholders:
                user.replace_all_uses_with(call.args[2 + placeholders[returned[user.args[1]]]])
                gm.graph.erase_node(user)
                rewired += 1
    return rewired


class RecomputeRegionInputs(CustomGraphPass):
    """``recompute_region_inputs`` as Inductor's ``joint_custom_pre_pass``, keyed in its caches by this file."""

    def __call__(self, graph: fx.Graph) -> None:
        recompute_region_inputs(graph.owning_module)

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
