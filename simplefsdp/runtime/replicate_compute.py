"""The replicate-for-compute getter: how the forward reads a sharded parameter.

Reading ``module.weight`` gathers the DTensor shard into a full local tensor (all-gather for ``Shard``, nothing for
``Replicate``), cast to the compute dtype; a tensor-parallel parameter is gathered over dp only, into TP's own
DTensor. Its backward turns the local gradient into a ``Partial("avg")`` DTensor and reduces it back to the
parameter's placement: reduce-scatter, all-reduce, or both. With gradient sync off (``grad_sync.py``) the gradient
goes to an accumulator instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from simplefsdp.runtime.activation_checkpoint import checkpoint_context
from simplefsdp.runtime.grad_sync import GradientSync, route_gradient
from simplefsdp.runtime.quantize import Quantize, quantized_replicate


def _recompute_everything(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Checkpoint policy for the gather region: recompute every op (the all-gather, its wait, the cast)."""
    return CheckpointPolicy.MUST_RECOMPUTE


_reshard_context = checkpoint_context(_recompute_everything)


# Dynamo's notice that a checkpoint context_fn must not hold in-place ops: our gather region holds none, and the
# notice would only confuse users at every compile.
logging.getLogger("torch._higher_order_ops.wrap").addFilter(
    lambda record: "context_fn is passed to torch.utils.checkpoint" not in record.getMessage())


@dataclass(frozen=True)
class ReplicateComputation:
    """Turns a sharded DTensor parameter into the full local tensor the forward computes with."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    quantize: Quantize | None = None
    tensor_parallel: DeviceMesh | None = None  # the mesh of TP's DTensors (``parallelize_module``), if any
    sync: GradientSync = field(default_factory=GradientSync, compare=False)

    def gather(self, param: DTensor, error: torch.Tensor | None) -> torch.Tensor:
        """All-gather ``param`` in ``param_dtype``; its gradient is averaged over ranks in ``reduce_dtype``, or both
        in ``quantize``'s formats (``error``: this parameter's error feedback buffer, or None).

        On a (replicas, shards) mesh the gradient is reduce-scattered over the shards first and its
        shard then all-reduced over the replicas, so the replicas exchange shards, not whole gradients.
        """
        ndim = param.device_mesh.ndim
        if self.quantize is not None and param.is_floating_point() and param.dim():  # a 0-dim one: plain
            return quantized_replicate(param, error, self.quantize, self.param_dtype, self.reduce_dtype)
        grad_placements = [Partial("avg")] * ndim
        if self.tensor_parallel is not None and ndim == 2:  # (dp, tp): gather over dp, keep TP's shard
            tp_placement = param.placements[1]
            full = param.redistribute(placements=[Replicate(), tp_placement], forward_dtype=self.param_dtype,
                                      backward_dtype=self.reduce_dtype)
            return full.to_local(grad_placements=[Partial("avg"), tp_placement])
        if ndim == 2:
            # The no-op redistribute's backward all-reduces the shard's gradient over the replicas.
            unchanged = param.redistribute(param.device_mesh, param.placements, backward_dtype=self.reduce_dtype)
            shard = unchanged.to_local(grad_placements=[Partial("avg"), param.placements[1]])
            param = DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
            grad_placements = [Replicate(), Partial("avg")]
        full = param.redistribute(placements=[Replicate()] * ndim, forward_dtype=self.param_dtype,
                                  backward_dtype=self.reduce_dtype)
        return full.to_local(grad_placements=grad_placements)

    def compute_view(self, param: DTensor, accumulator: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
        """The gathered parameter (TP's DTensor for a TP parameter); with sync off its gradient goes to
        ``accumulator`` unreduced."""
        full = route_gradient(self.gather(param, error), accumulator, self.sync)
        if self.tensor_parallel is None or param.device_mesh.ndim == 1:
            return full
        return DTensor.from_local(full, self.tensor_parallel, param.placements[1:], run_check=False, shape=param.shape,
                                  stride=param.stride())

    def __call__(self, param: DTensor, accumulator: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
        if self.reshard_after_forward:
            return checkpoint(self.compute_view, param, accumulator, error, use_reentrant=False,
                              context_fn=_reshard_context)
        return self.compute_view(param, accumulator, error)


def install_getters(module: nn.Module, accumulators: dict[str, torch.Tensor], errors: dict[str, torch.Tensor | None],
                    replicate: ReplicateComputation) -> None:
    """Make ``module.<name>`` return ``replicate(module._parameters[name], accumulators[name], errors[name])``.

    By a subclass with one property per name, so ``state_dict`` and ``named_parameters`` still see the shards."""
    module._grad_accumulators, module._error_feedback = accumulators, errors
    cls = module._class_without_getters = module.__class__
    getters = {name: property(functools.partial(_read_parameter, name=name, replicate=replicate))
               for name in accumulators}
    module.__class__ = type(f"Sharded{cls.__name__}", (cls,), getters)


def _read_parameter(module: nn.Module, name: str, replicate: ReplicateComputation) -> torch.Tensor:
    return replicate(module._parameters[name], module._grad_accumulators[name], module._error_feedback[name])


@contextlib.contextmanager
def stored_parameters(model: nn.Module) -> Iterator[None]:
    """Inside, ``module.<name>`` is the sharded parameter itself, not a gather (for DCP's ``state_dict`` and others
    that walk attributes, where every read through a getter would all-gather)."""
    swapped = [(module, module.__class__) for module in model.modules() if "_class_without_getters" in vars(module)]
    for module, _ in swapped:
        module.__class__ = module._class_without_getters
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
