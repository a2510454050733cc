"""Low-bit communication (``Quantize``): the wire format, and replicate-for-compute over ``Shard(0)``'s ranks
(``fully_shard``; ``hybrid_shard``'s shards, then its replicas) and over ``replicate``'s replicas.

Format: each block of ``block_size`` values travels as one fp32 scale (``absmax / qmax``) and its codes
``round(x / scale)`` in ``[-qmax, qmax]``: int8 (qmax 127, a byte each) or int4 (qmax 7, two to a byte); a packed row
is ``[scale bytes | codes]``, ``uint8``. Rounding is deterministic: the backward's re-gather reproduces the forward's
weights. Forward: each rank's shard, padded to whole blocks, is packed, all-gathered and dequantized to
``param_dtype``. Backward: each rank packs its gradient plus its error buffer, a row per destination rank, and sends
the rows by an all-to-all; each receiver dequantizes, sums in fp32 and averages (a collective never sums low-bit
codes: gloo's int8 sum wraps around). Between replicas (``hybrid_shard``) the averaged shard is exchanged the same
way, a chunk per replica (error feedback on it too), then each replica's sum is quantized again and all-gathered, so
every replica decodes the same bits. Without a format the collectives are hybrid's or the plain reduce-scatter."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

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


def quantize_option(args: argparse.Namespace) -> Quantize | None:
    """The ``Quantize`` the command line's ``--quantize-*`` and ``--no-error-feedback`` flags ask for, or None."""
    if args.quantize_gather is None and args.quantize_reduce is None:
        return None
    return Quantize(args.quantize_gather, args.quantize_reduce, args.quantize_block_size, args.error_feedback)


def check_read_once(model: nn.Module, compile: bool) -> None:
    """Raise ``ValueError`` where a parameter would be exchanged twice a step, so its error feedback counted twice:
    a module placed twice in the model, or tied parameters without compiling (eager gathers at every read). Not caught:
    a module called more than once in one forward (a looped block) is exchanged at each call: only tracing tells, and
    bookkeeping of reads inside a checkpointed block would break Dynamo's graph there."""
    if len(list(model.named_modules(remove_duplicate=False))) > len(list(model.modules())):
        raise ValueError("a module of the model is placed twice in it, so its parameters would be exchanged twice "
                         "a step and their error feedback counted twice; pass Quantize(..., error_feedback=False)")
    tied = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
    if tied and not compile:
        raise ValueError("without compiling, tied parameters are gathered at every read and their error feedback "
                         "would count twice; pass compile=True (a compiled call gathers them once) or "
                         "Quantize(..., error_feedback=False)")


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


def packed_block_bytes(fmt: str, block_size: int) -> int:
    """The bytes one block of ``block_size`` values takes packed: its fp32 scale and its codes."""
    return 4 + (block_size if fmt == "int8" else block_size // 2)


def unpack_dequantize(packed: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Inverse of ``quantize_pack`` up to rounding: packed ``uint8`` rows → fp32 rows ``(R, N)``."""
    rows, blocks = packed.shape[0], packed.shape[1] // packed_block_bytes(fmt, block_size)
    numel = blocks * block_size
    scale_bytes = packed[:, :4 * blocks].reshape(rows, -1, 4).to(torch.int32) << _byte_shifts(packed.device)
    scales = scale_bytes.sum(-1, dtype=torch.int32).view(torch.float32)
    codes = packed[:, 4 * blocks:]
    if fmt == "int4":
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(rows, numel).to(torch.int8) - 8
    values = codes.contiguous().view(torch.int8).float().reshape(rows, -1, block_size)
    return (values * scales.unsqueeze(-1)).reshape(rows, numel)


def padded_rows(shape: torch.Size, shards: int, block_size: int, replicas: int = 1) -> tuple[int, int]:
    """``(values, padded)``: values per rank's row (``Shard(0)``'s rows per rank times the rest), that rounded up to
    whole blocks, ``replicas`` blocks at a time (a row splits into one chunk per replica)."""
    values, unit = -(-shape[0] // shards) * shape[1:].numel(), block_size * replicas
    return values, -(-values // unit) * unit


def replicas_and_shards(mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, int]:
    """How many replicas of how many shards ``placements`` on ``mesh`` make: ``(1, n)`` for ``Shard(0)``, ``(n, 1)``
    for ``Replicate()``, the mesh's shape for ``(Replicate(), Shard(0))``."""
    shards = mesh.size(mesh.ndim - 1) if placements[-1].is_shard() else 1
    return mesh.size(0) if mesh.ndim == 2 or not placements[0].is_shard() else 1, shards


def new_error_buffer(param: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                     quantize: Quantize | None) -> torch.Tensor | None:
    """One rank's error feedback, fp32: ``(shards, padded)``, a row per destination rank (none for one shard), and
    with replicas one more row for the exchange between them; None when not needed (a parameter frozen when sharded,
    e.g. LoRA's base weights, has no gradient to exchange: were it unfrozen later, it would exchange without one)."""
    replicas, shards = replicas_and_shards(mesh, placements)
    rows = shards * (shards > 1) + (replicas > 1)
    if quantize is None or quantize.reduce is None or not quantize.error_feedback or not param.is_floating_point() \
            or not param.requires_grad or not rows or not param.dim():
        return None
    device = "meta" if param.is_meta else mesh.device_type  # allocated by materialize_error_buffers
    return torch.zeros(rows, padded_rows(param.shape, shards, quantize.block_size, replicas)[1], device=device)


def _exchange(rows: torch.Tensor, error: torch.Tensor | None, quantize: Quantize, group) -> tuple[torch.Tensor, ...]:
    """Row ``i`` of ``rows`` (plus ``error``) quantized and sent to rank ``i`` of ``group``; returns the fp32 sum of
    the rows received, and the updated error (or None)."""
    fmt, block_size = quantize.reduce, quantize.block_size
    sent = rows if error is None else rows + error
    packed = quantize_pack(sent, fmt, block_size)
    if error is not None:
        error = quantize.beta * error + (1 - quantize.beta) * (sent - unpack_dequantize(packed, fmt, block_size))
    received = funcol.all_to_all_single(packed, None, None, group)
    return unpack_dequantize(received, fmt, block_size).sum(0), error


class _QuantizedReplicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, error, mesh, placements, shape, quantize, param_dtype, reduce_dtype):
        shard_group = (mesh, mesh.ndim - 1)
        replicas, shards = replicas_and_shards(mesh, placements)
        values, padded = padded_rows(shape, shards, quantize.block_size, replicas)
        ctx.reduce_args = error, mesh, placements, shape, quantize, reduce_dtype, shard.shape, shard.dtype
        row = shard.reshape(1, -1)
        if shards == 1:  # replicas only: nothing to gather
            full = row.to(param_dtype)
        elif quantize.gather is None:
            row = torch.nn.functional.pad(row.to(param_dtype), (0, values - row.shape[1]))
            full = funcol.all_gather_tensor(row, 0, shard_group).reshape(shards, values)
        else:
            row = quantize_pack(torch.nn.functional.pad(row, (0, padded - row.shape[1])), "int8", quantize.block_size)
            packed = funcol.all_gather_tensor(row, 0, shard_group)
            full = unpack_dequantize(packed, "int8", quantize.block_size)[:, :values].to(param_dtype)
        return full.reshape(-1, *shape[1:])[:shape[0]]

    @staticmethod
    def backward(ctx, grad):
        return quantized_reduce(grad, *ctx.reduce_args), None, None, None, None, None, None, None


def quantized_reduce(grad: torch.Tensor, error: torch.Tensor | None, mesh: DeviceMesh, placements: Sequence[Placement],
                     shape: torch.Size, quantize: Quantize, reduce_dtype: torch.dtype | None, shard_shape: torch.Size,
                     shard_dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of the average over ranks of the full gradients ``grad``, exchanged in ``quantize.reduce``'s
    format with error feedback (``error`` is updated in place), or plainly in ``reduce_dtype`` without a format."""
    shard_group, replica_group = (mesh, mesh.ndim - 1), (mesh, 0)
    replicas, shards = replicas_and_shards(mesh, placements)
    values, padded = padded_rows(shape, shards, quantize.block_size, replicas)
    rows = torch.nn.functional.pad(grad.reshape(-1), (0, shards * values - grad.numel())).reshape(shards, -1)
    if quantize.reduce is None:
        mine = rows.to(reduce_dtype or grad.dtype).reshape(-1)
        if shards > 1:
            mine = funcol.reduce_scatter_tensor(mine, "sum", 0, shard_group) / shards
        if replicas > 1:  # gloo has no "avg"
            mine = funcol.all_reduce(mine, "sum", replica_group) / replicas
    else:
        sent = torch.nn.functional.pad(rows.float(), (0, padded - values))
        mine, new_error = sent[0], []  # a one-rank exchange moves nothing: not rounded
        if shards > 1:
            mine, shard_error = _exchange(sent, None if error is None else error[:shards], quantize, shard_group)
            mine, new_error = mine / shards, [shard_error]
        if replicas > 1:  # each replica sums one chunk, then gathers all, quantized: every replica decodes the same
            chunks = mine.reshape(replicas, -1)
            reduced, chunk_error = _exchange(chunks, None if error is None else error[-1].reshape(chunks.shape),
                                             quantize, replica_group)
            packed = quantize_pack((reduced / replicas).reshape(1, -1), quantize.reduce, quantize.block_size)
            gathered = funcol.all_gather_tensor(packed, 0, replica_group)
            mine = unpack_dequantize(gathered, quantize.reduce, quantize.block_size).reshape(-1)
            new_error.append(None if error is None else chunk_error.reshape(1, -1))
        if error is not None:
            error.copy_(torch.cat(new_error))
    return mine[:shard_shape.numel()].reshape(shard_shape).to(shard_dtype)


def quantized_replicate(param: DTensor, error: torch.Tensor | None, quantize: Quantize,
                        param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """The full ``param`` in ``param_dtype``, gathered and its gradient reduced in ``quantize``'s formats."""
    shard = param.to_local()
    return _QuantizedReplicate.apply(shard, error, param.device_mesh, param.placements, param.shape, quantize,
                                     param_dtype or shard.dtype, reduce_dtype)


def error_feedback_state(model: nn.Module) -> dict[str, DTensor]:
    """Every error feedback buffer once, by ``<module>.<parameter>`` (a tied parameter's one buffer by its first name,
    as ``named_parameters`` names it), as a DTensor of one row block per rank (each rank's own state, so checkpoints
    save and load each rank's buffers in place)."""
    state, seen = {}, set()
    for module_name, module in model.named_modules():
        for name, error in vars(module).get("_error_feedback", {}).items():
            if error is not None and id(error) not in seen:
                seen.add(id(error))
                mesh = module._parameters[name].device_mesh
                state[f"{module_name}.{name}".lstrip(".")] = DTensor.from_local(error, mesh, [Shard(0)] * mesh.ndim,
                                                                                run_check=False)
    return state


def materialize_error_buffers(model: nn.Module, device: str) -> None:
    """Replace error feedback buffers created on ``meta`` by zeros on ``device`` (tied parameters keep sharing)."""
    zeros: dict[int, torch.Tensor] = {}
    for module in model.modules():
        errors = vars(module).get("_error_feedback", {})
        for name, error in errors.items():
            if error is not None:
                errors[name] = zeros.setdefault(id(error), torch.zeros_like(error, device=device))
