"""The replicate-for-compute getter: how the forward reads a sharded parameter (ARCHITECTURE.md, steps 4 and 6:
gather, cast and reduce back; tied parameters gathered once per compiled call)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from simplefsdp.passes.bucket_plan import block_of
from simplefsdp.runtime.activation_checkpoint import checkpoint_context
from simplefsdp.runtime.grad_sync import GradientSync, route_gradient
from simplefsdp.runtime.quantize import Quantize, quantized_reduce, quantized_replicate


def _recompute_everything(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Checkpoint policy for the gather region: recompute every op (the all-gather, its wait, the cast)."""
    return CheckpointPolicy.MUST_RECOMPUTE


_reshard_context = checkpoint_context(_recompute_everything)


# Dynamo's notice that a checkpoint context_fn must not hold in-place ops: our gather region holds none, and the
# notice would only confuse users at every compile.
logging.getLogger("torch._higher_order_ops.wrap").addFilter(
    lambda record: "context_fn is passed to torch.utils.checkpoint" not in record.getMessage())


class ForwardGathers:
    """The tied parameters gathered for the current compiled call of the root module, by parameter key; else None."""

    def __init__(self) -> None:
        self.gathered: dict[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class ReplicateComputation:
    """Turns a sharded DTensor parameter into the full local tensor the forward computes with."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    quantize: Quantize | None = None
    tensor_parallel: DeviceMesh | None = None  # the mesh of TP's DTensors (``parallelize_module``), if any
    sync: GradientSync = field(default_factory=GradientSync, compare=False)
    gathers: ForwardGathers = field(default_factory=ForwardGathers, compare=False)
    # The classes install_getters made for this computation, by module class and parameter names: shared, so that
    # Dynamo's guards on a block's type hold for every block alike.
    getter_classes: dict[tuple[type, tuple[str, ...]], type] = field(default_factory=dict, init=False, compare=False,
                                                                     repr=False)

    def gather(self, param: DTensor, error: torch.Tensor | None) -> torch.Tensor:
        """All-gather ``param`` in ``param_dtype``; its gradient is averaged over ranks in ``reduce_dtype``, or both
        in ``quantize``'s formats (``error``: this parameter's error feedback buffer, or None); on a hybrid mesh,
        reduce-scattered over the shards, then the shard all-reduced over the replicas."""
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

    def in_block(self, fqn: str, blocks: Sequence[str]) -> ReplicateComputation:
        """The computation for the module ``fqn`` of a model whose repeated blocks are ``blocks`` (in forward order):
        outside the blocks and in the last block the gathered parameters are kept from forward to backward, as
        FSDP2 keeps its root's and torchtitan its last block's (the backward gathers them first)."""
        if not self.reshard_after_forward or not blocks or block_of(fqn, blocks) not in (None, blocks[-1]):
            return self
        return self._kept_from_forward_to_backward

    @functools.cached_property
    def _kept_from_forward_to_backward(self) -> ReplicateComputation:
        return dataclasses.replace(self, reshard_after_forward=False)

    def compute_view(self, param: DTensor, accumulator: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
        """The gathered parameter (TP's DTensor for a TP parameter); with sync off its gradient goes to
        ``accumulator`` unreduced."""
        full = route_gradient(self.gather(param, error), accumulator, self.sync)
        if self.tensor_parallel is None or param.device_mesh.ndim == 1:
            return full
        return DTensor.from_local(full, self.tensor_parallel, param.placements[1:], run_check=False, shape=param.shape,
                                  stride=param.stride())

    def reduce(self, param: DTensor, grad: torch.Tensor, error: torch.Tensor | None) -> DTensor:
        """What ``gather``'s backward gives ``param`` for the full local gradient ``grad`` (in the reduce dtype):
        averaged over the data-parallel ranks, placed as ``param``, in ``param``'s dtype."""
        mesh, placements = param.device_mesh, param.placements
        if self.quantize is not None and param.is_floating_point() and param.dim():
            local = quantized_reduce(grad, error, mesh, placements, param.shape, self.quantize, self.reduce_dtype,
                                     param.to_local().shape, param.dtype)
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape,
                                      stride=param.stride())
        if self.tensor_parallel is not None and mesh.ndim == 2:  # (dp, tp): reduce over dp, keep TP's shard
            steps = [[Partial("avg"), placements[1]], placements]
        else:  # hybrid: reduce-scatter over the shards first, then all-reduce the shard over the replicas
            steps = [[Partial("avg")] * mesh.ndim, [Partial("avg")] * (mesh.ndim - 1) + [placements[-1]], placements]
        reduced = DTensor.from_local(grad, mesh, steps[0], run_check=False, shape=param.shape, stride=param.stride())
        for step in steps[1:]:
            reduced = reduced.redistribute(mesh, step)
        return reduced.to(param.dtype)

    def __call__(self, param: DTensor, accumulator: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
        return self._recomputed(self.compute_view, param, accumulator, error)

    def _recomputed(self, gather: Callable, *args):
        """``gather(*args)``, in a checkpoint that recomputes it in backward when resharding after forward."""
        if self.reshard_after_forward:
            return checkpoint(gather, *args, use_reentrant=False, context_fn=_reshard_context)
        return gather(*args)

    def gather_all(self, reads: list[tuple[nn.Module, str]], region: Callable | None = None) -> list[torch.Tensor]:
        """``getattr(module, name)`` for each of ``reads`` in one region recomputed in backward when resharding after
        forward (not one per parameter); a parameter read twice, or gathered already for this call, is gathered once.
        With ``region`` (a nested compile region of ``gather_shards``), where no gradient is routed to an accumulator
        nor quantized, the gathers go through it: Dynamo traces the gathers of blocks alike once."""
        gathered = dict(self.gathers.gathered or {})
        rest = {module._gather_keys[name]: (module, name) for module, name in reads
                if module._gather_keys[name] not in gathered}
        if rest and region is not None and self.quantize is None and not self.sync.reductions_registered:
            gathered.update(zip(rest, region(*[module._parameters[name] for module, name in rest.values()])))
        elif rest:
            gathered.update(zip(rest, self._recomputed(self._gather_each, list(rest.values()))))
        return [gathered[module._gather_keys[name]] for module, name in reads]

    def _gather_each(self, reads: list[tuple[nn.Module, str]]) -> list[torch.Tensor]:
        return [self.compute_view(module._parameters[name], module._grad_accumulators[name],
                                  module._error_feedback[name]) for module, name in reads]

    def gather_shards(self, *params: DTensor) -> list[torch.Tensor]:
        """The gathered full local tensor of each of ``params``, in one checkpoint when resharding after forward."""
        return self._recomputed(self._gather_params, *params)

    def _gather_params(self, *params: DTensor) -> list[torch.Tensor]:
        return [self.gather(param, None) for param in params]


def install_getters(module: nn.Module, keys: dict[str, int], accumulators: dict[str, torch.Tensor],
                    errors: dict[str, torch.Tensor | None], replicate: ReplicateComputation) -> None:
    """Make ``module.<name>`` return ``replicate(module._parameters[name], accumulators[name], errors[name])`` in the
    forward (``_read_parameter``), by a subclass with one property per name, one for all modules of a class alike
    (a graph Dynamo compiles for one block serves the others): ``state_dict`` still sees the shards."""
    module._gather_keys, module._grad_accumulators, module._error_feedback = keys, accumulators, errors
    cls = module._class_without_getters = module.__class__
    key = (cls, tuple(accumulators))
    if key not in replicate.getter_classes:
        getters = {name: property(functools.partial(_read_parameter, name=name, replicate=replicate))
                   for name in accumulators}
        replicate.getter_classes[key] = type(f"Sharded{cls.__name__}", (cls,), getters)
    module.__class__ = replicate.getter_classes[key]


_MODULE_CALL = nn.Module._call_impl.__code__  # private: the frame every module call (hooks, forward) runs in


def gathers_on_read() -> bool:
    """Whether a parameter read now is the forward's: traced by Dynamo, inside a module's call (the root's, a block
    called alone, one a graph break runs eagerly), or in a backward (eager checkpointing runs a forward again)."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1:  # private: -1 outside a backward
        return True
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _MODULE_CALL:
        frame = frame.f_back
    return frame is not None


def _read_parameter(module: nn.Module, name: str, replicate: ReplicateComputation) -> torch.Tensor:
    if not gathers_on_read():
        return module._parameters[name]
    gathered = replicate.gathers.gathered
    if gathered is not None and module._gather_keys[name] in gathered:
        return gathered[module._gather_keys[name]]
    return replicate(module._parameters[name], module._grad_accumulators[name], module._error_feedback[name])


def gather_tied_once_per_call(model: nn.Module, replicate: ReplicateComputation) -> None:
    """Each compiled call of ``model`` gathers every tied parameter (one read by several modules) once, before the
    forward, so that a read inside a checkpointed block only reads it (a tensor gathered in one block could not be
    handed to another). Eager calls gather at every read: eager activation checkpointing re-runs a block's reads in
    backward and must see the ops its forward ran. The sum of the gradients is the same."""
    readers: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, key in vars(module).get("_gather_keys", {}).items():
            readers.setdefault(key, []).append((module, name))
    tied = [modules[0] for modules in readers.values() if len(modules) > 1]

    def gather_tied(*_) -> None:
        replicate.gathers.gathered = None
        if torch.compiler.is_compiling():
            replicate.gathers.gathered = {module._gather_keys[name]: getattr(module, name) for module, name in tied}

    def forget_tied(*_) -> None:
        replicate.gathers.gathered = None

    if tied:
        model.register_forward_pre_hook(gather_tied)
        model.register_forward_hook(forget_tied, always_call=True)


def reduce_pending(replicate: ReplicateComputation, module: nn.Module, name: str, pending: torch.Tensor) -> None:
    """Add the reduction of ``module.<name>``'s pending gradient sum to the sharded parameter's ``.grad``."""
    param = module._parameters[name]
    reduced = replicate.reduce(param, pending, module._error_feedback[name])
    param.grad = reduced if param.grad is None else param.grad + reduced
