"""Parameter sharding: turn every parameter of a module into a DTensor on the data-parallel mesh."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from simplefsdp.runtime.replicate_compute import ReplicateComputation, install_getters


def param_placements(mode: str) -> tuple[Placement, ...]:
    """Where a parameter lives between steps: sharded on dim 0, replicated, or both (hybrid)."""
    return {"fully_shard": (Shard(0),), "replicate": (Replicate(),), "hybrid_shard": (Replicate(), Shard(0))}[mode]


def check_not_sharded(module: nn.Module) -> None:
    """Raise ``ValueError`` if ``module`` or any parameter in it was already sharded."""
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name!r} is already a DTensor: compile_sharded was applied to this module "
                "(or a submodule) before; apply it once, to the outermost module"
            )


def _fingerprint(module: nn.Module) -> list[str]:
    """Name, shape and dtype of every parameter and buffer, in registration order."""
    params = [f"parameter {n} {tuple(p.shape)} {p.dtype}" for n, p in module.named_parameters(remove_duplicate=False)]
    return params + [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]


def check_same_model_on_all_ranks(module: nn.Module, mesh: DeviceMesh) -> None:
    """Compare parameter/buffer shapes across the mesh; raise ``ValueError`` on every rank if any differ.

    One small object all-gather per mesh dimension, so a mismatch becomes an
    error here instead of a hang in a later collective.
    """
    mine = _fingerprint(module)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        gathered = _all_gather_picklable(mine, group, mesh.device_type)
        for group_rank, theirs in enumerate(gathered):
            if theirs == mine:
                continue
            rank = dist.get_global_rank(group, group_rank)
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
            detail = (
                f"{diff[0]} here, {diff[1]} there" if diff
                else f"{len(mine)} parameters and buffers here vs {len(theirs)} there"
            )
            raise ValueError(
                f"the model differs between rank {dist.get_rank()} and rank {rank}: {detail}; "
                "build the same model (same config) on every rank before compile_sharded"
            )


def _all_gather_picklable(obj: object, group: dist.ProcessGroup, device: str) -> list:
    """Every group rank's ``obj``, in group-rank order; ``dist.all_gather_object`` without its NumPy dependency."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(payload)], device=device), group=group)
    longest = max(int(length) for length in lengths)
    padded = torch.cat([payload, payload.new_zeros(longest - len(payload))])
    buffers = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(buffers, padded, group=group)
    return [pickle.loads(bytes(buffer[: int(length)].tolist())) for buffer, length in zip(buffers, lengths)]


def broadcast_buffers(module: nn.Module, mesh: DeviceMesh) -> None:
    """Copy every buffer from the mesh's first rank to all ranks, so all start identical."""
    for buffer in module.buffers():
        for dim in reversed(range(mesh.ndim)):
            dist.broadcast(buffer, group=mesh.get_group(dim), group_src=0)


def shard_parameters(module: nn.Module, mesh: DeviceMesh, mode: str, replicate: ReplicateComputation) -> None:
    """Replace each parameter by a DTensor parameter placed for ``mode`` and install the gathering getters.

    Values come from the mesh's first rank. A parameter shared by several modules
    (tied weights) becomes one DTensor shared by the same modules.
    """
    placements = param_placements(mode)
    sharded: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        names = [name for name, param in submodule._parameters.items() if param is not None]
        for name in names:
            param = submodule._parameters[name]
            if id(param) not in sharded:
                dtensor = distribute_tensor(param.detach(), mesh, placements)
                sharded[id(param)] = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            submodule._parameters[name] = sharded[id(param)]
        if names:
            install_getters(submodule, names, replicate)
