"""``compile_sharded(precompile=True)``: a later process loads the saved graphs instead of tracing, and trains
bitwise as the usual compiled path does; anything the graphs depend on changes their key."""

from __future__ import annotations

import importlib
import linecache
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from test_defaults_step_back import WithUnusedWeight
from torch._dynamo.package import SourceInfo
from torch._dynamo.utils import counters

import simplefsdp.api
import simplefsdp.runtime.precompile as precompile
from simplefsdp import compile_sharded
from simplefsdp.ir.hardware import get_profile
from simplefsdp.models.llama import build_model

STEPS, MICRO_BATCHES = 3, 2


def _train(precompile_: bool) -> dict:
    """AdamW steps of a sharded debug Llama, each accumulating 2 micro-batches with sync off for the first: two
    graphs (accumulate; reduce what is pending)."""
    torch.manual_seed(0)
    model = compile_sharded(build_model("debug"), precompile=precompile_)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 256, (STEPS, 4 * dist.get_world_size(), 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in data:
        for index, micro in enumerate(batch.chunk(dist.get_world_size())[dist.get_rank()].chunk(MICRO_BATCHES)):
            model.set_requires_gradient_sync(index == MICRO_BATCHES - 1)
            loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten())
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    parameters = {name: parameter.full_tensor() for name, parameter in model.named_parameters()}
    return {"losses": torch.stack(losses), "parameters": parameters}


def _usual_then_precompiled(artifacts: str) -> tuple[dict, dict, int]:
    precompile.ARTIFACTS = Path(artifacts)
    usual = _train(False)
    graphs = counters["stats"]["unique_graphs"]
    return usual, _train(True), counters["stats"]["unique_graphs"] - graphs


def _precompiled(artifacts: str) -> tuple[dict, int]:
    precompile.ARTIFACTS = Path(artifacts)
    graphs = counters["stats"]["unique_graphs"]
    return _train(True), counters["stats"]["unique_graphs"] - graphs


def test_a_restart_loads_the_saved_graphs_and_trains_bitwise_as_the_usual_path(tmp_path):
    """The same backend and passes compile the same kernels, so the saved graphs, and those loaded by new processes,
    compute bitwise what the usual compiled path does (itself checked against single-process training in
    test_parity and test_grad_accumulation)."""
    cold = run_on_ranks(2, _usual_then_precompiled, str(tmp_path))
    warm = run_on_ranks(2, _precompiled, str(tmp_path))
    assert len(list(tmp_path.glob("*.aot"))) == 2 * 2  # two graphs per rank, each rank its own
    for (usual, saved, compiled), (loaded, compiled_again) in zip(cold, warm):
        assert compiled == 2 and compiled_again == 0
        for run in (saved, loaded):
            assert torch.equal(run["losses"], usual["losses"])
            for name, parameter in usual["parameters"].items():
                assert torch.equal(run["parameters"][name], parameter), name


def test_a_graph_is_keyed_by_what_it_depends_on(fake_world):
    model = compile_sharded(build_model("debug"), compile=False)
    state = precompile.ModuleState(model)
    first = state()
    changes = [
        lambda: model.layers[0].train(False),
        lambda: setattr(model.layers[1].attention, "n_heads", 8),
        lambda: delattr(model.layers[1].attention, "n_heads"),
        lambda: model.set_requires_gradient_sync(False),
        lambda: next(model.output.parameters()).requires_grad_(False),
    ]
    for change in changes:
        change()
        assert state() != first
        first = state()


def test_the_run_key_holds_the_plan_s_hardware_profile(fake_world, monkeypatch):
    """Rank 0's profile prices "auto" buckets: a graph saved under another profile holds another plan, which a rank
    that loads it would run against ranks that compiled the new one."""
    keys = []
    for name in ("h100", "a100"):
        monkeypatch.setattr(simplefsdp.api, "agreed_profile", lambda device_type, name=name: get_profile(name))
        keys.append(compile_sharded(build_model("debug"), precompile=True)._compiled_call_impl.run)
    assert keys[0] != keys[1]


def test_a_changed_source_is_seen(tmp_path, monkeypatch):
    path = tmp_path / "traced_module.py"
    path.write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source_info = SourceInfo(inlined_sources=set())
    source_info.add_code(importlib.import_module("traced_module").f.__code__)
    monkeypatch.delitem(sys.modules, "traced_module")
    assert len(source_info.inlined_sources) == 1
    compiled = type("Compiled", (), {"source_info": lambda self: source_info})()
    assert precompile.sources_unchanged(compiled)
    path.write_text("def f(x):\n    return x + 2\n")
    linecache.checkcache(str(path))
    assert not precompile.sources_unchanged(compiled)


@pytest.mark.parametrize("options, problem", [
    ({"compile": False}, "compile=True and backend='inductor'"),
    ({"backend": "aot_eager"}, "compile=True and backend='inductor'"),
    ({"dynamic": True}, "leave dynamic and fullgraph unset"),
    ({"fullgraph": False}, "leave dynamic and fullgraph unset"),
])
def test_precompile_refuses_what_it_cannot_save(options, problem):
    with pytest.raises(ValueError, match=problem):
        compile_sharded(build_model("debug"), precompile=True, **options)


class _Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.linear(x)


def test_a_graph_break_is_an_error_naming_the_fix(fake_world, tmp_path, monkeypatch):
    monkeypatch.setattr(precompile, "ARTIFACTS", tmp_path)
    model = compile_sharded(_Breaks(), precompile=True)
    with pytest.raises(RuntimeError, match="precompile needs the forward in one graph.*precompile=False"):
        model(torch.randn(4, 8))


def test_past_dynamos_recompile_limit_is_an_error_naming_the_fix(fake_world, tmp_path, monkeypatch):
    monkeypatch.setattr(precompile, "ARTIFACTS", tmp_path)
    model = compile_sharded(_Breaks(), precompile=True)
    with (torch._dynamo.config.patch(recompile_limit=0),
          pytest.raises(RuntimeError, match="each new input shape compiles a graph of its own.*precompile=False")):
        model(torch.randn(4, 8))


def test_blocks_holding_a_weight_they_never_read_precompile_as_regions(fake_world, tmp_path, monkeypatch):
    """precompile has no step back to the whole graph: a region's unread input is dropped as on the usual path
    (``ir/capture.py: compiling_regions``), else the unread weight's missing gradient fails the compile. The unread
    weights get no gradient, as in eager."""
    monkeypatch.setattr(precompile, "ARTIFACTS", tmp_path)
    model = compile_sharded(torch.nn.Sequential(*(WithUnusedWeight() for _ in range(3))), precompile=True)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert [parameter.grad is not None for parameter in model.parameters()] == [True, False] * 3
    assert len(list(tmp_path.glob("*.aot"))) == 1
