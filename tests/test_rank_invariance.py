"""Every rank of a group plans the same collectives: the plans are a pure function of rank-invariant facts.

On a fake process group (one process), each zoo model and Llama 3 8B is traced on the rank coordinates of worlds of
3 and 8 (8 leaves the ranks past a small first dimension empty shards; 3 splits most first dimensions unevenly; a
world of 4 holds no kind of shard these two lack, and its 2 or 3 traces per model cost the suite 2 minutes; world 2
runs for real in ``test_zoo``, whose compiled graphs carry the rank guard, which raises when the two ranks' plans
differ), the passes run with default options, and the collective signatures of the graphs that would run must be
equal. Ranks whose local shards have the same shapes trace the same graph (DTensor's pads and narrows depend on the
coordinate only through the shard's size), so one rank per such class is traced (``plan_signatures.ranks_by_shards``):
1 to 4 traces per world instead of up to 8. A world that divides every dimension (Llama 3 8B at 8) has one class:
traced once, nothing to compare. ``hybrid_shard`` also runs on a model with empty shards; there a replica group's
all-reduce holds its own coordinate's shard, so only its element count may differ between coordinates.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from plan_signatures import plan_signatures, ranks_by_shards
from simplefsdp.ir.hardware import H100
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.mixed_precision import MixedPrecision
from zoo import ZOO, build, logits

WORLDS = (3, 8)


def _assert_every_rank_plans_alike(model, inputs, world: int, shards: int | None = None, **options) -> int:
    """Trace one rank of each class and compare; returns how many classes were compared."""
    classes = ranks_by_shards(model, world, shards)
    signatures = [tuple(tuple(_as_other_coordinates_plan(line, shards) for line in lines)
                        for lines in plan_signatures(model, inputs, world, ranks[0], **options)) for ranks in classes]
    for ranks, signature in zip(classes[1:], signatures[1:]):
        for phase, mine, theirs in zip(("forward", "backward"), signatures[0], signature):
            difference = next((f"{a!r} vs {b!r}" for a, b in zip(mine, theirs) if a != b),
                              f"{len(mine)} vs {len(theirs)} collectives")
            assert mine == theirs, (f"world {world}: ranks {classes[0]} and {ranks} plan different {phase} "
                                    f"collectives: {difference}")
    return len(classes)


def _as_other_coordinates_plan(line: str, shards: int | None) -> str:
    """``line`` as the ranks of another shard coordinate must plan it too. A replica group (``hybrid_shard``'s
    all-reduce, groups of stride ``shards``) holds the ranks of one shard coordinate: its element count is their own
    uneven shard's, on which only its members must agree; the plan around it is priced by the padded shard
    (``bucket_plan.planned_bytes``), so its kind, order, dtype and module must still match."""
    if shards is None or f"/stride{shards} " not in line:
        return line
    return re.sub(r"elements=\d+", "elements=<this coordinate's shard>", line)


def _output_sum(output, *inputs) -> torch.Tensor:
    return logits(output).float().sum()


# the zoo's families, one model each: Llama, Qwen2, Gemma 3, BERT, DeepSeek-V3 and Falcon shard as Mixtral's and
# GPT-2's layers do (DeepSeek-V3's experts stacked, its router of 3 rows, as Mixtral's), a ResNet's convolutions and
# batch norms as the batch-norm Sequential's
FAMILIES = [name for name in ZOO if name not in ("llama", "qwen2", "gemma3", "bert", "deepseek_v3", "falcon", "resnet")]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_rank_of_a_zoo_model_plans_the_same_collectives(name):
    model = build(name, layers=2)  # every block of a model shards alike: two show the plan between repeats
    inputs, _ = ZOO[name].batch(0, 2)
    compared = [_assert_every_rank_plans_alike(model, inputs, world, loss_fn=_output_sum) for world in WORLDS]
    assert max(compared) > 1, f"every world split {name}'s parameters evenly: no two plans were compared"


def test_every_rank_of_a_hybrid_shard_model_with_empty_shards_plans_the_same_collectives():
    """A (2, 2) mesh: shard coordinate 1 holds an empty shard of the (1,) gain and 1 of the 3 rows of the projection.
    It is traced in this process after coordinate 0, so it must trace with its own mesh, not one DTensor cached."""
    name = "fewer_elements_than_ranks"
    model = build(name)
    inputs, _ = ZOO[name].batch(0, 2)
    assert _assert_every_rank_plans_alike(model, inputs, 4, 2, mode="hybrid_shard", loss_fn=_output_sum) > 1


@pytest.mark.parametrize("mode", ["fully_shard", "hybrid_shard"])
def test_every_rank_of_llama3_8b_plans_the_same_collectives(mode):
    """Two of its 32 layers (every layer shards alike), bf16 gathers and fp32 reductions, h100 pricing (inspect's
    defaults); hybrid_shard on (2, 3) (nodes of 3 ranks: 3 splits its dimensions unevenly), whose groups differ
    between coordinates."""
    with torch.device("meta"):
        model = build_model("llama3-8b", n_layers=2)
    tokens = torch.zeros(1, 128, dtype=torch.long, device="meta")
    hardware = H100 if mode == "fully_shard" else dataclasses.replace(H100, devices_per_node=3)
    compared = [_assert_every_rank_plans_alike(model, (tokens,), world, 3 if mode == "hybrid_shard" else None,
                                               mode=mode, hardware=hardware, loss_fn=_output_sum,
                                               mp_policy=MixedPrecision(torch.bfloat16, torch.float32))
                for world in (WORLDS if mode == "fully_shard" else (6,))]
    assert max(compared) > 1, compared

