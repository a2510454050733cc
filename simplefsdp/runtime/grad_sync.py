"""Gradient accumulation without communication (FSDP2's ``set_requires_gradient_sync(False)``).

While sync is off, a gathered parameter's gradient flows not to the sharded parameter (no reduction) but into a
per-parameter accumulator leaf, where autograd sums the unreduced local gradients across micro-batches; the next
backward with sync on adds that sum before its one reduction, then drops it. ``torch.compile`` guards on the flag and
on a pending sum: one graph per state. Known cost: with sync off the compiled backward keeps the forward's gathered
parameters (the partitioner does not recompute a gather whose output has no gradient path).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import nn


class GradientSync:
    """The switch ``set_requires_gradient_sync`` flips; one per ``compile_sharded`` model."""

    def __init__(self) -> None:
        self.enabled = True
        self.drops_registered = False


def new_accumulator(param: torch.Tensor, device: str) -> torch.Tensor:
    """A memory-free leaf of ``param``'s full shape on ``device``; its ``.grad`` is the pending sum."""
    return param.new_zeros((), device=device).expand(param.shape).requires_grad_()  # fake when param is fake


class _RouteGradient(torch.autograd.Function):
    """Identity on ``value``; the incoming gradient goes to ``accumulator`` instead of ``value``."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
        ctx.accumulator_dtype = accumulator.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.to(ctx.accumulator_dtype)


class _AddPending(torch.autograd.Function):
    """Identity on ``value``; its gradient gets ``pending`` added (in ``pending``'s dtype) on the way back."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        # Kept on ctx, not saved for backward: under activation checkpointing this forward may
        # be recomputed after the pending sum was dropped, and saved tensors must match.
        ctx.pending = pending
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad.to(ctx.pending.dtype) + ctx.pending).to(grad.dtype), None


def route_gradient(full: torch.Tensor, accumulator: torch.Tensor, sync: GradientSync) -> torch.Tensor:
    """``full`` for the forward; its gradient accumulates unreduced in ``accumulator.grad`` with sync off, and with
    sync on it includes the sum pending there, if any."""
    if not sync.enabled:
        return _RouteGradient.apply(full.detach(), accumulator)
    return full if accumulator.grad is None else _AddPending.apply(full, accumulator.grad)


def register_pending_drops(model: nn.Module, sync: GradientSync) -> None:
    """Clear each accumulator's pending sum once a backward with sync on has accumulated its parameter's gradient.

    Registered when sync is first turned off, so on the parameters as they are then (``to_empty`` replaces them).
    The hooks also fire with sync off (a compiled backward runs every accumulation), where they keep the sum."""
    for module in model.modules():
        for name, accumulator in vars(module).get("_grad_accumulators", {}).items():
            module._parameters[name].register_post_accumulate_grad_hook(functools.partial(_drop, sync, accumulator))


def _drop(sync: GradientSync, accumulator: torch.Tensor, _: torch.Tensor) -> None:
    if sync.enabled:
        accumulator.grad = None


class GradientSyncMethods:
    """FSDP2's gradient-sync controls, mixed into the class of the model ``compile_sharded`` returns."""
    _gradient_sync: GradientSync

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Off: backwards keep full gradients locally with no communication. On: the next backward reduces all."""
        if not requires_gradient_sync and not self._gradient_sync.drops_registered:
            register_pending_drops(self, self._gradient_sync)
            self._gradient_sync.drops_registered = True
        self._gradient_sync.enabled = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside run without gradient communication; the first backward after it reduces everything."""
        previous = self._gradient_sync.enabled
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)


def add_gradient_sync_methods(model: nn.Module, sync: GradientSync) -> None:
    """Give ``model`` the methods of ``GradientSyncMethods``, controlling ``sync``, by swapping its class."""
    model._gradient_sync = sync
    model.__class__ = type(type(model).__name__, (GradientSyncMethods, type(model)), {})
