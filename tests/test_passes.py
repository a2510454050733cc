"""Bucketing and reordering passes on the fake process group (world size 8, one process).

Plans are checked on the schedules of the ``debug`` model (2 layers) traced once
without code generation; the FX rewrites are checked on those graphs; one
Inductor compile checks that the order survives into the generated code.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from torch import nn
from torch._inductor.fx_passes import bucketing
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import compile_sharded
from simplefsdp.ir.capture import capture_graphs
from simplefsdp.ir.hardware import get_profile
from simplefsdp.ir.schedule import pinned, read_schedule
from simplefsdp.ir.signature import collective_lines
from simplefsdp.models.llama import build_model, get_config
from simplefsdp.passes.auto_buckets import block_or_module, module_names, plan_auto_buckets
from simplefsdp.passes.bucket_plan import BUCKETED_KINDS, bucketable, find_blocks, group_collectives, plan_buckets
from simplefsdp.passes import inductor_internals
from simplefsdp.passes.inductor_internals import pin_order
from simplefsdp.passes.install import OverlapPasses
from simplefsdp.passes.reorder import plan_reorder
from simplefsdp.runtime.fake_world import fake_world
from simplefsdp.runtime.rank_agreement import agreement_groups
from simplefsdp.runtime.replicate_compute import ReplicateComputation
from simplefsdp.runtime.sharding import shard_parameters
from scenarios import TwoLinears

LAYERS = get_config("debug").n_layers
TOKENS = (2, 16)
MANUAL = [["tok_embeddings"], ["layers.0", "layers.1"], ["norm", "output"]]
BLOCKS = find_blocks(build_model("debug"))


def traced(reshard_after_forward: bool, model: nn.Module | None = None, inputs: tuple | None = None,
           mode: str = "fully_shard"):
    """The forward and backward graphs (min-cut partitioned as Inductor) of ``model`` (default: debug) on 8 fake
    ranks."""
    torch.manual_seed(0)
    model = model or build_model("debug")
    replicate = ReplicateComputation(None, None, reshard_after_forward)
    shard_parameters(model, init_device_mesh("cpu", (8,)), mode, replicate)
    torch._dynamo.reset()
    graphs = capture_graphs(model, inputs or (torch.randint(0, 256, TOKENS),), fused_attention=False)
    return graphs, read_schedule(graphs.forward, "forward"), read_schedule(graphs.backward, "backward")


@pytest.fixture(scope="module")
def world():
    """One fake world of 8 ranks for the whole module (the rewrites look its process group up)."""
    with fake_world(8):
        yield


@pytest.fixture(scope="module")
def resharded(world):
    return traced(reshard_after_forward=True)


@pytest.fixture(scope="module")
def kept(world):
    return traced(reshard_after_forward=False)


def kinds(plan) -> list[tuple[str, str]]:
    return [(bucket.kind, bucket.name) for bucket in plan.buckets]


def collectives(graph: torch.fx.Graph, kind: str) -> int:
    prefix = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[kind]
    return sum(node.op == "call_function" and str(node.target).startswith(f"_c10d_functional.{prefix}")
               for node in graph.nodes)


def test_block_plan_has_one_bucket_per_layer_plus_head_and_tail(resharded):
    _, forward, backward = resharded
    layers = [f"layers.{i}" for i in range(LAYERS)]
    assert BLOCKS == tuple(layers)
    assert kinds(plan_buckets(forward, "block", BLOCKS)) == [("all_gather", n) for n in ["head", *layers, "tail"]]
    # The backward re-gathers every bucket but the embedding's: its backward never reads the weight.
    backward_plan = plan_buckets(backward, "block", BLOCKS)
    reversed_layers = layers[::-1]
    assert [n for k, n in kinds(backward_plan) if k == "all_gather"] == ["tail", *reversed_layers]
    assert [n for k, n in kinds(backward_plan) if k == "reduce_scatter"] == ["tail", *reversed_layers, "head"]
    tail = next(b for b in backward_plan.buckets if b.kind == "reduce_scatter" and b.name == "tail")
    assert tail.owners == ("output", "norm")


def test_replicate_all_reduces_go_in_byte_sized_buckets_one_in_flight_behind_compute(world):
    graphs, _, backward = traced(False, mode="replicate")
    all_reduces = [n.collective.bytes for n in backward.collectives() if n.collective.kind == "all_reduce"]
    budget = sum(all_reduces) // 2  # buckets of at most a quarter of the gradients' bytes
    passes = OverlapPasses("block", memory_budget=budget, blocks=BLOCKS)
    stages = {stage.name: stage for stage in passes.stages(graphs.backward, "backward")}
    buckets = stages["bucketed"].plan.buckets
    assert len(buckets) >= 4 and all(b.kind == "all_reduce" for b in buckets)
    sizes = [sum(backward.node(name).collective.bytes for name in b.collectives) for b in buckets]
    assert all(size <= budget // 2 or len(b.collectives) == 1 for size, b in zip(sizes, buckets)), sizes
    assert sum(len(b.collectives) for b in buckets) == len(all_reduces)

    def overlap(schedule) -> tuple[int, list[int]]:
        """The most all-reduces in flight at once, and the compute nodes run while each one is in flight."""
        in_flight, most, computes = {}, 0, []
        for node in schedule.nodes:
            if node.kind == "collective":
                in_flight[node.name] = 0
            elif node.kind == "wait":
                computes.append(in_flight.pop(node.waits_for))
            real = node.kind == "compute" and node.alias_of is None
            in_flight = {name: done + real for name, done in in_flight.items()}
            most = max(most, len(in_flight))
        return most, computes

    assert overlap(backward) == (1, [0] * len(all_reduces))  # traced: each wait right after its all-reduce
    most, computes = overlap(stages["reordered"].schedule)
    # Each bucket's wait sinks to the next bucket's issue: one in flight, hidden behind the next gradients' compute.
    assert most == 1 and all(computes[:-1]) and len(computes) == len(buckets), computes


def test_manual_and_no_plans(resharded):
    _, forward, _ = resharded
    plan = plan_buckets(forward, MANUAL)
    assert kinds(plan) == [("all_gather", "tok_embeddings"), ("all_gather", "layers.0+layers.1"),
                           ("all_gather", "norm+output")]
    assert len(plan.buckets[1].collectives) == 18
    assert plan_buckets(forward, None).buckets == ()


def test_plan_prints_buckets_and_owners(resharded):
    _, forward, _ = resharded
    text = str(plan_buckets(forward, MANUAL))
    assert text.splitlines()[0] == "forward: 3 bucket(s)"
    assert "  all_gather norm+output: 2 collective(s) [norm, output]" in text


def test_auto_plan_merges_whole_units_within_the_budget(resharded):
    _, forward, backward = resharded
    h100 = get_profile("h100")
    for schedule in (forward, backward):
        block = plan_buckets(schedule, "block", BLOCKS)
        modules = group_collectives(schedule, module_names(bucketable(schedule), BLOCKS))
        gradients = group_collectives(schedule, block_or_module(bucketable(schedule, BUCKETED_KINDS), BLOCKS))
        auto = plan_auto_buckets(schedule, h100, blocks=BLOCKS)
        assert sorted(c for b in auto.buckets for c in b.collectives) == sorted(
            c for b in block.buckets for c in b.collectives)
        for bucket in auto.buckets:  # all-gathers merge whole module units, reduce-scatters whole blocks and modules
            units = modules if bucket.kind == "all_gather" else gradients
            parts = [b for b in units.buckets if b.kind == bucket.kind and b.name in bucket.name.split("+")]
            assert tuple(c for b in parts for c in b.collectives) == bucket.collectives
        unmerged = plan_auto_buckets(schedule, h100, memory_budget=1, blocks=BLOCKS)
        assert [b for b in kinds(unmerged) if b[0] == "all_gather"] == [
            b for b in kinds(modules) if b[0] == "all_gather"]
        assert [b for b in kinds(unmerged) if b[0] == "reduce_scatter"] == [
            b for b in kinds(gradients) if b[0] == "reduce_scatter"]
    units = group_collectives(forward, module_names(bucketable(forward), BLOCKS))
    first_layer = [name for kind, name in kinds(units) if name.startswith("layers.0.")]
    assert first_layer == ["layers.0.attention_norm", "layers.0.attention", "layers.0.ffn_norm",
                           "layers.0.feed_forward"]
    # With matmuls much slower than communication and a roomy budget, everything after the first attention's
    # matmuls hides behind them in one bucket; the lookup before them is memory-bound and hides no merged gather.
    slow_matmuls = dataclasses.replace(h100, flops_per_s={"float32": 1e6})
    merged = plan_auto_buckets(forward, slow_matmuls, memory_budget=1 << 40, blocks=BLOCKS)
    assert [name for _, name in kinds(merged)][:3] == [
        "tok_embeddings", "layers.0.attention_norm", "layers.0.attention"]
    assert len(merged.buckets) == 4 and len(merged.buckets[-1].collectives) == 15


def test_auto_plan_leaves_a_collective_alone_where_copying_it_into_a_bucket_costs_more_than_it_saves(resharded):
    """A lone reduce-scatter works on its gradient where it lies; merged, the gradient is copied into the bucket's
    buffer. The output layer's gradient joins the norm's where a copy costs less than a collective's latency."""
    _, _, backward = resharded
    h100 = get_profile("h100")
    output = next(node.name for node in bucketable(backward)
                  if node.fqn == "output" and node.collective.kind == "reduce_scatter")

    def output_bucket(hardware) -> tuple[str, ...]:
        plan = plan_auto_buckets(backward, hardware, blocks=BLOCKS)
        return next(bucket.owners for bucket in plan.buckets if output in bucket.collectives)

    assert output_bucket(h100) == ("output", "norm")
    # The output layer's gradient, (256 x 64) fp32: read and written once at 1 MB/s, far over a 10 us latency.
    assert output_bucket(dataclasses.replace(h100, memory_bandwidth=1e6)) == ("output",)


def test_reorder_prefetches_each_bucket_behind_the_previous(resharded):
    graphs, _, _ = resharded
    forward = copy.deepcopy(graphs.forward)
    OverlapPasses("block", reorder=False, blocks=BLOCKS)(forward.graph)
    bucketed = read_schedule(forward, "forward")
    all_gathers = [n.name for n in bucketed.collectives() if n.collective.kind == "all_gather"]
    waits = {n.waits_for: n.name for n in bucketed.nodes if n.kind == "wait"}
    # issued once the previous bucket is copied out of its buffer (a single parameter's: once waited for)
    copied_out = {n.inputs[0]: n.name for n in bucketed.nodes if n.op.startswith("simplefsdp.all_gather_copy_out")}
    plan = plan_reorder(bucketed, prefetch=1)
    assert [(p.collective, p.after) for p in plan.prefetches if p.after] == [
        (later, copied_out.get(waits[earlier], waits[earlier])) for earlier, later in zip(all_gathers, all_gathers[1:])]
    assert set(copied_out.values()) & {p.after for p in plan.prefetches}
    # Only the first all-gather may be issued at the start of the graph, before any compute.
    assert {p.collective for p in plan.prefetches if p.after is None} <= {all_gathers[0]}
    two_ahead = plan_reorder(bucketed, prefetch=2)
    assert [p.collective for p in two_ahead.prefetches if p.after] == all_gathers[2:]
    assert plan_reorder(bucketed, prefetch=0).prefetches == ()


def test_pinned_nodes_keep_their_cost_in_the_schedule(resharded):
    """Pinning wraps nodes in Inductor's ``control_deps``; the schedule must still read the op inside."""
    graphs, _, _ = resharded
    for gm, phase in ((graphs.forward, "forward"), (graphs.backward, "backward")):
        before = read_schedule(gm, phase)
        pinned = copy.deepcopy(gm)
        OverlapPasses("block", reorder=True, blocks=BLOCKS)(pinned.graph)
        assert any(str(node.target) == "control_deps" for node in pinned.graph.nodes)
        after = read_schedule(pinned, phase)
        assert sum(n.flops for n in after.nodes) == sum(n.flops for n in before.nodes)
        waited = {n.waits_for for n in after.nodes if n.kind == "wait"}
        assert waited == {n.name for n in after.collectives()}
        ops = {n.op for n in after.nodes}
        assert "control_deps" not in ops and "aten.mm.default" in ops


@pytest.mark.parametrize("reshard", [True, False])
def test_block_buckets_rewrite_the_graphs(resharded, kept, reshard):
    graphs, _, _ = resharded if reshard else kept
    forward, backward = copy.deepcopy(graphs.forward).graph, copy.deepcopy(graphs.backward).graph
    before = collectives(forward, "all_gather"), collectives(backward, "all_gather")
    passes = OverlapPasses("block", reorder=True, blocks=BLOCKS)
    passes(forward)
    passes(backward)
    assert collectives(forward, "all_gather") == LAYERS + 2
    assert collectives(backward, "reduce_scatter") == LAYERS + 2
    assert collectives(backward, "all_gather") == (LAYERS + 1 if reshard else 0)
    assert before[0] > LAYERS + 2
    forward.lint()
    backward.lint()


def test_buckets_alike_are_traced_once_into_the_same_graph(resharded, monkeypatch):
    graphs, _, _ = resharded
    trace, traced = bucketing._trace, []
    monkeypatch.setattr(bucketing, "_trace", lambda fn, inputs: traced.append(fn) or trace(fn, inputs))
    codes, traces = [], []
    for reuse in (True, False):
        if not reuse:  # every bucket traced, as Inductor's bucketing does on its own
            monkeypatch.setattr(inductor_internals, "_signature", lambda fn, inputs: None)
        traced.clear()
        backward = copy.deepcopy(graphs.backward)
        OverlapPasses("block", reorder=False, blocks=BLOCKS)(backward.graph)
        codes.append(backward.code)
        traces.append(len(traced))
    assert codes[0] == codes[1]
    # merged: an all-gather and a reduce-scatter bucket per layer and for the tail (norm, output); the head holds one
    # parameter. With reuse, the later layers' buckets of each kind are copies of the first layer's trace.
    assert traces[1] == 2 * LAYERS + 2
    assert traces[0] == traces[1] - 2 * (LAYERS - 1)


def test_pass_uuid_follows_options():
    block = OverlapPasses("block").uuid()
    assert block == OverlapPasses("block").uuid()
    assert block != OverlapPasses("block", prefetch=2).uuid()
    assert block != OverlapPasses(MANUAL).uuid()


def linears(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


def test_generated_code_prefetches_each_layer_and_other_models_are_unaffected(world):
    torch.manual_seed(0)
    torch._dynamo.reset()
    # the whole graph, whose generated code runs each matmul in order (a region's code is a function of its own)
    model = compile_sharded(build_model("debug"), buckets="block", prefetch=1, compile_blocks_once=False)
    _, (forward_code, _) = run_and_get_code(lambda: model(torch.randint(0, 256, TOKENS)).sum().backward())
    other = compile_sharded(TwoLinears(), buckets=None, reorder=False, reshard_after_forward=False)
    _, (other_code, _) = run_and_get_code(lambda: other(torch.randn(2, 8)).sum().backward())
    events = re.findall(r"_c10d_functional\.(all_gather_into_tensor(?:_out)?|reduce_scatter_tensor)\.default\(|"
                        r"extern_kernels\.(mm)\(", forward_code)
    events = [collective or matmul for collective, matmul in events]
    per_layer = linears(build_model("debug").layers[0])
    first_matmul = [i for i, event in enumerate(events) if event == "mm"][::per_layer]
    gathers = [i for i, event in enumerate(events) if event.startswith("all_gather")]
    # Bucket k+1 (layer k, then the tail) is issued before the first matmul of bucket k (layer k-1).
    for layer in range(1, LAYERS + 1):
        assert gathers[layer + 1] < first_matmul[layer - 1], (layer, events)
    # Each bucket's buffer is allocated (copy-in) only once the previous bucket is copied out of its own: one buffer
    # in flight, as FSDP2's.
    copies = re.findall(r"simplefsdp\.all_gather_copy_(in|out)\.default\(", forward_code)
    assert len(copies) >= 2 * LAYERS and copies == ["in", "out"] * (len(copies) // 2), copies
    # How many collectives the buckets leave is pinned once, in test_block_buckets_rewrite_the_graphs.
    # The second model compiled in the same process keeps one all-gather per parameter.
    assert len(re.findall(r"all_gather_into_tensor\.default\(", other_code)) == 4
    assert "all_gather_into_tensor_out" not in other_code


def test_first_gather_is_hoisted_above_compute_it_does_not_need(resharded):
    graphs, _, _ = resharded
    # The merged first bucket starts with its own copy-in: it must not be pinned to run after the gather.
    plan = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    forward = copy.deepcopy(graphs.forward)
    passes = OverlapPasses(plan, reorder=True)
    passes(forward.graph)
    forward.graph.lint()
    backward = copy.deepcopy(graphs.backward)
    passes(backward.graph)
    backward.graph.lint()
    hoisted = 0
    for graph_module, (_, reorder) in zip((graphs.forward, graphs.backward), passes.plans):
        bucketed = copy.deepcopy(graph_module)
        OverlapPasses(plan, reorder=False)(bucketed.graph)  # the graph the reorder plan names
        nodes = {node.name: node for node in bucketed.graph.nodes}
        for prefetch in reorder.prefetches:
            if prefetch.after is not None or not prefetch.collective.startswith("all_gather"):
                continue
            needed, stack = set(), [nodes[prefetch.collective]]
            while stack:
                for node in stack.pop().all_input_nodes:
                    if node.name not in needed:
                        needed.add(node.name)
                        stack.append(node)
            assert prefetch.anchor in nodes and prefetch.anchor not in needed, prefetch
            hoisted += 1
    assert hoisted, passes.plans


def test_a_node_reading_a_gathered_bucket_after_its_first_user_stays_out_of_the_copy_out(resharded):
    """Gemma 3n's backward compares a clamped weight with its bounds after the weight's first use. The reorder plan
    took that comparison for the end of the bucket's copy-out: the next gather went after it, behind the compute it was
    pinned before, and the rank guard's pins made a cycle (Inductor's topological sort asserted)."""
    graphs, _, _ = resharded
    backward = copy.deepcopy(graphs.backward)
    OverlapPasses("block", reorder=False, blocks=BLOCKS)(backward.graph)
    copy_out = next(node for node in backward.graph.nodes
                    if str(node.target).startswith("simplefsdp.all_gather_copy_out"))
    weight = next(iter(copy_out.users))
    with backward.graph.inserting_before(backward.graph.output_node()):
        compared = backward.graph.call_function(torch.ops.aten.ge.Scalar, (weight, -1.0))
    backward.recompile()
    schedule = read_schedule(backward, "backward")
    position = {node.name: index for index, node in enumerate(schedule.nodes)}
    plan = plan_reorder(schedule)
    assert compared.name not in {name for sink in plan.sinks for name in sink.nodes}
    assert compared.name not in {prefetch.after for prefetch in plan.prefetches}
    assert any(prefetch.after == copy_out.name for prefetch in plan.prefetches), plan
    assert all(position[prefetch.after] < position[prefetch.anchor] for prefetch in plan.prefetches if prefetch.after)
    OverlapPasses(None, blocks=BLOCKS, agree_over=("0",))(backward.graph)
    backward.graph.lint()  # every node after its inputs, the pins' included


def test_guard_runs_before_every_collective_only_when_asked(resharded):
    """With ``agree_over`` each graph starts with one agreement call holding its collective signature, and every
    collective runs after it; without it (``inspect``) there is none."""
    graphs, _, _ = resharded
    agree_op = torch.ops.simplefsdp.agree_on_collectives.default
    for gm, phase in ((graphs.forward, "forward"), (graphs.backward, "backward")):
        guarded, plain = copy.deepcopy(gm), copy.deepcopy(gm)
        final = list(OverlapPasses("block", blocks=BLOCKS).stages(copy.deepcopy(gm), phase))[-1].schedule
        OverlapPasses("block", blocks=BLOCKS, agree_over=("0",))(guarded.graph)
        OverlapPasses("block", blocks=BLOCKS)(plain.graph)
        assert not any(node.target is agree_op for node in plain.graph.nodes)
        agree = next(node for node in guarded.graph.nodes if node.op != "placeholder")
        assert agree.target is agree_op and agree.args == ("\n".join(collective_lines(final)), "0")
        assert sum(node.target is agree_op for node in guarded.graph.nodes) == 1
        nodes = {node.name: node for node in guarded.graph.nodes}
        schedule = read_schedule(guarded, phase)
        for collective in schedule.collectives():
            assert pinned(nodes[collective.name]) and agree in nodes[collective.name].args[0], collective.name
        assert collective_lines(schedule) == collective_lines(final)
    assert agreement_groups(init_device_mesh("cpu", (8,))) == ()  # the fake group: compile_sharded adds no guard


def test_pinning_a_pinned_node_keeps_its_dependencies(resharded):
    graphs, _, _ = resharded
    forward = copy.deepcopy(graphs.forward)
    nodes = [node for node in forward.graph.nodes if node.op == "call_function"]
    first, second, target = nodes[0], nodes[1], nodes[-2]
    pin_order(forward.graph, {target: [first]})
    pinned_target = next(node for node in forward.graph.nodes if node.name == target.name)
    pin_order(forward.graph, {pinned_target: [second]})
    assert pinned(pinned_target) and pinned_target.args[0] == (first, second)
    forward.graph.lint()
