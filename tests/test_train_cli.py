"""``simplefsdp train`` as a user runs it: bad input, a killed rank, a save killed halfway, exact resume.

The jobs run eagerly (``--no-compile``): these items are about the loop,
checkpoints and the launcher, not Inductor, and the machine has two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils._pytree import tree_flatten

from simplefsdp.cli import main
from simplefsdp.runtime.checkpoint import checkpoint_path, latest_checkpoint

FAULT_INJECTION = Path(__file__).parent / "fault_injection"
TRAIN = ["--model", "debug", "--nproc", "2", "--no-compile", "--grad-accum", "2", "--max-norm", "0.5", "--seq-len", "32"]


def train(*options: str, kill: str | None = None, step_sleep: float = 0, timeout: float = 300
          ) -> subprocess.CompletedProcess:
    """Run ``simplefsdp train`` as a separate job; ``kill`` is a SIGKILL point, ``step_sleep`` seconds are added to
    every optimizer step (see fault_injection/)."""
    env = dict(os.environ, SIMPLEFSDP_TEST_KILL=kill or "", SIMPLEFSDP_TEST_STEP_SLEEP=str(step_sleep))
    if kill or step_sleep:
        env["PYTHONPATH"] = os.pathsep.join([str(FAULT_INJECTION), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "simplefsdp", "train", *TRAIN, *options]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
        (["--resume", "--checkpoint-dir", "/nonexistent/run"], "no checkpoint to resume from in /nonexistent/run"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--max-norm", "-1"], "--max-norm must be positive"),
        (["--prefetch", "-1"], "prefetch must be a whole number of buckets"),
    ],
)
def test_bad_input_is_rejected_before_any_rank_starts(options, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", "--model", "debug", *options])


def test_plot_without_matplotlib_names_the_extra_before_any_rank_starts(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra sees
    with pytest.raises(SystemExit) as error:
        main(["train", "--model", "debug", "--plot", str(tmp_path / "loss.png")])
    assert str(error.value) == (f"simplefsdp train: --plot {tmp_path / 'loss.png'}: matplotlib is not installed; "
                                "pip install 'simplefsdp[plot]'")


def test_a_killed_rank_ends_the_job_within_60_seconds_naming_it():
    job = train("--steps", "200", kill="1:optimizer-step:3", timeout=60)
    assert job.returncode != 0
    assert "rank 1 was killed by SIGKILL" in job.stderr
    assert "step    2/200" in job.stdout


def _load_full(path: Path, tmp_path: Path) -> dict:
    dcp_to_torch_save(path, tmp_path / f"{path.parent.name}.pt")
    return torch.load(tmp_path / f"{path.parent.name}.pt", weights_only=False)


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_which_resumes_exactly(tmp_path):
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    job = train("--steps", "4", "--checkpoint-dir", str(killed), "--checkpoint-every", "2", kill="1:checkpoint-write:2")
    assert job.returncode != 0 and "rank 1 was killed by SIGKILL" in job.stderr
    assert latest_checkpoint(killed) == checkpoint_path(killed, 2)

    resumed = train("--steps", "4", "--checkpoint-dir", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stdout and "step    3/4" in resumed.stdout
    assert train("--steps", "4", "--checkpoint-dir", str(straight)).returncode == 0

    expected, expected_structure = tree_flatten(_load_full(checkpoint_path(straight, 4), tmp_path))
    actual, actual_structure = tree_flatten(_load_full(checkpoint_path(killed, 4), tmp_path))
    assert expected_structure == actual_structure
    assert sum(isinstance(value, torch.Tensor) for value in expected) > 3 * 21  # parameters and AdamW moments
    for index, (want, got) in enumerate(zip(expected, actual)):
        assert torch.equal(want, got) if isinstance(want, torch.Tensor) else want == got, index
