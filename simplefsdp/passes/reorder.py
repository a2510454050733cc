"""Reordering for overlap: prefetch all-gathers, sink waits, and pin the order for Inductor.

Plan (a pure function of a ``Schedule``): all-gathers in program order are buckets ``0..n-1`` (one per merged
bucket, or per parameter when unbucketed). All-gather ``i + prefetch`` is issued right after the copy-out of
all-gather ``i`` (its wait and the nodes that read only it), before bucket ``i``'s compute, so bucket ``i``'s gathered
buffer is freed before bucket ``i + prefetch``'s is allocated (FSDP2's order: one gathered buffer less at the peak);
the first ``prefetch`` all-gathers at the start of the graph, before any compute (in the backward the output layer's
re-gather then hides behind its weight-gradient matmul, which does not need it). The backward's re-gathers already run
in reverse block order, so the same rule prefetches them in reverse. Reduce-scatters stay where the bucketing put them
(as soon as their gradients exist). Every wait, with its copy-out views, sinks to just before its first real user; a
reduce-scatter's (all-reduce's) wait no further than the next reduce-scatter (all-reduce): at most two gradient
buffers of each in flight.

Apply moves the nodes in the FX graph and pins the order (each bucket's first compute node depends on the all-gathers
prefetched before it, each sunk wait on the node before it), so Inductor's scheduler keeps it."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
from torch import fx

from simplefsdp.ir.schedule import COMPUTE, WAIT, Schedule, ScheduleNode
from simplefsdp.passes.inductor_internals import pin_order


@dataclass(frozen=True)
class Prefetch:
    """Issue ``collective`` (and the nodes it needs) right after ``after`` (``None``: at the start of the graph);
    ``anchor``, the first compute node it hides behind, must run after it."""
    collective: str
    after: str | None
    anchor: str


@dataclass(frozen=True)
class Sink:
    """Move ``nodes`` (a wait and its copy-out views, program order) to just before ``before``."""
    nodes: tuple[str, ...]
    before: str

    def moves(self, position: dict[str, int]) -> bool:
        """Whether some node of the graph lies between the last of ``nodes`` and ``before``."""
        return position[self.before] > max(position[name] for name in self.nodes) + 1


@dataclass(frozen=True)
class ReorderPlan:
    """The moves for one graph."""
    phase: str
    prefetches: tuple[Prefetch, ...]
    sinks: tuple[Sink, ...]

    def __str__(self) -> str:
        lines = [f"{self.phase}: {len(self.prefetches)} prefetch(es), {len(self.sinks)} sunk wait(s)"]
        lines += [f"  issue {p.collective} after {p.after or 'the graph inputs'} (before {p.anchor})"
                  for p in self.prefetches]
        lines += [f"  sink {s.nodes[0]} to before {s.before}" for s in self.sinks]
        return "\n".join(lines)


def plan_reorder(schedule: Schedule, prefetch: int = 1) -> ReorderPlan:
    """Prefetch all-gathers ``prefetch`` (0 or more) buckets ahead and sink every wait (see the module docstring)."""
    position = {node.name: index for index, node in enumerate(schedule.nodes)}
    waits = {node.waits_for: node for node in schedule.nodes if node.kind == WAIT}
    collectives = [node for node in schedule.data_parallel_collectives() if node.name in waits]
    sinks = {node.name: _sink(schedule, waits[node.name], collectives, position) for node in collectives}
    all_gathers = [node for node in schedule.parameter_gathers() if node.name in waits]
    prefetches = []
    for first in all_gathers[:prefetch]:
        anchor = _first_compute(schedule.nodes, nx.ancestors(schedule.dag, first.name))
        if anchor is not None and position[first.name] > position[anchor]:
            prefetches.append(Prefetch(first.name, None, anchor))
    for earlier, later in zip(all_gathers, all_gathers[prefetch:] if prefetch else []):
        copied_out, start = _copy_out(schedule, sinks[earlier.name]), sinks[earlier.name].before
        if position[later.name] > position[copied_out]:
            anchor = _first_compute(schedule.nodes[position[start]:]) or start
            prefetches.append(Prefetch(later.name, copied_out, anchor))
    return ReorderPlan(schedule.phase, tuple(prefetches), tuple(s for s in sinks.values() if s.moves(position)))


def _sink(schedule: Schedule, wait: ScheduleNode, collectives: list[ScheduleNode], position: dict) -> Sink:
    """The wait, the copy-out nodes before its first other user that read only it (views, reshapes, casts), and the
    node to sink them before. A node that reads only them after that user (Gemma 3n's backward of a clamped weight
    compares it with its bounds there) stays where it is."""
    chain, limit = {wait.name}, len(schedule.nodes) - 1
    for node in schedule.nodes[position[wait.name] + 1:]:
        if not chain.intersection(node.inputs):
            continue
        if node.kind != COMPUTE or not set(node.inputs) <= chain or node.flops:
            limit = position[node.name]
            break
        chain.add(node.name)
    kind = schedule.node(wait.waits_for).collective.kind
    if kind != "all_gather":
        later = [position[c.name] for c in collectives
                 if c.collective.kind == kind and position[c.name] > position[wait.name]]
        limit = min([limit, *later])
    return Sink(tuple(sorted(chain, key=position.__getitem__)), schedule.nodes[limit].name)


def _copy_out(schedule: Schedule, sink: Sink) -> str:
    """The last node of a wait's copy-out that is not a view of another (the copy out of a bucket's buffer), or the
    wait: after it the gathered buffer is no longer needed."""
    return next((name for name in reversed(sink.nodes) if schedule.node(name).alias_of is None), sink.nodes[0])


def _first_compute(nodes: list[ScheduleNode], skip: set[str] = frozenset()) -> str | None:
    """The first real compute node of ``nodes`` not in ``skip``: the start of a bucket's compute."""
    return next((node.name for node in nodes if node.kind == COMPUTE and node.alias_of is None
                 and node.name not in skip), None)


def apply_reorder(graph: fx.Graph, plan: ReorderPlan) -> None:
    """Move the nodes of ``plan`` in ``graph`` and pin the new order, in place."""
    by_name = {node.name: node for node in graph.nodes}
    pins: dict[fx.Node, list[fx.Node]] = {}
    for sink in plan.sinks:
        before = by_name[sink.before]
        for name in sink.nodes:
            before.prepend(by_name[name])
        wait = by_name[sink.nodes[0]]
        if wait.prev.op == "call_function":
            pins.setdefault(wait, []).append(wait.prev)
    for prefetch in plan.prefetches:
        collective = by_name[prefetch.collective]
        after = by_name[prefetch.after] if prefetch.after else list(graph.find_nodes(op="placeholder"))[-1]
        for node in needed_after(graph, collective, after):
            after.append(node)
            after = node
        pins.setdefault(by_name[prefetch.anchor], []).append(collective)
    pin_order(graph, pins)


def needed_after(graph: fx.Graph, collective: fx.Node, after: fx.Node) -> list[fx.Node]:
    """``collective`` and those of its inputs (transitively) that now sit after ``after``, program order."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    needed, stack = {collective}, [collective]
    while stack:
        for node in stack.pop().all_input_nodes:
            if node not in needed and order[node] > order[after]:
                needed.add(node)
                stack.append(node)
    return sorted(needed, key=order.__getitem__)
