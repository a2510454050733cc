"""``simplefsdp.inspect`` on the fake process group: schedules and plans of each pass stage, the files it writes
(its command line and bad input: ``test_inspect_cli``)."""

import dataclasses
import json

import networkx as nx
import pytest
import torch
from charts import png_size
from scenarios import TwoLinears
from torch import nn

import simplefsdp
from simplefsdp.ir.hardware import get_profile
from simplefsdp.ir.render import SHRINK, format_bytes
from simplefsdp.ir.schedule import COLLECTIVE, WAIT, read_schedule
from simplefsdp.models.llama import build_model, get_config
from simplefsdp.runtime.mixed_precision import MixedPrecision
from zoo import build

BF16_FP32 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LAYERS = get_config("debug").n_layers


def inspect_debug(mode: str, **options):
    """The whole graph, whose nodes keep each module's name and op (the default's regions: ``test_block_regions``)."""
    torch.manual_seed(0)
    model = build_model("debug")
    tokens = torch.zeros(1, 128, dtype=torch.long)
    return simplefsdp.inspect(model, (tokens,), world_size=8, mode=mode, hardware="h100", mp_policy=BF16_FP32,
                              **{"compile_blocks_once": False, **options})


@pytest.fixture(scope="module")
def fully_sharded():
    """The default passes: auto buckets, reorder, prefetch 1."""
    return inspect_debug("fully_shard")


@pytest.fixture(scope="module")
def traced(fully_sharded):
    return fully_sharded.stage("traced")


def kinds(schedule, kind):
    return [node.collective.kind for node in schedule.collectives() if node.collective.kind == kind]


def test_a_gathers_bytes_group_and_dtype_are_read_from_the_graph(traced):
    # How many collectives the traced graphs hold is pinned once, in test_graphs.py.
    wq = next(node for node in traced.forward.collectives() if node.fqn == "layers.0.attention.wq")
    assert wq.collective.bytes == 64 * 64 * 2 and wq.collective.group_size == 8
    assert wq.collective.dtype == torch.bfloat16


def test_attention_is_traced_as_the_fused_kernel(fully_sharded):
    ops = {node.op for schedule in fully_sharded.schedules for node in schedule.nodes}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops
    assert "aten.bmm.default" not in ops  # no unfused attention matmuls


def test_attention_with_a_mask_is_traced_as_the_memory_efficient_kernel():
    """Hugging Face passes ``scaled_dot_product_attention`` a causal mask under ``torch.compile``. On meta tensors SDPA
    would dispatch to its math, which saves every layer's attention probabilities (heads x tokens² each: SmolLM2's
    layout at 8,192 tokens predicted 134 GiB a rank where its activations take 16); a GPU runs a fused kernel."""
    torch.manual_seed(0)
    report = simplefsdp.inspect(build("llama", layers=2), (torch.zeros(1, 64, dtype=torch.long),), world_size=2,
                                hardware="h100", compile_blocks_once=False)
    ops = {node.op for schedule in report.schedules for node in schedule.nodes}
    assert "aten._scaled_dot_product_efficient_attention.default" in ops
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in ops
    assert "aten.bmm.default" not in ops


def test_schedule_dag_links_each_wait_to_its_collective(fully_sharded):
    for schedule in fully_sharded.schedules:
        assert nx.is_directed_acyclic_graph(schedule.dag)
        for node in schedule.nodes:
            if node.kind == WAIT:
                assert schedule.node(node.waits_for).kind == COLLECTIVE
                assert schedule.dag.has_edge(node.waits_for, node.name)


def test_sharded_param_bytes_and_fqns(fully_sharded):  # of the final graphs: the passes keep the inputs
    model = build_model("debug")
    fqns = {graph_input.param_fqn for graph_input in fully_sharded.forward.inputs if graph_input.param_fqn}
    assert fqns == {name for name, _ in model.named_parameters()}
    # each rank holds dim-0 shards of ceil(rows / 8) rows, fp32
    expected = sum(-(-p.shape[0] // 8) * p[0].numel() * 4 for p in model.parameters())
    assert sum(graph_input.bytes for graph_input in fully_sharded.forward.inputs if graph_input.param_fqn) == expected


def test_reading_a_graph_does_not_change_it():
    from simplefsdp.ir.capture import capture_graphs

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    graphs = capture_graphs(model, (torch.randn(4, 8),))
    before = (graphs.forward.code, [dict(node.meta) for node in graphs.forward.graph.nodes])
    read_schedule(graphs.forward, "forward", graphs.param_fqns)
    assert (graphs.forward.code, [dict(node.meta) for node in graphs.forward.graph.nodes]) == before


def test_inspect_leaves_the_model_alone():
    model = build_model("debug")
    before = {name: param.clone() for name, param in model.named_parameters()}
    simplefsdp.inspect(model, (torch.zeros(1, 16, dtype=torch.long),), world_size=2, mode="replicate")
    for name, param in model.named_parameters():
        assert type(param) is nn.Parameter and torch.equal(param, before[name])


def test_stages_follow_the_passes_that_are_on(fully_sharded, traced):
    assert [stage.name for stage in fully_sharded.stages] == ["traced", "bucketed", "reordered"]
    assert fully_sharded.final is fully_sharded.stage("reordered")
    assert fully_sharded.prediction is fully_sharded.final.prediction
    assert traced.forward_plan is None and traced.backward_plan is None
    with pytest.raises(KeyError, match="no 'bucket' stage; this report has traced, bucketed, reordered"):
        fully_sharded.stage("bucket")
    # the passes hide communication that the traced graphs expose
    assert fully_sharded.prediction.exposed_communication < traced.prediction.exposed_communication


def test_bucketing_merges_collectives_and_reordering_only_moves_them(fully_sharded, traced):
    bucketed, reordered = fully_sharded.stage("bucketed"), fully_sharded.stage("reordered")
    for phase in ("forward", "backward"):
        traced_graph, bucketed_graph, reordered_graph = (getattr(s, phase) for s in (traced, bucketed, reordered))
        assert 0 < len(bucketed_graph.collectives()) < len(traced_graph.collectives())
        plan = getattr(bucketed, f"{phase}_plan")
        assert sum(len(bucket.collectives) for bucket in plan.buckets) == len(traced_graph.collectives())
        assert sorted(n.name for n in reordered_graph.collectives()) == sorted(
            n.name for n in bucketed_graph.collectives())
        assert [n.name for n in reordered_graph.nodes] != [n.name for n in bucketed_graph.nodes]
        assert "all_gather_into_tensor_out" in bucketed_graph.code  # the merged gather into one flat buffer


def first(schedule, predicate) -> int:
    return next(index for index, node in enumerate(schedule.nodes) if predicate(node))


def gather_of_layer(schedule, plan, layer: int) -> int:
    """Where the all-gather bucket holding the first ``layers.<layer>`` parameter is issued (a bucket is named for its
    first module, which may be the previous layer's)."""
    gathers = [bucket for bucket in plan.buckets if bucket.kind == "all_gather"]
    bucket = next(index for index, b in enumerate(gathers) if any(o.startswith(f"layers.{layer}.") for o in b.owners))
    issued = [index for index, node in enumerate(schedule.nodes)
              if node.kind == COLLECTIVE and node.collective.kind == "all_gather"]
    return issued[bucket]


def first_matmul_of_layer(schedule, layer: int) -> int:
    return first(schedule, lambda n: n.op == "aten.mm.default" and n.fqn.startswith(f"layers.{layer}."))


def test_reordering_issues_each_layers_gather_before_the_previous_layers_compute(fully_sharded):
    bucketed, reordered = fully_sharded.stage("bucketed").forward, fully_sharded.stage("reordered").forward
    plan = fully_sharded.stage("bucketed").forward_plan
    for layer in range(1, LAYERS):
        assert gather_of_layer(reordered, plan, layer) < first_matmul_of_layer(reordered, layer - 1)
        assert gather_of_layer(bucketed, plan, layer) > first_matmul_of_layer(bucketed, layer - 1)


def test_summary_tabulates_the_stages_then_the_plans_then_the_final_graphs(fully_sharded, traced):
    summary = fully_sharded.summary()
    lines = summary.splitlines()
    assert lines[1].split() == ["stage", "collectives", "predicted", "step", "exposed", "comm.", "peak", "memory"]
    assert [line.split()[0] for line in lines[2:5]] == ["traced", "bucketed", "reordered"]
    assert lines[2].split()[1] == str(len(traced.forward.collectives()) + len(traced.backward.collectives()))
    plans = fully_sharded.plans()
    assert plans.startswith("bucket plan\nforward: ") and "\nreorder plan\nforward: " in plans
    assert "  all_gather tok_embeddings: 1 collective(s) [tok_embeddings]" in plans
    assert "  reduce_scatter layers.0: " in plans and "issue all_gather_into_tensor_out_1 after " in plans
    assert summary.index(plans) < summary.index("reordered graphs (what runs)\npredicted step")


def test_a_peak_over_the_devices_memory_is_named_with_what_to_shrink(fully_sharded):
    """The final summary says when the predicted peak is over the profile's ``memory_capacity``, and names the fix for
    the category that holds the most at the peak; where the peak fits (equal included), it says nothing."""
    memory = fully_sharded.prediction.memory
    largest = max(memory.peak_by_category.items(), key=lambda item: item[1])[0]

    def summary(capacity: int) -> str:
        return dataclasses.replace(fully_sharded, hardware=dataclasses.replace(
            fully_sharded.hardware, memory_capacity=capacity)).summary()

    summaries = {capacity: summary(capacity) for capacity in (memory.peak_bytes - 1, memory.peak_bytes)}
    line = next(line for line in summaries[memory.peak_bytes - 1].splitlines() if line.startswith("does not fit"))
    assert line.startswith(f"does not fit: the peak is over h100's {format_bytes(memory.peak_bytes - 1)} per device")
    assert line.endswith(f"; {largest} hold the most: {SHRINK[largest]}")
    assert "does not fit" not in summaries[memory.peak_bytes] and "does not fit" not in fully_sharded.summary()


def test_save_writes_each_stage_plans_summaries_png_and_trace(fully_sharded, traced, tmp_path):
    paths = fully_sharded.save(tmp_path)
    stages = ["0-traced", "1-bucketed", "2-reordered"]
    assert sorted(path.name for path in paths) == sorted([
        "backward.py", "forward.py", "plan.txt", "summary.txt", "summary.json", "timeline.png", "trace.json",
        *(f"{phase}.{stage}.py" for phase in ("forward", "backward") for stage in stages),
    ])
    assert (tmp_path / "forward.0-traced.py").read_text() == traced.forward.code
    assert (tmp_path / "backward.1-bucketed.py").read_text() == fully_sharded.stage("bucketed").backward.code
    assert (tmp_path / "forward.py").read_text() == (tmp_path / "forward.2-reordered.py").read_text()
    assert "all_gather_into_tensor_out" in (tmp_path / "forward.py").read_text()
    assert "reduce_scatter_tensor" in (tmp_path / "backward.py").read_text()
    assert (tmp_path / "plan.txt").read_text() == fully_sharded.plans()
    assert png_size(tmp_path / "timeline.png") == (1200, 750)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    communication = [event for event in events if event.get("tid") == 1 and event["ph"] == "X"]
    assert len(communication) == len(fully_sharded.forward.collectives()) + len(fully_sharded.backward.collectives())
    assert (tmp_path / "summary.txt").read_text() == fully_sharded.summary()


def test_hybrid_shard_all_reduces_shards_not_whole_gradients():
    """On a (2 replicas, 4 shards) mesh each gradient is reduce-scattered over the shards first,
    then only its shard is all-reduced over the replicas: a quarter of the bytes, in the reduce dtype."""
    with torch.device("meta"):
        model = build_model("debug")
    report = simplefsdp.inspect(model, (torch.zeros(1, 16, dtype=torch.long),), world_size=8, mode="hybrid_shard",
                     hardware=dataclasses.replace(get_profile("h100"), devices_per_node=4),
                     mp_policy=MixedPrecision(torch.bfloat16, torch.bfloat16), buckets=None, reorder=False)
    backward = report.backward
    reduce_scatters = [n for n in backward.collectives() if n.collective.kind == "reduce_scatter"]
    all_reduces = [n for n in backward.collectives() if n.collective.kind == "all_reduce"]
    assert len(reduce_scatters) == len(all_reduces) == len(list(model.parameters()))
    assert {n.collective.group_size for n in reduce_scatters} == {4}
    assert {n.collective.group_size for n in all_reduces} == {2}
    assert {n.collective.dtype for n in reduce_scatters + all_reduces} == {torch.bfloat16}
    assert 4 * sum(n.collective.bytes for n in all_reduces) == sum(n.collective.bytes for n in reduce_scatters)
    position = {n.name: index for index, n in enumerate(backward.nodes)}
    assert position[all_reduces[0].name] > position[reduce_scatters[0].name]
    # The all-reduces come from no module's code; each is credited to the parameter its input belongs to.
    assert [n.fqn for n in all_reduces] == [n.fqn for n in reduce_scatters]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_one_model_class_can_be_captured_more_often_than_dynamos_per_code_limit():
    from simplefsdp.ir.capture import capture_graphs

    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        graphs = capture_graphs(_Tiny(), (torch.randn(2, 4),), fused_attention=False)
    # the last capture traced the model: its forward holds the linear's matmul
    assert any("mm" in str(node.target) for node in graphs.forward.graph.nodes), graphs.forward.code


def test_inspect_shards_as_compile_sharded_does_casting_float_inputs_to_param_dtype():
    """inspect shards through compile_sharded itself and traces its hooks into the graph, as compile_sharded's
    compiled call does: the fp32 input enters the graph, which casts it to bf16."""
    report = simplefsdp.inspect(TwoLinears(), (torch.randn(8, 8),), world_size=4, mp_policy=BF16_FP32,
                                buckets=None, reorder=False)
    (x,) = [graph_input for graph_input in report.stage("traced").forward.inputs if graph_input.param_fqn is None]
    assert x.bytes == 8 * 8 * torch.float32.itemsize


def test_summary_json_lists_each_stage_with_wire_bytes_tokens_per_second_and_peak(tmp_path):
    report = simplefsdp.inspect(TwoLinears(), (torch.randn(8, 8),), world_size=4, mp_policy=BF16_FP32)
    report.save(tmp_path)
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert [stage["name"] for stage in stages] == ["traced", "bucketed", "reordered"]
    traced = stages[0]
    # 144 parameter elements gathered in bf16, second.weight's 64 gathered again in backward (reshard after
    # forward), 144 reduce-scattered in fp32, over 4 ranks: a ring sends and receives 3/4 of each full buffer.
    assert traced["wire_bytes"] == 2 * 3 / 4 * ((144 + 64) * 2 + 144 * 4)
    assert traced["collectives"] == 9 and stages[1]["collectives"] < 9
    for stage, expected in zip(stages, report.stages):
        assert stage["step_seconds"] == expected.prediction.step_time > 0
        assert stage["exposed_comm_seconds"] == expected.prediction.exposed_communication
        assert stage["peak_bytes"] == expected.prediction.memory.peak_bytes
        assert stage["tokens_per_second_per_device"] == 8 / stage["step_seconds"]  # 8 rows of 8 features
        assert stage["wire_bytes"] == traced["wire_bytes"]  # bucketing merges collectives, not bytes


def test_activation_checkpointing_recomputes_in_backward_as_train_applies_it(fully_sharded):
    reports = {mode: inspect_debug("fully_shard", buckets=None, reorder=False, activation_checkpointing=mode)
               for mode in ("selective", "full")}
    reports["none"] = fully_sharded  # the passes change neither the matmuls nor the saved tensors
    matmuls = {mode: sum(node.op == "aten.mm.default" for node in report.backward.nodes)
               for mode, report in reports.items()}
    assert matmuls["full"] > matmuls["selective"] == matmuls["none"]  # full recomputes the forward's matmuls
    saved = {mode: sum(graph_input.bytes for graph_input in report.backward.inputs)
             for mode, report in reports.items()}
    assert saved["full"] < saved["none"]  # full saves only each block's input (and its RNG-seeded ops)
    # the checkpointed blocks still run the flash kernel, and their nodes keep the blocks' FQNs
    forward = reports["selective"].forward
    assert "aten._scaled_dot_product_flash_attention.default" in {node.op for node in forward.nodes}
    assert "layers.0.attention.wq" in {node.fqn for node in forward.nodes}
    with pytest.raises(ValueError, match="checkpoints each repeated block, and TwoLinears has none; pass activation_checkpointing='none'"):
        simplefsdp.inspect(TwoLinears(), (torch.randn(8, 8),), activation_checkpointing="full")


def test_replica_groups_price_the_fault_tolerant_all_reduce_of_the_gradient_shards_after_backward():
    report = inspect_debug("fully_shard", replica_groups=4)
    ft = report.fault_tolerant
    # Rank 0 holds the first ceil(rows / 8) rows of each fp32 master parameter: its gradient shard, all-reduced.
    model = build_model("debug")
    shard_bytes = sum(min(-(-p.shape[0] // 8), p.shape[0]) * p[0].numel() * 4 for p in model.parameters())
    assert ft["replica_groups"] == 4 and ft["exchange_bytes"] == shard_bytes and ft["exchange_every"] == 1
    assert ft["bytes_per_step"] == 2 * 3 * shard_bytes // 4  # a ring all-reduce over 4 sends 2 (4 - 1) / 4 of it
    assert ft["step_seconds"] == report.prediction.step_time + ft["exchange_seconds"] > report.prediction.step_time
    assert "fault-tolerant: 4 replica groups, --replica-sync step" in report.summary()
    assert inspect_debug("fully_shard").fault_tolerant is None
