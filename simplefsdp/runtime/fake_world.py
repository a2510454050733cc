"""A fake data-parallel world in one process: trace any world size with no peers and no data."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Run the body as ``rank`` of a fake default process group of ``world_size`` ranks; collectives move no data.
    The body sees no DTensor state of an earlier world of this process, nor leaves any to a later one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: the only way to start "fake"
    # private: the only way to empty DTensor's sharding-propagation caches (imported here: it loads Dynamo)
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this process; inspect with world_size traces on "
                           "its own fake group, so call it before init_process_group (or from `simplefsdp inspect`)")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}) for a world of {world_size}, got {rank!r}")
    # a spec cached while tracing another rank would carry that rank's mesh: why, ARCHITECTURE.md's private-API table
    _clear_sharding_prop_cache()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()
