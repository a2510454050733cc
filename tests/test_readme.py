"""Every Python example in README.md and in docs/*.md runs as written (a 1-rank world, as a new user would run it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_examples(text: str) -> list[str]:
    """The bodies of the ```python blocks in ``text``, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def section_example(heading: str) -> str:
    """The first Python example in README.md's section ``heading`` (e.g. ``"## Use it"``)."""
    section = README.read_text().split(f"\n{heading}\n", 1)[1]
    return python_examples(section)[0]


USE_IT = section_example("## Use it")  # run as a saved script, also under torchrun, by test_first_run.py
EXAMPLES = [
    pytest.param(example, id=f"{page.relative_to(ROOT)}-example{index}")
    for page in PAGES
    for index, example in enumerate(example for example in python_examples(page.read_text()) if example != USE_IT)
]


def test_readme_and_docs_have_examples():
    assert USE_IT in python_examples(README.read_text())
    pages = {param.id.rsplit("-example", 1)[0] for param in EXAMPLES}
    assert "README.md" in pages and any(page.startswith("docs/") for page in pages), pages


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(example, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
