"""The copy-in and copy-out of an all-gather bucket, as two custom ops Inductor calls instead of generating code;
and the traced body of an all-to-all bucket.

A bucket's flat buffer holds rank ``r``'s shards at ``[r * total, (r + 1) * total)``. Generated copy kernels would
read each parameter at its own offset, so no two blocks' kernels would be alike and Inductor would compile a few per
parameter; opaque ops cost no compilation. Both ops copy, never alias their inputs."""

from __future__ import annotations

import itertools

import torch


@torch.library.custom_op("simplefsdp::all_gather_copy_in", mutates_args=())
def all_gather_copy_in(shards: list[torch.Tensor], group_size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A new flat buffer for ``group_size`` ranks whose slice for ``rank`` holds ``shards``, cast to ``dtype``."""
    total = sum(shard.numel() for shard in shards)
    buffer = torch.empty(total * group_size, dtype=dtype, device=shards[0].device)
    local = buffer.narrow(0, total * rank, total).split([shard.numel() for shard in shards])
    torch._foreach_copy_(list(local), [shard.reshape(-1) for shard in shards])
    return buffer


@all_gather_copy_in.register_fake
def _(shards: list[torch.Tensor], group_size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return shards[0].new_empty(sum(shard.numel() for shard in shards) * group_size, dtype=dtype)


@torch.library.custom_op("simplefsdp::all_gather_copy_out", mutates_args=())
def all_gather_copy_out(gathered: torch.Tensor, group_size: int, numels: list[int], ndims: list[int],
                        sizes: list[int]) -> list[torch.Tensor]:
    """Each parameter (``numels[i]`` elements per rank; its ``ndims[i]`` sizes next in ``sizes``) as a new tensor."""
    outputs = [gathered.new_empty(shape) for shape in _shapes(ndims, sizes)]
    for output, part in zip(outputs, gathered.view(group_size, -1).split(numels, dim=1)):
        output.view(group_size, -1).copy_(part)
    return outputs


@all_gather_copy_out.register_fake
def _(gathered: torch.Tensor, group_size: int, numels: list[int], ndims: list[int],
      sizes: list[int]) -> list[torch.Tensor]:
    return [gathered.new_empty(shape) for shape in _shapes(ndims, sizes)]


def _shapes(ndims: list[int], sizes: list[int]) -> list[list[int]]:
    return [sizes[end - ndim:end] for ndim, end in zip(ndims, itertools.accumulate(ndims))]


def all_gather_bucket(shards: list[torch.Tensor], group_name: str, group_size: int, rank: int,
                      dtype: torch.dtype) -> list[torch.Tensor]:
    """All-gather ``shards`` as one collective (copy in, gather, wait, copy out); traced in by ``merge_all_gathers``."""
    buffer = torch.ops.simplefsdp.all_gather_copy_in(shards, group_size, rank, dtype)
    total = sum(shard.numel() for shard in shards)
    local = buffer.narrow(0, total * rank, total)
    functional = torch.ops._c10d_functional
    gathered = functional.wait_tensor(functional.all_gather_into_tensor_out(local, group_size, group_name, out=buffer))
    sizes = [size for shard in shards for size in (shard.shape[0] * group_size, *shard.shape[1:])]
    return torch.ops.simplefsdp.all_gather_copy_out(
        gathered, group_size, [shard.numel() for shard in shards], [shard.ndim for shard in shards], sizes)


def all_to_all_bucket(inputs: list[torch.Tensor], output_splits: list[int], input_splits: list[int],
                      group_name: str) -> list[torch.Tensor]:
    """All-to-all ``inputs`` (split on dim 0 alike) as one collective, their other dims side by side (one wait);
    traced in by ``merge_all_to_alls``."""
    functional = torch.ops._c10d_functional
    flat = torch.cat([tensor.flatten(1) for tensor in inputs], 1)
    received = functional.wait_tensor(functional.all_to_all_single(flat, output_splits, input_splits, group_name))
    parts = received.split([tensor[0].numel() for tensor in inputs], 1)
    return [part.contiguous().view(-1, *tensor.shape[1:]) for part, tensor in zip(parts, inputs)]
