"""Gradient accumulation without communication (FSDP2's ``set_requires_gradient_sync(False)``).

While sync is off, a gathered parameter's gradient goes, unreduced, to a per-parameter accumulator leaf in the reduce
dtype, where autograd sums it over micro-batches and reads; a backward with sync on while a sum is pending adds to it,
then reduces the sum once into the sharded parameter's ``.grad``, as FSDP2 reduces its accumulated unsharded gradient.
``torch.compile`` guards on the flag and on a pending sum: one graph for "reduce now", one for "accumulate"."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn


class GradientSync:
    """The switch ``set_requires_gradient_sync`` flips; one per ``compile_sharded`` model."""

    def __init__(self) -> None:
        self.enabled = True
        self.reductions_registered = False


def new_accumulator(param: torch.Tensor, device: str, dtype: torch.dtype | None) -> torch.Tensor:
    """A memory-free leaf (fake when ``param`` is) of ``param``'s full shape on ``device`` in ``dtype`` (default:
    ``param``'s); its ``.grad`` is the pending sum."""
    return param.new_zeros((), device=device, dtype=dtype or param.dtype).expand(param.shape).requires_grad_()


def _routed(value: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
    """``value``'s values (``accumulator`` holds zeros, and ``x - +0`` is ``x``); the gradient goes to ``accumulator``
    (in its dtype), none to ``value``. No ``autograd.Function``: torch 2.13 keeps a graph holding one out of
    AOTAutograd's cache, so every warm start would trace it again."""
    return value.detach() - (accumulator.detach() - accumulator).to(value.dtype)


def route_gradient(full: torch.Tensor, accumulator: torch.Tensor, sync: GradientSync) -> torch.Tensor:
    """``full`` for the forward; its gradient goes to ``accumulator.grad`` unreduced when sync is off or a sum is
    pending there, else through ``full``'s own backward (the reduction). Until sync is first turned off no sum can be
    pending, and the accumulator is not read: Dynamo then neither wraps it as an input nor guards on it."""
    if sync.enabled and (not sync.reductions_registered or accumulator.grad is None):
        return full
    return _routed(full, accumulator)


Reduce = Callable[[nn.Module, str, torch.Tensor], None]


def register_pending_reductions(model: nn.Module, sync: GradientSync, reduce: Reduce) -> None:
    """After each backward with sync on, ``reduce(module, name, pending)`` each parameter's pending sum, once, and
    drop it; with sync off the sum stays. A parameter shared by several modules has one accumulator and one hook."""
    seen: set[int] = set()
    for module in model.modules():
        for name, accumulator in vars(module).get("_grad_accumulators", {}).items():
            if id(accumulator) not in seen:
                seen.add(id(accumulator))
                accumulator.register_post_accumulate_grad_hook(functools.partial(_reduce, sync, reduce, module, name))


def _reduce(sync: GradientSync, reduce: Reduce, module: nn.Module, name: str, accumulator: torch.Tensor) -> None:
    if sync.enabled:
        pending, accumulator.grad = accumulator.grad, None
        reduce(module, name, pending)


def reduces_every_micro_batch(choice: str | None, mode: str) -> bool:
    """Whether accumulation reduces after every micro-batch: ``choice`` (``"every"`` or ``"last"``, the command line's
    ``--grad-accum-reduce``), by default ``every`` for ``fully_shard`` (sharded gradients: ZeRO-3 memory), else
    ``last`` (replicas hold full gradients anyway, and their all-reduce crosses the slow link)."""
    return (choice or ("every" if mode == "fully_shard" else "last")) == "every"


class GradientSyncMethods:
    """FSDP2's gradient-sync controls, mixed into the class of the model ``compile_sharded`` returns."""
    _gradient_sync: GradientSync
    _reduce_pending: Reduce

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Off: backwards keep full gradients locally with no communication. On: the next backward reduces all."""
        if not requires_gradient_sync and not self._gradient_sync.reductions_registered:
            register_pending_reductions(self, self._gradient_sync, self._reduce_pending)
            self._gradient_sync.reductions_registered = True
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


def add_gradient_sync_methods(model: nn.Module, sync: GradientSync, reduce: Reduce) -> None:
    """Give ``model`` the methods of ``GradientSyncMethods``, controlling ``sync``; ``reduce(module, name, pending)``
    reduces a pending sum into the parameter's ``.grad``. By swapping the model's class."""
    model._gradient_sync, model._reduce_pending = sync, reduce
    model.__class__ = type(type(model).__name__, (GradientSyncMethods, type(model)), {})
