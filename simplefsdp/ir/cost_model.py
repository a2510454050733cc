"""Predicted run time of schedule nodes on a hardware profile.

Compute: a roofline, ``max(FLOPs / matmul rate, bytes moved / memory bandwidth)`` plus the kernel launch and host
dispatch overheads; views and tuple items cost only the dispatch overhead (0 on GPUs), waits nothing.

Collectives: an alpha-beta model with ring factors. For ``n`` ranks and a full buffer of ``S`` bytes, a ring all-gather
or reduce-scatter moves ``(n-1)/n * S`` through each rank's link (NCCL's "bus bandwidth" convention) in ``n-1`` steps;
an all-reduce is a reduce-scatter followed by an all-gather. A group spanning ``N`` nodes of ``g`` ranks runs
hierarchically: the inter-node phase moves ``(N-1)/N * S`` bytes through the node's ``g`` network links at once, the
intra-node phase ``(g-1)/g * S`` over NVLink; the phases add up."""

from __future__ import annotations

import torch

from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.schedule import COLLECTIVE, COMPUTE, Collective, ScheduleNode


def node_time(node: ScheduleNode, hardware: HardwareProfile, dtype: torch.dtype | None = None) -> float:
    """Seconds ``node`` occupies its compute or communication stream; ``dtype``: the matmul dtype (default float32)."""
    if node.kind == COLLECTIVE:
        return collective_time(node.collective, hardware)
    if node.kind != COMPUTE:
        return 0.0
    if node.alias_of is not None:
        return hardware.dispatch_overhead
    if node.parts:  # a block compiled once costs what its nodes would in the whole graph
        return sum(node_time(part, hardware, dtype) for part in node.parts)
    launch = hardware.dispatch_overhead + hardware.kernel_overhead
    return launch + max(node.flops / hardware.matmul_rate(dtype or torch.float32),
                        (node.bytes_read + node.bytes_written) / hardware.memory_bandwidth)


def collective_time(collective: Collective, hardware: HardwareProfile) -> float:
    """Seconds for one collective of ``collective.bytes`` bytes over its group, by the model above."""
    return collective_seconds(collective.kind, collective.bytes, collective.group_ranks, hardware)


def wire_bytes(collective: Collective) -> float:
    """Bytes one rank sends plus receives for ``collective`` in a ring of ``n`` ranks: ``2 * (n-1)/n * S`` for
    ``S = collective.bytes`` (a uint8 payload counts 1 byte per element), twice that for an all-reduce."""
    ranks = collective.group_size
    return (4 if collective.kind == "all_reduce" else 2) * (ranks - 1) / ranks * collective.bytes if ranks > 1 else 0.0


def collective_seconds(kind: str, size: float, ranks: tuple[int, ...], hardware: HardwareProfile) -> float:
    """Seconds for a ``kind`` collective whose full buffer is ``size`` bytes over global ``ranks``."""
    if len(ranks) <= 1:
        return 0.0
    nodes = len({rank // hardware.devices_per_node for rank in ranks})
    local = len(ranks) // nodes
    one_way = hardware.collective_latency + _ring_phase(size, local, hardware.intra_node_bandwidth,
                                                        hardware.intra_node_latency)
    if nodes > 1:
        one_way += _ring_phase(size, nodes, local * hardware.inter_node_bandwidth, hardware.inter_node_latency)
    return 2 * one_way - hardware.collective_latency if kind == "all_reduce" else one_way


def _ring_phase(size: float, ranks: int, bandwidth: float, step_latency: float) -> float:
    """A ring over ``ranks`` participants: ``ranks-1`` steps moving ``(ranks-1)/ranks`` of ``size``."""
    return (ranks - 1) * step_latency + (ranks - 1) / ranks * size / bandwidth if ranks > 1 else 0.0

