"""``clip_grad_norm_`` over sharded gradients equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from collectives import CountCollectives
from ranks import run_on_ranks

import simplefsdp
from simplefsdp.models.llama import build_model


def _loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _clip(max_norm, norm_type):
    """Clip sharded (eager: the item is not about Inductor) and unsharded gradients; return norms and max error."""
    torch.manual_seed(0)
    model = build_model("debug")
    reference = copy.deepcopy(model)
    simplefsdp.compile_sharded(model, compile=False)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = torch.randint(0, 256, (world * 2, 17), generator=torch.Generator().manual_seed(1))
    _loss(model, data.chunk(world)[rank]).backward()
    _loss(reference, data).backward()
    with CountCollectives() as counter:
        norm = simplefsdp.clip_grad_norm_(model, max_norm, norm_type)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    expected = dict(reference.named_parameters())
    error = max((p.grad.full_tensor() - expected[n].grad).abs().max().item() for n, p in model.named_parameters())
    return norm.item(), expected_norm.item(), error, dict(counter.counts)


CASES = [(0.1, 2.0), (1e6, 2.0), (0.01, float("inf"))]  # clipping, not clipping, max-norm


def _clip_cases():
    return [_clip(max_norm, norm_type) for max_norm, norm_type in CASES]


def test_clip_matches_unsharded():
    for results in run_on_ranks(2, _clip_cases):
        for (norm, expected_norm, error, counts), case in zip(results, CASES):
            assert norm == pytest.approx(expected_norm, rel=1e-5), case
            assert error < 1e-7, case
            assert counts == {"allreduce_": 1}, case
