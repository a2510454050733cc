"""Activation checkpointing per block: ``full`` recomputes the whole block in backward, ``selective`` keeps matmul outputs.

Applied by replacing each block's ``forward`` with a checkpointed call of the
original, so parameter names and ``state_dict`` keys do not change. Composes
with sharding: the parameter gathers inside a block stay recomputed.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective")

aten = torch.ops.aten
SAVED_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective policy: keep the outputs of matmuls and attention, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# A partial, not a lambda: Dynamo traces selective checkpointing only through a partial.
_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Checkpoint each of ``blocks`` (e.g. ``model.layers``): ``mode`` is ``"none"``, ``"full"`` or ``"selective"``."""
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of: {', '.join(AC_MODES)}")
    if mode == "none":
        return
    options = {"context_fn": _SELECTIVE} if mode == "selective" else {}
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **options)
