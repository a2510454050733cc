"""Bucket planning: which collectives of one graph (a ``Schedule``) are merged into one, as plain data.

A bucket never mixes collective kinds, process groups or dtypes (such collectives form separate buckets of one name).
Modes: ``None``; ``"block"``, one bucket per repeated block (an FQN prefix ending in a list index, ``layers.0``) plus
a ``head`` (before the blocks in the forward: the embedding) and a ``tail`` (after them; first in the backward); a
manual plan, lists of module FQN prefixes, bucket ``i`` taking every collective under list ``i`` and the rest staying
unbucketed; ``"auto"``, see ``simplefsdp.passes.auto_buckets``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

from simplefsdp.ir.schedule import Schedule, ScheduleNode

BUCKETED_KINDS = ("all_gather", "reduce_scatter")
BucketMode = Union[None, str, Sequence[Sequence[str]]]

_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


@dataclass(frozen=True)
class Bucket:
    """Collectives (node names, program order) merged into one, and the module FQNs that own them."""

    name: str
    kind: str
    collectives: tuple[str, ...]
    owners: tuple[str, ...]


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of one graph (``phase`` is ``"forward"`` or ``"backward"``), in program order."""

    phase: str
    buckets: tuple[Bucket, ...]

    def __str__(self) -> str:
        lines = [f"{self.phase}: {len(self.buckets)} bucket(s)"]
        for bucket in self.buckets:
            owners = ", ".join(dict.fromkeys(bucket.owners))
            lines.append(f"  {bucket.kind} {bucket.name}: {len(bucket.collectives)} collective(s) [{owners}]")
        return "\n".join(lines)


def plan_buckets(schedule: Schedule, mode: BucketMode) -> BucketPlan:
    """Group ``schedule``'s all-gathers and reduce-scatters into buckets by ``mode`` (``"auto"`` excluded)."""
    if mode is None:
        return BucketPlan(schedule.phase, ())
    if mode == "block":
        names = block_names(schedule, bucketable(schedule))
    elif isinstance(mode, str):
        raise ValueError(f"plan_buckets takes None, 'block' or a manual plan, got {mode!r}")
    else:
        names = _manual_names(schedule, mode)
    return group_collectives(schedule, names)


def bucketable(schedule: Schedule) -> list[ScheduleNode]:
    """The collectives a plan may bucket: all-gathers and reduce-scatters, program order."""
    return [node for node in schedule.collectives() if node.collective.kind in BUCKETED_KINDS]


def group_collectives(schedule: Schedule, names: dict[str, str]) -> BucketPlan:
    """Buckets from a collective-name → bucket-name map, split by kind, process group and dtype."""
    groups: dict[tuple, list[ScheduleNode]] = {}
    for node in bucketable(schedule):
        if node.name in names:
            collective = node.collective
            key = (names[node.name], collective.kind, collective.group_name, collective.dtype)
            groups.setdefault(key, []).append(node)
    return BucketPlan(schedule.phase, tuple(
        Bucket(name, kind, tuple(n.name for n in nodes), tuple(n.fqn for n in nodes))
        for (name, kind, _, _), nodes in groups.items()))


def block_of(fqn: str) -> str | None:
    """The repeated block ``fqn`` lies in (``layers.3.attention.wq`` → ``layers.3``), or None."""
    return match.group(1) if (match := _BLOCK.match(fqn)) else None


def block_names(schedule: Schedule, nodes: list[ScheduleNode]) -> dict[str, str]:
    """Node name → its block, or ``head`` / ``tail`` for nodes before / after the blocks in the forward."""
    before, after = ("head", "tail") if schedule.phase == "forward" else ("tail", "head")
    names, seen_block = {}, False
    for node in nodes:
        block = block_of(node.fqn)
        seen_block = seen_block or block is not None
        names[node.name] = block or (after if seen_block else before)
    return names


def _manual_names(schedule: Schedule, plan: Sequence[Sequence[str]]) -> dict[str, str]:
    names = {}
    for node in bucketable(schedule):
        matches = [prefixes for prefixes in plan if any(covers(prefix, node.fqn) for prefix in prefixes)]
        if len(matches) > 1:
            raise ValueError(f"module {node.fqn!r} is in {len(matches)} buckets of the manual plan ({matches}); "
                             "name each module in one bucket only")
        if matches:
            names[node.name] = "+".join(matches[0])
    return names


def covers(prefix: str, fqn: str) -> bool:
    """Whether module ``fqn`` is ``prefix`` or lies under it (``""`` covers everything)."""
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")
