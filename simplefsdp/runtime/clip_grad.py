"""Gradient-norm clipping over sharded gradients with a single all-reduce."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the unsharded model, with one all-reduce over the sharding mesh dimension.

    Scales the gradients in place to a total ``norm_type``-norm of at most ``max_norm``; returns the norm before."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    group = _shard_group(grads)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in local])
    inf = math.isinf(norm_type)
    total = norms.max() if inf else norms.pow(norm_type).sum()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if not inf:
        total = total.pow(1.0 / norm_type)
    torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _shard_group(grads: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group over which gradients are sharded, or None; ``ValueError`` if their layouts differ."""
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    layouts = {(g.device_mesh, tuple(g.placements)) for g in dtensors}
    if len(layouts) > 1 or (dtensors and len(dtensors) != len(grads)):
        raise ValueError("clip_grad_norm_ needs every gradient sharded the same way (the parameters of one "
                         f"compile_sharded model); found {len(layouts)} layouts and {len(grads) - len(dtensors)} "
                         "plain tensors")
    if not layouts:
        return None
    mesh, placements = layouts.pop()
    shard_dims = [dim for dim, placement in enumerate(placements) if isinstance(placement, Shard)]
    if len(shard_dims) > 1:
        raise ValueError(f"clip_grad_norm_ supports gradients sharded over one mesh dimension, got {placements}")
    return mesh.get_group(shard_dims[0]) if shard_dims else None
