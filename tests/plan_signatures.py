"""The collective signature of each graph a model compiles to on one rank of a fake world, to compare across ranks.

``plan_signatures`` traces the model as ``compile_sharded`` shards it on ``rank`` of a fake process group of
``world_size`` (``simplefsdp.inspect(rank=...)``), runs the passes, and returns ``ir.signature.collective_lines`` of
the forward and backward graphs that would run. Lines name a group by its global ranks, which differ between the
coordinates of a 2-D mesh; ``normalize_groups`` names it by its size and stride in the mesh instead.
"""

from __future__ import annotations

import re

from torch import nn

from simplefsdp import inspect
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.signature import collective_lines, signature_digest

# The ``cpu`` profile measured on the 2-core machine where Hugging Face's ViT crashed under buckets="auto" (rounded):
# fixed here so the test plans the same everywhere, with the per-node dispatch overhead that priced each rank's pads.
CPU_LIKE = HardwareProfile(
    name="cpu-like", flops_per_s={"float32": 1.8e11, "bfloat16": 1.2e12}, memory_bandwidth=1.4e10,
    intra_node_bandwidth=8.4e8, inter_node_bandwidth=8.4e8, intra_node_latency=0.0, inter_node_latency=0.0,
    collective_latency=3.3e-4, kernel_overhead=0.0, dispatch_overhead=6.2e-6, devices_per_node=2,
    memory_capacity=25 * 2**30)


def normalize_groups(line: str) -> str:
    """``group=(1, 3)`` → ``group=size2/stride2``: the same for every coordinate of a regular mesh's dimension."""
    def group(match: re.Match) -> str:
        ranks = [int(rank) for rank in match.group(1).split(",") if rank.strip()]
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
        return f"group=size{len(ranks)}/stride{stride}"

    return re.sub(r"group=\(([^)]*)\)", group, line)


def plan_signatures(model: nn.Module, example_inputs: tuple, world_size: int, rank: int, **options
                    ) -> tuple[tuple[str, ...], ...]:
    """Normalized collective lines of the forward and the backward graph after the passes, on ``rank`` of a fake
    world of ``world_size``; ``options`` go to ``simplefsdp.inspect`` (default hardware ``CPU_LIKE``)."""
    report = inspect(model, example_inputs, world_size=world_size, rank=rank, **{"hardware": CPU_LIKE, **options})
    return tuple(tuple(normalize_groups(line) for line in collective_lines(schedule)) for schedule in report.schedules)


def plan_digests(model: nn.Module, example_inputs: tuple, world_size: int, rank: int, **options) -> tuple[str, ...]:
    """``signature_digest`` of each graph's ``plan_signatures``."""
    return tuple(signature_digest(lines) for lines in plan_signatures(model, example_inputs, world_size, rank,
                                                                        **options))


def shard_sizes(model: nn.Module, shards: int, coordinate: int) -> tuple[int, ...]:
    """The first-dimension size of each parameter's ``Shard(0)`` shard at ``coordinate`` of ``shards`` (torch.chunk's
    split: chunks of ``ceil(n / shards)``, the last ones short or empty); 0-dim parameters are replicated."""
    sizes = []
    for param in model.parameters():
        if param.dim() == 0:
            continue
        chunk = -(-param.shape[0] // shards)
        sizes.append(max(0, min(param.shape[0], (coordinate + 1) * chunk) - coordinate * chunk))
    return tuple(sizes)


def ranks_by_shards(model: nn.Module, world_size: int, shards: int | None = None) -> list[list[int]]:
    """The ranks of a world grouped by the shapes of their local shards (``shards`` per group, default the world;
    the shard coordinate is the rank modulo ``shards``, as in a (replicas, shards) mesh)."""
    shards = shards or world_size
    groups: dict[tuple, list[int]] = {}
    for rank in range(world_size):
        groups.setdefault(shard_sizes(model, shards, rank % shards), []).append(rank)
    return list(groups.values())

