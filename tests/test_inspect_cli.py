"""``simplefsdp inspect``'s command line, and bad input to ``simplefsdp.inspect``: each a clear line, before tracing
where it can be (the fake process group)."""

import sys

import pytest
import torch
from torch import nn

import simplefsdp
from simplefsdp.cli import main
from simplefsdp.ir.capture import TraceError
from simplefsdp.models.llama import build_model, get_config

LAYERS = get_config("debug").n_layers


@pytest.mark.parametrize("options, message", [
    (dict(buckets="blocks"), "unknown bucket mode 'blocks'; choose 'auto', 'block', None, or a manual plan"),
    (dict(buckets=[["layers.7"]]), "names module(s) that Llama does not have: 'layers.7'"),
    (dict(reorder="yes"), "reorder must be True or False, got 'yes'"),
    (dict(prefetch=-1), "prefetch must be a whole number of buckets (0 or more), got -1"),
    (dict(memory_budget=0), "memory_budget must be a positive number of bytes or None, got 0"),
])
def test_bad_pass_options_are_one_clear_line(options, message):
    with pytest.raises((ValueError, TypeError)) as error:
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=8, **options)
    assert "\n" not in str(error.value) and message in str(error.value)


def test_cli_without_passes_keeps_only_the_traced_stage(tmp_path, capsys):
    assert main(["inspect", "--model", "debug", "--seq-len", "16", "--buckets", "none", "--no-reorder",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    stage_rows = out.split("\n\n")[0].splitlines()[2:]  # the title, the table's header, then one row per stage
    assert [row.split()[0] for row in stage_rows] == ["traced"]
    assert "no passes applied" in out and "traced graphs (what runs)" in out
    assert sorted(path.name for path in tmp_path.glob("*ward*.py")) == [
        "backward.0-traced.py", "backward.py", "forward.0-traced.py", "forward.py"]
    # the CLI traces train's next-token loss after the model: its log-softmax and gather end the forward
    assert "torch.ops.aten.gather.default" in (tmp_path / "forward.py").read_text()


def test_cli_without_matplotlib_writes_everything_but_the_png_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra sees
    assert main(["inspect", "--model", "debug", "--seq-len", "16", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "trace.json").is_file() and not (tmp_path / "timeline.png").exists()
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert skipped == [f"skipped {tmp_path / 'timeline.png'}: matplotlib is not installed; "
                       "pip install 'simplefsdp[plot]'"]


def test_cli_pass_flags_reach_the_passes(tmp_path, capsys):
    assert main(["inspect", "--model", "debug", "--seq-len", "16", "--buckets", "block", "--prefetch", "2",
                 "--out", str(tmp_path)]) == 0
    plans = (tmp_path / "plan.txt").read_text()
    assert f"  all_gather layers.{LAYERS - 1}: " in plans and "  all_gather head: " in plans
    # prefetch 2: the forward's third gather bucket (layers.1) is issued right after the first one's wait
    reorder = plans[plans.index("reorder plan"):]
    assert "issue all_gather_into_tensor_out_1 after wait_tensor " in reorder
    assert "reorder plan" in capsys.readouterr().out


def test_cli_replica_sync_flags_reach_the_price(capsys):
    assert main(["inspect", "--model", "debug", "--seq-len", "16", "--replica-groups", "2", "--replica-sync",
                 "diloco", "--sync-every", "8", "--outer-quantize", "int4"]) == 0
    summary = capsys.readouterr().out
    assert "replica groups, --replica-sync diloco --outer-quantize int4: " in summary and "every 8 step(s)" in summary


def test_a_quantized_outer_exchange_without_diloco_is_refused_before_tracing():
    with pytest.raises(ValueError, match="--outer-quantize int8 is for --replica-sync diloco's pseudo-gradient"):
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=8,
                           replica_groups=2, replica_sync=dict(sync="demo", outer_quantize="int8"))


def test_unknown_hardware_is_one_line_naming_the_choices():
    with pytest.raises(ValueError) as error:
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=8, hardware="h1OO")
    assert "\n" not in str(error.value) and "h100, a100, h100-100g, cpu" in str(error.value)


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


def test_model_with_nothing_to_train_is_one_line_naming_why():
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(TraceError, match="Linear returned no tensor that requires grad, so there is no backward"):
        simplefsdp.inspect(frozen, (torch.randn(2, 4),), world_size=2)


def test_cli_reports_bad_input_in_one_line(capsys):
    with pytest.raises(SystemExit) as error:
        main(["inspect", "--model", "debug", "--world-size", "12", "--mode", "hybrid_shard"])
    assert str(error.value).startswith("simplefsdp inspect: world size 12 does not fit")
    assert "\n" not in str(error.value)
    with pytest.raises(SystemExit) as error:
        main(["inspect", "--model", "debug", "--prefetch", "-1"])
    assert str(error.value) == "simplefsdp inspect: prefetch must be a whole number of buckets (0 or more), got -1"
