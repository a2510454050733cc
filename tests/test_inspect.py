"""``simplefsdp.inspect`` on the fake process group: schedules, golden summaries, files, bad input."""

import json
import xml.etree.ElementTree as ElementTree

import networkx as nx
import pytest
import torch
from torch import nn

import simplefsdp
from simplefsdp.cli import main
from simplefsdp.ir.capture import TraceError
from simplefsdp.ir.schedule import COLLECTIVE, WAIT, read_schedule
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.mixed_precision import MixedPrecision

BF16_FP32 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def inspect_debug(mode: str, **options):
    torch.manual_seed(0)
    model = build_model("debug")
    tokens = torch.zeros(1, 128, dtype=torch.long)
    return simplefsdp.inspect(model, (tokens,), world_size=8, mode=mode, hardware="h100", mp_policy=BF16_FP32,
                              **options)


@pytest.fixture(scope="module")
def fully_sharded():
    return inspect_debug("fully_shard")


def kinds(schedule, kind):
    return [node.collective.kind for node in schedule.collectives() if node.collective.kind == kind]


def test_fully_shard_gathers_every_parameter_and_reduce_scatters_every_gradient(fully_sharded):
    num_params = len(list(build_model("debug").parameters()))
    assert len(kinds(fully_sharded.forward, "all_gather")) == num_params
    assert len(kinds(fully_sharded.backward, "reduce_scatter")) == num_params
    # reshard after forward: the backward gathers again every weight its gradient needs (all but the embedding's)
    assert len(kinds(fully_sharded.backward, "all_gather")) == num_params - 1
    wq = next(node for node in fully_sharded.forward.collectives() if node.fqn == "layers.0.attention.wq")
    assert wq.collective.bytes == 64 * 64 * 2 and wq.collective.group_size == 8
    assert wq.collective.dtype == torch.bfloat16


def test_attention_is_traced_as_the_fused_kernel(fully_sharded):
    ops = {node.op for schedule in fully_sharded.schedules for node in schedule.nodes}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops
    assert "aten.bmm.default" not in ops  # no unfused attention matmuls


def test_schedule_dag_links_each_wait_to_its_collective(fully_sharded):
    for schedule in fully_sharded.schedules:
        assert nx.is_directed_acyclic_graph(schedule.dag)
        for node in schedule.nodes:
            if node.kind == WAIT:
                assert schedule.node(node.waits_for).kind == COLLECTIVE
                assert schedule.dag.has_edge(node.waits_for, node.name)


def test_sharded_param_bytes_and_fqns(fully_sharded):
    model = build_model("debug")
    fqns = {graph_input.param_fqn for graph_input in fully_sharded.forward.inputs if graph_input.param_fqn}
    assert fqns == {name for name, _ in model.named_parameters()}
    # each rank holds dim-0 shards of ceil(rows / 8) rows, fp32
    expected = sum(-(-p.shape[0] // 8) * p[0].numel() * 4 for p in model.parameters())
    assert fully_sharded.sharded_param_bytes == expected


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


def test_save_writes_graphs_summary_svg_and_trace(fully_sharded, tmp_path):
    paths = fully_sharded.save(tmp_path)
    assert sorted(path.name for path in paths) == [
        "backward.py", "forward.py", "summary.txt", "timeline.svg", "trace.json",
    ]
    assert "all_gather_into_tensor" in (tmp_path / "forward.py").read_text()
    assert "reduce_scatter_tensor" in (tmp_path / "backward.py").read_text()
    svg = ElementTree.parse(tmp_path / "timeline.svg").getroot()
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}rect")) > 100
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    communication = [event for event in events if event.get("tid") == 1 and event["ph"] == "X"]
    assert len(communication) == 21 + 20 + 21  # forward gathers, backward re-gathers, reduce-scatters
    assert (tmp_path / "summary.txt").read_text() == fully_sharded.summary()


def test_unknown_hardware_is_one_line_naming_the_choices():
    with pytest.raises(ValueError) as error:
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=8, hardware="h1OO")
    assert "\n" not in str(error.value) and "h100, a100, cpu" in str(error.value)


def test_world_size_that_does_not_fit_the_mesh_is_one_line():
    with pytest.raises(ValueError) as error:
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=12,
                           mode="hybrid_shard")
    assert "\n" not in str(error.value) and "world size 12" in str(error.value) and "multiple of 8" in str(error.value)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        if y.sum() > 0:  # data-dependent control flow: no single graph
            return y
        return -y


def test_model_that_fails_to_trace_is_one_line_naming_the_fix():
    with pytest.raises(TraceError) as error:
        simplefsdp.inspect(DataDependent(), (torch.randn(2, 4),), world_size=2)
    message = str(error.value)
    assert "\n" not in message and "DataDependent" in message and "fullgraph=True" in message


def test_cli_reports_bad_input_in_one_line(capsys):
    with pytest.raises(SystemExit) as error:
        main(["inspect", "--model", "debug", "--world-size", "12", "--mode", "hybrid_shard"])
    assert str(error.value).startswith("simplefsdp inspect: world size 12 does not fit")
    assert "\n" not in str(error.value)
