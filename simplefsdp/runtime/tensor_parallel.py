"""FSDP x TP: parameters that ``parallelize_module`` made DTensors on a tensor-parallel mesh, sharded over dp too.

As FSDP2 lays them out: this rank's TP shard is split on dim 0 over the data-parallel mesh, giving a DTensor on the
(dp, tp) mesh whose dp placement is ``Shard(0)``, or ``_StridedShard(0)`` where TP also shards dim 0 (the dp shard
is a slice of the TP shard, not of the full tensor). Gathering over dp gives back TP's own DTensor."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
# private: the only placement of a dp shard taken from a TP shard of the same dimension (FSDP2 uses it too)
from torch.distributed.tensor.placement_types import _StridedShard


def tensor_parallel_mesh(model: nn.Module, mesh: DeviceMesh, mode: str) -> DeviceMesh | None:
    """The mesh ``parallelize_module`` put ``model``'s DTensor parameters on, or None if it has none. Raises
    ``ValueError`` naming the fix, before any collective, unless that mesh is 1-D, shared by all of them, and ``mesh``
    is the other dimension of the same 2-D mesh, for ``fully_shard``."""
    meshes = {param.device_mesh for param in model.parameters() if isinstance(param, DTensor)}
    if not meshes:
        return None
    fix = ('build one mesh, mesh_2d = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")), '
           'then parallelize_module(model, mesh_2d["tp"], plan) and compile_sharded(model, mesh=mesh_2d["dp"])')
    tp_mesh = meshes.pop()
    if meshes or tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs every DTensor parameter on one 1-D mesh; {fix}")
    if mode != "fully_shard":
        raise ValueError(f"tensor-parallel parameters shard over data-parallel ranks with mode='fully_shard' only, "
                         f"got mode={mode!r}; pass mode='fully_shard'")
    try:
        DeviceMesh._concatenate([mesh, tp_mesh])  # private: FSDP2's way to span two submeshes of one mesh
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"mesh {mesh} and the tensor-parallel mesh {tp_mesh} are not two dimensions of one "
                         f"mesh ({error}); {fix}") from None
    return tp_mesh


def shard_tensor_parallel(param: DTensor, mesh: DeviceMesh) -> DTensor:
    """``param`` (TP's DTensor) with this rank's TP shard also sharded on dim 0 over ``mesh``, from ``mesh``'s first
    rank: a DTensor on the (dp, tp) mesh."""
    shard = distribute_tensor(param.to_local().detach(), mesh, [Shard(0)]).to_local()
    tp_placement, tp = param.placements[0], param.device_mesh.size()
    strided = isinstance(tp_placement, Shard) and tp_placement.dim == 0 and tp > 1
    dp_placement = _StridedShard(0, split_factor=tp) if strided else Shard(0)
    spanned = DeviceMesh._concatenate([mesh, param.device_mesh])
    return DTensor.from_local(shard, spanned, (dp_placement, tp_placement), run_check=False, shape=param.shape,
                              stride=param.stride())
