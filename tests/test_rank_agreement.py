"""Ranks that disagree raise the same error on every rank, fast, instead of hanging: a model that differs between
ranks (``compile_sharded``'s check, any mesh shape), and compiled graphs whose collectives were planned differently
(the guard ``passes/rank_guard.py`` inserts and ``runtime/rank_agreement.py`` runs)."""

from __future__ import annotations

import copy
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp.runtime.rank_agreement as rank_agreement
from simplefsdp import compile_sharded
from simplefsdp.ir.signature import lines_by_group
from simplefsdp.passes.install import OverlapPasses
from simplefsdp.runtime.compile import graph_cache_hits
from ranks import run_on_ranks
from scenarios import FORWARD_BACKWARD_BOUND

# A rank that waited in a collective for a rank that raised would wait for gloo's timeout (120 s, ranks.py).
MODEL_CHECK_SECONDS = 10
# The guard's bound also covers one cold Inductor compile of a two-block model's forward (~5 s on 2 busy cores).
GUARD_SECONDS = 30


def _line(kind: str, group: tuple[int, ...], elements: int, module: str) -> str:
    return f"{kind} group={group} elements={elements} dtype=torch.float32 module={module}"


def test_hybrid_lines_differ_between_replicas_and_still_agree():
    """On a (2, 2) hybrid mesh ranks 0 and 1 reduce over different replica groups: only members are compared."""
    by_rank = {rank: lines_by_group([_line("reduce_scatter", (rank - rank % 2, rank - rank % 2 + 1), 64, "a"),
                                     _line("all_reduce", (rank % 2, rank % 2 + 2), 32, "a")])
               for rank in range(4)}
    assert rank_agreement._first_disagreement(by_rank) is None
    by_rank[3] = lines_by_group([_line("reduce_scatter", (2, 3), 64, "a"), _line("all_reduce", (1, 3), 16, "a")])
    assert rank_agreement._first_disagreement(by_rank) == ((1, 3), 3, 1)
    by_rank[3] = lines_by_group([_line("reduce_scatter", (2, 3), 64, "a")])  # rank 3 issues nothing on (1, 3)
    assert rank_agreement._first_disagreement(by_rank) == ((1, 3), 3, 1)


def _hybrid_model_check(differing: tuple[int, ...]) -> tuple[str, float]:
    """Build a model whose second layer is wider on the ``differing`` ranks and shard it on a (2, 2) mesh; return the
    error and the seconds this rank took to raise it."""
    mesh = init_device_mesh("cpu", (2, 2))
    width = 6 if dist.get_rank() in differing else 4
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, width))
    start = time.perf_counter()
    try:
        compile_sharded(model, mesh=mesh, mode="hybrid_shard", compile=False)
    except ValueError as error:
        return str(error), time.perf_counter() - start
    return "no error", time.perf_counter() - start


def _hybrid_model_checks() -> list[tuple[str, float]]:
    return [_hybrid_model_check((3,)), _hybrid_model_check((2, 3))]


def test_model_differing_on_a_2d_mesh_raises_the_same_error_on_every_rank():
    results = run_on_ranks(4, _hybrid_model_checks)
    for case, (rank, shape) in enumerate([(3, "(6, 4)"), (2, "(6, 4)")]):
        messages = {results[r][case][0] for r in range(4)}
        assert messages == {f"the model differs between rank {rank} and rank 0: parameter 1.weight {shape} "
                            "torch.float32 on rank {rank}, parameter 1.weight (4, 4) torch.float32 on rank 0; "
                            "build the same model (same config) on every rank before compile_sharded"
                            .replace("{rank}", str(rank))}
        assert max(results[r][case][1] for r in range(4)) < MODEL_CHECK_SECONDS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())  # "block" buckets: one all-gather and one reduce-scatter per block


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _one_bucket_less(passes: OverlapPasses, schedule):
    """Rank 1's planner in the failing cases: its last bucket stays unmerged."""
    plan = _plan_buckets(passes, schedule)
    return dataclasses.replace(plan, buckets=plan.buckets[:-1])


_plan_buckets = OverlapPasses.plan_buckets


def _guarded_forward(model: nn.Module | None = None, rows: int = 4) -> tuple[str, float]:
    """Run a forward of ``model`` (default: a fresh one, compiled anew) on ``rows`` rows; return the guard's error
    and this rank's seconds to raise it."""
    if model is None:
        torch._dynamo.reset()
        rank_agreement.GRAPHS.clear()  # as in a new process
        model = compile_sharded(_blocks(), buckets="block")
    start = time.perf_counter()
    try:
        model(torch.randn(rows, 16))
    except ValueError as error:
        return str(error), time.perf_counter() - start
    return "no error", time.perf_counter() - start


def _evaluate_on_rank_0_then_train(model: nn.Module) -> str:
    """Rank 0 alone runs a forward without gradients (its gathers are the training forward's), then both ranks train
    a step: rank 0's forward meets rank 1's backward. The guard's error on this rank."""
    try:
        if dist.get_rank() == 0:
            with torch.no_grad():
                model(torch.randn(4, 16))
        model(torch.randn(4, 16)).sum().backward()
    except ValueError as error:
        return str(error)
    return "no error"


def _guard_cases(cache_root: str) -> dict:
    """1. Both ranks plan alike: train 3 steps, then rank 0 alone evaluates. 2. Rank 1 plans one bucket less and
    compiles; rank 0 loads the first case's graphs from its FX graph cache (its passes never run). 3. Both compile,
    rank 1 one bucket less. 4. Both train a step alike; then rank 1 alone meets a new input shape and recompiles, one
    bucket less, while rank 0 runs the graph it has (a sequence length of each rank's own). 5. Fresh default models
    whose first inputs have one shape, then two: the bucket mode each graph is planned with."""
    rank = dist.get_rank()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")  # no rank reads another's plan
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    reference = _train(copy.deepcopy(_blocks()), batches)
    model = compile_sharded(_blocks(), buckets="block")
    losses = _train(model, [batch.chunk(2)[rank] for batch in batches])
    result = {"reference": reference, "losses": losses, "graphs": len(rank_agreement.GRAPHS)}
    result["evaluated_on_rank_0"] = _evaluate_on_rank_0_then_train(model)
    hits_before = graph_cache_hits()
    if rank == 1:
        OverlapPasses.plan_buckets = _one_bucket_less
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    result["cache_hit"] = _guarded_forward()
    result["cache_hits"] = graph_cache_hits()[0] - hits_before[0]
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    result["both_compile"] = _guarded_forward()
    OverlapPasses.plan_buckets = _plan_buckets
    torch._dynamo.reset()
    model = compile_sharded(_blocks(), buckets="block")
    model(torch.randn(4, 16)).sum().backward()  # planned alike
    if rank == 1:
        OverlapPasses.plan_buckets = _one_bucket_less
    result["recompiled_on_rank_1"] = _guarded_forward(model, rows=6 if rank == 1 else 4)
    OverlapPasses.plan_buckets = _plan_buckets
    result["planned"] = {first_rows: _buckets_planned(first_rows) for first_rows in ((4, 4), (4, 6))}
    return result


def _buckets_planned(first_rows: tuple[int, int]) -> list:
    """The bucket mode each graph of a fresh default model is planned with, where rank r's first input has
    ``first_rows[r]`` rows."""
    planned = []

    def recorded(passes: OverlapPasses, schedule):
        planned.append(passes.buckets)
        return _plan_buckets(passes, schedule)

    torch._dynamo.reset()
    OverlapPasses.plan_buckets = recorded
    try:
        compile_sharded(_blocks())(torch.randn(first_rows[dist.get_rank()], 16)).sum().backward()
    finally:
        OverlapPasses.plan_buckets = _plan_buckets
    return planned


def test_ranks_that_plan_different_collectives_raise_the_same_error(tmp_path):
    results = run_on_ranks(2, _guard_cases, str(tmp_path))
    # Planned alike: two graphs guarded (forward, backward), and training is unchanged.
    for result in results:
        assert result["graphs"] == 2
    for step, reference in enumerate(results[0]["reference"]):
        loss = sum(result["losses"][step] for result in results) / 2  # each rank's loss is the mean of its half
        assert abs(loss - reference) <= FORWARD_BACKWARD_BOUND * abs(reference)
    # A forward on rank 0 alone: the per-call check of rank 0's next forward meets rank 1's backward's, on both ranks
    messages = {result["evaluated_on_rank_0"] for result in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("ranks ran compiled graphs with different collectives at the same call: collective "), \
        message
    assert "Every rank must call the model the same way, step by step. A forward on some ranks only" in message
    assert results[0]["cache_hits"] >= 1  # rank 0's graph came from the cache: its passes did not run
    # Before the guard exchanged the same thing at every call, rank 1's new graph (an object all-gather at its first
    # call) met rank 0's graph (an all-reduce) in the recompile case, and both waited for gloo's timeout.
    for case in ("cache_hit", "both_compile", "recompiled_on_rank_1"):
        messages = {result[case][0] for result in results}
        assert len(messages) == 1, messages
        message = messages.pop()
        # Rank 1 gathers the second block's four parameters one by one: the first one differs from the bucket.
        # (Blocks compiled once, the default: a gather is named by its block.)
        assert message.startswith("ranks planned different buckets for the same collectives: collective 1 on "
                                  "process group (0, 1) is all_gather group=(0, 1) elements=512 dtype=torch.float32 "
                                  "module=1 on rank 1, all_gather group=(0, 1) elements=1072 dtype=torch.float32 "
                                  "module=1 on rank 0 "), message
        assert "pass buckets='block' or buckets=None" in message
        assert max(result[case][1] for result in results) < GUARD_SECONDS
    # "auto" prices compute on each rank's shapes: where the first inputs differ, every rank plans "block" instead
    for result in results:
        assert result["planned"] == {(4, 4): ["auto", "auto"], (4, 6): ["block", "block"]}


def _evaluate_on_rank_0_of_a_2d_mesh() -> str:
    """On a (2, 2) hybrid mesh every rank trains a step, then rank 0 alone evaluates and every rank trains again:
    rank 0's forward meets the others' backward, so only the groups holding rank 0 differ. The guard's error."""
    model = compile_sharded(_blocks(), mesh=init_device_mesh("cpu", (2, 2)), mode="hybrid_shard", buckets="block")
    model(torch.randn(4, 16)).sum().backward()
    return _evaluate_on_rank_0_then_train(model)


def test_a_forward_on_one_rank_of_a_2d_mesh_raises_on_every_rank():
    """Rank 3, whose two groups agree, would otherwise go on into the backward's collectives and wait there."""
    messages = run_on_ranks(4, _evaluate_on_rank_0_of_a_2d_mesh)
    # ranks 0 and 2 meet the difference in their replica group; ranks 1 and 3 learn of it from rank 0 and rank 2
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("ranks ran compiled graphs with different collectives at the same call: "), messages
