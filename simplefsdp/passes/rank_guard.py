"""The pass side of the cross-rank guard: one call of ``simplefsdp::agree_on_collectives`` at the top of a compiled
graph, with the graph's collective signature (``ir.signature``) baked in as a constant, and every collective of the
graph pinned after it (one Inductor does not know as a collective, after the one before it too). The pass runs no
collective; the op's run-time side: ``runtime/rank_agreement.py``; why: ``ARCHITECTURE.md``, "The cross-rank guard"."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

import simplefsdp.runtime.rank_agreement  # noqa: F401  registers torch.ops.simplefsdp.agree_on_collectives
from simplefsdp.ir.schedule import Schedule
from simplefsdp.ir.signature import collective_lines
from simplefsdp.passes.inductor_internals import pin_order


def insert_agreement(gm: fx.GraphModule, schedule: Schedule, group_names: Sequence[str]) -> fx.Node | None:
    """Insert the guard into ``gm``, whose final schedule is ``schedule``, exchanging over the mesh whose dimensions'
    process groups are ``group_names``; return its node (``None``: the graph has no data-parallel collective)."""
    lines = collective_lines(schedule)
    if not lines:
        return None
    graph = gm.graph
    fake = next(node.meta["val"] for node in graph.find_nodes(op="placeholder")
                if isinstance(node.meta.get("val"), torch.Tensor))
    args = ("\n".join(lines), ",".join(group_names))
    with graph.inserting_before(next(node for node in graph.nodes if node.op != "placeholder")):
        agree = graph.call_function(torch.ops.simplefsdp.agree_on_collectives.default, args)
    with fake.fake_mode:
        agree.meta["val"] = torch.ops.simplefsdp.agree_on_collectives(*args)
    by_name = {node.name: node for node in graph.nodes}
    collectives = schedule.collectives()
    after = {by_name[node.name]: [agree] for node in collectives}
    for previous, node in zip(collectives, collectives[1:]):
        if not (_known_to_inductor(previous.op) and _known_to_inductor(node.op)):
            after[by_name[node.name]].append(by_name[previous.name])
    pin_order(graph, after)
    gm.recompile()
    return agree


def _known_to_inductor(op: str) -> bool:
    """Whether Inductor's scheduler keeps collective ``op`` in the graph's order among the others (its own
    collectives); one of ours (``runtime/gloo_broadcasts.py``) is pinned between its neighbours instead: Inductor
    moves an opaque op to lower its peak memory, differently on ranks whose shards differ in size."""
    return op.startswith("_c10d_functional.")
