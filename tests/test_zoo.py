"""The zoo on 2 gloo ranks with default options (``compile_sharded(model)``: Inductor, ``buckets="auto"``), each
model against an independent reference: one process training the whole batch from the same init, or, for batch
norm, ``DistributedDataParallel`` on the same ranks. Every model of ``zoo.ZOO`` trains in one launch (one process
start, one gloo group), a few SGD steps each; the bounds are derived in ``zoo.py`` as in ``scenarios.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ranks import run_on_ranks
from scenarios import relative_difference
from simplefsdp import compile_sharded
from zoo import ZOO, ZOO_BOUND, build, zoo_update_bound

STEPS, LOCAL_BATCH, LR = 3, 2, 0.1


def _slice(value, rank: int, ranks: int):
    return value.chunk(ranks)[rank] if isinstance(value, torch.Tensor) else value


def _train(name: str, model: nn.Module, rank: int = 0, ranks: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD on this rank's slice of each global batch of 2 ranks (``ranks=1``: the whole batch); the local losses and
    the final parameters, gathered whole."""
    entry = ZOO[name]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, target = entry.batch(step, LOCAL_BATCH * 2)
        loss = entry.loss(model(*(_slice(x, rank, ranks) for x in inputs)), _slice(target, rank, ranks))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {key: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for key, p in model.named_parameters()}
    return losses, params


def _train_the_zoo() -> dict[str, dict]:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, entry in ZOO.items():
        losses, params = _train(name, compile_sharded(build(name)), rank, ranks)
        results[name] = {"losses": losses, "params": params}
        if entry.reference == "ddp":
            ddp = DistributedDataParallel(build(name), broadcast_buffers=False)
            ddp_losses, ddp_params = _train(name, ddp, rank, ranks)
            results[name]["reference"] = ddp_losses, {key.removeprefix("module."): p for key, p in ddp_params.items()}
    return results


def test_zoo_trains_like_its_reference_with_default_options():
    per_rank = run_on_ranks(2, _train_the_zoo)
    for name, entry in ZOO.items():
        initial = dict(build(name).named_parameters())
        if entry.reference == "process":
            ref_losses, ref_params = _train(name, build(name))
            # each rank's loss is the mean over its half of the batch: the global mean is their mean
            losses = [sum(values) / 2 for values in zip(*(result[name]["losses"] for result in per_rank))]
            _assert_close(name, losses, ref_losses, initial, ref_params, [r[name]["params"] for r in per_rank])
        else:
            for rank, result in enumerate(per_rank):
                ref_losses, ref_params = result[name]["reference"]
                _assert_close(f"{name} rank {rank}", result[name]["losses"], ref_losses, initial, ref_params,
                              [result[name]["params"]])


def _assert_close(name: str, losses: list[float], ref_losses: list[float], initial: dict, ref_params: dict,
                  rank_params: list[dict]) -> None:
    for step, (loss, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(loss - ref) <= ZOO_BOUND * abs(ref), f"{name} step {step}: loss {loss} vs reference {ref}"
    trained = [key for key in ref_params if initial[key].requires_grad]
    start = torch.cat([initial[key].detach().flatten() for key in trained])
    ref_update = torch.cat([(ref_params[key] - initial[key]).flatten() for key in trained])
    for params in rank_params:
        assert params.keys() == ref_params.keys(), name
        for key in ref_params.keys() - trained:
            assert torch.equal(params[key], ref_params[key]), f"{name}: frozen {key} changed"
        # norm-wise over the model: a parameter whose gradient is zero in exact arithmetic (a key bias under softmax)
        # has an update of rounding noise alone, which no relative bound of its own covers
        update = torch.cat([(params[key] - initial[key]).flatten() for key in trained])
        difference, bound = relative_difference(update, ref_update), zoo_update_bound(start, ref_update, STEPS)
        assert difference <= bound, f"{name}: update differs by {difference:.2e} (bound {bound:.2e})"
