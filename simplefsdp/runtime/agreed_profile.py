"""The hardware profile every rank plans with: global rank 0's, broadcast, so all ranks bucket alike.

Each rank measuring or loading its own (hosts with different CPUs, one busy measurement) would price the same graph
with different numbers, plan different buckets, and issue mismatched collectives."""

from __future__ import annotations

import torch.distributed as dist

from simplefsdp.ir.hardware import HardwareProfile, local_profile


def agreed_profile(device_type: str) -> HardwareProfile:
    """Rank 0's ``local_profile(device_type)`` on every rank of the default group; every rank calls it (a 1-rank
    world, or none, just loads its own). If rank 0 fails to get one, every rank raises."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local_profile(device_type)
    answer: list[HardwareProfile | str | None] = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            answer[0] = local_profile(device_type)
        except Exception as error:  # tell the other ranks, which wait in the broadcast below, then raise here
            failure, answer[0] = error, f"{type(error).__name__}: {error}"
    # The others wait while rank 0 measures (~10 s on a CPU, uncached), or, if it dies, for the default group's timeout
    # (5 min from mesh.py's init_distributed, which sets from LOCAL_RANK the CUDA device NCCL sends the pickle through).
    dist.broadcast_object_list(answer, src=0)
    if failure is not None:
        raise failure
    if not isinstance(answer[0], HardwareProfile):
        raise RuntimeError(f"rank 0 could not get the {device_type} hardware profile ({answer[0]}); see rank 0's "
                           "error, or pass buckets='block' to compile_sharded to plan without a profile")
    return answer[0]
