"""A new user's first run: README's "Use it" example, saved as a script with no ``__main__`` guard, run with no cached
cpu profile, alone and under torchrun; it must finish (a hang fails the timeout) and measure the CPU once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import USE_IT

ROOT = Path(__file__).resolve().parent.parent
MEASURING = "simplefsdp: measuring this CPU once"
# The measurement (~10 s) and a cold Inductor compile of `debug` (~1 min on 2 busy cores) fit well inside this.
TIMEOUT_S = 300


def run_example(tmp_path: Path, launcher: list[str]) -> tuple[str, Path]:
    """Run the example saved as ``example.py`` in ``tmp_path`` with an empty cpu profile cache; its output and the
    cache folder."""
    (tmp_path / "example.py").write_text(USE_IT)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["SIMPLEFSDP_CACHE"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))  # this checkout's package
    try:
        result = subprocess.run([sys.executable, *launcher, "example.py"], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"the README example did not finish in {TIMEOUT_S} s (a hang?); it said:\n{hang.stdout}\n"
                    f"{hang.stderr}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output, cache


def test_readme_example_as_a_script_measures_once_and_trains(tmp_path):
    output, cache = run_example(tmp_path, [])
    assert re.findall(r"^step (\d) loss \d", output, flags=re.M) == ["0", "1", "2"], output[-3000:]
    assert output.count(MEASURING) == 1, output[-3000:]
    assert len(list(cache.glob("cpu-*.json"))) == 1  # cached for the next run


def test_readme_example_under_torchrun_measures_once_on_rank_0(tmp_path):
    # --standalone: a free port, so this launch cannot collide with another job's default port 29500
    output, cache = run_example(tmp_path, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    # both ranks print their steps, interleaved in one pipe
    assert sorted(re.findall(r"step (\d) loss \d", output)) == ["0", "0", "1", "1", "2", "2"], output[-3000:]
    assert output.count(MEASURING) == 1, output[-3000:]  # rank 0 measured; rank 1 got its profile by broadcast
    assert len(list(cache.glob("cpu-*.json"))) == 1
