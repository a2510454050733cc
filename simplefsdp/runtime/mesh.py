"""The data-parallel world: process group start-up, device choice, and the device mesh per mode."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = {"fully_shard": ("shard",), "replicate": ("replicate",), "hybrid_shard": ("replicate", "shard")}


def device_type() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> None:
    """Start the default process group (NCCL on GPUs, gloo on CPUs) once: from ``torchrun``, else a 1-rank world."""
    if dist.is_initialized():
        return
    timeout = timedelta(minutes=5)
    backend = "nccl" if device_type() == "cuda" else "gloo"
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The elastic agent keeps its store across restarts: a restarted rank must not read the dead ranks' addresses.
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timeout)
        store = dist.PrefixStore(f"simplefsdp/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def default_mesh(mode: str) -> DeviceMesh:
    """The whole world as a mesh for ``mode``; hybrid uses (nodes, ranks per node)."""
    init_distributed()
    world = dist.get_world_size()
    if mode == "hybrid_shard":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % per_node:
            raise ValueError(f"hybrid_shard needs the world ({world} ranks) to split evenly into nodes of {per_node}; "
                             "pass mesh=init_device_mesh(device, (replicas, shards)) explicitly")
        return init_device_mesh(device_type(), (world // per_node, per_node), mesh_dim_names=MESH_DIM_NAMES[mode])
    return init_device_mesh(device_type(), (world,), mesh_dim_names=MESH_DIM_NAMES[mode])


def check_mesh(mesh: DeviceMesh, mode: str) -> None:
    """Raise ``ValueError`` unless ``mesh`` has the dimensionality ``mode`` needs."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    wanted = len(MESH_DIM_NAMES[mode])
    if mesh.ndim != wanted:
        shape = "(replicas, shards)" if wanted == 2 else "(world_size,)"
        raise ValueError(f"mode={mode!r} needs a {wanted}-D mesh but got a {mesh.ndim}-D mesh of shape "
                         f"{tuple(mesh.shape)}; build one with init_device_mesh(device, {shape})")


def data_parallel_groups(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of ``mesh``'s process groups, as collectives in a traced graph name them."""
    return tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))


def check_tensor_parallel_world(world_size: int, tp: int, mode: str) -> None:
    """Raise ``ValueError`` unless ``world_size`` ranks split into a ``(world_size // tp, tp)`` mesh for ``mode``."""
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"tp={tp!r} must be a positive int dividing the world size {world_size} "
                         f"(the mesh is (world // tp, tp)); pick a tp that divides {world_size}")
    if tp > 1 and mode != "fully_shard":
        raise ValueError(f"tensor parallelism composes with mode='fully_shard' only, got mode={mode!r}")


def mesh_by_value(mesh: DeviceMesh) -> str:
    """``mesh`` as what a graph compiled for it depends on: ranks, layout, device, dim names, process groups' names."""
    return f"DeviceMesh {mesh._stable_hash()} groups {list(data_parallel_groups(mesh))}"
