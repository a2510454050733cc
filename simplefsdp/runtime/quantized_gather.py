"""The replicate-for-compute step with low-bit communication (``Quantize``), on a 1-D mesh of ``Shard(0)`` shards.

Forward: the local shard, padded to a whole number of blocks, is quantized and packed, all-gathered as ``uint8``, and
each rank's row is unpacked and dequantized to ``param_dtype``. Backward: each rank quantizes its whole gradient plus
its error buffer, row by destination rank, and sends the rows by an all-to-all; each receiver dequantizes and sums
them in fp32 and averages (a collective never sums low-bit codes: gloo's int8 sum wraps around). Without a format
the collective is the plain all-gather or an averaged reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from simplefsdp.runtime.quantize import Quantize, quantize_pack, unpack_dequantize


def padded_rows(shape: torch.Size, world: int, block_size: int) -> tuple[int, int]:
    """``(values, padded)``: values per rank's row (``Shard(0)``'s rows per rank times the rest), that rounded up to
    a whole number of blocks."""
    values = -(-shape[0] // world) * shape[1:].numel()
    return values, -(-values // block_size) * block_size


def new_error_buffer(param: torch.Tensor, world: int, quantize: Quantize | None, device: str) -> torch.Tensor | None:
    """One rank's error feedback: ``(world, padded)`` fp32, a row per destination rank; None when not needed."""
    if quantize is None or quantize.reduce is None or not quantize.error_feedback or not param.is_floating_point():
        return None
    device = "meta" if param.is_meta else device  # allocated by materialize_error_buffers
    return torch.zeros(world, padded_rows(param.shape, world, quantize.block_size)[1], device=device)


class _QuantizedReplicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, error, mesh, shape, quantize, param_dtype, reduce_dtype):
        world = mesh.size()
        values, padded = padded_rows(shape, world, quantize.block_size)
        ctx.mesh, ctx.shard_shape, ctx.shard_dtype = mesh, shard.shape, shard.dtype
        ctx.quantize, ctx.reduce_dtype, ctx.error, ctx.values, ctx.padded = quantize, reduce_dtype, error, values, padded
        row = shard.reshape(1, -1)
        if quantize.gather is None:
            row = torch.nn.functional.pad(row.to(param_dtype), (0, values - row.shape[1]))
            full = funcol.all_gather_tensor(row, 0, mesh).reshape(world, values)
        else:
            row = quantize_pack(torch.nn.functional.pad(row, (0, padded - row.shape[1])), "int8", quantize.block_size)
            packed = funcol.all_gather_tensor(row, 0, mesh)
            full = unpack_dequantize(packed, "int8", quantize.block_size)[:, :values].to(param_dtype)
        return full.reshape(-1, *shape[1:])[:shape[0]]

    @staticmethod
    def backward(ctx, grad):
        quantize, world = ctx.quantize, ctx.mesh.size()
        rows = torch.nn.functional.pad(grad.reshape(-1), (0, world * ctx.values - grad.numel())).reshape(world, -1)
        if quantize.reduce is None:
            dtype = ctx.reduce_dtype or grad.dtype
            mine = funcol.reduce_scatter_tensor(rows.to(dtype).reshape(-1), "sum", 0, ctx.mesh) / world
        else:
            sent = torch.nn.functional.pad(rows.float(), (0, ctx.padded - ctx.values))
            if ctx.error is not None:
                sent = sent + ctx.error
            packed = quantize_pack(sent, quantize.reduce, quantize.block_size)
            if ctx.error is not None:
                lost = sent - unpack_dequantize(packed, quantize.reduce, quantize.block_size)
                ctx.error.copy_(quantize.beta * ctx.error + (1 - quantize.beta) * lost)
            received = funcol.all_to_all_single(packed, None, None, ctx.mesh)
            mine = unpack_dequantize(received, quantize.reduce, quantize.block_size).sum(0)[:ctx.values] / world
        shard_grad = mine[:ctx.shard_shape.numel()].reshape(ctx.shard_shape).to(ctx.shard_dtype)
        return shard_grad, None, None, None, None, None, None


def quantized_replicate(param: DTensor, error: torch.Tensor | None, quantize: Quantize,
                        param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """The full ``param`` in ``param_dtype``, gathered and its gradient reduced in ``quantize``'s formats."""
    shard = param.to_local()
    dtype = param_dtype or shard.dtype
    return _QuantizedReplicate.apply(shard, error, param.device_mesh, param.shape, quantize, dtype, reduce_dtype)


def error_feedback_state(model: nn.Module) -> dict[str, DTensor]:
    """Every error feedback buffer by ``<module>.<parameter>``, as a DTensor of one row block per rank (each rank's
    own state, so checkpoints save and load each rank's buffers in place)."""
    return {f"{module_name}.{name}".lstrip("."): DTensor.from_local(error, module._parameters[name].device_mesh,
                                                                    [Shard(0)], run_check=False)
            for module_name, module in model.named_modules()
            for name, error in vars(module).get("_error_feedback", {}).items() if error is not None}


def materialize_error_buffers(model: nn.Module, device: str) -> None:
    """Replace error feedback buffers created on ``meta`` by zeros on ``device`` (tied parameters keep sharing)."""
    zeros: dict[int, torch.Tensor] = {}
    for module in model.modules():
        errors = vars(module).get("_error_feedback", {})
        for name, error in errors.items():
            if error is not None:
                errors[name] = zeros.setdefault(id(error), torch.zeros_like(error, device=device))
