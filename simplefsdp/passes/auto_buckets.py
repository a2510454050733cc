"""``buckets="auto"``: per-block buckets, merged where the cost model says merging is free.

Algorithm (one graph, one pass over its collectives in program order):

1. Start from the ``"block"`` plan: one unit per repeated block, head and tail.
   Each unit has its predicted communication time (``simplefsdp.ir.cost_model``
   alpha-beta model, on the given hardware profile), its full buffer bytes, and
   the compute time of the nodes owned by its modules (roofline).
2. Walk the units of each (kind, process group, dtype) in program order and
   grow the current bucket by the next unit while both hold:
   - the merged bucket's communication still fits under the compute it
     overlaps: for an all-gather, the compute of the previous bucket (it is
     prefetched behind it); for a reduce-scatter, the compute of the unit
     after it (it runs behind the next block's backward);
   - the gathered bytes in flight, ``(prefetch + 1)`` buckets of at most the
     merged bucket's size, stay within ``memory_budget``. The default budget is
     what per-block bucketing holds: the largest full-buffer bytes of any
     ``prefetch + 1`` consecutive units.
   Merging saves one collective's latency each time, so small units (norms,
   short blocks) are merged until they would stop hiding or exceed the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simplefsdp.ir.cost_model import as_number, collective_seconds, node_time
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.schedule import COMPUTE, Schedule
from simplefsdp.passes.bucket_plan import Bucket, BucketPlan, block_names, plan_buckets


@dataclass
class _Unit:
    bucket: Bucket
    bytes: float
    compute: float


def plan_auto_buckets(schedule: Schedule, hardware: HardwareProfile, memory_budget: int | None = None,
                      prefetch: int = 1, compute_dtype: torch.dtype | None = None) -> BucketPlan:
    """Buckets for ``schedule`` chosen by the algorithm of the module docstring.

    ``compute_dtype`` sets the matmul rate; by default the dtype the parameters are gathered in.
    """
    blocks = plan_buckets(schedule, "block")
    gathered = [node.collective.dtype for node in schedule.collectives() if node.collective.kind == "all_gather"]
    compute_dtype = compute_dtype or (gathered[0] if gathered else None)
    compute = _compute_by_block(schedule, hardware, compute_dtype)
    streams: dict[tuple, list[_Unit]] = {}
    for bucket in blocks.buckets:
        first = schedule.node(bucket.collectives[0]).collective
        size = sum(as_number(schedule.node(name).collective.bytes) for name in bucket.collectives)
        unit = _Unit(bucket, size, compute.get(bucket.name, 0.0))
        streams.setdefault((bucket.kind, first.group_name, first.dtype), []).append(unit)
    merged = []
    for (kind, group_name, _), units in streams.items():
        ranks = schedule.node(units[0].bucket.collectives[0]).collective.group_ranks
        budget = memory_budget if memory_budget is not None else _default_budget(units, prefetch)
        merged += _merge(units, kind, ranks, hardware, budget, prefetch)
    position = {node.name: index for index, node in enumerate(schedule.nodes)}
    merged.sort(key=lambda bucket: position[bucket.collectives[0]])
    return BucketPlan(schedule.phase, tuple(merged))


def _merge(units: list[_Unit], kind: str, ranks: tuple[int, ...], hardware: HardwareProfile, budget: float,
           prefetch: int) -> list[Bucket]:
    groups: list[list[_Unit]] = [[units[0]]]
    for index, unit in enumerate(units[1:], start=1):
        candidate = groups[-1] + [unit]
        size = sum(u.bytes for u in candidate)
        if kind == "all_gather":
            hiding = sum(u.compute for u in groups[-2]) if len(groups) > 1 else 0.0
        else:
            hiding = units[index + 1].compute if index + 1 < len(units) else 0.0
        fits_time = collective_seconds(kind, size, ranks, hardware) <= hiding
        if fits_time and size * (prefetch + 1) <= budget:
            groups[-1] = candidate
        else:
            groups.append([unit])
    return [_join([u.bucket for u in group]) for group in groups]


def _join(buckets: list[Bucket]) -> Bucket:
    return Bucket(
        "+".join(b.name for b in buckets), buckets[0].kind,
        tuple(name for b in buckets for name in b.collectives), tuple(fqn for b in buckets for fqn in b.owners),
    )


def _default_budget(units: list[_Unit], prefetch: int) -> float:
    window = prefetch + 1
    return max(sum(u.bytes for u in units[start:start + window]) for start in range(len(units)))


def _compute_by_block(schedule: Schedule, hardware: HardwareProfile, dtype: torch.dtype | None) -> dict[str, float]:
    """Predicted compute seconds per block name (``head`` and ``tail`` included)."""
    computes = [node for node in schedule.nodes if node.kind == COMPUTE]
    seconds: dict[str, float] = {}
    names = block_names(schedule, computes)
    for node in computes:
        seconds[names[node.name]] = seconds.get(names[node.name], 0.0) + node_time(node, hardware, dtype)
    return seconds
