"""Every Python example in README.md runs as written (a 1-rank world, as a new user would run it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def section_example(heading: str) -> str:
    """The first Python example in README.md's section ``heading`` (e.g. ``"## Use it"``)."""
    section = README.read_text().split(f"\n{heading}\n", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


USE_IT = section_example("## Use it")  # run as a saved script, also under torchrun, by test_first_run.py
OTHERS = [example for example in EXAMPLES if example != USE_IT]


def test_readme_has_examples():
    assert USE_IT in EXAMPLES and len(OTHERS) >= 1


@pytest.mark.parametrize("example", OTHERS, ids=[f"example{i}" for i in range(len(OTHERS))])
def test_readme_example_runs(example, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
