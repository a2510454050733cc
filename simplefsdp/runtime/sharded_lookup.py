"""An embedding looked up where its rows are sharded: every rank's token ids are all-gathered, each rank embeds them
with its own rows (zeros for the rows it does not hold) and the embeddings are reduce-scattered back to the ranks
whose tokens they are. That moves tokens x hidden per rank where gathering the table moves the table twice (its
all-gather at the start of the forward and its gradient's reduce-scatter at the end of the backward, neither hidden
behind any compute). It needs every rank's ids of one shape: the ranks compare their inputs' shapes at every call
of the compiled model, and a call where they differ gathers the table instead (one more graph)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.runtime.grad_sync import GradientSync
from simplefsdp.runtime.rank_agreement import agreement_groups, input_shapes
from simplefsdp.runtime.replicate_compute import gathers_on_read


# The exchange writes world x tokens x hidden elements about four times (the lookup, its mask, the concatenation, and
# as many in the backward) where the gathered table is written once: it pays where world x tokens <= rows / 4.
EXCHANGE_WRITES = 4
_CPU_GROUPS: dict[str, dist.ProcessGroup] = {}  # by name, the groups lookups compare their ranks' shapes on


def _averaging_gradient(embedded: torch.Tensor, world: int) -> torch.Tensor:
    """``embedded``'s values (``x - x`` is +0 for a finite ``x``, and ``x - +0`` is ``x``, -0 included), whose
    gradient is divided by ``world``, as the gathered table's reduce-scatter averages it. No ``autograd.Function``:
    torch 2.13 keeps a graph holding one out of AOTAutograd's cache, so every warm start would trace the model again."""
    kept = embedded.detach()
    return kept - (kept - embedded) / world


def can_look_up_where_sharded(module: nn.Module, mode: str, mesh: Any, plain: bool) -> bool:
    """Whether ``module`` is a plain ``nn.Embedding`` whose table can be looked up where it is sharded: by rows over a
    1-D mesh of more than one rank, gathered without quantizing (``plain``)."""
    return (plain and mode == "fully_shard" and mesh.ndim == 1 and mesh.size() > 1
            and type(module).forward is nn.Embedding.forward and module.max_norm is None and not module.sparse
            and not module.scale_grad_by_freq)


def install_sharded_lookup(module: nn.Module, param: DTensor, dtype: torch.dtype | None, sync: GradientSync) -> None:
    """Make ``module``'s forward look its ids up where ``param`` (its ``weight``, a row-sharded DTensor) is sharded,
    where every rank holds rows, at calls whose ranks agree on their inputs' shapes (``_ranks_agree_on_shapes``, set
    by ``agree_on_shapes_every_call`` on ``_shapes_group``; always in a world that cannot disagree, as ``inspect``'s)
    and where the exchange costs less than the table (``EXCHANGE_WRITES``); not while gradients accumulate without
    sync (``sync``), whose backward communicates nothing."""
    mesh = param.device_mesh
    world, vocabulary = mesh.size(), param.shape[0]
    rows = math.ceil(vocabulary / world)
    if rows * (world - 1) >= vocabulary:
        return  # a rank would hold no rows
    # An input, not a constant, so every rank's graph is the same; not a buffer, which materialize_sharded would empty
    module._first_row = torch.tensor(rows * mesh.get_local_rank(), device=mesh.device_type)
    group = mesh.get_group()
    module._ranks_agree_on_shapes = not agreement_groups(mesh)
    if not module._ranks_agree_on_shapes:  # the shapes are compared on a CPU group: no wait for a GPU
        cpu_group = group if dist.get_backend(group) == "gloo" else dist.new_group(
            dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        module._shapes_group = cpu_group.group_name  # a name: the module stays copyable
        _CPU_GROUPS[cpu_group.group_name] = cpu_group
    gathered_forward = type(module).forward

    def forward(self: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        synced = sync.enabled and (not sync.reductions_registered or self._grad_accumulators["weight"].grad is None)
        cheaper = EXCHANGE_WRITES * world * ids.numel() <= vocabulary
        if not (gathers_on_read() and synced and self._ranks_agree_on_shapes and cheaper):
            return gathered_forward(self, ids)
        return sharded_lookup(ids, self._parameters["weight"], self._first_row, rows, self.padding_idx, dtype)

    module.__class__ = type(type(module).__name__, (type(module),), {"forward": forward})


def sharded_lookup(ids: torch.Tensor, param: DTensor, first_row: torch.Tensor, rows: int, padding_idx: int | None,
                   dtype: torch.dtype | None) -> torch.Tensor:
    """``F.embedding(ids, full_table, padding_idx)`` in ``dtype``, the table's gradient averaged over ranks into
    ``param``'s shard, without gathering the table. Each rank's ids are embedded apart, so that a row's gradient sums
    each rank's tokens first, then the ranks, as the gathered table's reduce-scatter does; each token's gradient is
    divided by the world first, which the reduce-scatter does after (bitwise on 2 ranks, where halving is exact)."""
    world, group = param.device_mesh.size(), param.device_mesh.get_group()
    shard = param.to_local()
    every_id = funcol.all_gather_tensor(ids.reshape(-1), 0, group).view(world, -1)
    local = every_id - first_row
    held = (local >= 0) & (local < rows)
    local = torch.where(held, local, 0)
    pieces = []
    for rank in range(world):
        embedded = F.embedding(local[rank], shard.to(dtype or shard.dtype))
        if padding_idx is not None:  # its row gets no gradient
            embedded = torch.where((every_id[rank] == padding_idx)[:, None], embedded.detach(), embedded)
        pieces.append(torch.where(held[rank, :, None], embedded, 0))
    embedded = funcol.reduce_scatter_tensor_autograd(torch.cat(pieces), "sum", 0, group)
    return _averaging_gradient(embedded, world).view(*ids.shape, -1)


def agree_on_shapes_every_call(model: nn.Module, call: Callable) -> Callable:
    """``call`` (``model``'s compiled call), preceded at each call by a comparison of the inputs' shapes over the ranks
    of ``model``'s sharded lookups (one all-reduce of a digest) that lets the lookups run only where they agree."""
    lookups = [module for module in model.modules() if "_shapes_group" in vars(module)]
    if not lookups:
        return call

    def agreeing_call(*args: Any, **kwargs: Any) -> Any:
        digest = int(hashlib.sha256(input_shapes(args, kwargs).encode()).hexdigest()[:15], 16)
        extremes = torch.tensor([digest, -digest])  # 60 bits: -digest fits an int64
        dist.all_reduce(extremes, dist.ReduceOp.MAX, group=_CPU_GROUPS[lookups[0]._shapes_group])
        for module in lookups:
            module._ranks_agree_on_shapes = bool(extremes[0] == -extremes[1])
        return call(*args, **kwargs)

    return agreeing_call
