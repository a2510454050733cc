"""Activation checkpointing per block: ``full`` recomputes the block in backward, ``selective`` keeps matmul outputs.

Each block's ``forward`` becomes a checkpointed call of the original, so parameter names and ``state_dict`` keys do
not change; the parameter gathers inside a block stay recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from simplefsdp.names import AC_MODES

aten = torch.ops.aten
SAVED_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,  # what SDPA dispatches to on an H100 (inspect --device cuda)
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _draws_random_numbers(op) -> bool:
    # Recomputing such an op (attention, dropout) makes AOTAutograd 2.13 save its RNG state after the DTensor mesh it
    # saves: misaligned, an AssertionError at the first compiled forward. Both policies save their outputs.
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective policy: keep the outputs of matmuls, attention and ops that draw random numbers, recompute the rest."""
    saved = op in SAVED_OPS or _draws_random_numbers(op)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _save_random_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Full policy: recompute everything except ops that draw random numbers."""
    return CheckpointPolicy.MUST_SAVE if _draws_random_numbers(op) else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_context(policy: Callable[..., CheckpointPolicy]) -> functools.partial:
    """The checkpoint ``context_fn`` that applies ``policy``, cacheable by AOTAutograd."""
    context = functools.partial(create_selective_checkpoint_contexts, policy)  # Dynamo traces only a partial
    # Without a cache_hash AOTAutograd bypasses its cache, and every process traces the graphs again.
    context.cache_hash = hashlib.sha256(inspect.getsource(sys.modules[policy.__module__]).encode()).hexdigest()
    return context


_POLICIES = {"selective": checkpoint_context(_save_matmuls), "full": checkpoint_context(_save_random_ops)}


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Checkpoint each of ``blocks`` (e.g. ``model.layers``): ``mode`` is ``"none"``, ``"full"`` or ``"selective"``."""
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of: {', '.join(AC_MODES)}")
    if mode == "none":
        return
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=_POLICIES[mode])


def checkpoint_hugging_face_layers_fully(model: nn.Module) -> None:
    """Layers checkpointed by Hugging Face's ``activation_checkpointing_enable()`` checkpoint with the ``full`` policy:
    the same recomputation, but what random ops drew is kept (theirs recomputes attention, which fails compiled)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False,
                                                                    context_fn=_POLICIES["full"])
