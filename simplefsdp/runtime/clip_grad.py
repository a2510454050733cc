"""Gradient-norm clipping over sharded gradients with one scalar all-reduce per sharded mesh dimension."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the unsharded model, summing each gradient's shards over the mesh
    dimensions it is sharded on (dp, and tp for a tensor-parallel parameter), never over its replicas: scales the
    gradients in place to a total ``norm_type``-norm of at most ``max_norm``; returns the norm before."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norms: dict[tuple, list[torch.Tensor]] = {}  # the process groups a gradient is sharded over -> its shards' norms
    for grad, t in zip(grads, local):
        norms.setdefault(_shard_groups(grad), []).append(torch.linalg.vector_norm(t, norm_type, dtype=torch.float32))
    partials = []
    for groups, group_norms in norms.items():  # the same order on every rank: the parameters'
        stacked = torch.stack(group_norms)
        partial = stacked.max() if inf else stacked.pow(norm_type).sum()
        for group in groups:
            dist.all_reduce(partial, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        partials.append(partial)
    total = torch.stack(partials).max() if inf else torch.stack(partials).sum().pow(1.0 / norm_type)
    torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _shard_groups(grad: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups of the mesh dimensions ``grad`` is sharded on (any placement but ``Replicate``: ``Shard``
    and FSDP x TP's strided form, which is no ``Shard``)."""
    if not isinstance(grad, DTensor):
        return ()
    return tuple(grad.device_mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                 if not placement.is_replicate())
