"""Parameter sharding: turn every parameter of a module into a DTensor on the data-parallel mesh."""

from __future__ import annotations

from collections import Counter
import functools
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # private: the only test for a fake tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private: as meta_init.py
from torch.optim.optimizer import register_optimizer_step_pre_hook

from simplefsdp.passes.bucket_plan import block_of
from simplefsdp.runtime.grad_sync import new_accumulator
from simplefsdp.runtime.quantize import new_error_buffer
from simplefsdp.runtime.sharded_lookup import can_look_up_where_sharded, install_sharded_lookup
from simplefsdp.runtime.replicate_compute import ReplicateComputation, install_getters
from simplefsdp.runtime.tensor_parallel import shard_tensor_parallel


# Where a parameter lives between steps, by mode: sharded on dim 0, replicated, or both (hybrid).
PLACEMENTS = {"fully_shard": (Shard(0),), "replicate": (Replicate(),), "hybrid_shard": (Replicate(), Shard(0))}


def placements(param: torch.Tensor, mode: str) -> tuple:
    """``mode``'s placements for ``param``; a 0-dim parameter (a learned scalar) has no dim 0 and is replicated."""
    return PLACEMENTS[mode] if param.dim() else (Replicate(),) * len(PLACEMENTS[mode])


def distribute(param: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``distribute_tensor(param, mesh, placements)``: rank 0's values, this rank's shard. A tensor with no values
    (meta or fake) gets an empty local shard of the same size, without being split into a chunk per rank (which
    costs 12 ms a parameter at 512 ranks)."""
    if not (param.is_meta or is_fake(param)):
        return distribute_tensor(param.detach(), mesh, placements)
    shape, _ = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    return DTensor.from_local(param.new_empty(shape), mesh, placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def check_not_sharded(module: nn.Module) -> None:
    """Raise ``ValueError`` if ``compile_sharded`` was applied to ``module`` or a submodule (TP's DTensors are fine)."""
    for prefix, submodule in module.named_modules():
        if "_class_without_getters" in vars(submodule):
            name = f"{prefix}.{next(iter(submodule._grad_accumulators))}".lstrip(".")
            raise ValueError(f"parameter {name!r} is already a DTensor: compile_sharded was applied to this module "
                             "(or a submodule) before; apply it once, to the outermost module")


def holds_values(module: nn.Module) -> bool:
    """False when any parameter or buffer of ``module`` is on the meta device or fake (inspect's): nothing to move or
    broadcast (moving a fake CUDA tensor would even initialize CUDA)."""
    return not any(t.is_meta or is_fake(t) for t in [*module.parameters(), *module.buffers()])


def broadcast_buffers(module: nn.Module, mesh: DeviceMesh) -> None:
    """Copy every buffer from the mesh's first rank to all ranks, so all start identical."""
    for buffer in module.buffers():
        for dim in reversed(range(mesh.ndim)):
            dist.broadcast(buffer, group=mesh.get_group(dim), group_src=0)


def shard_parameters(module: nn.Module, mesh: DeviceMesh, mode: str, replicate: ReplicateComputation,
                     blocks: tuple[str, ...] = (), sharded_lookup: bool = False) -> None:
    """Replace each parameter by a DTensor parameter placed for ``mode`` (values from the mesh's first rank; a tied
    parameter stays one, a tensor-parallel one goes on the (dp, tp) mesh) and install the gathering getters. Where
    the model has ``blocks``, the modules outside them and the last block keep their gathered parameters from forward
    to backward (``ReplicateComputation.in_block``): the backward needs the output layer and the last block first; an
    embedding's backward reads no weight. With ``sharded_lookup``, such an embedding (not tied) looks its ids up where
    its rows are sharded."""
    _refuse_optimizers_outside_the_sharding()
    sharded: dict[int, tuple[int, nn.Parameter, torch.Tensor, torch.Tensor | None]] = {}
    uses = Counter(id(param) for submodule in module.modules() for param in submodule._parameters.values())
    plain = sharded_lookup and replicate.quantize is None and replicate.tensor_parallel is None
    for prefix, submodule in module.named_modules():
        keys, accumulators, errors = {}, {}, {}
        tied = uses[id(submodule._parameters.get("weight"))] > 1
        for name, param in submodule._parameters.items():
            if param is None:
                continue
            if id(param) not in sharded:
                param._replaced_by_compile_sharded = f"{prefix}.{name}".lstrip(".")
                computed = param.to_local() if isinstance(param, DTensor) else param  # what the forward reads
                dtensor = (shard_tensor_parallel(param, mesh) if isinstance(param, DTensor)
                           else distribute(param, mesh, placements(param, mode)))
                new_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
                new_param._sharded_by_compile_sharded = True
                error = new_error_buffer(param, mesh, placements(param, mode), replicate.quantize)
                accumulator = new_accumulator(computed, mesh.device_type, replicate.reduce_dtype)
                sharded[id(param)] = (len(sharded), new_param, accumulator, error)
            keys[name], submodule._parameters[name], accumulators[name], errors[name] = sharded[id(param)]
        if accumulators:
            install_getters(submodule, keys, accumulators, errors, replicate.in_block(prefix, blocks))
            outside = block_of(prefix, blocks) is None
            if outside and not tied and can_look_up_where_sharded(submodule, mode, mesh, plain):
                install_sharded_lookup(submodule, submodule._parameters["weight"], replicate.param_dtype,
                                       replicate.sync)
            submodule.register_load_state_dict_pre_hook(_shard_plain_tensors)


def _shard_plain_tensors(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook: a plain tensor given for one of ``module``'s own DTensor parameters, of its shape
    (each rank holding the full value, as ``torch.load`` of an unsharded checkpoint gives), becomes this rank's shard,
    cut locally with no collective; one of another shape is left for ``load_state_dict``'s size-mismatch error."""
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and type(value) is torch.Tensor and value.shape == param.shape:
            state_dict[prefix + name] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                          src_data_rank=None)


@functools.cache
def _refuse_optimizers_outside_the_sharding() -> None:
    """From now on, an optimizer's first step (and its first after its parameter groups change size) raises
    ``ValueError`` if the optimizer holds a parameter that ``shard_parameters`` replaced, or a plain trained parameter
    beside a sharded one on more than one rank (each error says why)."""

    def refuse(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        param_counts = [len(group["params"]) for group in optimizer.param_groups]
        if vars(optimizer).get("_param_counts_checked_by_compile_sharded") == param_counts:
            return  # checked at an earlier step (0.2 ms for 300 parameters)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        for param in params:
            if "_replaced_by_compile_sharded" in vars(param):
                raise ValueError(f"{type(optimizer).__name__} holds parameter {param._replaced_by_compile_sharded!r} "
                                 "as it was before compile_sharded, which replaced it by a sharded DTensor parameter, "
                                 "so this step would never update the model: create the optimizer after "
                                 "compile_sharded, from model.parameters() (as with FSDP2's fully_shard)")
        sharded = next((param for param in params if "_sharded_by_compile_sharded" in vars(param)), None)
        plain = next((param for param in params if param.requires_grad and not isinstance(param, DTensor)), None)
        if sharded is not None and sharded.device_mesh.size() > 1 and plain is not None:
            raise ValueError(f"{type(optimizer).__name__} holds a plain parameter of shape {tuple(plain.shape)} beside "
                             "parameters sharded by compile_sharded: no rank averages its gradient, so the ranks would "
                             "drift apart; apply compile_sharded once, to the outermost module, so that it shards "
                             "every parameter (as FSDP2's fully_shard must wrap the root)")
        optimizer._param_counts_checked_by_compile_sharded = param_counts

    register_optimizer_step_pre_hook(refuse)
