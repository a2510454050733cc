"""The price of what crosses replica groups (``train --fault-tolerant --replica-sync``): the bytes one rank sends
(as a ring sends them, the count ``train`` prints) and the seconds of the cost model, per exchange and per step."""

from __future__ import annotations

import torch

from simplefsdp.ir.cost_model import collective_seconds
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.optim.demo import payload_bytes


def replica_sync_price(shards: list[torch.Tensor], groups: int, world_size: int, hardware: HardwareProfile,
                       sync: str = "step", sync_every: int = 32, chunk: int = 64, top_k: int = 32) -> dict:
    """The exchange between ``groups`` replica groups of ``world_size`` ranks for one rank's gradient ``shards``:
    ``step`` all-reduces them every step, ``demo`` all-gathers DeMo's top-``top_k`` components per chunk every step,
    ``diloco`` all-reduces the pseudo-gradient every ``sync_every`` steps."""
    ranks = tuple(range(0, groups * world_size, world_size))  # this rank's peers: the same rank of every group
    if sync == "demo":
        exchanged = sum(payload_bytes(s.shape, s.element_size(), chunk, top_k) for s in shards)
        seconds, sent, every = collective_seconds("all_gather", groups * exchanged, ranks, hardware), \
            (groups - 1) * exchanged, 1
    else:
        exchanged = sum(s.numel() * s.element_size() for s in shards)
        seconds, sent, every = collective_seconds("all_reduce", exchanged, ranks, hardware), \
            2 * (groups - 1) * exchanged // groups, sync_every if sync == "diloco" else 1
    return dict(replica_groups=groups, replica_sync=sync, exchange_bytes=exchanged, exchange_seconds=seconds,
                exchange_every=every, bytes_per_step=sent / every, seconds_per_step=seconds / every)
