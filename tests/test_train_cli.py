"""``simplefsdp train`` as a user runs it: bad input, a killed rank, a save killed halfway, exact resume.

The jobs run eagerly (``--no-compile``): these items are about the loop,
checkpoints and the launcher, not Inductor, and the machine has two cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils._pytree import tree_flatten

from simplefsdp.cli import main
from simplefsdp.models.llama import build_model, get_config
from simplefsdp.runtime.checkpoint import checkpoint_path, latest_checkpoint
from simplefsdp.train import learning_rate

FAULT_INJECTION = Path(__file__).parent / "fault_injection"
TRAIN = ["--model", "debug", "--nproc", "2", "--no-compile", "--grad-accum", "2", "--max-norm", "0.5",
         "--seq-len", "32"]


def train(*options: str, kill: str | None = None, signal: str = "SIGKILL", step_sleep: float = 0, timeout: float = 300
          ) -> subprocess.CompletedProcess:
    """Run ``simplefsdp train`` as a separate job; ``kill`` is a point where a rank sends itself ``signal``,
    ``step_sleep`` seconds are added to every optimizer step (see fault_injection/)."""
    env = dict(os.environ, SIMPLEFSDP_TEST_KILL=kill or "", SIMPLEFSDP_TEST_SIGNAL=signal,
               SIMPLEFSDP_TEST_STEP_SLEEP=str(step_sleep))
    if kill or step_sleep:
        env["PYTHONPATH"] = os.pathsep.join([str(FAULT_INJECTION), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "simplefsdp", "train", *TRAIN, *options]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--model", "gpt5"], "--model gpt5: not a reference model"),
        (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
        (["--resume", "--checkpoint-dir", "/nonexistent/run"], "no checkpoint to resume from in /nonexistent/run"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--max-norm", "-1"], "--max-norm must be positive"),
        (["--prefetch", "-1"], "prefetch must be a whole number of buckets"),
        (["--nproc", "2", "--tp", "3"], "--tp 3: tp=3 must be a positive int dividing the world size 2"),
        (["--nproc", "4", "--tp", "4"], r"--tp 4: .* needs n_kv_heads \(2\) divisible by 4"),
        (["--nproc", "4", "--tp", "2", "--mode", "hybrid_shard"], "composes with mode='fully_shard' only"),
        (["--replica-sync", "demo"], "--replica-sync demo is what crosses replica groups: add --fault-tolerant"),
        (["--precompile", "--no-compile"], "--precompile: precompile=True saves Inductor's compiled graphs"),
        (["--precompile", "--variable-seq-len"], "--precompile compiles a graph per sequence length"),
    ],
)
def test_bad_input_is_rejected_before_any_rank_starts(options, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", "--model", "debug", *options])


def test_galore_without_lr_takes_its_recommended_rate_and_adamw_its_own():
    assert learning_rate(None, "galore") == 1e-2
    assert learning_rate(None, "adamw") == 1e-3
    assert learning_rate(3e-4, "galore") == 3e-4


def test_plot_without_matplotlib_names_the_extra_before_any_rank_starts(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra sees
    with pytest.raises(SystemExit) as error:
        main(["train", "--model", "debug", "--plot", str(tmp_path / "loss.png")])
    assert str(error.value) == (f"simplefsdp train: --plot {tmp_path / 'loss.png'}: matplotlib is not installed; "
                                "pip install 'simplefsdp[plot]'")


def test_a_killed_rank_ends_the_job_within_60_seconds_naming_it():
    job = train("--steps", "200", kill="1:step-end:3", timeout=60)
    assert job.returncode != 0
    assert "rank 1 was killed by SIGKILL" in job.stderr
    assert "step    2/200" in job.stdout


def test_a_rank_that_crashes_in_cpp_prints_where_its_python_was():
    """A segfault or glibc's abort on a corrupted heap kills a rank with no Python traceback; the launcher's ranks
    print their threads' Python stacks first (faulthandler), so the job's output says where the rank was."""
    job = train("--steps", "200", kill="1:step-end:3", signal="SIGSEGV", timeout=60)
    assert job.returncode != 0
    assert "rank 1 was killed by SIGSEGV" in job.stderr
    assert "Fatal Python error: Segmentation fault" in job.stderr
    assert re.search(r'File ".*sitecustomize.py", line \d+ in _killing', job.stderr), job.stderr


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
    straight_job = train("--steps", "4", "--checkpoint-dir", str(straight))
    assert straight_job.returncode == 0, straight_job.stderr
    rank = get_config("debug").dim // 4
    assert f"optimizer state bytes per rank: {expected_state_bytes('adamw', rank)}\n" in straight_job.stdout

    expected = assert_same_checkpoint(checkpoint_path(straight, 4), checkpoint_path(killed, 4), tmp_path)
    assert sum(isinstance(value, torch.Tensor) for value in expected) > 3 * 21  # parameters and AdamW moments


def assert_same_checkpoint(expected_path: Path, actual_path: Path, tmp_path: Path) -> list:
    """Assert two DCP checkpoints hold the same structure and bytes; return the expected one's leaves."""
    expected, expected_structure = tree_flatten(_load_full(expected_path, tmp_path))
    actual, actual_structure = tree_flatten(_load_full(actual_path, tmp_path))
    assert expected_structure == actual_structure
    for index, (want, got) in enumerate(zip(expected, actual)):
        assert torch.equal(want, got) if isinstance(want, torch.Tensor) else want == got, index
    return expected


def expected_state_bytes(optimizer: str, rank: int, projector_bytes: int = 4) -> int:
    """Rank 0's optimizer state on 2 ranks for the debug Llama, from its shapes: rank 0 holds ceil(rows / 2) of
    each parameter; a step counter (fp32 scalar) per parameter; AdamW keeps two fp32 moments of its shard, GaLore
    two of rows x rank and the replicated n x rank projector (``projector_bytes`` an element) for 2-D weights whose
    smaller side exceeds the rank, where that is less than AdamW's two moments."""
    total = 0
    for parameter in build_model("debug").parameters():
        rows = -(-parameter.shape[0] // 2)
        local_numel = rows * parameter[0].numel()
        galore = 4 * 2 * rows * rank + projector_bytes * parameter.shape[-1] * rank
        projected = parameter.ndim == 2 and min(parameter.shape) > rank and galore < 8 * local_numel
        if optimizer == "galore" and projected:
            total += galore
        else:
            total += 4 * 2 * local_numel
        total += 4
    return total


def _losses_and_norms(job: subprocess.CompletedProcess) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm) as the job printed them."""
    assert job.returncode == 0, job.stderr
    lines = [line.split() for line in job.stdout.splitlines() if line.startswith("step ")]
    return {int(words[1].split("/")[0]): (float(words[3]), float(words[-1])) for words in lines}


def test_a_tp_checkpoint_resumes_without_tp_where_tp_went_on(tmp_path):
    """dp 2 x tp 2 saves at step 2 and trains step 3; 2 data-parallel ranks resume from that checkpoint (DCP
    reshards the (dp, tp) DTensors) and train the same step 3 on the same global batch: the same printed loss and
    gradient norm (4 decimals; the layouts differ by fp32 rounding only)."""
    tensor_parallel = _losses_and_norms(train("--nproc", "4", "--tp", "2", "--steps", "3", "--checkpoint-dir",
                                              str(tmp_path), "--checkpoint-every", "2"))
    shutil.rmtree(checkpoint_path(tmp_path, 3))  # resume from step 2
    resumed = _losses_and_norms(train("--steps", "3", "--checkpoint-dir", str(tmp_path), "--resume"))
    assert tensor_parallel.keys() == {1, 2, 3} and resumed.keys() == {3}
    loss, norm = tensor_parallel[3]
    assert resumed[3][0] == pytest.approx(loss, abs=1e-4) and resumed[3][1] == pytest.approx(norm, abs=1e-3)
