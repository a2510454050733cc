"""gloo's collectives in the forms gloo runs fastest: a lever for gloo alone (CPU ranks); NCCL runs each collective as
a ring of its own, and ``inspect``'s fake process group is left as traced (``benchmarks/step_breakdown.md`` measures).

- **A reduce-scatter as an all-to-all and a sum.** gloo runs a reduce-scatter as an all-reduce of a copy of its whole
  input (2 (n - 1) / n of the input's bytes sent per rank); an all-to-all of its n chunks sends (n - 1) / n, and the n
  chunks each rank receives are summed here in one kernel. The sum of two chunks is the all-reduce's, so on 2 ranks the
  gradients are bitwise unchanged; on more, the order of additions may differ from gloo's ring (reduce dtype rounding).
- **An all-gather as a broadcast from each rank, in place.** gloo's all-gather receives into a flat buffer of its own
  and copies out of it; its broadcast works in the tensor it is given. Each rank copies its shards into its slice of
  the gathered buffer and every slice is broadcast from its rank, the broadcasts issued together and waited as one:
  35-45% less time a call from 1 MiB a rank up, and no flat copy. A copy: bitwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from simplefsdp.ir.schedule import WAIT, Schedule, process_group
from simplefsdp.passes.inductor_internals import replace_collective
from simplefsdp.runtime.gloo_broadcasts import ALL_GATHER_BY_BROADCASTS

REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
ALL_GATHERS = ("_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.all_gather_into_tensor_out.default")


def plan_gloo_collectives(schedule: Schedule) -> tuple[str, ...]:
    """The reduce-scatters and all-gathers of ``schedule``'s data-parallel collectives whose process group runs on
    gloo and whose one reader is their wait, by name."""
    return tuple(node.name for node in schedule.data_parallel_collectives()
                 if node.op in (REDUCE_SCATTER, *ALL_GATHERS) and _waited_once(schedule, node.name)
                 and dist.get_backend(process_group(node.collective.group_name)) == "gloo")


def _waited_once(schedule: Schedule, name: str) -> bool:
    """Whether collective ``name`` is read by one node, its wait, and is no output of the graph (torch 2.14's
    partitioner can save a gathered tensor unwaited for the backward)."""
    readers = list(schedule.dag.successors(name))
    return len(readers) == 1 and schedule.node(readers[0]).kind == WAIT and name not in schedule.outputs


def apply_gloo_collectives(graph: fx.Graph, names: tuple[str, ...]) -> None:
    """Replace each reduce-scatter of ``names`` (one wait each) by ``reduce_scatter_by_all_to_all`` and each all-gather
    by ``all_gather_by_broadcasts``, in place."""
    by_name = {node.name: node for node in graph.nodes}
    for name in names:
        node = by_name[name]
        if str(node.target) == REDUCE_SCATTER:
            replace_collective(graph, node, reduce_scatter_by_all_to_all, node.args[1:4])
        else:
            _gather_by_broadcasts(graph, node)


def reduce_scatter_by_all_to_all(inputs: list[torch.Tensor], reduce_op: str, group_size: int,
                                 group_name: str) -> list[torch.Tensor]:
    """``reduce_scatter_tensor(inputs[0], reduce_op, group_size, group_name)`` as an all-to-all of its ``group_size``
    chunks along dim 0 and their sum (``"sum"``) or mean (``"avg"``); traced in by ``apply_gloo_collectives``."""
    functional = torch.ops._c10d_functional
    (tensor,) = inputs
    rows = tensor.shape[0] // group_size
    splits = [rows] * group_size
    received = functional.wait_tensor(functional.all_to_all_single(tensor, splits, splits, group_name))
    total = received.view(group_size, rows, *tensor.shape[1:]).sum(0)
    return [total / group_size if reduce_op == "avg" else total]


def _gather_by_broadcasts(graph: fx.Graph, gather: fx.Node) -> None:
    """Replace ``gather`` (one wait) by ``all_gather_by_broadcasts`` of its shards: a bucket's (the inputs of the
    copy-in that made its ``out`` buffer, which goes) or its one input, whose gathered shape a view after the wait
    restores."""
    (wait,) = gather.users
    copy_in = gather.kwargs.get("out")
    shards = copy_in.args[0] if copy_in is not None else [gather.args[0]]
    gathered = gather.meta["val"]
    with graph.inserting_before(copy_in if copy_in is not None else gather):
        broadcasts = graph.call_function(ALL_GATHER_BY_BROADCASTS, (shards, *gather.args[1:3]))
    broadcasts.meta = {**gather.meta, "val": gathered.reshape(-1)}
    wait.replace_input_with(gather, broadcasts)
    wait.meta["val"] = broadcasts.meta["val"]
    if gathered.dim() != 1:
        with graph.inserting_after(wait):
            view = graph.call_function(torch.ops.aten.view.default, (wait, list(gathered.shape)))
        wait.replace_all_uses_with(view, delete_user_cb=lambda user: user is not view)
        view.meta = {**wait.meta, "val": gathered}
    local = gather.args[0]
    graph.erase_node(gather)
    for node in (local, copy_in) if copy_in is not None else ():
        if not node.users:
            graph.erase_node(node)
