"""The all-gather bucket's copy-in and copy-out ops against a hand-built buffer."""

from __future__ import annotations

import torch

import simplefsdp.passes.bucket_copies  # noqa: F401  (registers torch.ops.simplefsdp.*)


def test_copy_in_places_cast_shards_in_this_ranks_slice():
    shards = [torch.arange(6.0).reshape(3, 2), torch.tensor([7.0, 8.0])]
    buffer = torch.ops.simplefsdp.all_gather_copy_in(shards, 3, 1, torch.bfloat16)
    assert buffer.dtype == torch.bfloat16 and buffer.shape == (24,)
    assert torch.equal(buffer[8:16].float(), torch.tensor([0.0, 1, 2, 3, 4, 5, 7, 8]))


def test_copy_out_rebuilds_each_parameter_from_every_ranks_slice():
    group_size, weight, bias = 2, torch.randn(4, 3), torch.randn(6)
    weight_shards, bias_shards = weight.chunk(group_size), bias.chunk(group_size)
    gathered = torch.cat([torch.cat([w.reshape(-1), b]) for w, b in zip(weight_shards, bias_shards)])
    outputs = torch.ops.simplefsdp.all_gather_copy_out(gathered, group_size, [6, 3], [2, 1], [4, 3, 6])
    assert torch.equal(outputs[0], weight) and torch.equal(outputs[1], bias)
    assert all(output.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr() for output in outputs)
