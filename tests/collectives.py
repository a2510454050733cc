"""Counting the collectives that actually run, eager or compiled, at the operator level."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


COLLECTIVES = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "all_to_all")


class CountCollectives(TorchDispatchMode):
    """Counts every ``_c10d_functional`` / ``c10d`` collective op dispatched while active, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace in ("_c10d_functional", "c10d") and name.startswith(COLLECTIVES):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def reductions(self) -> int:
        """Reduce-scatters plus all-reduces seen so far."""
        return sum(n for name, n in self.counts.items() if "reduce" in name)
