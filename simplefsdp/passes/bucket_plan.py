"""Bucket planning: which collectives of one graph (a ``Schedule``) are merged into one, as plain data.

A bucket never mixes collective kinds, process groups or dtypes (such collectives form separate buckets of one name).
Modes: ``None``; ``"block"``, one bucket per repeated block (``find_blocks``: ``layers.0``, ``0``, ``h.0``) plus a
``head`` (before the blocks in the forward: the embedding) and a ``tail`` (after them; first in the backward); a
manual plan, lists of module FQN prefixes, bucket ``i`` taking every collective under list ``i`` and the rest staying
unbucketed; ``"auto"``, see ``simplefsdp.passes.auto_buckets``. With ``"block"``, all-reduces (``replicate``,
``hybrid_shard``'s replicas) are bucketed by bytes as DDP does: in backward order, up to half the memory budget
(two buckets in flight, ``reorder``), by default 25 MiB (the first: 1 MiB).

Every plan is a pure function of rank-invariant facts (``planned_bytes``, ``rank_local_nodes``; why:
``ARCHITECTURE.md``, "Every rank plans the same")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence, Union

from torch import nn

from simplefsdp.ir.schedule import COLLECTIVE, Schedule, ScheduleNode

BUCKETED_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
BucketMode = Union[None, str, Sequence[Sequence[str]]]
ALL_REDUCE_BUCKET_BYTES = 25 * 2**20, 2**20  # DDP's bucket_cap_mb, and its first bucket's, which starts sooner


@dataclass(frozen=True)
class Bucket:
    """Collectives (node names, program order) merged into one, and the module FQNs that own them."""
    name: str
    kind: str
    collectives: tuple[str, ...]
    owners: tuple[str, ...]


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of one graph (``phase``: ``"forward"`` or ``"backward"``), program order, and the blocks it used."""
    phase: str
    buckets: tuple[Bucket, ...]
    blocks: tuple[str, ...] = ()

    def __str__(self) -> str:
        found = f", {len(self.blocks)} block(s) {self.blocks[0]} .. {self.blocks[-1]}" if self.blocks else ""
        lines = [f"{self.phase}: {len(self.buckets)} bucket(s){found}"]
        lines += [f"  {b.kind} {b.name}: {len(b.collectives)} collective(s) [{', '.join(dict.fromkeys(b.owners))}]"
                  for b in self.buckets]
        return "\n".join(lines)


def find_blocks(model: nn.Module) -> tuple[str, ...]:
    """FQNs of the repeated blocks of ``model``: children of an ``nn.Sequential``, ``nn.ModuleList`` or
    ``nn.ModuleDict`` at any depth (the outermost) with the class and parameter shapes of a sibling. Nothing inside
    a child of a container holding blocks, or named as one but for its indices, is a block: RegNet's
    ``stages.0.layers`` (two layers that differ) beside ``stages.1.layers`` holds layers, not their convolutions."""
    blocks: list[str] = []
    children_of: dict[str, list[str]] = {}  # by container searched, its children's FQNs
    holding: set[str] = set()  # the containers holding blocks, their indices replaced
    for name, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and block_of(name, blocks) is None:
            children = {f"{name}.{key}".lstrip("."): (type(child), tuple(p.shape for p in child.parameters()))
                        for key, child in module.named_children()
                        if not isinstance(child, (nn.ModuleList, nn.ModuleDict))}  # a block runs a forward
            counts = Counter(children.values())
            found = [fqn for fqn, signature in children.items() if signature[1] and counts[signature] > 1]
            blocks += found
            children_of[name] = list(children)
            if found:
                holding.add(_without_indices(name))
    layers = tuple(child for name, children in children_of.items() if _without_indices(name) in holding
                   for child in children)
    return tuple(block for block in blocks if block_of(block.rpartition(".")[0], layers) is None)


def _without_indices(fqn: str) -> str:
    """``fqn`` with each index replaced (``stages.0.layers`` → ``stages.#.layers``)."""
    return ".".join("#" if part.isdigit() else part for part in fqn.split("."))


def plan_buckets(schedule: Schedule, mode: BucketMode, blocks: Sequence[str] = (),
                 memory_budget: int | None = None) -> BucketPlan:
    """Group ``schedule``'s collectives into buckets by ``mode`` (``"auto"`` excluded), ``blocks`` for ``"block"``."""
    if mode is None:
        return BucketPlan(schedule.phase, ())
    if mode == "block":
        names = {**all_reduce_names(schedule, memory_budget), **block_names(schedule, bucketable(schedule), blocks)}
    elif isinstance(mode, str):
        raise ValueError(f"plan_buckets takes None, 'block' or a manual plan, got {mode!r}")
    else:
        names, blocks = _manual_names(schedule, mode), ()
    return group_collectives(schedule, names, blocks)


def bucketable(schedule: Schedule, kinds: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_to_all")
               ) -> list[ScheduleNode]:
    """The data-parallel collectives of ``kinds`` (default: all but all-reduces), in order; parameters' gathers only."""
    gathers = {node.name for node in schedule.parameter_gathers()}
    return [node for node in schedule.data_parallel_collectives()
            if node.collective.kind in kinds and (node.collective.kind != "all_gather" or node.name in gathers)]


def all_reduce_names(schedule: Schedule, memory_budget: int | None) -> dict[str, str]:
    """All-reduce node name → its bucket (``all_reduce.N``): consecutive all-reduces, at most the cap's bytes."""
    cap, first_cap = (memory_budget // 2,) * 2 if memory_budget else ALL_REDUCE_BUCKET_BYTES
    names, index, size = {}, 0, 0
    for node in bucketable(schedule, ("all_reduce",)):
        if size and size + planned_bytes(schedule, node) > (cap if index else first_cap):
            index, size = index + 1, 0
        size += planned_bytes(schedule, node)
        names[node.name] = f"all_reduce.{index}"
    return names


def group_collectives(schedule: Schedule, names: dict[str, str], blocks: Sequence[str] = ()) -> BucketPlan:
    """Buckets from a collective-name → bucket-name map, split by kind, process group and dtype."""
    groups: dict[tuple, list[ScheduleNode]] = {}
    for node in (node for node in bucketable(schedule, BUCKETED_KINDS) if node.name in names):
        key = (names[node.name], node.collective.kind, node.collective.group_name, node.collective.dtype)
        groups.setdefault(key, []).append(node)
    return BucketPlan(schedule.phase, tuple(
        Bucket(name, kind, tuple(n.name for n in nodes), tuple(n.fqn for n in nodes))
        for (name, kind, _, _), nodes in groups.items()), tuple(blocks))


def block_of(fqn: str, blocks: Sequence[str]) -> str | None:
    """The block of ``blocks`` that ``fqn`` lies in (``layers.3.attention.wq`` → ``layers.3``), or None."""
    return next((block for block in blocks if covers(block, fqn)), None)


def block_names(schedule: Schedule, nodes: list[ScheduleNode], blocks: Sequence[str]) -> dict[str, str]:
    """Node name → its block, or ``head`` / ``tail`` for nodes before / after the blocks in the forward."""
    before, after = ("head", "tail") if schedule.phase == "forward" else ("tail", "head")
    names, seen_block = {}, False
    for node in nodes:
        block = block_of(node.fqn, blocks)
        seen_block = seen_block or block is not None
        names[node.name] = block or (after if seen_block else before)
    return names


def _manual_names(schedule: Schedule, plan: Sequence[Sequence[str]]) -> dict[str, str]:
    """Node name → its bucket of ``plan`` (checked by ``options.check_manual_plan``: a module in one bucket only)."""
    matches = {node.name: [prefixes for prefixes in plan if any(covers(prefix, node.fqn) for prefix in prefixes)]
               for node in bucketable(schedule, BUCKETED_KINDS)}
    return {name: "+".join(buckets[0]) for name, buckets in matches.items() if buckets}


def covers(prefix: str, fqn: str) -> bool:
    """Whether module ``fqn`` is ``prefix`` or lies under it (``""`` covers everything)."""
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")


def planned_bytes(schedule: Schedule, node: ScheduleNode) -> int:
    """The bytes a plan counts for collective ``node``: its full buffer, the same on every rank of its group, except
    for an all-reduce of a view of an earlier collective's output (``hybrid_shard``'s all-reduce of the shard a
    reduce-scatter left, narrowed to this rank's uneven shard): that output's bytes, the padded shard."""
    base = schedule.node(node.inputs[0]) if node.collective.kind == "all_reduce" and node.inputs else None
    while base is not None and base.alias_of is not None:
        base = schedule.node(base.alias_of)
    if base is not None and base.kind == COLLECTIVE:
        return max(node.collective.bytes, base.bytes_written)
    return node.collective.bytes


def rank_local_nodes(schedule: Schedule) -> set[str]:
    """Nodes that exist, or have their sizes, only because of this rank's local shards: everything a parameter's
    all-gather (one that follows no data-parallel collective) reads, i.e. the casts, pads and quantization of the
    shard, and everything after a gradient collective (reduce-scatter, all-to-all, all-reduce), i.e. narrowing to
    the shard, casts, error feedback. No planner prices these; every rank still has the same other nodes."""
    collectives = {node.name: node.collective.kind for node in schedule.data_parallel_collectives()}
    after_any, after_gradient = set(), set()
    for node in schedule.nodes:
        if node.name in collectives or after_any.intersection(node.inputs):
            after_any.add(node.name)
        if collectives.get(node.name, "all_gather") != "all_gather" or after_gradient.intersection(node.inputs):
            after_gradient.add(node.name)
    before_gather = set()
    for node in reversed(schedule.nodes):
        parameter_gather = collectives.get(node.name) == "all_gather" and not after_any.intersection(node.inputs)
        if parameter_gather or node.name in before_gather:
            before_gather.update(node.inputs)
    return (before_gather | after_gradient) - collectives.keys()
