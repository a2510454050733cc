"""gloo's reduce-scatters as all-to-alls: gloo runs a reduce-scatter as an all-reduce of a copy of its whole input
(2 (n - 1) / n of the input's bytes sent per rank), an all-to-all of its n chunks sends (n - 1) / n, and the n chunks
each rank receives are summed here in one kernel. A lever for gloo alone (CPU ranks): NCCL's reduce-scatter is its
own ring, and ``inspect``'s fake process group is left as traced.

The sum of two chunks is the all-reduce's sum, so on 2 ranks the gradients are bitwise unchanged; on more, the order
of the additions may differ from gloo's ring (a rounding of the reduce dtype).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from simplefsdp.ir.schedule import Schedule, process_group
from simplefsdp.passes.inductor_internals import replace_collective

REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


def plan_gloo_reduce_scatters(schedule: Schedule) -> tuple[str, ...]:
    """The reduce-scatters of ``schedule``'s data-parallel collectives whose process group runs on gloo, by name."""
    return tuple(node.name for node in schedule.data_parallel_collectives()
                 if node.op == REDUCE_SCATTER and dist.get_backend(process_group(node.collective.group_name)) == "gloo")


def apply_gloo_reduce_scatters(graph: fx.Graph, names: tuple[str, ...]) -> None:
    """Replace each reduce-scatter of ``names`` (one wait each) by ``reduce_scatter_by_all_to_all``, in place."""
    by_name = {node.name: node for node in graph.nodes}
    for name in names:
        node = by_name[name]
        replace_collective(graph, node, reduce_scatter_by_all_to_all, node.args[1:4])


def reduce_scatter_by_all_to_all(inputs: list[torch.Tensor], reduce_op: str, group_size: int,
                                 group_name: str) -> list[torch.Tensor]:
    """``reduce_scatter_tensor(inputs[0], reduce_op, group_size, group_name)`` as an all-to-all of its ``group_size``
    chunks along dim 0 and their sum (``"sum"``) or mean (``"avg"``); traced in by ``apply_gloo_reduce_scatters``."""
    functional = torch.ops._c10d_functional
    (tensor,) = inputs
    rows = tensor.shape[0] // group_size
    splits = [rows] * group_size
    received = functional.wait_tensor(functional.all_to_all_single(tensor, splits, splits, group_name))
    total = received.view(group_size, rows, *tensor.shape[1:]).sum(0)
    return [total / group_size if reduce_op == "avg" else total]
