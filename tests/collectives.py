"""Counting the collectives that actually run, eager or compiled, at the operator level."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COLLECTIVES = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "all_to_all")


class CountCollectives(TorchDispatchMode):
    """Counts the collective ops on floating-point data (any data with ``any_dtype``) dispatched while active, by op
    name. Object collectives (pickled bytes, e.g. DCP's planning) are not counted unless ``any_dtype``. Higher-order
    ops (a compiled-once block's ``invoke_subgraph``, which holds no collective) run as they are.
    """

    supports_higher_order_operators = True

    def __init__(self, any_dtype: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.any_dtype = any_dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        counted = self.any_dtype or _carries_floats(args)
        if namespace in ("_c10d_functional", "c10d") and name.startswith(COLLECTIVES) and counted:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _carries_floats(args) -> bool:
    return any(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in tree_leaves(args))
