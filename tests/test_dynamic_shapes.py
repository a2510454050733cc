"""Shapes that change: a smaller last batch, new sequence lengths, ``dynamic=True``, eval and inference.

On 2 gloo ranks (one launch for every job) the debug Llama trains with SGD through ``CHANGING_SHAPES``
under each bucket mode and is checked against one unsharded process fed the same global batches. On the
fake process group the passes plan a dynamic graph as they plan the static graph at the hint sizes.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

import simplefsdp
from changing_shapes import (CHANGING_SHAPES, RAGGED_SEQ_LENS, run_changing_shape_jobs, train_changing_shapes,
                             train_ragged)
from ranks import run_on_ranks
from scenarios import build
from simplefsdp.cli import build_parser
from simplefsdp.data import step_seq_len
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.compile import _described_inputs, _first_change

MANUAL_PLAN = [["tok_embeddings"], ["layers.0", "layers.1"], ["norm", "output"]]
WORLD = 2
# One block: half the compile time of the debug Llama, the same kinds of ops. A vocabulary of 1024 rows: the
# embedding is looked up where it is sharded at up to 128 tokens a rank (runtime/sharded_lookup.py), so the steps
# below cross that bound both ways, and ranks of sequence lengths of their own gather the table at the steps where
# their shapes differ and look it up where they agree.
SCENARIO = "one_layer_llama_1k_vocab"
# Every graph here compiles cold in a fresh cache (about a minute on 2 cores), so the 2-rank jobs are the defaults
# (auto buckets, Dynamo's automatic dynamic shapes, then eval and inference), dynamic=True with block buckets, and
# ranks with sequence lengths of their own (the defaults, which then plan block buckets); the plans of symbolic graphs
# are pinned on the fake process group below, and test_parity checks that bucketing leaves numerics bitwise unchanged
# (it is structural: the same for every value of the symbols).
JOBS = {
    "defaults": ({}, "evaluate"),
    "dynamic-block": ({"dynamic": True, "buckets": "block"}, "train"),
    "ragged": ({}, "ragged"),
}

# Bounds (fp32, unit roundoff u = 2^-24). A length-K reduction carries a relative error of at most about K*u,
# and an error passes through at most D reductions in a row. K = 1024: the vocabulary, which the loss sums over;
# every other reduction (the most tokens of one global batch, 2 ranks x 3 x 64 = 384, which the weight gradients sum
# over, dim 64, FFN 192, sequence <= 64) is shorter. D: the longest chain of matmuls, 6 per block (q/k/v, scores,
# weighted values, wo, w1/w3, w2) per block + output, forward, as many again backward.
U, K, D = 2.0**-24, 1024, 2 * (6 * build(SCENARIO).config.n_layers + 1)
STEP_BOUND = D * K * U  # one step's loss and gradients
# SGD's update after n steps sums n gradients, each within STEP_BOUND; the parameters that later gradients see
# differ by these sums, so the bound grows at most linearly with the steps (and so for the eval outputs).
UPDATE_BOUND = len(CHANGING_SHAPES) * STEP_BOUND


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = run_on_ranks(WORLD, run_changing_shape_jobs, SCENARIO, list(JOBS.values()))  # one launch for all jobs
    return {name: [rank_results[index] for rank_results in per_rank] for index, name in enumerate(JOBS)}


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, no sharding, eager: the global batch of both ranks each step."""
    return train_changing_shapes(build(SCENARIO), WORLD)


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("job", [name for name, (_, kind) in JOBS.items() if kind != "ragged"])
def test_changing_shapes_match_the_single_process_reference(results, reference, job):
    ranks, initial = results[job], build(SCENARIO).state_dict()
    for step, expected in enumerate(reference["losses"]):
        loss = sum(rank["losses"][step] for rank in ranks).item() / WORLD  # equal local batches: the global mean
        assert abs(loss - expected.item()) <= (step + 1) * STEP_BOUND * expected.item(), f"step {step}"
    for rank in ranks:
        for name, expected in reference["params"].items():
            update, expected_update = rank["params"][name] - initial[name], expected - initial[name]
            assert relative_difference(update, expected_update) <= UPDATE_BOUND, name
        for name, output in rank["outputs"].items():
            assert relative_difference(output, reference["outputs"][name]) <= UPDATE_BOUND, name
    assert results["defaults"][0]["outputs"].keys() == {"eval_no_grad", "inference_mode"}


def test_ranks_with_sequence_lengths_of_their_own_match_the_single_process_reference(results):
    """The first inputs differ in shape, so "auto" plans block buckets on both ranks; then each rank recompiles for a
    new length while the other runs the graph it has, both plan the same collectives, and the guard lets every call
    run. The ranks' shapes agree at step 1 alone, the one step whose embedding is looked up where it is sharded. The
    bounds are the changing shapes'."""
    reference, initial = train_ragged(build(SCENARIO), WORLD), build(SCENARIO).state_dict()
    for step, expected in enumerate(reference["losses"]):
        loss = sum(rank["losses"][step] for rank in results["ragged"]).item() / WORLD
        assert abs(loss - expected.item()) <= (step + 1) * STEP_BOUND * expected.item(), f"step {step}"
    for rank in results["ragged"]:
        assert rank["shapes_agree"] == [False, True, False]
        for name, expected in reference["params"].items():
            update, expected_update = rank["params"][name] - initial[name], expected - initial[name]
            assert relative_difference(update, expected_update) <= len(RAGGED_SEQ_LENS) * STEP_BOUND, name


def test_a_change_of_shape_recompiles_once_then_the_graph_is_dynamic(results):
    """Steps 2-4 change the batch, the sequence length, both: one recompile, to a dynamic graph that gathers the
    table (144 and 192 tokens a rank); at step 4's 64 tokens the lookup where the table is sharded pays again: one more
    graph, dynamic too."""
    for rank in results["defaults"]:
        assert rank["graphs"] == [1, 1, 2, 2, 3]


def _graphs_of_blocks_compiled_once_at_new_lengths() -> tuple[list[int], list[str]]:
    """Dynamo's count of graphs after each step of the debug Llama (2 blocks, one region), compiled once per block,
    at 4 sequence lengths, and what this rank printed to stderr."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = simplefsdp.compile_sharded(build_model("debug"), backend="aot_eager", compile_blocks_once=True)
    before, graphs, printed = counters["stats"]["unique_graphs"], [], io.StringIO()
    with contextlib.redirect_stderr(printed):
        for seq_len in (32, 20, 39, 16):
            model(torch.zeros(2, seq_len, dtype=torch.long)).sum().backward()
            graphs.append(counters["stats"]["unique_graphs"] - before)
    return graphs, printed.getvalue().splitlines()


def test_blocks_compiled_once_recompile_once_for_a_new_length_then_stay_dynamic():
    """The regions' reuse key describes a symbolic size as -1 without reading its value: hashing the size would
    specialize it, and every new length would compile again (1, 2, 3, 4 graphs). The one recompile prints one line
    on rank 0 naming the input that changed."""
    [(graphs, printed)] = run_on_ranks(1, _graphs_of_blocks_compiled_once_at_new_lengths)
    assert graphs == [1, 2, 2, 2]
    recompiles = [line for line in printed if line.startswith("simplefsdp: recompiled")]
    assert len(recompiles) == 1, printed
    assert re.fullmatch(r"simplefsdp: recompiled Llama for input args\[0\] \(2, 32\) int64 -> \(2, 20\) int64 in "
                        r"\d+\.\d s", recompiles[0]), recompiles


def test_a_recompile_with_the_same_inputs_says_so_and_points_to_dynamos_log():
    inputs = _described_inputs((torch.zeros(2, 3, dtype=torch.long),), {"mask": None})
    assert inputs == {"args[0]": "(2, 3) int64", "kwargs['mask']": "None"}
    assert _first_change(inputs, {**inputs, "kwargs['mask']": "True"}) == "for input kwargs['mask'] None -> True"
    assert _first_change(inputs, {"args[0]": "(2, 3) int64"}) == "for input kwargs['mask'] None -> absent"
    assert "TORCH_LOGS=recompiles" in _first_change(inputs, inputs)


def test_variable_seq_len_is_deterministic_and_spans_half_to_full():
    lengths = [step_seq_len(step, 64, seed=3) for step in range(1, 41)]
    assert lengths == [step_seq_len(step, 64, seed=3) for step in range(1, 41)]
    assert min(lengths) >= 32 and max(lengths) <= 64 and len(set(lengths)) > 10
    assert lengths != [step_seq_len(step, 64, seed=4) for step in range(1, 41)]


# "auto" plans through "block" and then reorders, as "none" does; "manual" is the other way to plan buckets.
BUCKET_MODES = {"auto": "auto", "manual": MANUAL_PLAN}


@pytest.fixture(scope="module", params=BUCKET_MODES)
def static_and_dynamic(request):
    """The passes (each way to plan buckets, reorder on) on the debug Llama for 8 ranks, traced static and symbolic,
    both as the whole graph (``dynamic=True`` compiles no block once)."""
    with torch.device("meta"):
        model = build_model("debug")
    tokens = torch.zeros(2, 32, dtype=torch.long)
    return [simplefsdp.inspect(model, (tokens,), world_size=8, dynamic=dynamic, buckets=BUCKET_MODES[request.param],
                               compile_blocks_once=False)
            for dynamic in (False, True)]


def reorder_moves(report, phase: str) -> tuple[list, list]:
    """The reorder plan with each compute node named by op and module: the dynamic graph numbers nodes otherwise."""
    schedule, plan = getattr(report.stages[-2], phase), getattr(report.stage("reordered"), f"{phase}_plan")
    named = lambda name: (schedule.node(name).op, schedule.node(name).fqn)  # noqa: E731
    return ([(p.collective, p.after, named(p.anchor)) for p in plan.prefetches],
            [(s.nodes, named(s.before)) for s in plan.sinks])


def test_plans_of_a_dynamic_graph_equal_the_static_plans_at_the_hints(static_and_dynamic):
    static, dynamic = static_and_dynamic
    assert static.forward.symbols == {} and sorted(dynamic.forward.symbols.values()) == [2, 32]
    for phase in ("forward", "backward"):
        assert str(getattr(dynamic.stage("bucketed"), f"{phase}_plan")) == str(
            getattr(static.stage("bucketed"), f"{phase}_plan"))
        assert reorder_moves(dynamic, phase) == reorder_moves(static, phase)
    assert len(dynamic.stage("bucketed").forward.collectives()) < len(dynamic.stage("traced").forward.collectives())


def test_inspect_names_the_symbolic_sizes_and_their_hints(static_and_dynamic):
    static, dynamic = static_and_dynamic
    symbols = ", ".join(f"{name}={hint}" for name, hint in sorted(dynamic.forward.symbols.items()))
    assert f"symbolic sizes, priced at their hints: {symbols}\n" in dynamic.summary()
    assert "symbolic" not in static.summary()
    # the memory model and the simulator report at the hints: the same peak as static, to a few scalars' bytes
    assert abs(dynamic.prediction.memory.peak_bytes - static.prediction.memory.peak_bytes) <= 64


def test_inspect_command_line_takes_dynamic():
    assert build_parser().parse_args(["inspect", "--dynamic"]).dynamic
    assert not build_parser().parse_args(["inspect"]).dynamic
