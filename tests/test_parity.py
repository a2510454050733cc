"""Numerics: sharded training on gloo ranks equals one process training the global batch.

All jobs of one world size run in one launch of ranks (to pay process start-up
and compilation once); each test below checks one job against its reference.
Against the single-process reference (SGD) the bound comes from fp32 rounding
(``scenarios.FORWARD_BACKWARD_BOUND``); where two jobs run the same arithmetic in
the same order (passes on and off, ``aot_eager`` and FSDP2 eager) the check is bitwise.
"""

from __future__ import annotations

import pytest
import torch

from ranks import run_on_ranks
from scenarios import assert_matches_reference, build, run_jobs

INDUCTOR = {"backend": "inductor"}
EAGER = {"compile": False}
PASSES_OFF = {**INDUCTOR, "buckets": None, "reorder": False}
KEEP_UNSHARDED = {"reshard_after_forward": False}
ADAMW = {"optimizer": "adamw"}  # bitwise checks only: see scenarios.py
MANUAL_PLAN = [["tok_embeddings"], ["layers.0", "layers.1"], ["norm", "output"]]
# Passes on: each bucket mode, reorder on and off, resharding on and off, each in some job (compile_sharded's default
# is buckets="auto", reorder=True, so "fully_shard-inductor" and "...-keep-unsharded" are the auto jobs).
# The passes only move and merge collectives: every step's gradients must be bitwise those without them.
PASS_JOBS = {
    "fully_shard-inductor": "passes-off-inductor",
    "fully_shard-inductor-keep-unsharded": "passes-off-inductor-keep-unsharded",
    "block-inductor": "passes-off-inductor",
    "manual-no-reorder-inductor": "passes-off-inductor",
    "no-buckets-reorder-inductor-keep-unsharded": "passes-off-inductor-keep-unsharded",
    "linear_7x5-inductor": "linear_7x5-passes-off-inductor",  # uneven shards: 5 rows over 2 ranks, padded
    "replicate-inductor": "replicate-passes-off-inductor",  # all-reduces in 64 KiB byte buckets, one in flight
}

TWO_RANK_JOBS = {
    "fully_shard-eager": ("llama", "simplefsdp", EAGER),
    "fully_shard-inductor": ("llama", "simplefsdp", INDUCTOR),
    "fully_shard-inductor-keep-unsharded": ("llama", "simplefsdp", {**INDUCTOR, **KEEP_UNSHARDED}),
    "passes-off-inductor": ("llama", "simplefsdp", PASSES_OFF),
    "passes-off-inductor-keep-unsharded": ("llama", "simplefsdp", {**PASSES_OFF, **KEEP_UNSHARDED}),
    "block-inductor": ("llama", "simplefsdp", {**INDUCTOR, "buckets": "block"}),
    "manual-no-reorder-inductor": ("llama", "simplefsdp", {**INDUCTOR, "buckets": MANUAL_PLAN, "reorder": False}),
    "no-buckets-reorder-inductor-keep-unsharded": (
        "llama", "simplefsdp", {**INDUCTOR, **KEEP_UNSHARDED, "buckets": None}),
    "replicate-eager": ("llama", "simplefsdp", {**EAGER, "mode": "replicate"}),
    "replicate-inductor": (
        "llama", "simplefsdp", {**INDUCTOR, "mode": "replicate", "buckets": "block", "memory_budget": 2**17}),
    "replicate-passes-off-inductor": ("llama", "simplefsdp", {**PASSES_OFF, "mode": "replicate"}),
    "fully_shard-aot_eager-adamw": ("llama", "simplefsdp", {"backend": "aot_eager", **ADAMW}),
    "fsdp2-adamw": ("llama", "fsdp2", ADAMW),
    "fully_shard-eager-bf16-adamw": ("llama", "simplefsdp", {**EAGER, "param_dtype": torch.bfloat16, **ADAMW}),
    "fully_shard-aot_eager-bf16-adamw": (
        "llama", "simplefsdp", {"backend": "aot_eager", "param_dtype": torch.bfloat16, **ADAMW}),
    **{
        f"{scenario}-{name}": (scenario, "simplefsdp", options)
        for scenario in ("linear_7x5", "tiny_first_dim", "tied_llama", "frozen_layer", "buffer")
        for name, options in (("eager", EAGER), ("inductor", INDUCTOR))
    },
    "graph_break-inductor": ("graph_break", "simplefsdp", INDUCTOR),
    # each block's frames compiled once for all nine (aot_eager: Dynamo's frames are the point, not Inductor's kernels)
    "graph_break_in_each_block-aot_eager": ("graph_break_in_each_block", "simplefsdp", {"backend": "aot_eager"}),
    "routed_experts-inductor": ("routed_experts", "simplefsdp", INDUCTOR),
    # the whole graph, beside the default (each block's compute compiled once; "tied_llama" ties weights outside
    # the blocks)
    "llama-whole-graph-inductor": ("llama", "simplefsdp", {**INDUCTOR, "compile_blocks_once": False}),
    "linear_7x5-passes-off-inductor": ("linear_7x5", "simplefsdp", PASSES_OFF),
}
HYBRID = {"mode": "hybrid_shard", "mesh_shape": (2, 2)}
FOUR_RANK_JOBS = {
    "hybrid_shard-eager": ("llama", "simplefsdp", {**EAGER, **HYBRID}),
    "hybrid_shard-inductor": ("llama", "simplefsdp", {**INDUCTOR, **HYBRID}),
    # the (1, 8) scale leaves shard coordinate 1 of each replica an empty shard; the (3, 8) projection splits 2 + 1
    "tiny_first_dim-hybrid_shard-eager": ("tiny_first_dim", "simplefsdp", {**EAGER, **HYBRID}),
    "tiny_first_dim-hybrid_shard-inductor": ("tiny_first_dim", "simplefsdp", {**INDUCTOR, **HYBRID}),
}
JOBS = {**{name: (2, job) for name, job in TWO_RANK_JOBS.items()},
        **{name: (4, job) for name, job in FOUR_RANK_JOBS.items()}}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """Per job, the result of every rank (rank order)."""
    out = {}
    for world, jobs in ((2, TWO_RANK_JOBS), (4, FOUR_RANK_JOBS)):
        per_rank = run_on_ranks(world, run_jobs, list(jobs.values()))
        out.update({name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(jobs)})
    return out


SIMPLEFSDP_JOBS = [name for name, (_, (_, wrapper, _)) in JOBS.items() if wrapper == "simplefsdp"]
REFERENCE_JOBS = [name for name in SIMPLEFSDP_JOBS if JOBS[name][1][2].get("optimizer", "sgd") == "sgd"]


@pytest.mark.parametrize("job", REFERENCE_JOBS)
def test_matches_single_process_reference(results, job):
    """Losses and parameter updates (``p_final - p_init``: the parameters' own size would hide errors)
    within fp32 rounding of one process training the global batch."""
    world, (scenario, _, _) = JOBS[job]
    ranks = results[job]
    # With equal local batches the global mean loss is the mean of the rank losses.
    losses = [sum(rank["losses"][step] for rank in ranks).item() / world for step in range(len(ranks[0]["losses"]))]
    worst = assert_matches_reference(scenario, world, losses, [rank["params"] for rank in ranks])
    print(f"{job}: largest update difference is {worst:.3f} of its bound")


@pytest.mark.parametrize("job", SIMPLEFSDP_JOBS)
def test_parameters_and_gradients_are_sharded_dtensors(results, job):
    world, (scenario, _, options) = JOBS[job]
    mode = options.get("mode", "fully_shard")
    expected = {"fully_shard": ("S(0)",), "replicate": ("R",), "hybrid_shard": ("R", "S(0)")}[mode]
    unwrapped = build(scenario)
    for rank in results[job]:
        assert rank["param_is_dtensor"]
        assert rank["state_dict_keys"] == list(unwrapped.state_dict())
        for name, param in unwrapped.named_parameters():
            assert rank["param_placements"][name] == expected
            if param.requires_grad:
                assert rank["grad_placements"][name] == ("DTensor", expected), name
            else:
                assert rank["grad_placements"][name] is None, f"frozen {name} got a gradient"


@pytest.mark.parametrize("job", PASS_JOBS)
def test_passes_leave_numerics_bitwise_unchanged(results, job):
    for ours, without in zip(results[job], results[PASS_JOBS[job]]):
        assert ours["grad_digests"] == without["grad_digests"]  # every step's gradient shards, bitwise
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], without["losses"]))
        assert all(torch.equal(ours["params"][n], without["params"][n]) for n in without["params"])


def test_blocks_compiled_once_are_bitwise_the_whole_graph(results):
    """A block's compute in a region (the default) runs the ops of the whole graph in the same order (Inductor fuses
    within each block alike): every step's gradient shards, losses and parameters are bitwise the whole-graph
    path's."""
    for ours, reference in zip(results["fully_shard-inductor"], results["llama-whole-graph-inductor"]):
        assert ours["grad_digests"] == reference["grad_digests"]
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], reference["losses"]))
        assert all(torch.equal(ours["params"][n], reference["params"][n]) for n in reference["params"])


def test_aot_eager_is_bitwise_fsdp2_eager(results):
    """The same ops in the same order as FSDP2 eager, with AdamW on DTensors."""
    for ours, theirs in zip(results["fully_shard-aot_eager-adamw"], results["fsdp2-adamw"]):
        assert ours["grad_digests"] == theirs["grad_digests"]  # every step's gradient shards, bitwise
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
        assert all(torch.equal(ours["params"][n], theirs["params"][n]) for n in theirs["params"])


def test_bf16_mixed_precision_compiles_bitwise_like_eager(results):
    """bf16 compute with fp32 master parameters: the compiled graphs cast where eager casts.

    Against FSDP2's bf16 there is no bitwise check (its first forward already differs in the last bits) and no
    useful bound (bf16 rounds each op's output to 2^-8; across a forward+backward that bounds nothing).
    """
    for compiled, eager, fp32 in zip(results["fully_shard-aot_eager-bf16-adamw"],
                                     results["fully_shard-eager-bf16-adamw"], results["fully_shard-aot_eager-adamw"]):
        assert compiled["grad_digests"] == eager["grad_digests"]
        assert all(torch.equal(a, b) for a, b in zip(compiled["losses"], eager["losses"]))
        for name, param in eager["params"].items():
            assert compiled["params"][name].dtype == torch.float32  # fp32 master parameters
            assert torch.equal(compiled["params"][name], param), name
        assert not torch.equal(compiled["losses"][0], fp32["losses"][0])  # param_dtype took effect


def test_tied_weights_stay_tied(results):
    assert all(rank["tied"] for job in ("tied_llama-eager", "tied_llama-inductor") for rank in results[job])


def test_buffers_come_from_rank_zero(results):
    expected = build("buffer").offset
    for job in ("buffer-eager", "buffer-inductor"):
        assert all(torch.equal(rank["buffers"]["offset"], expected) for rank in results[job])


def test_graph_break_warns_once_naming_it(results):
    for rank in results["graph_break-inductor"]:
        assert len(rank["warnings"]) == 1
        assert "graph_break" in rank["warnings"][0] or "graph break" in rank["warnings"][0].lower()


def test_sizes_read_with_tolist_compile_into_one_graph(results):
    """Experts' sizes read with ``.tolist()`` are traced as values known at run time, not a graph break: every rank
    runs the same graphs whatever its data routes where (after a break, each rank's frames were compiled for its own
    sizes, and JetMoE's ranks ran different collectives). Its losses and updates: ``test_matches_single_process_
    reference``."""
    assert all(rank["warnings"] == [] for rank in results["routed_experts-inductor"])
