"""``DeMo``: decoupled momentum (Peng et al.), per local shard as FlexDeMo runs it across replica groups.

Each step a parameter's momentum accumulates ``lr * grad``; a DCT over fixed-size chunks of the momentum picks each
chunk's ``top_k`` largest coefficients, which leave the momentum and are exchanged across replica groups (one
all-gather of values and indices per step); the mean of every group's coefficient at an index, decoded back, gives the
update's sign: ``p -= lr * sign(decode(mean))``. The rest of the momentum stays local. Inside a replica group
gradients are reduce-scattered as usual, so a rank holds its shard's group-averaged gradient and runs DeMo on that
shard (``to_local``); the same rank of every group holds the same shard, so the exchanged shapes agree.
"""

from __future__ import annotations

import functools
import math

import torch

from simplefsdp.optim.exchange import ONE_GROUP, Collectives
from simplefsdp.optim.galore import local


def largest_divisor(size: int, chunk: int) -> int:
    """The largest divisor of ``size`` that is at most ``chunk`` (1 for an empty dimension)."""
    return next(d for d in range(min(size, chunk), 0, -1) if size % d == 0) if size else 1


@functools.cache
def dct_basis(size: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix (frequency x position), computed in float64 and rounded to float32."""
    position = torch.arange(size, dtype=torch.float64) + 0.5
    frequency = torch.arange(size, dtype=torch.float64)[:, None]
    scale = torch.full((size, 1), math.sqrt(2 / size), dtype=torch.float64)
    scale[0] = math.sqrt(1 / size)
    return (scale * torch.cos(math.pi * frequency * position / size)).float()


def as_matrix(shape: torch.Size) -> tuple[int, int]:
    """The (rows, columns) of a tensor of ``shape`` seen as 2-D: a 1-D or 0-D one as one row."""
    return (1, math.prod(shape)) if len(shape) < 2 else (shape[0], math.prod(shape[1:]))


def chunk_shape(shape: torch.Size, chunk: int) -> tuple[int, int]:
    """The (rows, columns) of one DCT chunk of a tensor of ``shape``: each the largest divisor of that side of
    ``as_matrix(shape)`` at most ``chunk``."""
    rows, columns = as_matrix(shape)
    return largest_divisor(rows, chunk), largest_divisor(columns, chunk)


def encode(x: torch.Tensor, chunk: tuple[int, int]) -> torch.Tensor:
    """The 2-D DCT of every ``chunk`` of ``x``: (chunks, chunk rows * chunk columns) coefficients, chunks row-major."""
    (rows, columns), (h, w) = as_matrix(x.shape), chunk
    blocks = x.reshape(rows // h, h, columns // w, w)
    bases = dct_basis(h).to(x), dct_basis(w).to(x)
    return torch.einsum("yaxb,ia,jb->yxij", blocks, *bases).reshape(-1, h * w)


def decode(coefficients: torch.Tensor, shape: torch.Size, chunk: tuple[int, int]) -> torch.Tensor:
    """The tensor of ``shape`` whose ``encode`` is ``coefficients``: the inverse DCT of every chunk."""
    (rows, columns), (h, w) = as_matrix(shape), chunk
    bases = dct_basis(h).to(coefficients), dct_basis(w).to(coefficients)
    blocks = coefficients.reshape(rows // h, columns // w, h, w)
    return torch.einsum("yxij,ia,jb->yaxb", blocks, *bases).reshape(shape)


def index_dtype(chunk: tuple[int, int]) -> torch.dtype:
    """The smallest integer type that holds every position in a chunk."""
    return torch.int16 if chunk[0] * chunk[1] <= 2**15 else torch.int32


def payload_bytes(shape: torch.Size, element_size: int, chunk: int = 64, k: int = 32) -> int:
    """Bytes a rank sends per step for a local shard of ``shape``: per chunk, ``k`` values and their positions."""
    h, w = chunk_shape(shape, chunk)
    return math.prod(shape) // (h * w) * min(k, h * w) * (element_size + index_dtype((h, w)).itemsize)


def top_k(coefficients: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's ``k`` coefficients of largest magnitude (all of a smaller chunk): (positions, values)."""
    positions = coefficients.abs().topk(min(k, coefficients.shape[-1]), dim=-1, sorted=False).indices
    return positions, coefficients.gather(-1, positions)


def mean_of_groups(picks: list[tuple[torch.Tensor, torch.Tensor]], chunk_size: int) -> torch.Tensor:
    """At each coefficient, the mean of the values the groups sent for it (zero where none did), as DeMo decodes:
    summed in the groups' order, so every group computes the same bits."""
    total = picks[0][1].new_zeros(picks[0][1].shape[0], chunk_size)
    count = torch.zeros_like(total)
    for positions, values in picks:
        total.scatter_add_(-1, positions.long(), values)
        count.scatter_add_(-1, positions.long(), torch.ones_like(values))
    return total / count.clamp(min=1)


class DeMo(torch.optim.Optimizer):
    """Sign-SGD on the decoded mean of every replica group's top DCT components of its momentum (DeMo).

    ``chunk``: the DCT's chunk side (a 2-D weight's chunks are ``chunk`` x ``chunk``); ``top_k``: coefficients
    exchanged per chunk; ``decay``: the momentum's decay; ``weight_decay``: decoupled, as SGD's. Defaults are DeMo's.
    Under ``ReplicaGroup`` the exchange goes through torchft; alone, ``step`` exchanges with itself.
    """

    def __init__(self, params, lr: float = 1e-3, chunk: int = 64, top_k: int = 32, decay: float = 0.999,
                 weight_decay: float = 0.0) -> None:
        if chunk < 1 or top_k < 1 or not 0 <= decay <= 1:
            raise ValueError(f"DeMo needs chunk >= 1, top_k >= 1 and 0 <= decay <= 1; got {chunk}, {top_k}, {decay}")
        super().__init__(params, dict(lr=lr, chunk=chunk, top_k=top_k, decay=decay, weight_decay=weight_decay))
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    @torch.no_grad()
    def exchange(self, collectives: Collectives = ONE_GROUP, step: int | None = None) -> None:
        """Fold the gradient into each momentum, pick its top components and all-gather them with the other groups
        (one all-gather for all parameters); ``step`` applies the result, ``discard`` drops it. ``step`` (the
        training step) is unused: DeMo exchanges every step."""
        sent, kept = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not local(p).numel():
                    continue
                if "delta" not in self.state[p]:
                    self.state[p]["delta"] = torch.zeros_like(p)
                momentum = local(self.state[p]["delta"]) * group["decay"] + local(p.grad) * group["lr"]
                chunk = chunk_shape(momentum.shape, group["chunk"])
                positions, values = top_k(encode(momentum, chunk), group["top_k"])
                picked = values.new_zeros(values.shape[0], chunk[0] * chunk[1]).scatter_(-1, positions, values)
                momentum -= decode(picked, momentum.shape, chunk)
                sent += [positions.to(index_dtype(chunk)), values]
                kept.append((p, group, momentum, chunk))
        sizes = [t.numel() * t.element_size() for t in sent]
        payloads = collectives.all_gather(torch.cat([t.reshape(-1).view(torch.uint8) for t in sent])) if sent else []
        pieces = [payload.split(sizes) for payload in payloads]
        self.pending = []
        for index, (p, group, momentum, chunk) in enumerate(kept):
            positions, values = sent[2 * index:2 * index + 2]
            picks = [(piece[2 * index].clone().view(positions.dtype).view(positions.shape),  # clone: aligned
                      piece[2 * index + 1].clone().view(values.dtype).view(values.shape)) for piece in pieces]
            direction = decode(mean_of_groups(picks, chunk[0] * chunk[1]), momentum.shape, chunk).sign_()
            self.pending.append((p, group, momentum, direction))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Apply the exchanged update (exchanging with no one first if ``exchange`` was not called this step)."""
        if self.pending is None:
            self.exchange()
        for p, group, momentum, direction in self.pending:
            local(self.state[p]["delta"]).copy_(momentum)
            local(p).mul_(1 - group["lr"] * group["weight_decay"]).add_(direction, alpha=-group["lr"])
        self.pending = None

    def discard(self) -> None:
        """Drop the exchanged update of a step that did not commit: momentum and parameters stay as they were."""
        self.pending = None
