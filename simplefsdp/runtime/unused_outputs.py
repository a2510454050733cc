"""A compiled model's parameter that gets no gradient keeps ``.grad`` as it was, as in eager PyTorch and FSDP2.

torch 2.13's compiled backward hands zeros for an output the loss does not read (pytorch#131794), so an input feeding
only such outputs got an all-zero gradient. Each Dynamo graph is read once for which outputs each input reaches; a hook
on the outputs' backward node drops the gradient of every leaf input that reaches none the loss read. The compiled
backward, its reduce-scatters included, still runs whole. Before that, each region input its subgraph never reads (a
block's parameter its compute does not read) is dropped from the region, so that parameter gets no gradient either;
one it reads only into integers (an indexer's weight picking top-k positions) is handed to the region detached.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._dynamo.backends.registry import lookup_backend  # private: a backend's name to its function


def graph_outputs(gm: fx.GraphModule) -> tuple:
    """What Dynamo's graph ``gm`` returns: a flat tuple, one entry per output the compiled graph returns."""
    values = gm.graph.output_node().args[0]
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


def outputs_reached(gm: fx.GraphModule) -> list[int]:
    """For each placeholder of ``gm``, in order, a bit mask of the output positions it reaches."""
    output = gm.graph.output_node()
    reached: dict[fx.Node, int] = {}
    for position, value in enumerate(graph_outputs(gm)):
        if isinstance(value, fx.Node):
            reached[value] = reached.get(value, 0) | 1 << position
    for node in reversed(gm.graph.nodes):
        for user in node.users:
            if user is not output:
                reached[node] = reached.get(node, 0) | reached.get(user, 0)
    return [reached.get(node, 0) for node in gm.graph.find_nodes(op="placeholder")]


_ALIASES = (torch.ops.aten.alias, torch.ops.aten.alias.default)


def unread_region_inputs(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """By subgraph name, the positions of the tensor inputs that a region (``invoke_subgraph``) of ``gm`` never reads
    (aliased at most, the alias unused): a block's parameter its compute does not read."""
    unread = {}
    for name in sorted({call.args[0].target for call in gm.graph.find_nodes(
            op="call_function", target=torch.ops.higher_order.invoke_subgraph)}):
        placeholders = getattr(gm, name).graph.find_nodes(op="placeholder")
        positions = tuple(index for index, node in enumerate(placeholders)
                          if isinstance(node.meta.get("example_value"), torch.Tensor)
                          and all(user.target in _ALIASES and not user.users for user in node.users))
        if positions:
            unread[name] = positions
    return unread


def drop_region_inputs(gm: fx.GraphModule, unread: dict[str, tuple[int, ...]]) -> None:
    """Remove the inputs ``unread`` names from their regions and the matching operands from every call of them: a
    parameter a region never reads then gets no gradient, as in the whole graph, which never gathers it (handed to
    the region, its gathered copy's gradient was None, which DTensor's redistribute backward cannot take)."""
    for name, positions in unread.items():
        body = getattr(gm, name)
        for index, node in enumerate(body.graph.find_nodes(op="placeholder")):
            if index in positions:
                for user in list(node.users):
                    body.graph.erase_node(user)
                body.graph.erase_node(node)
        body.recompile()
    for call in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        positions = unread.get(call.args[0].target, ())
        call.args = (*call.args[:2], *(arg for index, arg in enumerate(call.args[2:]) if index not in positions))
    gm.recompile()


def drop_unread_region_inputs(gm: fx.GraphModule) -> None:
    """Drop from ``gm``'s regions the inputs their subgraphs never read, and the operands from the regions' calls;
    detach the operands of the inputs they read without a gradient (``ungraded_region_inputs``)."""
    if unread := unread_region_inputs(gm):
        drop_region_inputs(gm, unread)
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    ungraded = {name: ungraded_region_inputs(getattr(gm, name)) for name in {call.args[0].target for call in calls}}
    for call in calls:
        for index in ungraded[call.args[0].target]:
            with gm.graph.inserting_before(call):
                call.update_arg(2 + index, gm.graph.call_method("detach", (call.args[2 + index],)))
    if any(ungraded.values()):
        gm.recompile()


def ungraded_region_inputs(body: fx.GraphModule) -> tuple[int, ...]:
    """The positions of a region's inputs requiring a gradient that reach its outputs through integer or boolean values
    alone (an indexer's weight that only picks top-k positions, as DeepSeek-V3.2's sparse attention): they get no
    gradient, and handed to the region as requiring one, their gathered copy's gradient was None, which DTensor's
    redistribute backward cannot take. A value Dynamo recorded no tensor for counts as carrying a gradient."""
    graded: set[fx.Node] = set()
    output = body.graph.output_node()
    for node in reversed(body.graph.nodes):
        if _carries_gradient(node) and any(user is output or user in graded for user in node.users):
            graded.add(node)
    return tuple(index for index, node in enumerate(body.graph.find_nodes(op="placeholder")) if node.users
                 and node not in graded and getattr(node.meta.get("example_value"), "requires_grad", False))


def _carries_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s value could carry a gradient: not a tensor (or tuple of tensors) of integers or booleans."""
    value = node.meta.get("example_value")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return not all(isinstance(v, torch.Tensor) for v in values) or any(
        v.is_floating_point() or v.is_complex() for v in values)


class KeepGradientsOfUnusedOutputs:
    """A Dynamo backend: ``backend``'s compiled graph, its regions' unread inputs dropped first
    (``drop_region_inputs``), whose leaf inputs get no gradient from outputs the loss does not read
    (``keep_gradients_of_unused_outputs``)."""

    def __init__(self, backend: str | Callable) -> None:
        self.backend = backend

    def reset(self) -> None:
        """``torch._dynamo.reset()``'s call: the wrapped backend's reset (Inductor's frees its CUDA graphs)."""
        getattr(lookup_backend(self.backend), "reset", lambda: None)()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        drop_unread_region_inputs(gm)
        compiled = lookup_backend(self.backend)(gm, example_inputs, **kwargs)
        reached = outputs_reached(gm)
        every_output = (1 << len(graph_outputs(gm))) - 1
        if all(mask in (0, every_output) for mask in reached):  # no input could miss a gradient eager would give
            return compiled

        def call(*args: Any) -> Any:
            outputs = compiled(*args)
            keep_gradients_of_unused_outputs(args, outputs, reached)
            return outputs

        return call


def keep_gradients_of_unused_outputs(inputs: Sequence[Any], outputs: Sequence[Any], reached: list[int]) -> None:
    """Make the backward of ``outputs`` give no gradient to a leaf of ``inputs`` whose ``reached`` mask (of output
    positions) holds no output that got a gradient. Outputs from another backward node than the one most share count
    as read."""
    differentiable = [(position, output) for position, output in enumerate(outputs)
                      if isinstance(output, torch.Tensor) and output.grad_fn is not None]
    if not differentiable or len(inputs) != len(reached):
        return
    node = Counter(output.grad_fn for _, output in differentiable).most_common(1)[0][0]
    slots = [(1 << position, output.output_nr) for position, output in differentiable if output.grad_fn is node]
    read_elsewhere = sum(1 << position for position, output in differentiable if output.grad_fn is not node)
    reach_of_leaf: dict[int, int] = {}
    for value, mask in zip(inputs, reached):
        if isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None:
            reach_of_leaf[id(value)] = reach_of_leaf.get(id(value), 0) | mask
    # None: not a leaf input, its gradient stays
    masks = [reach_of_leaf.get(id(getattr(function, "variable", None))) for function, _ in node.next_functions]

    def drop_unreached(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        read = read_elsewhere | sum(bit for bit, slot in slots if grad_outputs[slot] is not None)
        return tuple(None if mask is not None and not mask & read else grad
                     for grad, mask in zip(grad_inputs, masks))

    node.register_hook(drop_unreached)
