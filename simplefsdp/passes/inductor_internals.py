"""Every private PyTorch Inductor API the passes use, in one place (tested in tests/test_passes.py and
tests/test_torch_2_14.py; why each: ``ARCHITECTURE.md``, "Private PyTorch APIs").

Inductor's FX bucketing replaces a list of collectives by one on a flat buffer, tracing our
``bucket_copies.all_gather_bucket`` and ``all_to_all_bucket`` in place of all-gathers and all-to-alls; padding for
uneven shards stays outside the merged region. ``preserve_node_ordering`` pins an order for Inductor's scheduler."""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Hashable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch import fx
from torch._inductor.fx_passes import bucketing
from torch._inductor.fx_passes.bucketing import (merge_all_reduce_bucket, merge_reduce_scatter_bucket,
                                                 process_collective_bucket)
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import tree_flatten

from simplefsdp.ir.schedule import pinned, process_group
from simplefsdp.passes.bucket_copies import all_gather_bucket, all_to_all_bucket


def merge_all_gathers(graph: fx.Graph, all_gathers: list[fx.Node]) -> None:
    """Replace ``all_gathers`` (one group and dtype, each with one wait) by one all-gather where the first one was."""
    _, group_size, group_name = all_gathers[0].args
    rank = dist.get_rank(process_group(group_name))
    dtype = all_gathers[0].meta["val"].dtype
    process_collective_bucket(
        graph, all_gathers, all_gather_bucket, insert_before=all_gathers[0],
        trace_args_fn=lambda shards: ([shard.meta["val"] for shard in shards], group_name, group_size, rank, dtype))


def merge_reduce_scatters(graph: fx.Graph, reduce_scatters: list[fx.Node]) -> None:
    """Replace ``reduce_scatters`` (each with one wait) by one reduce-scatter placed after the last one."""
    merge_reduce_scatter_bucket(graph, reduce_scatters, mode="custom_ops", insert_before=reduce_scatters[-1].next)


def merge_all_reduces(graph: fx.Graph, all_reduces: list[fx.Node]) -> None:
    """Replace ``all_reduces`` (one group and dtype, each with one wait) by one placed after the last one."""
    merge_all_reduce_bucket(graph, all_reduces, insert_before=all_reduces[-1].next)


def merge_all_to_alls(graph: fx.Graph, all_to_alls: list[fx.Node]) -> None:
    """Replace ``all_to_alls`` (one group, one wait each) by one per set of equal constant splits, after its last."""
    alike: dict[str, list[fx.Node]] = {}
    for node in all_to_alls:
        if all(isinstance(size, int) for size in (*node.args[1], *node.args[2])):
            alike.setdefault(repr(node.args[1:3]), []).append(node)
    for nodes in (nodes for nodes in alike.values() if len(nodes) > 1):
        process_collective_bucket(graph, nodes, all_to_all_bucket, insert_before=nodes[-1].next,
                                  trace_args_fn=lambda inputs, nodes=nodes: (
                                      [node.meta["val"] for node in inputs], *nodes[0].args[1:4]))


def replace_collective(graph: fx.Graph, collective: fx.Node, fn: Callable[..., list[torch.Tensor]],
                       constants: tuple) -> None:
    """Replace ``collective`` (one wait) by ``fn([its input], *constants)`` traced, issued there, waited at its wait."""
    (wait,) = collective.users
    process_collective_bucket(graph, [collective], fn, insert_before=collective, wait_insertion_point=wait.next,
                              trace_args_fn=lambda inputs: ([inputs[0].meta["val"]], *constants))


@contextlib.contextmanager
def bucket_traces_reused() -> Iterator[None]:
    """Inside, Inductor's bucketing traces a bucket's body once per signature (the function, its inputs' shapes,
    strides and dtypes, its constants) and inserts that graph again for every bucket alike (a model's blocks). The
    copies share fake values, which Inductor recomputes after our pass (``FakeTensorUpdater``)."""
    trace, traced = bucketing._trace, {}

    def trace_once(fn: Callable, inputs: tuple) -> fx.GraphModule:
        if (key := _signature(fn, inputs)) is None:
            return trace(fn, inputs)
        if key not in traced:
            traced[key] = trace(fn, inputs)
        return traced[key]

    with mock.patch.object(bucketing, "_trace", trace_once):
        yield


def _signature(fn: Callable, inputs: tuple) -> Hashable | None:
    """What a trace of ``fn(*inputs)`` depends on; None where a size is symbolic or a constant is not hashable."""
    leaves, spec = tree_flatten(inputs)
    parts: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sizes = (*leaf.shape, *leaf.stride())
            if not all(isinstance(size, int) for size in sizes):
                return None
            leaf = (sizes, leaf.dtype, leaf.device, leaf.requires_grad)
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
        parts.append(leaf)
    key = (fn, str(spec), tuple(parts))
    try:
        hash(key)
    except TypeError:
        return None
    return key


topological_sort = stable_topological_sort  # each node after its inputs, moving as few nodes as possible


def pin_order(graph: fx.Graph, after: dict[fx.Node, list[fx.Node]]) -> None:
    """Make each node of ``after`` run after the nodes it maps to, in Inductor's scheduler too (older pins kept)."""
    for node, deps in after.items():
        if deps and pinned(node):
            node.args = ((*node.args[0], *deps), *node.args[1:])
    wrap = {node: OrderedSet(deps) for node, deps in after.items() if deps and not pinned(node)}
    names = {node.name for node in wrap}
    preserve_node_ordering(graph, wrap)
    for node in [node for node in graph.nodes if node.name in names]:
        _lowerable_on_torch_2_14(graph, node)


def _lowerable_on_torch_2_14(graph: fx.Graph, pinned_node: fx.Node) -> None:
    """Make ``pinned_node`` (a node wrapped in ``control_deps``, a block's region call among them) one that torch 2.14
    lowers: the wrapped graph reads the subgraphs itself and returns ``None`` outputs as constants (``ARCHITECTURE.md``
    says why). Unused ``get_attr`` nodes are erased: Inductor would delete the attributes they name."""
    owner = graph.owning_module
    wrapped = getattr(owner, pinned_node.args[1].target)
    placeholders = wrapped.graph.find_nodes(op="placeholder")
    subgraphs = [arg for arg in pinned_node.args[2:]
                 if arg.op == "get_attr" and isinstance(getattr(owner, arg.target), fx.GraphModule)]
    values = pinned_node.meta.get("val")
    nones = isinstance(values, (list, tuple)) and any(value is None for value in values)
    if not subgraphs and not nones:
        return
    for placeholder, arg in zip(placeholders, pinned_node.args[2:]):
        if arg in subgraphs:
            setattr(wrapped, arg.target, getattr(owner, arg.target))
            with wrapped.graph.inserting_after(placeholders[-1]):
                placeholder.replace_all_uses_with(wrapped.graph.get_attr(arg.target))
            wrapped.graph.erase_node(placeholder)
    pinned_node.args = (*pinned_node.args[:2], *[arg for arg in pinned_node.args[2:] if arg not in subgraphs])
    for node in (node for node in subgraphs if not node.users):
        graph.erase_node(node)
    if nones:
        output = wrapped.graph.output_node()
        call = output.args[0]
        with wrapped.graph.inserting_before(output):
            output.args = (tuple(None if value is None else wrapped.graph.call_function(operator.getitem, (call, index))
                                 for index, value in enumerate(values)),)
    wrapped.recompile()
