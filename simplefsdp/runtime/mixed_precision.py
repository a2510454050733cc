"""Mixed precision policy: the dtype parameters are gathered and computed in, and the dtype gradients are reduced in."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: compute dtype of gathered parameters; ``reduce_dtype``: dtype of gradient reduction. ``None``
    keeps the parameter's own dtype, as do the sharded parameters and the gradients the optimizer sees."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"MixedPrecision({field}={dtype!r}) must be a floating-point torch.dtype, "
                                 f"e.g. {field}=torch.bfloat16, or None to keep the parameter dtype")


def dtype_named(name: str | None) -> torch.dtype | None:
    """The torch dtype a command-line name (``bfloat16``) stands for; None for None."""
    return None if name is None else getattr(torch, name)


def mixed_precision_option(args: argparse.Namespace) -> MixedPrecision:
    """The ``MixedPrecision`` the command line's ``--param-dtype`` and ``--reduce-dtype`` names ask for."""
    return MixedPrecision(dtype_named(args.param_dtype), dtype_named(args.reduce_dtype))


def cast_floating_inputs(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point tensors among ``module``'s forward arguments to ``dtype`` (as FSDP2 does)."""

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def hook(_module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    module.register_forward_pre_hook(hook, with_kwargs=True)
