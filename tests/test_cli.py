"""``python -m simplefsdp train`` as a user runs it: local ranks through the elastic launcher."""

from __future__ import annotations

import re
import subprocess
import sys


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp", *args], capture_output=True, text=True, timeout=timeout
    )


def test_train_on_two_ranks_from_a_text_file(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    result = run_cli(
        "train", "--model", "debug", "--nproc", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
        "--backend", "aot_eager", "--data", str(data),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 2 rank(s), mode fully_shard" in result.stdout
    steps = re.findall(r"^step +(\d+)/3 +loss (\d+\.\d+) +[\d,]+ tok/s", result.stdout, flags=re.M)
    assert [int(step) for step, _ in steps] == [1, 2, 3]
    assert re.search(r"^summary: loss \d+\.\d+ -> \d+\.\d+ over steps 1-3;", result.stdout, flags=re.M)


def test_bad_dtype_names_the_choices():
    result = run_cli("train", "--param-dtype", "int8")
    assert result.returncode == 2
    assert "unknown dtype 'int8'; choose one of: float32, bfloat16, float16" in result.stderr
