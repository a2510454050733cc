"""Let the partitioner recompute what a compiled-once block reads: its gathered parameters (resharding after forward),
and what it makes of a mask.

A region's forward returns the gathered weights its backward needs as saved outputs, which the outer partitioner can
only keep; ``recompute_region_inputs`` points each use of such an output at the region's input, the must-recompute
gather, so backward gathers again. ``compute_biases_once`` first moves the additive bias a region makes of an
attention mask out of the region, so its calls share one, as the whole graph's layers do. Run on the joint graph,
before partitioning."""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

# What a mask is made into an additive bias by: ops whose results are exact or correctly rounded (no transcendental),
# so the bias made outside the region equals the one made inside bitwise, however Inductor fuses it; views; constants.
_MAKES_A_BIAS = {getattr(torch.ops.aten, name) for name in (
    "where", "masked_fill", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt", "le", "gt", "ge",
    "bitwise_not", "bitwise_and", "bitwise_or", "_to_copy", "clone", "add", "sub", "mul", "neg", "full",
    "scalar_tensor", "zeros", "ones")} | {torch.ops.prims.convert_element_type}


def recompute_region_inputs(gm: fx.GraphModule) -> int:
    """Replace every use of an ``invoke_subgraph`` output that its subgraph returns unchanged from an input by that
    input, after ``compute_biases_once``; return how many outputs were rewired."""
    compute_biases_once(gm)
    rewired = 0
    for call in _region_calls(gm):
        subgraph = getattr(gm, call.args[0].target).graph
        placeholders = {node: index for index, node in enumerate(subgraph.find_nodes(op="placeholder"))}
        returned = subgraph.find_nodes(op="output")[0].args[0]
        for user in list(call.users):
            if user.target is operator.getitem and returned[user.args[1]] in placeholders:
                user.replace_all_uses_with(call.args[2 + placeholders[returned[user.args[1]]]])
                gm.graph.erase_node(user)
                rewired += 1
    return rewired


def compute_biases_once(gm: fx.GraphModule) -> int:
    """Where a region's forward saves, for its backward alone, a tensor that ``_MAKES_A_BIAS``' ops make of one
    boolean or integer input (an attention bias of a mask), make it in ``gm`` instead, once per mask the calls pass,
    and pass it in: the calls save the one tensor, as the whole graph's layers do. Return how many outputs moved."""
    moved = 0
    for forward_name, calls in _calls_by_subgraph(gm).items():
        forward = getattr(gm, forward_name)
        for index, made in enumerate(forward.graph.find_nodes(op="output")[0].args[0]):
            made_of = _made_of_one_mask(made) if isinstance(made, fx.Node) else None
            if made_of is None or not _read_by_backward_alone(calls, index):
                continue
            mask, nodes = made_of
            mask_position = 2 + forward.graph.find_nodes(op="placeholder").index(mask)
            biases: dict[fx.Node, fx.Node] = {}  # per mask the calls pass, the bias made of it
            for call in calls:
                outer_mask = call.args[mask_position]
                if outer_mask not in biases:
                    copies = {mask: outer_mask}
                    with gm.graph.inserting_before(call):
                        for node in nodes:
                            copies[node] = gm.graph.node_copy(node, copies.__getitem__)
                    biases[outer_mask] = copies[made]
                call.args = (*call.args, biases[outer_mask])
                if "eager_input_vals" in call.meta:  # Inductor lowers a region call with the operands' values here
                    values, keywords = call.meta["eager_input_vals"]
                    call.meta["eager_input_vals"] = (*values, made.meta["val"]), keywords
            with forward.graph.inserting_after(forward.graph.find_nodes(op="placeholder")[-1]):
                bias = forward.graph.placeholder(f"{made.name}_made_once")
            bias.meta = dict(made.meta)
            made.replace_all_uses_with(bias)
            forward.graph.eliminate_dead_code()
            forward.recompile()
            moved += 1
    return moved


def _region_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)


def _calls_by_subgraph(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    calls: dict[str, list[fx.Node]] = {}
    for call in _region_calls(gm):
        calls.setdefault(call.args[0].target, []).append(call)
    return calls


def _read_by_backward_alone(calls: list[fx.Node], index: int) -> bool:
    """Whether only other regions' calls (their backward) read output ``index`` of ``calls``, and some do."""
    readers = [reader for call in calls for getitem in call.users
               if getitem.target is operator.getitem and getitem.args[1] == index for reader in getitem.users]
    return bool(readers) and all(reader.target is torch.ops.higher_order.invoke_subgraph
                                 and reader.args[0].target != calls[0].args[0].target for reader in readers)


def _made_of_one_mask(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The boolean or integer placeholder and the nodes (in graph order) that make ``node`` of it alone by
    ``_MAKES_A_BIAS``' ops; None where ``node`` is not such a tensor, or is the placeholder itself."""
    seen: dict[fx.Node, None] = {}
    stack, masks = [node], set()
    while stack:
        current = stack.pop()
        if current in seen or current in masks:
            continue
        if current.op == "placeholder":
            value = current.meta.get("val")
            if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
                return None
            masks.add(current)
            continue
        target = current.target
        if current.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not (
                target.is_view or target.overloadpacket in _MAKES_A_BIAS):
            return None
        seen[current] = None
        stack.extend(current.all_input_nodes)
    if len(masks) != 1 or not seen:
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return masks.pop(), sorted(seen, key=order.__getitem__)


class RecomputeRegionInputs(CustomGraphPass):
    """``recompute_region_inputs`` as Inductor's ``joint_custom_pre_pass``, keyed in its caches by this file."""

    def __call__(self, graph: fx.Graph) -> None:
        recompute_region_inputs(graph.owning_module)

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
