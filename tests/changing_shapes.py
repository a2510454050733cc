"""Training loops whose inputs change shape: the batch and sequence length from step to step, then eval and inference
(``train_changing_shapes``), and ranks with sequence lengths of their own (``train_ragged``); for
``test_dynamic_shapes``, on the models of ``scenarios.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scenarios import _lm_loss, build


# Sequences per rank and tokens per sequence of each step: the batch and the sequence length change together at
# step 2, then each changes alone; eval and inference follow at sizes training never saw.
CHANGING_SHAPES = [(4, 32), (4, 32), (3, 48), (3, 64), (2, 32)]
EVAL_SHAPES = {"eval_no_grad": (3, 40), "inference_mode": (2, 24)}
CHANGING_SHAPES_LR = 1e-2


def changing_batch(step: int, size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` sequences of ``seq_len`` input tokens and their next-token targets, fixed by ``step``."""
    tokens = torch.randint(0, 256, (size, seq_len + 1), generator=torch.Generator().manual_seed(200 + step))
    return tokens[:, :-1], tokens[:, 1:]


def train_changing_shapes(model: nn.Module, world: int, rank: int | None = None, evaluate: bool = True) -> dict:
    """SGD on each step of ``CHANGING_SHAPES`` (a global batch of ``world`` ranks' sequences, or ``rank``'s slice
    of it), then, with ``evaluate``, eval and inference at ``EVAL_SHAPES``.

    Returns the losses, the full parameters, the eval outputs and Dynamo's count of graphs after each step.
    """
    from torch._dynamo.utils import counters

    optimizer = torch.optim.SGD(model.parameters(), lr=CHANGING_SHAPES_LR)
    graphs_before, losses, graphs = counters["stats"]["unique_graphs"], [], []
    for step, (size, seq_len) in enumerate(CHANGING_SHAPES):
        inputs, target = changing_batch(step, size * world, seq_len)
        if rank is not None:
            inputs, target = inputs.chunk(world)[rank], target.chunk(world)[rank]
        loss = _lm_loss(model(inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
    params = _full_parameters(model)
    if not evaluate:
        return {"losses": losses, "params": params, "graphs": graphs, "outputs": {}}
    model.eval()
    with torch.no_grad():
        eval_no_grad = model(changing_batch(-1, *EVAL_SHAPES["eval_no_grad"])[0])
    with torch.inference_mode():
        inference = model(changing_batch(-2, *EVAL_SHAPES["inference_mode"])[0]).clone()
    return {"losses": losses, "params": params, "graphs": graphs,
            "outputs": {"eval_no_grad": eval_no_grad, "inference_mode": inference}}


def _full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for name, p in model.named_parameters()}


# Each rank's own sequence length at each step, (rank 0, rank 1), 3 sequences a rank: they differ from the first
# call on; rank 0 meets a new length at step 1 and rank 1 at step 2, each recompiling while the other runs the graph
# it has.
RAGGED_SEQ_LENS = [(32, 24), (24, 24), (32, 16)]


def train_ragged(model: nn.Module, world: int, rank: int | None = None) -> dict:
    """SGD on ``RAGGED_SEQ_LENS``: ``rank``'s own batch, or in one process the mean of every rank's loss (what the
    ranks' averaged gradients descend). Returns the losses, the full parameters and, after each step, whether the
    ranks' shapes agreed (``None`` in one process, which has no lookup where the embedding is sharded)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=CHANGING_SHAPES_LR)
    losses, shapes_agree = [], []
    for step, lengths in enumerate(RAGGED_SEQ_LENS):
        ranks = range(world) if rank is None else [rank]
        batches = [changing_batch(10 * step + each, 3, lengths[each]) for each in ranks]
        loss = sum(_lm_loss(model(inputs), target) for inputs, target in batches) / len(batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        shapes_agree.append(vars(model.tok_embeddings).get("_ranks_agree_on_shapes"))
    return {"losses": losses, "params": _full_parameters(model), "shapes_agree": shapes_agree}


def run_changing_shape_jobs(scenario: str, jobs: list[tuple[dict, str]]) -> list[dict]:
    """For each ``(compile_sharded options, kind)``, train ``scenario``'s model on this rank: ``"evaluate"`` and
    ``"train"`` by ``train_changing_shapes`` (with and without its eval), ``"ragged"`` by ``train_ragged``."""
    from simplefsdp import compile_sharded

    results = []
    for options, kind in jobs:
        torch._dynamo.reset()
        model = compile_sharded(build(scenario), **options)
        world, rank = dist.get_world_size(), dist.get_rank()
        results.append(train_ragged(model, world, rank) if kind == "ragged"
                       else train_changing_shapes(model, world, rank, kind == "evaluate"))
    return results
