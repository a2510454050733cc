"""Numerics: sharded training on gloo ranks equals one process training the global batch.

All jobs of one world size run in one launch of ranks (to pay process start-up
and compilation once); each test below checks one job against its reference.
"""

from __future__ import annotations

import pytest
import torch

from ranks import run_on_ranks
from scenarios import build, run_jobs, train_reference

INDUCTOR = {"backend": "inductor"}
EAGER = {"compile": False}
PASSES_OFF = {**INDUCTOR, "buckets": None, "reorder": False}
KEEP_UNSHARDED = {"reshard_after_forward": False}
MANUAL_PLAN = [["tok_embeddings"], ["layers.0", "layers.1"], ["norm", "output"]]
# Passes on, each bucket mode with reorder on and off, resharding on and off (compile_sharded's default is
# buckets="auto", reorder=True, so "fully_shard-inductor" and "...-keep-unsharded" are the auto jobs).
PASS_JOBS = {
    "fully_shard-inductor": "passes-off-inductor",
    "fully_shard-inductor-keep-unsharded": "passes-off-inductor-keep-unsharded",
    "block-inductor": "passes-off-inductor",
    "block-no-reorder-inductor-keep-unsharded": "passes-off-inductor-keep-unsharded",
    "manual-no-reorder-inductor": "passes-off-inductor",
    "no-buckets-reorder-inductor-keep-unsharded": "passes-off-inductor-keep-unsharded",
    "linear_7x5-inductor": "linear_7x5-passes-off-inductor",  # uneven shards: 5 rows over 2 ranks, padded
}

TWO_RANK_JOBS = {
    "fully_shard-eager": ("llama", "simplefsdp", EAGER),
    "fully_shard-inductor": ("llama", "simplefsdp", INDUCTOR),
    "fully_shard-inductor-keep-unsharded": ("llama", "simplefsdp", {**INDUCTOR, **KEEP_UNSHARDED}),
    "passes-off-inductor": ("llama", "simplefsdp", PASSES_OFF),
    "passes-off-inductor-keep-unsharded": ("llama", "simplefsdp", {**PASSES_OFF, **KEEP_UNSHARDED}),
    "block-inductor": ("llama", "simplefsdp", {**INDUCTOR, "buckets": "block"}),
    "block-no-reorder-inductor-keep-unsharded": (
        "llama", "simplefsdp", {**INDUCTOR, **KEEP_UNSHARDED, "buckets": "block", "reorder": False}),
    "manual-no-reorder-inductor": ("llama", "simplefsdp", {**INDUCTOR, "buckets": MANUAL_PLAN, "reorder": False}),
    "no-buckets-reorder-inductor-keep-unsharded": ("llama", "simplefsdp", {**INDUCTOR, **KEEP_UNSHARDED, "buckets": None}),
    "replicate-eager": ("llama", "simplefsdp", {**EAGER, "mode": "replicate"}),
    "replicate-inductor": ("llama", "simplefsdp", {**INDUCTOR, "mode": "replicate"}),
    "fully_shard-aot_eager": ("llama", "simplefsdp", {"backend": "aot_eager"}),
    "fsdp2": ("llama", "fsdp2", {}),
    "fully_shard-aot_eager-bf16": ("llama", "simplefsdp", {"backend": "aot_eager", "param_dtype": torch.bfloat16}),
    "fsdp2-bf16": ("llama", "fsdp2", {"param_dtype": torch.bfloat16}),
    **{
        f"{scenario}-{name}": (scenario, "simplefsdp", options)
        for scenario in ("linear_7x5", "tiny_first_dim", "tied_llama", "frozen_layer", "buffer")
        for name, options in (("eager", EAGER), ("inductor", INDUCTOR))
    },
    "graph_break-inductor": ("graph_break", "simplefsdp", INDUCTOR),
    "linear_7x5-passes-off-inductor": ("linear_7x5", "simplefsdp", PASSES_OFF),
}
FOUR_RANK_JOBS = {
    "hybrid_shard-eager": ("llama", "simplefsdp", {**EAGER, "mode": "hybrid_shard", "mesh_shape": (2, 2)}),
    "hybrid_shard-inductor": ("llama", "simplefsdp", {**INDUCTOR, "mode": "hybrid_shard", "mesh_shape": (2, 2)}),
}
JOBS = {**{name: (2, job) for name, job in TWO_RANK_JOBS.items()}, **{name: (4, job) for name, job in FOUR_RANK_JOBS.items()}}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """Per job, the result of every rank (rank order)."""
    out = {}
    for world, jobs in ((2, TWO_RANK_JOBS), (4, FOUR_RANK_JOBS)):
        per_rank = run_on_ranks(world, run_jobs, list(jobs.values()))
        out.update({name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(jobs)})
    return out


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative difference ``|actual - expected| / |expected|``."""
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


SIMPLEFSDP_JOBS = [name for name, (_, (_, wrapper, _)) in JOBS.items() if wrapper == "simplefsdp" and "bf16" not in name]


@pytest.mark.parametrize("job", SIMPLEFSDP_JOBS)
def test_matches_single_process_reference(results, job):
    world, (scenario, _, _) = JOBS[job]
    ranks = results[job]
    ref_losses, ref_params = train_reference(scenario, world)
    # With equal local batches the global mean loss is the mean of the rank losses.
    losses = [sum(rank["losses"][step] for rank in ranks).item() / world for step in range(len(ref_losses))]
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(loss - ref) <= 1e-5 * abs(ref), f"step {step}: loss {loss} vs reference {ref}"
    for rank in ranks:
        assert rank["params"].keys() == ref_params.keys()
        for name, ref in ref_params.items():
            assert relative_difference(rank["params"][name], ref) <= 1e-5, name


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
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], without["losses"]))
        assert all(torch.equal(ours["params"][n], without["params"][n]) for n in without["params"])


def test_losses_bitwise_equal_fsdp2_eager(results):
    for ours, theirs in zip(results["fully_shard-aot_eager"], results["fsdp2"]):
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
        assert all(torch.equal(ours["params"][n], theirs["params"][n]) for n in theirs["params"])


def test_bf16_mixed_precision_matches_fsdp2(results):
    for ours, theirs in zip(results["fully_shard-aot_eager-bf16"], results["fsdp2-bf16"]):
        for a, b in zip(ours["losses"], theirs["losses"]):
            assert abs(a.item() - b.item()) <= 1e-2 * abs(b.item())
        for name, param in theirs["params"].items():
            assert ours["params"][name].dtype == torch.float32  # fp32 master parameters
            assert relative_difference(ours["params"][name], param) <= 1e-2, name


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
