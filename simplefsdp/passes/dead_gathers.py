"""Drop the all-gathers whose gathered tensor nothing reads: a parameter handed to a compiled-once block that its
compute never reads (``runtime/unused_outputs.py: drop_region_inputs``) is still gathered in the traced forward, and
would be bucketed and sent with the others. The graph is the same on every rank, and so is what this drops."""

from __future__ import annotations

import torch
from torch import fx


def plan_dead_gathers(graph: fx.Graph) -> tuple[str, ...]:
    """The all-gathers of ``graph`` whose one user is a wait that nothing reads, by name."""
    return tuple(node.name for node in graph.nodes
                 if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default and len(node.users) == 1
                 and (wait := next(iter(node.users))).target is torch.ops._c10d_functional.wait_tensor.default
                 and not wait.users)


def drop_dead_gathers(graph: fx.Graph, gathers: tuple[str, ...]) -> None:
    """Erase the all-gathers named ``gathers`` and their waits."""
    for node in [node for node in graph.nodes if node.name in gathers]:
        graph.erase_node(next(iter(node.users)))
        graph.erase_node(node)
