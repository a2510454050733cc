"""``buckets="auto"``: buckets merged from small units where the cost model says merging is free.

1. Cut the collectives into units: all-gathers, one per child module of a repeated block (``layers.3.attention``) and
   per top-level module outside the blocks (``tok_embeddings``); other kinds, one per block and per module outside
   the blocks (``output``, ``norm``). A unit has its full buffer bytes (``planned_bytes``) and the roofline compute
   time of its modules' nodes, less those that depend on this rank's shards (``rank_local_nodes``), so every rank
   plans the same.
2. Walk the units of each (kind, process group, dtype) in program order and grow the current bucket by the next unit
   while (a) the merged bucket's alpha-beta time fits under the compute it overlaps: for an all-gather the previous
   bucket's (it is prefetched behind it), for other kinds the next unit's (the next block's backward); (b)
   ``prefetch + 1`` buckets of the merged size fit ``memory_budget`` (default: what per-block bucketing holds, the
   most bytes of any ``prefetch + 1`` blocks in a row; for all-reduces at least ``prefetch + 1`` of DDP's 25 MiB
   buckets, as their gradients stay allocated until the optimizer step anyway); and (c) the copies the merge adds
   cost less than the latency it saves: a lone collective works on its tensor where it lies, a bucket's tensors are
   copied into and out of its flat buffer, so merging a lone one (an output layer's gradient beside a norm's) copies
   it. Small all-gather units end a bucket where the compute that can hide the next one ends (the first block's
   attention gathered behind the embedding lookup, its feed-forward behind that attention): only the embedding's own
   all-gather is exposed at the start of the step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from simplefsdp.ir.cost_model import collective_seconds, node_time
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.schedule import COMPUTE, Schedule, ScheduleNode
from simplefsdp.passes.bucket_plan import (ALL_REDUCE_BUCKET_BYTES, BUCKETED_KINDS, Bucket, BucketPlan,
                                           block_of, bucketable, group_collectives, planned_bytes, rank_local_nodes)


@dataclass
class _Unit:
    bucket: Bucket
    bytes: float
    compute: float


def plan_auto_buckets(schedule: Schedule, hardware: HardwareProfile, memory_budget: int | None = None,
                      prefetch: int = 1, compute_dtype: torch.dtype | None = None,
                      blocks: Sequence[str] = ()) -> BucketPlan:
    """Buckets for ``schedule`` by the module's algorithm, matmuls in ``compute_dtype`` (default: gathered dtype)."""
    compute_dtype = compute_dtype or next((n.collective.dtype for n in bucketable(schedule, ("all_gather",))), None)
    local = rank_local_nodes(schedule)
    computes = [node for node in schedule.nodes if node.kind == COMPUTE and node.name not in local]
    by_block = group_collectives(schedule, block_or_module(bucketable(schedule, BUCKETED_KINDS), blocks))
    streams = _streams(schedule, by_block, block_or_module(computes, blocks), hardware, compute_dtype)
    modules = _streams(schedule, group_collectives(schedule, module_names(bucketable(schedule), blocks)),
                       module_names(computes, blocks), hardware, compute_dtype)
    merged = []
    for (kind, group_name, dtype), units in streams.items():
        ranks = schedule.node(units[0].bucket.collectives[0]).collective.group_ranks
        budget = memory_budget if memory_budget is not None else max(  # the most bytes of prefetch + 1 in a row
            sum(u.bytes for u in units[start:start + prefetch + 1]) for start in range(len(units)))
        if kind == "all_reduce" and memory_budget is None:
            budget = max(budget, (prefetch + 1) * ALL_REDUCE_BUCKET_BYTES[0])
        if kind == "all_gather":
            units = modules[kind, group_name, dtype]
        merged += _merge(units, kind, ranks, hardware, budget, prefetch)
    position = {node.name: index for index, node in enumerate(schedule.nodes)}
    merged.sort(key=lambda bucket: position[bucket.collectives[0]])
    return BucketPlan(schedule.phase, tuple(merged), tuple(blocks))


def block_or_module(nodes: list[ScheduleNode], blocks: Sequence[str]) -> dict[str, str]:
    """Node name → its unit for kinds other than all-gathers: its block, or outside the blocks its module."""
    return {node.name: block_of(node.fqn, blocks) or node.fqn for node in nodes}


def module_names(nodes: list[ScheduleNode], blocks: Sequence[str]) -> dict[str, str]:
    """Node name → its all-gather unit: the child of its block (``layers.3.attention``), or its top-level module."""
    names = {}
    for node in nodes:
        block = block_of(node.fqn, blocks)
        child = (node.fqn[len(block) + 1:] if block else node.fqn).split(".")[0]
        names[node.name] = f"{block}.{child}" if block and child else (block or child)
    return names


def _streams(schedule: Schedule, plan: BucketPlan, compute_names: dict[str, str], hardware: HardwareProfile,
             compute_dtype: torch.dtype | None) -> dict[tuple, list[_Unit]]:
    """The buckets of ``plan`` as units, by (kind, process group, dtype), program order."""
    compute: dict[str, float] = {}
    for name, unit in compute_names.items():
        compute[unit] = compute.get(unit, 0.0) + node_time(schedule.node(name), hardware, compute_dtype)
    streams: dict[tuple, list[_Unit]] = {}
    for bucket in plan.buckets:
        first = schedule.node(bucket.collectives[0]).collective
        size = sum(planned_bytes(schedule, schedule.node(name)) for name in bucket.collectives)
        unit = _Unit(bucket, size, compute.get(bucket.name, 0.0))
        streams.setdefault((bucket.kind, first.group_name, first.dtype), []).append(unit)
    return streams


def _merge(units: list[_Unit], kind: str, ranks: tuple[int, ...], hardware: HardwareProfile, budget: float,
           prefetch: int) -> list[Bucket]:
    groups: list[list[_Unit]] = [[units[0]]]
    for index, unit in enumerate(units[1:], start=1):
        parts = (groups[-1], [unit])
        part_bytes = [sum(u.bytes for u in part) for part in parts]
        size, merged_seconds = sum(part_bytes), collective_seconds(kind, sum(part_bytes), ranks, hardware)
        if kind == "all_gather":
            hiding = sum(u.compute for u in groups[-2]) if len(groups) > 1 else 0.0
        else:
            hiding = units[index + 1].compute if index + 1 < len(units) else 0.0
        saved = sum(collective_seconds(kind, b, ranks, hardware) for b in part_bytes) - merged_seconds
        copied = sum(2 * b / hardware.memory_bandwidth  # a lone collective's tensor, read and written once
                     for b, part in zip(part_bytes, parts) if sum(len(u.bucket.collectives) for u in part) == 1)
        if merged_seconds <= hiding and size * (prefetch + 1) <= budget and copied <= saved:
            groups[-1] = groups[-1] + [unit]
        else:
            groups.append([unit])
    return [Bucket("+".join(u.bucket.name for u in group), kind,
                   tuple(name for u in group for name in u.bucket.collectives),
                   tuple(fqn for u in group for fqn in u.bucket.owners)) for group in groups]

