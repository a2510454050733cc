"""Memory model: liveness over the forward then the backward schedule, per rank, by category.

Every non-view node allocates its output when it runs; the storage is freed after the last node that reads it or any
view of it. Saved tensors live until their last use in the backward; the forward's own results (e.g. logits) until the
backward starts, when their gradients (``tangents_*``) arrive. Graph inputs and the backward's outputs (sharded
gradients) are held for the whole step.

Categories: ``sharded_params`` (what each rank keeps: shards, or whole parameters in replicate mode),
``unsharded_params`` (all-gather outputs), ``gradients`` (reduce-scatter / all-reduce outputs and returned gradients),
``comm_buffers`` (tensors made only for a collective, e.g. a shard cast to the compute dtype) and ``activations``."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from simplefsdp.ir.schedule import COLLECTIVE, COMPUTE, Schedule, ScheduleNode

_END = 1 << 62  # a step after the last one
CATEGORIES = ("sharded_params", "unsharded_params", "gradients", "comm_buffers", "activations")


@dataclass
class MemoryProfile:
    """Peak bytes per rank and its split by category; ``curve``: live bytes after each node, forward then backward."""
    peak_bytes: int
    peak_at: str
    peak_by_category: dict[str, int]
    curve: list[int] = field(repr=False)


@dataclass
class _Storage:
    bytes: int
    category: str
    last_use: int


def memory_profile(forward: Schedule, backward: Schedule) -> MemoryProfile:
    """Liveness of the whole step (forward, then backward) and its peak."""
    liveness = _Liveness()
    for graph_input in forward.inputs:
        category = "sharded_params" if graph_input.param_fqn else "activations"
        liveness.hold(f"f:{graph_input.name}", graph_input.bytes, category)
    liveness.run("f", forward.nodes)
    saved = {graph_input.name for graph_input in backward.inputs}
    for name in forward.outputs:
        if name is not None and name not in saved:  # the forward's results live until the backward starts
            liveness.use(f"f:{name}", liveness.step - 1)
    for graph_input in backward.inputs:
        if f"f:{graph_input.name}" in liveness.root:
            liveness.root[f"b:{graph_input.name}"] = liveness.root[f"f:{graph_input.name}"]
        else:  # the gradient of a forward result, arriving when the backward starts
            liveness.allocate(f"b:{graph_input.name}", graph_input.bytes, "activations")
    liveness.run("b", backward.nodes)
    for name in backward.outputs:
        if name is not None:
            liveness.use(f"b:{name}", _END, "gradients")  # held to the end of the step
    return liveness.peak()


class _Liveness:
    """Storages (keyed ``phase:name``) with the step that allocates and the last step that reads each."""

    def __init__(self) -> None:
        self.root: dict[str, str] = {}
        self.storages: dict[str, _Storage] = {}
        self.held: dict[str, int] = defaultdict(int)  # bytes alive for the whole step, by category
        self.allocated_at: dict[int, list[str]] = defaultdict(list)
        self.labels: list[str] = []
        self.step = 0

    def hold(self, key: str, size: float, category: str) -> None:
        """A storage alive for the whole step."""
        self.root[key] = key
        self.held[category] += int(size)

    def allocate(self, key: str, size: float, category: str) -> None:
        """A storage allocated at the current step."""
        self.root[key] = key
        self.storages[key] = _Storage(int(size), category, self.step)
        self.allocated_at[self.step].append(key)

    def use(self, key: str, step: int, category: str | None = None) -> None:
        """Keep the storage behind ``key`` alive at least through ``step``; with ``category``, recategorise it."""
        if (storage := self.storages.get(self.root.get(key, ""))) is not None:
            storage.last_use = max(storage.last_use, step)
            storage.category = category or storage.category

    def run(self, phase: str, nodes: list[ScheduleNode]) -> None:
        """Walk ``nodes`` in order: allocate each output, extend the life of each input."""
        users = defaultdict(list)
        for node in nodes:
            for name in node.inputs:
                users[name].append(node)
        # Ops that return several new tensors (read through getitem): each item is its own storage.
        split = {node.name: node for node in nodes if node.kind == COMPUTE and node.alias_of is None
                 and users[node.name] and all(user.op == "getitem" for user in users[node.name])}
        for node in nodes:
            key = f"{phase}:{node.name}"
            if node.alias_of in split:
                self.allocate(key, node.bytes_written, _category(split[node.alias_of], users[node.name]))
            elif node.alias_of is not None:
                self.root[key] = self.root.get(f"{phase}:{node.alias_of}", key)
            elif node.name not in split:
                self.allocate(key, node.bytes_written, _category(node, users[node.name]))
            for name in node.inputs:
                self.use(f"{phase}:{name}", self.step)
            self.labels.append(f"{'forward' if phase == 'f' else 'backward'}:{node.name}")
            self.step += 1

    def peak(self) -> MemoryProfile:
        """Sweep the steps: live bytes after allocation (the peak candidate), then frees."""
        freed_at: dict[int, list[str]] = defaultdict(list)
        for key, storage in self.storages.items():
            freed_at[storage.last_use].append(key)
        live: dict[str, int] = defaultdict(int, self.held)
        peak, peak_at, split, curve = -1, "", {}, []
        for step, label in enumerate(self.labels):
            for key in self.allocated_at[step]:
                live[self.storages[key].category] += self.storages[key].bytes
            total = sum(live.values())
            if total > peak:
                peak, peak_at, split = total, label, dict(live)
            for key in freed_at[step]:
                live[self.storages[key].category] -= self.storages[key].bytes
            curve.append(sum(live.values()))
        return MemoryProfile(peak, peak_at, {category: split.get(category, 0) for category in CATEGORIES}, curve)


def _category(node: ScheduleNode, users: list[ScheduleNode]) -> str:
    if node.kind == COLLECTIVE:
        return "unsharded_params" if node.collective.kind == "all_gather" else "gradients"
    if users and all(user.kind == COLLECTIVE for user in users):
        return "comm_buffers"
    return "activations"
