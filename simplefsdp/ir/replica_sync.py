"""The price of what crosses replica groups (``train --fault-tolerant --replica-sync``): the bytes one rank sends
(as a ring sends them, the count ``train`` prints) and the seconds of the cost model, per exchange and per step."""

from __future__ import annotations

import torch

from simplefsdp.ir.cost_model import collective_seconds
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.optim.demo import payload_bytes
from simplefsdp.optim.diloco import packed_bytes


def replica_sync_problem(sync: str = "step", outer_quantize: str | None = None, **price_options) -> str | None:
    """Why ``replica_sync_price``'s keywords (the ``--replica-sync`` flags) clash, with the fix; or None."""
    if outer_quantize and sync != "diloco":
        return (f"--outer-quantize {outer_quantize} is for --replica-sync diloco's pseudo-gradient; drop it or pass "
                "--replica-sync diloco")
    return None


def replica_sync_price(shards: list[torch.Tensor], groups: int, world_size: int, hardware: HardwareProfile,
                       sync: str = "step", sync_every: int = 32, chunk: int = 64, top_k: int = 32,
                       outer_quantize: str | None = None) -> dict:
    """The exchange between ``groups`` replica groups of ``world_size`` ranks for one rank's gradient ``shards``: each
    step, ``step`` all-reduces them, ``demo`` all-gathers DeMo's top-``top_k`` components per chunk; ``diloco``
    all-reduces the pseudo-gradient every ``sync_every`` steps (with ``outer_quantize``: all-gathers packed blocks)."""
    ranks = tuple(range(0, groups * world_size, world_size))  # this rank's peers: the same rank of every group
    every = sync_every if sync == "diloco" else 1
    if sync == "demo" or outer_quantize:
        exchanged = packed_bytes(sum(s.numel() for s in shards), outer_quantize) if outer_quantize else \
            sum(payload_bytes(s.shape, s.element_size(), chunk, top_k) for s in shards)
        seconds, sent = collective_seconds("all_gather", groups * exchanged, ranks, hardware), (groups - 1) * exchanged
    else:
        exchanged = sum(s.numel() * s.element_size() for s in shards)
        seconds, sent = collective_seconds("all_reduce", exchanged, ranks, hardware), \
            2 * (groups - 1) * exchanged // groups
    return dict(replica_groups=groups, replica_sync=sync, outer_quantize=outer_quantize,
                exchange_bytes=exchanged, exchange_seconds=seconds,
                exchange_every=every, bytes_per_step=sent / every, seconds_per_step=seconds / every)
