"""An all-gather as a broadcast from each rank, in place: the op ``passes/gloo_collectives.py`` puts in a graph on
gloo, whose all-gather receives into a flat buffer of its own and copies out of it, where its broadcast works in the
tensor it is given."""

from __future__ import annotations

import torch
import torch.distributed as dist

from simplefsdp.ir.schedule import process_group


@torch.library.custom_op("simplefsdp::all_gather_by_broadcasts", mutates_args=())
def all_gather_by_broadcasts(shards: list[torch.Tensor], group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's ``shards`` flat and side by side, rank-major, as one buffer; issued, not waited: a
    ``wait_tensor`` of the buffer waits for the ``group_size`` broadcasts that fill it."""
    group = process_group(group_name)
    numels = [shard.numel() for shard in shards]
    total = sum(numels)
    buffer = shards[0].new_empty(total * group_size)
    local = buffer.narrow(0, total * group.rank(), total).split(numels)
    torch._foreach_copy_(list(local), [shard.reshape(-1) for shard in shards])
    works = [dist.broadcast(buffer.narrow(0, total * source, total), group_src=source, group=group, async_op=True)
             for source in range(group_size)]
    arrived = torch.futures.collect_all([work.get_future() for work in works])
    torch._C._distributed_c10d._register_work(buffer, torch._C._distributed_c10d._create_work_from_future(arrived))
    return buffer


@all_gather_by_broadcasts.register_fake
def _(shards: list[torch.Tensor], group_size: int, group_name: str) -> torch.Tensor:
    return shards[0].new_empty(sum(shard.numel() for shard in shards) * group_size)


ALL_GATHER_BY_BROADCASTS = torch.ops.simplefsdp.all_gather_by_broadcasts.default
