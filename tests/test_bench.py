"""``simplefsdp bench``: a real 2-rank run of every contender on a Hugging Face Llama (structure and loss parity, not
speed)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from charts import png_size
from transformers import LlamaConfig

from simplefsdp.bench.profiling import WINDOW, frees_counted_on_every_thread, read_profile
from simplefsdp.bench.report import format_table
from simplefsdp.bench.report import check_parity
from simplefsdp.cli import main
from simplefsdp.names import CONTENDER_NAMES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One bench run of every contender: a Hugging Face Llama from its config.json alone (``--model hf:DIR``, as a
    user brings one), 2 gloo ranks, 3 measured steps, aot_eager (bitwise parity)."""
    out = tmp_path_factory.mktemp("bench")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=300, architectures=["LlamaForCausalLM"]).save_pretrained(out / "llama")
    command = [
        sys.executable, "-m", "simplefsdp", "bench", "--model", f"hf:{out / 'llama'}", "--nproc", "2", "--steps", "3",
        "--warmup", "1", "--seq-len", "32", "--backend", "aot_eager",
        "--json", str(out / "bench.json"), "--plot", str(out / "bench.png"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done


def test_bench_writes_json_table_and_chart(bench_run):
    out, done = bench_run
    results = json.loads((out / "bench.json").read_text())
    assert results["world_size"] == 2 and results["model"] == f"hf:{out / 'llama'}" and results["steps"] == 3
    assert set(results["methods"]) == {"step_time", "peak_memory", "collectives", "comm", "wire", "wait"}
    assert tuple(row["name"] for row in results["rows"]) == CONTENDER_NAMES
    for row in results["rows"]:
        assert row["status"] == "ok", row
        assert len(row["step_times_s"]) == 3 and len(row["losses"]) == 4 and len(row["last_loss_per_rank"]) == 2
        median = row["step_time_s"]["median"]
        assert median == statistics.median(row["step_times_s"])  # of the measured steps, warm-up excluded
        assert row["tokens_per_s_per_rank"] == pytest.approx(4 * 32 / median)
        assert row["peak_bytes_per_rank"] > 0 and row["warmup_s"] > 0
        assert math.isfinite(row["last_loss"])
    rows = {row["name"]: row for row in results["rows"]}
    assert rows["local"]["collectives_per_step"] == 0
    assert rows["simplefsdp"]["collectives_per_step"] > 0 and rows["simplefsdp"]["wait_ms_per_step"] is not None
    assert rows["fsdp2-eager"]["collectives_per_step"] > 0 and rows["fsdp2-eager"]["wait_ms_per_step"] is None
    assert "| contender |" in done.stdout and "step × FSDP2+compile" in done.stdout
    assert all(f"| {name} | " in done.stdout for name in CONTENDER_NAMES)
    assert "loss parity: ok: simplefsdp vs fsdp2-eager" in done.stdout and "bitwise" in done.stdout
    assert png_size(out / "bench.png") == (900, 780)  # two panels of eight bars
    assert "Warning" not in done.stderr, done.stderr


def test_wire_bytes_column_shows_int8_sending_less_than_full_precision(bench_run):
    out, done = bench_run
    sent = {row["name"]: row["wire_bytes_per_rank"] for row in json.loads((out / "bench.json").read_text())["rows"]}
    assert sent["local"] == 0 and sent["fsdp2-eager"] > 0
    # int8 codes plus a 4-byte scale per 256 values, all-to-all sending half of what gloo's all-reduce sends
    assert 0 < sent["simplefsdp-int8"] < sent["simplefsdp"] / 2
    assert "wire MiB/step (× FSDP2)" in done.stdout and f"{sent['simplefsdp-int8'] / 2**20:.2f} (" in done.stdout


def test_aot_eager_losses_are_bitwise_equal_to_fsdp2_eager(bench_run):
    rows = {row["name"]: row for row in json.loads((bench_run[0] / "bench.json").read_text())["rows"]}
    assert rows["simplefsdp"]["losses"] == rows["fsdp2-eager"]["losses"]


def _rerun(results: dict, tmp_path: Path, capsys) -> tuple[int, str]:
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(results))
    code = main(["bench", "--from-json", str(path), "--json", str(tmp_path / "out.json"),
                 "--plot", str(tmp_path / "o.png")])
    return code, capsys.readouterr().out


def test_loss_mismatch_fails_the_command(bench_run, tmp_path, capsys):
    results = json.loads((bench_run[0] / "bench.json").read_text())
    assert _rerun(results, tmp_path, capsys)[0] == 0
    simplefsdp = next(row for row in results["rows"] if row["name"] == "simplefsdp")
    simplefsdp["last_loss_per_rank"][1] = math.nextafter(simplefsdp["last_loss_per_rank"][1], math.inf)
    code, out = _rerun(results, tmp_path, capsys)
    assert code == 1 and "loss parity: FAIL: simplefsdp vs fsdp2-eager" in out
    results["compile_backend"] = "inductor"  # fp32 tolerance instead of bitwise: one ulp passes, 1e-3 does not
    assert _rerun(results, tmp_path, capsys)[0] == 0
    simplefsdp["last_loss_per_rank"][1] += 1e-3
    assert _rerun(results, tmp_path, capsys)[0] == 1


def test_bad_contender_name_is_one_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--only", "simplefsdp,fsdp3"])
    assert "unknown contender(s) fsdp3; choose from: fsdp2-eager, simplefsdp" in capsys.readouterr().err


def test_a_block_freed_on_another_thread_leaves_the_peak():
    """The profiler records allocations and frees of the threads it profiles only; gloo's threads free collectives'
    buffers. A MiB freed on another thread, then 2 MiB allocated: the peak is the 2 MiB (and the small allocations
    beside), not 3 MiB as it read before (an unrecorded free kept the MiB live)."""
    mib = 1 << 20
    with frees_counted_on_every_thread(), torch.profiler.profile(profile_memory=True) as prof:
        with torch.profiler.record_function(WINDOW):
            box = [torch.empty(mib // 4)]
            freeing = threading.Thread(target=box.clear)  # the last reference dropped there
            freeing.start()
            freeing.join()
            two = torch.empty(mib // 2)
            del two
    assert 2 * mib <= read_profile(prof, "gloo", 1)["peak_bytes"] < 2.5 * mib


def test_parity_is_not_checked_without_the_reference(bench_run):
    results = json.loads((bench_run[0] / "bench.json").read_text())
    results["rows"] = [row for row in results["rows"] if row["name"] != "fsdp2-eager"]
    ok, lines = check_parity(results)
    assert ok and lines == ["loss parity: not checked (fsdp2-eager did not run)"]
    assert "× FSDP2" in format_table(results) and "| simplefsdp | " in format_table(results)


def test_mixed_precision_compares_within_the_dtype_tolerance_even_under_aot_eager(bench_run):
    results = json.loads((bench_run[0] / "bench.json").read_text())
    simplefsdp = next(row for row in results["rows"] if row["name"] == "simplefsdp")
    simplefsdp["last_loss_per_rank"][0] += 1e-4
    assert not check_parity(results)[0]
    results["param_dtype"] = "bfloat16"  # FSDP2 casts forward inputs too, so bf16 runs differ legitimately
    assert check_parity(results)[0]


def test_too_long_sequence_is_one_clear_error():
    with pytest.raises(SystemExit, match="--seq-len 500 is longer than debug supports; use --seq-len 128 or less"):
        main(["bench", "--model", "debug", "--seq-len", "500"])


def test_without_matplotlib_the_chart_is_skipped_in_one_line_unless_asked_for(bench_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra sees
    monkeypatch.chdir(tmp_path)
    saved = str(bench_run[0] / "bench.json")
    assert main(["bench", "--from-json", saved, "--json", "out.json"]) == 0
    assert ("skipped runs/bench.png: matplotlib is not installed; pip install 'simplefsdp[plot]'"
            in capsys.readouterr().out)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit) as error:
        main(["bench", "--from-json", saved, "--plot", "chart.png"])
    assert str(error.value) == ("simplefsdp bench: --plot chart.png: matplotlib is not installed; "
                                "pip install 'simplefsdp[plot]'")
