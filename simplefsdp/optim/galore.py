"""``GaLoreAdamW``: GaLore 2's low-rank projected Adam over ``compile_sharded``'s sharded parameters.

A 2-D weight whose smaller side exceeds ``rank`` keeps Adam's moments in a rank-``r`` subspace of its gradient's
columns: ``R = G Q`` with ``Q`` (n x r) the gradient's top right singular vectors, refreshed every
``update_every`` steps by a randomized SVD (Halko et al., as GaLore 2); the update is ``scale * N Q^T`` with ``N``
Adam's normalized step on ``R``. Other parameters get AdamW. Decoupled weight decay for both.

Under ``Shard(0)`` each rank holds rows ``G_i`` of the gradient, and ``G_i Q`` is its rows of ``G Q``. A refresh
all-gathers the gradient (``DTensor.full_tensor``, the bytes of one weight all-gather, once per ``update_every``
steps) and every rank computes the same ``Q`` from the same bytes and the same seeded sketch. The moments are
sharded like the weight (m_i x r per rank). ``Q`` is replicated by default: the step between refreshes is local,
no collective, but each rank holds n x r per weight, which outgrows AdamW's shard as ranks grow, so a weight is
projected only where that saves memory. ``projector_dtype=torch.bfloat16`` halves ``Q`` (rounded once per refresh,
as GaLore keeps it in the training dtype; products still in the gradient's dtype). ``shard_projector=True`` keeps
``Q``'s rows sharded too and all-gathers it at every step (n x r more bytes per weight and step): the state shrinks
with every rank added.
GaLore projects the smaller side; here the columns always, because projecting rows (``P^T G``) would sum over the
ranks' rows at every step. ``benchmarks/galore.md`` measures both layouts.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (same storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def refresh_seed(seed: int, step: int, index: int) -> int:
    """The sketch's seed for the ``index``-th parameter (from 1, in parameter-group order) refreshed at ``step``."""
    return seed * 1_000_003 + step * 1_009 + index


def top_right_singular_vectors(gradient: torch.Tensor, rank: int, seed: int, power_iterations: int = 2) -> torch.Tensor:
    """An orthonormal n x ``rank`` basis of ``gradient``'s (m x n) top right singular vectors by randomized SVD:
    a Gaussian sketch from ``seed`` (drawn on the CPU, so every device draws the same), ``power_iterations`` power
    iterations with QR, then an exact SVD of the m x k projection. A pure function of its arguments."""
    n = gradient.shape[1]
    sketch_width = min(n, rank + 8)  # Halko et al.'s oversampling
    generator = torch.Generator().manual_seed(seed)
    omega = torch.randn(n, sketch_width, generator=generator, dtype=gradient.dtype).to(gradient.device)
    basis = torch.linalg.qr(gradient.T @ (gradient @ omega)).Q
    for _ in range(power_iterations):
        basis = torch.linalg.qr(gradient.T @ (gradient @ basis)).Q
    _, _, right = torch.linalg.svd(gradient @ basis, full_matrices=False)
    return basis @ right[:rank].T


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW whose 2-D weights (smaller side > ``rank``) keep their moments in a rank-``rank`` gradient subspace.

    ``update_every``: steps between subspace refreshes (GaLore's T); ``scale``: GaLore's alpha, multiplying the
    projected-back update; ``seed``: of the refresh sketches, the same on every rank; ``projector_dtype``: the
    projectors' storage (the gradient's by default); ``shard_projector``: shard the projectors and all-gather them
    each step, instead of replicating them.
    """

    def __init__(self, params, lr: float = 1e-3, rank: int = 128, update_every: int = 200, scale: float = 0.25,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 seed: int = 0, projector_dtype: torch.dtype | None = None, shard_projector: bool = False) -> None:
        if rank < 1 or update_every < 1:
            raise ValueError(f"GaLoreAdamW needs rank >= 1 and update_every >= 1, got rank={rank}, "
                             f"update_every={update_every}")
        super().__init__(params, dict(lr=lr, rank=rank, update_every=update_every, scale=scale, betas=betas,
                                      eps=eps, weight_decay=weight_decay, seed=seed, projector_dtype=projector_dtype,
                                      shard_projector=shard_projector))
        for group in self.param_groups:
            for parameter in group["params"]:
                check_placements(parameter)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; on a refresh step every rank holding a projected weight's rows all-gathers its
        gradient (call it on every rank)."""
        loss = closure() if closure is not None else None
        parameters = [(parameter, group) for group in self.param_groups for parameter in group["params"]]
        for index, (parameter, group) in enumerate(parameters, 1):
            if parameter.grad is not None:
                self.update(parameter, group, index)
        return loss

    def update(self, parameter: torch.Tensor, group: dict, index: int) -> None:
        """Adam's step on ``parameter``: in its gradient's subspace if it is projected, else AdamW."""
        state, rank = self.state[parameter], group["rank"]
        projector_dtype = group["projector_dtype"] or parameter.dtype
        projected = is_projected(parameter.shape, row_shards(parameter), rank, group["shard_projector"],
                                 projector_dtype.itemsize / parameter.dtype.itemsize)
        if not state:
            columns = rank if projected else None
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=zeros_like_rows(parameter, columns),
                         exp_avg_sq=zeros_like_rows(parameter, columns))
        step = int(state["step"].add_(1).item())
        gradient = local(parameter.grad)
        if projected and (step - 1) % group["update_every"] == 0:
            full = parameter.grad.full_tensor() if isinstance(parameter.grad, DTensor) else parameter.grad
            projector = top_right_singular_vectors(full, rank, seed=refresh_seed(group["seed"], step, index))
            projector = projector.to(projector_dtype)
            state["projector"] = (distribute_tensor(projector, parameter.device_mesh, parameter.placements,
                                                    src_data_rank=None)
                                  if group["shard_projector"] and isinstance(parameter, DTensor) else projector)
        elif projected:
            projector = state["projector"]
            projector = projector.full_tensor() if isinstance(projector, DTensor) else projector
        if projected:
            projector = projector.to(gradient.dtype)
            gradient = gradient @ projector
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
        exp_avg.lerp_(gradient, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        normalized = (exp_avg / (1 - beta1**step)) / ((exp_avg_sq / (1 - beta2**step)).sqrt() + group["eps"])
        if projected:
            normalized = group["scale"] * (normalized @ projector.T)
        local(parameter).mul_(1 - group["lr"] * group["weight_decay"]).add_(normalized, alpha=-group["lr"])


def is_projected(shape: tuple[int, ...], row_shards: int, rank: int, shard_projector: bool,
                 projector_size: float = 1.0) -> bool:
    """Whether GaLore projects a parameter of ``shape`` whose rows are split over ``row_shards`` ranks: a 2-D weight
    whose smaller side exceeds ``rank``, and, with a replicated projector, only where projector (n x r, each element
    ``projector_size`` times a moment's bytes) and moments (2 x rows per rank x r) take less than AdamW's moments
    (2 x rows per rank x n)."""
    if len(shape) != 2 or min(shape) <= rank:
        return False
    rows, columns = -(-shape[0] // row_shards), shape[1]
    return shard_projector or projector_size * columns * rank + 2 * rows * rank < 2 * rows * columns


def row_shards(parameter: torch.Tensor) -> int:
    """How many ranks ``parameter``'s rows are split over (1 unless it is a DTensor sharded on dim 0)."""
    if not isinstance(parameter, DTensor):
        return 1
    return math.prod(size for size, p in zip(parameter.device_mesh.shape, parameter.placements) if p.is_shard())


def zeros_like_rows(parameter: torch.Tensor, columns: int | None) -> torch.Tensor:
    """Zero moments: like ``parameter``, or its rows x ``columns`` sharded like its rows."""
    if columns is None:
        return torch.zeros_like(parameter)
    rows = torch.zeros(local(parameter).shape[0], columns, dtype=parameter.dtype, device=parameter.device)
    if not isinstance(parameter, DTensor):
        return rows
    # a DTensor sharded like the weight's rows, so that a DCP checkpoint saves every rank's rows and reshards them
    return DTensor.from_local(rows, parameter.device_mesh, parameter.placements, run_check=False,
                              shape=(parameter.shape[0], columns), stride=(columns, 1))


def check_placements(parameter: torch.Tensor) -> None:
    """Raise ``ValueError`` for a parameter sharded other than by rows over data-parallel dims (TP's 2-D meshes)."""
    if isinstance(parameter, DTensor) and any(not (p.is_replicate() or (p.is_shard() and p.dim == 0))
                                              for p in parameter.placements):
        raise ValueError(f"GaLoreAdamW handles parameters sharded by rows (Shard(0)) or replicated, not placements "
                         f"{parameter.placements} (tensor parallelism shards columns): train with AdamW under --tp")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in ``optimizer``'s state: local shards of sharded tensors, whole replicated ones."""
    return sum(local(value).numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))
