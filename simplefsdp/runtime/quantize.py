"""Low-bit communication options and the wire format: symmetric absmax blocks packed into one ``uint8`` buffer.

Each block of ``block_size`` values is sent as one fp32 scale (``absmax / qmax``) and its codes
``round(x / scale)`` in ``[-qmax, qmax]``: int8 (qmax 127, a byte each) or int4 (qmax 7, two to a byte). A packed
row is ``[scales as bytes | codes]``. Rounding is deterministic, so quantizing the same values twice (the forward's
gather and its recompute in backward) gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {"int8": 127, "int4": 7}
# A scale travels as its four bytes, lowest first, taken with shifts: Inductor miscompiles a uint8 → float32 view
# of a slice (torch 2.13, CPU), and shifts do not depend on the machine's byte order.


def _byte_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 8, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Quantize:
    """``gather``: the format of weight all-gathers (``"int8"`` or None); ``reduce``: of the gradient exchange
    (``"int8"``, ``"int4"`` or None). With ``error_feedback`` each rank keeps what rounding lost from its gradients,
    ``e <- beta * e + (1 - beta) * (h - deQ(Q(h)))`` with ``h = g + e``, and adds it to the next step's."""

    gather: str | None = None
    reduce: str | None = None
    block_size: int = 256
    error_feedback: bool = True
    beta: float = 0.0

    def __post_init__(self) -> None:
        if self.gather not in (None, "int8"):
            raise ValueError(f"Quantize(gather={self.gather!r}): choose 'int8' or None")
        if self.reduce not in (None, *QMAX):
            raise ValueError(f"Quantize(reduce={self.reduce!r}): choose 'int8', 'int4' or None")
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % 2:
            raise ValueError(f"Quantize(block_size={self.block_size!r}) must be a positive even int, e.g. 256")
        if not 0 <= self.beta < 1:
            raise ValueError(f"Quantize(beta={self.beta!r}) must be in [0, 1); 0 keeps just the last residual")


def quantize_option(gather: str | None, reduce: str | None) -> Quantize | None:
    """``Quantize(gather, reduce)`` with the other options at their defaults, or None when both are None."""
    return None if gather is None and reduce is None else Quantize(gather, reduce)


def packed_bytes(numel: int, fmt: str, block_size: int) -> int:
    """Bytes of one packed row of ``numel`` values (a multiple of ``block_size``)."""
    return 4 * (numel // block_size) + (numel if fmt == "int8" else numel // 2)


def quantize_pack(rows: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Rows ``(R, N)`` of floats, ``N`` a multiple of ``block_size`` → packed ``uint8`` rows ``(R, packed_bytes)``."""
    blocks = rows.float().reshape(rows.shape[0], -1, block_size)
    scales = blocks.abs().amax(-1, keepdim=True) / QMAX[fmt]
    codes = (blocks / torch.where(scales > 0, scales, 1.0)).round().to(torch.int8).reshape(rows.shape[0], -1)
    if fmt == "int4":
        nibbles = (codes + 8).to(torch.uint8)
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    scale_bits = scales.reshape(rows.shape[0], -1, 1).view(torch.int32) >> _byte_shifts(rows.device)
    return torch.cat([(scale_bits & 255).to(torch.uint8).flatten(1), codes.view(torch.uint8)], dim=1)


def unpack_dequantize(packed: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Inverse of ``quantize_pack`` up to rounding: packed ``uint8`` rows → fp32 rows ``(R, N)``."""
    rows = packed.shape[0]
    numel = (packed.shape[1] * block_size) // (4 + (block_size if fmt == "int8" else block_size // 2))
    scale_bytes = packed[:, :4 * (numel // block_size)].reshape(rows, -1, 4).to(torch.int32) << _byte_shifts(packed.device)
    scales = scale_bytes.sum(-1, dtype=torch.int32).view(torch.float32)
    codes = packed[:, 4 * (numel // block_size):]
    if fmt == "int4":
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(rows, numel).to(torch.int8) - 8
    values = codes.contiguous().view(torch.int8).float().reshape(rows, -1, block_size)
    return (values * scales.unsqueeze(-1)).reshape(rows, numel)
