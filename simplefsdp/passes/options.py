"""Checking the bucketing and reordering options of ``compile_sharded`` before anything compiles."""

from __future__ import annotations

from typing import Any

from torch import nn

from simplefsdp.passes.bucket_plan import covers

BUCKET_MODES = ("auto", "block", None)


def check_pass_options(model: nn.Module | None, buckets: Any, reorder: Any, prefetch: Any, memory_budget: Any,
                       blocks: Any = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the fix for a bad option; ``model`` checks the module names."""
    manual = not isinstance(buckets, str) and buckets is not None
    if not manual and buckets not in BUCKET_MODES:
        raise ValueError(f"unknown bucket mode {buckets!r}; choose 'auto', 'block', None, or a manual plan "
                         "(a list of lists of module names, e.g. [['tok_embeddings'], ['layers.0']])")
    if manual and not _is_name_lists(buckets):
        raise TypeError(f"buckets must be 'auto', 'block', None or a list of lists of module names, got {buckets!r}")
    if blocks is not None and not _is_name_lists([blocks]):
        raise TypeError(f"blocks must be a list of module names, e.g. ['layers.0', 'layers.1'], got {blocks!r}")
    if model is not None:
        modules = [name for name, _ in model.named_modules() if name]
        names = [*(blocks or []), *(name for bucket in buckets for name in bucket)] if manual else blocks or []
        if unknown := [name for name in names if name not in modules]:
            raise ValueError(f"the manual bucket plan or blocks= names module(s) that {type(model).__name__} "
                             f"does not have: {', '.join(map(repr, unknown))}; valid names: {', '.join(modules)}")
        if manual:
            check_manual_plan(model, buckets)
    if not isinstance(reorder, bool):
        raise TypeError(f"reorder must be True or False, got {reorder!r}")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be a whole number of buckets (0 or more), got {prefetch!r}")
    if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget <= 0):
        raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")


def _is_name_lists(buckets: Any) -> bool:
    return isinstance(buckets, (list, tuple)) and all(
        isinstance(bucket, (list, tuple)) and bucket and all(isinstance(name, str) for name in bucket)
        for bucket in buckets)


def check_manual_plan(model: nn.Module, plan: list[list[str]]) -> None:
    """No parameter of ``model`` falls in two buckets of ``plan``."""
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        holding = [bucket for bucket in plan if any(covers(prefix, owner) for prefix in bucket)]
        if len(holding) > 1:
            raise ValueError(f"parameter {name!r} is in {len(holding)} buckets of the manual plan ({holding}); "
                             "put each module in one bucket only")
