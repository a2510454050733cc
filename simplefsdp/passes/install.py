"""Our passes as one Inductor ``post_grad_custom_post_pass``, scoped to one compiled model (other models compiled in
the process are unaffected); ``OverlapPasses.stages`` is the passes' one code path, for Inductor and ``inspect``."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from simplefsdp.ir.hardware import HardwareProfile, get_profile
from simplefsdp.ir.schedule import COLLECTIVE_OPS, Schedule, read_schedule
from simplefsdp.passes.auto_buckets import plan_auto_buckets
from simplefsdp.passes.bucket_apply import apply_buckets
from simplefsdp.passes.bucket_plan import BucketMode, BucketPlan, plan_buckets
from simplefsdp.passes.dead_gathers import drop_dead_gathers, plan_dead_gathers
from simplefsdp.passes.gloo_collectives import apply_gloo_collectives, plan_gloo_collectives
from simplefsdp.passes.rank_guard import insert_agreement
from simplefsdp.passes.reorder import ReorderPlan, apply_reorder, plan_reorder

_SOURCES = sorted(Path(__file__).parent.glob("*.py")) + sorted((Path(__file__).parent.parent / "ir").glob("*.py"))


@dataclass(frozen=True)
class PassStage:
    """One graph after a step of the passes (``"traced"``, ``"bucketed"``, ``"gloo"``: gloo's reduce-scatters as
    all-to-alls and all-gathers as broadcasts, ``"reordered"``) and the plan it applied."""
    name: str
    schedule: Schedule
    plan: BucketPlan | ReorderPlan | tuple[str, ...] | None


class OverlapPasses(CustomGraphPass):
    """Bucket then reorder one graph, in place; ``plans`` collects each compiled graph's (bucket, reorder) plans.
    ``blocks``: the repeated blocks (``bucket_plan.find_blocks``); ``groups``: the data-parallel process groups whose
    collectives alone are bucketed and moved (empty: all); ``agree_over``: the process groups of the mesh's dimensions:
    non-empty, each graph checks before its first collective that every rank planned the same (``rank_guard.py``)."""

    def __init__(self, buckets: BucketMode = "auto", reorder: bool = True, prefetch: int = 1,
                 memory_budget: int | None = None, hardware: str | HardwareProfile = "h100",
                 blocks: Sequence[str] = (), groups: Sequence[str] = (), agree_over: Sequence[str] = ()) -> None:
        self.buckets, self.reorder, self.prefetch = buckets, reorder, prefetch
        self.memory_budget, self.hardware = memory_budget, hardware
        self.blocks, self.groups, self.agree_over = tuple(blocks), tuple(groups), tuple(agree_over)
        self.plans: list[tuple[BucketPlan | None, ReorderPlan | None]] = []

    def __call__(self, graph: fx.Graph) -> None:
        if not any(str(node.target) in COLLECTIVE_OPS for node in graph.nodes):  # a block compiled once: compute only
            return
        stages = list(self.stages(graph.owning_module, graph_phase(graph)))
        plans = {stage.name: stage.plan for stage in stages}
        self.plans.append((plans.get("bucketed"), plans.get("reordered")))
        if self.agree_over:
            insert_agreement(graph.owning_module, stages[-1].schedule, self.agree_over)

    def stages(self, gm: fx.GraphModule, phase: str, param_fqns: dict[str, str] | None = None) -> Iterator[PassStage]:
        """Run the passes on ``gm`` in place, yielding its schedule before them (its dead all-gathers dropped) and
        after each pass that is on."""
        if dead := plan_dead_gathers(gm.graph):
            drop_dead_gathers(gm.graph, dead)
            gm.recompile()
        schedule = read_schedule(gm, phase, param_fqns, self.groups)
        yield PassStage("traced", schedule, None)
        if self.buckets is not None:
            bucket_plan = self.plan_buckets(schedule)
            apply_buckets(gm.graph, bucket_plan)
            gm.recompile()
            schedule = read_schedule(gm, phase, param_fqns, self.groups)
            yield PassStage("bucketed", schedule, bucket_plan)
        if lowered := plan_gloo_collectives(schedule):
            apply_gloo_collectives(gm.graph, lowered)
            gm.recompile()
            schedule = read_schedule(gm, phase, param_fqns, self.groups)
            yield PassStage("gloo", schedule, lowered)
        if self.reorder:
            reorder_plan = plan_reorder(schedule, self.prefetch)
            apply_reorder(gm.graph, reorder_plan)
            gm.recompile()
            yield PassStage("reordered", read_schedule(gm, phase, param_fqns, self.groups), reorder_plan)

    def plan_buckets(self, schedule: Schedule) -> BucketPlan:
        if self.buckets == "auto":
            return plan_auto_buckets(schedule, get_profile(self.hardware), self.memory_budget, self.prefetch,
                                     blocks=self.blocks)
        return plan_buckets(schedule, self.buckets, self.blocks, self.memory_budget)

    def uuid(self) -> bytes:
        options = (self.buckets, self.reorder, self.prefetch, self.memory_budget, self.hardware, self.blocks,
                   self.groups, self.agree_over)
        digest = hashlib.sha256(repr(options).encode())
        for path in _SOURCES:
            digest.update(path.read_bytes())
        return digest.digest()


def graph_phase(graph: fx.Graph) -> str:
    """``"backward"`` for a graph that takes output gradients (``tangents_*`` inputs), else ``"forward"``."""
    tangents = any(node.name.startswith("tangents") for node in graph.find_nodes(op="placeholder"))
    return "backward" if tangents else "forward"


def check_no_custom_post_pass(compile_options: dict[str, Any]) -> None:
    """Raise ``ValueError`` if the user's Inductor ``options`` already hold the hook our passes use."""
    if "post_grad_custom_post_pass" in (compile_options.get("options") or {}):
        raise ValueError("options['post_grad_custom_post_pass'] is taken by simplefsdp's bucketing and reordering; "
                         "pass buckets=None, reorder=False to compile with your own pass instead")


def inductor_options(passes: OverlapPasses, compile_options: dict[str, Any]) -> dict[str, Any]:
    """``compile_options`` with ``passes`` added to its Inductor ``options`` (the user's other options kept)."""
    options = {**(compile_options.get("options") or {}), "post_grad_custom_post_pass": passes}
    return {**compile_options, "options": options}
