"""FSDP x TP on a (dp, tp) mesh: torch's ``parallelize_module`` with the Llama plan, then ``compile_sharded``.

Numerics: 4 gloo ranks, dp 2 x tp 2, eager and Inductor (passes on), against one process training the global batch
of the 2 data-parallel ranks. The bound is the data-parallel one (``scenarios.FORWARD_BACKWARD_BOUND``) unchanged:
tensor parallelism splits each row-parallel matmul's sum (wo, w2, the embedding lookup) and, in the backward, each
column-parallel input gradient's into tp partial sums added by an all-reduce, a reordering of the same K terms,
which gamma_K of the longest reduction already covers; the chain of dependent reductions does not get longer.
Graphs: on the fake process group, the passes bucket and move the data-parallel collectives and leave tensor
parallelism's where TP put them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ranks import run_on_ranks
from scenarios import (FORWARD_BACKWARD_BOUND, LOCAL_BATCH, SCENARIOS, STEPS, assert_matches_reference, build, gamma,
                       make_optimizer)
from simplefsdp import Quantize, clip_grad_norm_, compile_sharded, inspect
from simplefsdp.cli import main
from simplefsdp.models.llama import build_model
from simplefsdp.models.llama_tp import parallelize_llama, tensor_parallel_plan
from simplefsdp.runtime.fake_world import fake_world

DP, TP = 2, 2
JOBS = {"eager": {"compile": False}, "inductor": {"buckets": "block"}}


def train_fsdp_x_tp(options: dict) -> dict:
    """On this rank of a (2, 2) mesh: the global gradient norm at the initial parameters, then SGD on its dp slice."""
    torch._dynamo.reset()
    mesh_2d = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build("llama")
    parallelize_llama(model, mesh_2d["tp"])
    compile_sharded(model, mesh=mesh_2d["dp"], **options)
    dp_rank = mesh_2d["dp"].get_local_rank()
    _, batch, loss_fn = SCENARIOS["llama"]
    optimizer = make_optimizer(model, "sgd")
    inputs, target = batch(0, LOCAL_BATCH * DP)
    loss_fn(model(inputs.chunk(DP)[dp_rank]), target.chunk(DP)[dp_rank]).backward()
    initial_norm = clip_grad_norm_(model, max_norm=1e6).item()  # large: measures, does not clip
    optimizer.zero_grad()
    eager = options.get("compile") is False
    accumulation_error = _accumulation_error(model, loss_fn, inputs, target, dp_rank) if eager else None
    losses = []
    for step in range(STEPS):
        inputs, target = batch(step, LOCAL_BATCH * DP)
        loss = loss_fn(model(inputs.chunk(DP)[dp_rank]), target.chunk(DP)[dp_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "dp_rank": dp_rank, "losses": losses, "initial_norm": initial_norm, "accumulation_error": accumulation_error,
        "params": {name: p.full_tensor() for name, p in model.named_parameters()},
        "placements": {name: (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements)))
                       for name, p in model.named_parameters()},
    }


def _accumulation_error(model, loss_fn, inputs, target, dp_rank) -> float:
    """This dp rank's slice in 2 micro-batches, sync off then on (the pending sum reduced over dp after the backward),
    against one plain process's gradient on the global batch: the largest norm-wise relative difference."""
    micro_batches = zip(inputs.chunk(DP)[dp_rank].chunk(2), target.chunk(DP)[dp_rank].chunk(2))
    for index, (micro_inputs, micro_target) in enumerate(micro_batches):
        model.set_requires_gradient_sync(index == 1)
        (loss_fn(model(micro_inputs), micro_target) / 2).backward()
    reference = build("llama")
    loss_fn(reference(inputs), target).backward()
    expected = dict(reference.named_parameters())
    errors = [((p.grad.full_tensor() - expected[name].grad).norm() / expected[name].grad.norm()).item()
              for name, p in model.named_parameters()]
    model.zero_grad()
    return max(errors)


def run_jobs() -> list[dict]:
    return [train_fsdp_x_tp(options) for options in JOBS.values()]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """Per job, the result of every rank (rank order)."""
    per_rank = run_on_ranks(DP * TP, run_jobs)
    return {name: [rank_results[index] for rank_results in per_rank] for index, name in enumerate(JOBS)}


@pytest.mark.parametrize("job", JOBS)
def test_fsdp_x_tp_matches_single_process_reference(results, job):
    ranks = results[job]
    # the ranks of a tensor-parallel group compute the same loss; the global loss is the mean over dp
    losses = [sum(rank["losses"][step] for rank in ranks) / len(ranks) for step in range(STEPS)]
    assert all(rank["losses"] == ranks[rank["dp_rank"] * TP]["losses"] for rank in ranks)
    worst = assert_matches_reference("llama", DP, losses, [rank["params"] for rank in ranks])
    print(f"{job}: largest update difference is {worst:.3f} of its bound")


def test_accumulated_tensor_parallel_gradients_match_one_process(results):
    """Accumulation reduces the pending sum of a (dp, tp) parameter over dp once, keeping TP's shard (eager job)."""
    for rank in results["eager"]:
        assert rank["accumulation_error"] <= FORWARD_BACKWARD_BOUND


def test_parameters_are_dtensors_on_dp_and_tp(results):
    """TP's column-parallel weights are split on dim 0 over tp, then over dp (FSDP2's strided form); row-parallel
    ones on dim 1 over tp and 0 over dp; the norms, which TP leaves alone, over dp only."""
    for rank in results["eager"]:
        placements = rank["placements"]
        assert placements["layers.0.attention.wq.weight"] == (("dp", "tp"), ("_S(0, 2)", "S(0)"))
        assert placements["layers.0.feed_forward.w2.weight"] == (("dp", "tp"), ("S(0)", "S(1)"))
        assert placements["tok_embeddings.weight"] == (("dp", "tp"), ("_S(0, 2)", "S(0)"))
        assert placements["norm.weight"] == (("dp",), ("S(0)",))


def test_clip_grad_norm_counts_each_shard_once(results):
    """The norm of gradients sharded over dp and tp, and of norms replicated over tp, is the unsharded one.

    Bound as in test_clip_grad: the gradients' forward+backward bound, plus gamma_N/2 for the sum of squares
    of all N elements taken in another order."""
    reference = build("llama")
    _, batch, loss_fn = SCENARIOS["llama"]
    inputs, target = batch(0, LOCAL_BATCH * DP)
    loss_fn(reference(inputs), target).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6).item()
    bound = FORWARD_BACKWARD_BOUND + gamma(sum(p.numel() for p in reference.parameters())) / 2
    for job in JOBS:
        for rank in results[job]:
            assert rank["initial_norm"] == pytest.approx(expected, rel=bound, abs=0), job


@pytest.fixture(scope="module")
def report():
    """``inspect`` of the debug Llama on 8 fake ranks, dp 4 x tp 2, one bucket per block."""
    tokens = torch.zeros(2, 16, dtype=torch.long)
    return inspect(build_model("debug"), (tokens,), world_size=8, tp=TP, buckets="block")


def tensor_parallel(schedule) -> list:
    return [node for node in schedule.collectives() if node.collective.group_size == TP]


def test_passes_bucket_data_parallel_collectives_and_leave_tensor_parallel_ones(report):
    traced, final = report.stage("traced"), report.final
    for phase in ("forward", "backward"):
        before, after = getattr(traced, phase), getattr(final, phase)
        tp_before = tensor_parallel(before)
        assert len(tp_before) >= 2 * 2  # at least the wo and w2 all-reduces of each of the 2 blocks
        # TP's collectives: the same nodes, in the same order, each still waited on right where TP waits
        assert [node.name for node in tensor_parallel(after)] == [node.name for node in tp_before]
        for schedule in (before, after):
            position = {node.name: index for index, node in enumerate(schedule.nodes)}
            waits = {node.waits_for: node.name for node in schedule.nodes if node.waits_for}
            compute_between = {name: [n for n in schedule.nodes[position[name] + 1:position[waits[name]]]
                                      if n.kind == "compute" and n.flops] for name in (c.name for c in tp_before)}
            assert not any(compute_between.values()), compute_between
        # the data-parallel ones: one bucket per block plus head and tail, every collective on the dp group
        plan = getattr(report.stage("bucketed"), f"{phase}_plan")
        assert {bucket.name for bucket in plan.buckets} == {"head", "layers.0", "layers.1", "tail"}
        tp_names = {node.name for node in tp_before}
        assert not tp_names.intersection(name for bucket in plan.buckets for name in bucket.collectives)
        dp_after = [node for node in after.collectives() if node.name not in tp_names]
        assert {node.collective.group_size for node in dp_after} == {8 // TP}
        assert len(dp_after) == len(plan.buckets) < len(before.collectives()) - len(tp_before)
    # the reorder plans prefetch and sink data-parallel collectives and waits only
    plans = report.final.forward_plan, report.final.backward_plan
    moved = {move.collective for plan in plans for move in plan.prefetches}
    moved |= {sink.nodes[0] for plan in plans for sink in plan.sinks}
    tp_nodes = {node.name for schedule in (traced.forward, traced.backward) for node in schedule.nodes
                if node in tensor_parallel(schedule) or node.waits_for in {c.name for c in tensor_parallel(schedule)}}
    assert moved and not moved & tp_nodes


def test_inspect_counts_a_tensor_parallel_groups_tokens_once(report):
    assert report.tokens == 2 * 16 // TP  # the 2 ranks of a tp group compute on the same 2x16 tokens


def test_cli_inspect_tp_prints_the_2d_layout_and_rejects_a_tp_that_does_not_divide(capsys):
    assert main(["inspect", "--model", "debug", "--seq-len", "16", "--world-size", "4", "--tp", "2"]) == 0
    title = "debug, fully_shard, world 4, tp 2, hardware h100, 1x16 tokens per tp group"
    assert capsys.readouterr().out.startswith(title)
    with pytest.raises(SystemExit, match="simplefsdp inspect: tp=3 must be a positive int dividing the world size 4"):
        main(["inspect", "--model", "debug", "--world-size", "4", "--tp", "3"])


def test_tensor_parallel_plan_covers_every_linear_of_the_blocks():
    plan = tensor_parallel_plan(build_model("debug").config)
    linears = {name for name, module in build_model("debug").named_modules() if isinstance(module, nn.Linear)}
    assert linears | {"tok_embeddings"} == set(plan)


@pytest.mark.parametrize(("tp", "overrides", "message"), [
    (4, {}, r"n_kv_heads \(2\) divisible by 4"),
    (2, {"tie_embeddings": True}, "tie_embeddings=False"),
])
def test_bad_tensor_parallel_layouts_are_rejected_before_any_collective(tp, overrides, message):
    with pytest.raises(ValueError, match=message):
        inspect(build_model("debug", **overrides), (torch.zeros(1, 8, dtype=torch.long),), world_size=8, tp=tp)


def test_tp_with_another_mode_or_mesh_is_rejected(monkeypatch):
    with fake_world(8):
        mesh_2d = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_llama(build_model("debug"), mesh_2d["tp"])
        monkeypatch.setattr(dist, "all_gather_object", lambda *_: pytest.fail("a collective ran"))
        with pytest.raises(ValueError, match="mode='fully_shard' only"):
            compile_sharded(model, mesh=mesh_2d["dp"], mode="replicate", compile=False)
        fix = r'not two dimensions of one mesh .*compile_sharded\(model, mesh=mesh_2d\["dp"\]\)'
        with pytest.raises(ValueError, match=fix):
            compile_sharded(model, mesh=mesh_2d["tp"], compile=False)
        with pytest.raises(ValueError, match="quantize does not support tensor-parallel"):
            compile_sharded(model, mesh=mesh_2d["dp"], compile=False, quantize=Quantize(gather="int8"))
