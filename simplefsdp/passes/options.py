"""Checking the bucketing and reordering options of ``compile_sharded`` before anything compiles."""

from __future__ import annotations

from typing import Any

from torch import nn

from simplefsdp.passes.bucket_plan import covers

BUCKET_MODES = ("auto", "block", None)


def check_pass_options(model: nn.Module | None, buckets: Any, reorder: Any, prefetch: Any, memory_budget: Any,
                       blocks: Any = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the fix for a bad option; ``model`` checks module names."""
    if isinstance(buckets, str) or buckets is None:
        if buckets not in BUCKET_MODES:
            raise ValueError(
                f"unknown bucket mode {buckets!r}; choose 'auto', 'block', None, or a manual plan "
                "(a list of lists of module names, e.g. [['tok_embeddings'], ['layers.0']])"
            )
    elif not _is_manual_plan(buckets):
        raise TypeError(f"buckets must be 'auto', 'block', None or a list of lists of module names, got {buckets!r}")
    elif model is not None:
        check_manual_plan(model, buckets)
    if blocks is not None and not _is_manual_plan([blocks]):
        raise TypeError(f"blocks must be a list of module names, e.g. ['layers.0', 'layers.1'], got {blocks!r}")
    if blocks is not None and model is not None:
        _check_names(model, blocks, "blocks")
    if not isinstance(reorder, bool):
        raise TypeError(f"reorder must be True or False, got {reorder!r}")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be a whole number of buckets (0 or more), got {prefetch!r}")
    if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget <= 0):
        raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")


def _is_manual_plan(buckets: Any) -> bool:
    return isinstance(buckets, (list, tuple)) and all(
        isinstance(bucket, (list, tuple)) and bucket and all(isinstance(name, str) for name in bucket)
        for bucket in buckets)


def check_manual_plan(model: nn.Module, plan: list[list[str]]) -> None:
    """Every prefix names a module of ``model``, and no parameter falls in two buckets."""
    _check_names(model, [prefix for bucket in plan for prefix in bucket], "the manual bucket plan")
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        holding = [bucket for bucket in plan if any(covers(prefix, owner) for prefix in bucket)]
        if len(holding) > 1:
            raise ValueError(f"parameter {name!r} is in {len(holding)} buckets of the manual plan ({holding}); "
                             "put each module in one bucket only")


def _check_names(model: nn.Module, names: list[str], what: str) -> None:
    modules = [name for name, _ in model.named_modules() if name]
    unknown = [name for name in names if name not in modules]
    if unknown:
        raise ValueError(f"{what} names module(s) that {type(model).__name__} does not have: "
                         f"{', '.join(map(repr, unknown))}; valid names: {', '.join(modules)}")
