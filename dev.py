"""Set up the project's virtual environment (once) and run the demo or the tests.

    python3 dev.py demo [train options]   # 2-rank training run of cpu-small
    python3 dev.py test [pytest options]  # the whole test suite, on 2 pytest-xdist workers

Needs only Python >= 3.10. The environment lives in .venv; a second run skips
the install unless pyproject.toml changed. torch is pinned to 2.13.0 here so
pip takes the CPU build instead of a multi-GB CUDA one.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".simplefsdp-installed"
TORCH = "torch==2.13.0"


def ensure_environment() -> None:
    """Create .venv and install torch and the package with its test, plot and ft extras, unless already done."""
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print(f"installing {TORCH} and simplefsdp[test,plot,ft] into {VENV}", flush=True)
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[test,plot,ft]"], check=True)
    STAMP.write_text(wanted)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test"):
        print(__doc__)
        return 2
    ensure_environment()
    command, extra = sys.argv[1], sys.argv[2:]
    if command == "demo":
        args = ["-m", "simplefsdp", "train", "--model", "cpu-small", "--nproc", "2", "--steps", "30", *extra]
    else:
        # two workers, a file each at a time, longest files first (tests/conftest.py): the suite is CPU-bound; the
        # 20 slowest tests listed at the end, where a CI log says what the suite's time went to
        args = ["-m", "pytest", *(extra or ["-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
                                            "--durations=20"])]
    return subprocess.run([str(PYTHON), *args], cwd=ROOT, env=os.environ).returncode


if __name__ == "__main__":
    sys.exit(main())
