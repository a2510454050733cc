"""Gradient accumulation with sync off: 4 micro-batches equal one batch, and only the last one communicates."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from collectives import CountCollectives
from ranks import run_on_ranks
from scenarios import FORWARD_BACKWARD_BOUND
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import compile_sharded
from simplefsdp.models.llama import build_model

MICRO_BATCHES = 4


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _accumulate_once(model, micro_batches, use_context_manager):
    """One accumulation cycle: sync off for all but the last micro-batch."""
    for index, micro in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if use_context_manager and not last:
            with model.no_sync():
                (_loss(model, micro) / len(micro_batches)).backward()
        else:
            model.set_requires_gradient_sync(last)
            (_loss(model, micro) / len(micro_batches)).backward()
        yield


def _accumulate(mode, mesh_shape, backend, use_context_manager, compile_blocks_once=False):
    """Sharded accumulation vs. an unsharded model's gradient on the whole global batch, then collective counts.

    The gradients are compared from a cycle run without the counting mode (a dispatch
    mode can change what runs); a second cycle counts the collectives per micro-batch.
    """
    torch.manual_seed(0)
    model = build_model("debug")
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    compile_sharded(model, mode=mode, mesh=mesh, backend=backend, compile_blocks_once=compile_blocks_once)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = torch.randint(0, 256, (world * MICRO_BATCHES * 2, 17), generator=torch.Generator().manual_seed(1))
    micro_batches = data.chunk(world)[rank].chunk(MICRO_BATCHES)
    for _ in _accumulate_once(model, micro_batches, use_context_manager):
        pass
    _loss(reference, data).backward()
    expected = dict(reference.named_parameters())
    relative_error = max(((p.grad.full_tensor() - expected[name].grad).norm() / expected[name].grad.norm()).item()
                         for name, p in model.named_parameters())
    model.zero_grad()
    reductions = []
    cycle = _accumulate_once(model, micro_batches, use_context_manager)
    for _ in range(MICRO_BATCHES):
        with CountCollectives() as counter:
            next(cycle)
        reductions.append(dict(counter.counts))
    return reductions, relative_error


@pytest.mark.parametrize(
    "mode, mesh_shape, backend, reduction, use_context_manager, compile_blocks_once",
    [
        ("fully_shard", None, "inductor", "reduce_scatter_tensor", True, False),
        ("fully_shard", None, "inductor", "reduce_scatter_tensor", False, True),
        ("hybrid_shard", (2, 1), "aot_eager", "all_reduce", False, False),
    ],
)
def test_accumulation_matches_one_batch_and_defers_reduction(mode, mesh_shape, backend, reduction, use_context_manager,
                                                             compile_blocks_once):
    for reductions, relative_error in run_on_ranks(2, _accumulate, mode, mesh_shape, backend, use_context_manager,
                                                   compile_blocks_once):
        # 4 micro-batches x 2 ranks x 2 sequences x 16 tokens: each weight gradient sums the same 256 token terms
        # as the reference, in another order (within LONGEST_REDUCTION): fp32 rounding of a forward+backward;
        # dividing each micro-batch's loss by 4 is exact.
        assert relative_error <= FORWARD_BACKWARD_BOUND
        for counts in reductions[:-1]:
            assert not any("reduce" in name for name in counts), counts
        # the same counter sees one reduction per parameter in the last micro-batch
        assert reductions[-1].get(reduction, 0) == len(dict(build_model("debug").named_parameters()))


def test_aotautograds_cache_keeps_the_graphs_of_unsynced_micro_batches(fake_world):
    """So a warm start loads them instead of tracing them again (torch 2.13 bypasses the cache for a graph holding
    an ``autograd.Function``, as the routing of gradients to their pending sums once was): the micro-batch with sync
    off and the one that reduces the sums."""
    model = compile_sharded(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    counters.clear()
    with model.no_sync():
        model(torch.randn(4, 8)).sum().backward()
    model(torch.randn(4, 8)).sum().backward()
    cache = counters["aot_autograd"]
    assert cache["autograd_cache_bypass"] == 0 and cache["total"] == 2, dict(cache)
    assert cache["autograd_cache_saved"] + cache["autograd_cache_hit"] == 2, dict(cache)
