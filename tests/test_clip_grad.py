"""``clip_grad_norm_`` over sharded gradients equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from collectives import CountCollectives
from ranks import run_on_ranks
from scenarios import FORWARD_BACKWARD_BOUND, U, gamma

import simplefsdp
from simplefsdp.models.llama import build_model


def _loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _clip(max_norm, norm_type):
    """Clip sharded (eager: the item is not about Inductor) and unsharded gradients.

    Returns both total norms, the largest norm-wise relative difference of a clipped gradient, and the counts.
    """
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
    error = max(((p.grad.full_tensor() - expected[n].grad).norm() / expected[n].grad.norm()).item()
                for n, p in model.named_parameters())
    return norm.item(), expected_norm.item(), error, dict(counter.counts)


CASES = [(0.1, 2.0), (1e6, 2.0), (0.01, float("inf"))]  # clipping, not clipping, max-norm


def _clip_cases():
    return [_clip(max_norm, norm_type) for max_norm, norm_type in CASES]


def test_clip_matches_unsharded():
    # The gradients differ within fp32 rounding of a forward+backward (the batch is split over ranks), and a
    # norm moves by no more than its argument. The 2-norm's sum of squares over all N elements, summed per
    # shard then over ranks instead of per tensor then over tensors, adds gamma_N relative, half that after
    # the square root; the inf-norm's max rounds nothing. Clipping multiplies by max_norm / (norm + 1e-6):
    # the norm's difference, then two more roundings.
    elements = sum(p.numel() for p in build_model("debug").parameters())
    norm_bound = {2.0: FORWARD_BACKWARD_BOUND + gamma(elements) / 2, float("inf"): FORWARD_BACKWARD_BOUND}
    for results in run_on_ranks(2, _clip_cases):
        for (norm, expected_norm, error, counts), case in zip(results, CASES):
            bound = norm_bound[case[1]]
            assert norm == pytest.approx(expected_norm, rel=bound, abs=0), case
            assert error <= FORWARD_BACKWARD_BOUND + bound + 2 * U, case
            assert counts == {"allreduce_": 1}, case
