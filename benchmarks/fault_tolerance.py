"""Goodput of fault-tolerant replica groups: ``simplefsdp train --fault-tolerant`` (cpu-small, compiled, 2 groups
of 1 gloo rank) for ``--steps`` steps, once without failures and once with a rank SIGKILLed from outside at each
``--kill-at`` step of group 0's step lines (groups 1, 0, 1, ... in turn), side by side.

    python benchmarks/fault_tolerance.py --steps 300 --kill-at 100,200

Per failure: the stall (the longest gap between the surviving group's step lines after the kill, less its median
step), and the time to heal (kill to the killed group's first step line after its restart). Goodput: committed
steps per second, and samples per second (a step with k of 2 groups commits k groups' batches), relative to the run
without failures.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP = re.compile(r"^step +(\d+)/\d+ .* group (\d) replicas (\d)/(\d)(  not committed)?$")


def rank_pids(group: int) -> list[int]:
    """PIDs of the rank processes (not the launcher) of replica group ``group``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        if b"--replica-group" in command and command[command.index(b"--replica-group") + 1] == str(group).encode() \
                and b"TORCHELASTIC_RUN_ID=" in environ and proc.name.isdigit():
            pids.append(int(proc.name))
    return pids


def run(steps: int, kill_at: list[int]) -> dict:
    """Run the job, killing at ``kill_at``; return the step lines with arrival times, and the kills."""
    command = [sys.executable, "-m", "simplefsdp", "train", "--model", "cpu-small", "--nproc", "1",
               "--fault-tolerant", "--replica-groups", "2", "--steps", str(steps)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, kills, pending = [], [], list(kill_at)
    start = time.perf_counter()
    for line in job.stdout:
        if not (match := STEP.match(line.strip())):
            continue
        step, group, participants = int(match[1]), int(match[2]), int(match[3])
        lines.append((time.perf_counter() - start, step, group, participants, not match[5]))
        if pending and group == 0 and step == pending[0]:
            victim = 1 if len(kills) % 2 == 0 else 0
            for pid in rank_pids(victim):
                os.kill(pid, signal.SIGKILL)
            kills.append((time.perf_counter() - start, victim, step))
            pending.pop(0)
    assert job.wait() == 0, "the job failed"
    return {"lines": lines, "kills": kills, "seconds": time.perf_counter() - start}


def report(clean: dict, faulty: dict, steps: int) -> None:
    def rates(result):
        committed = {step: k for _, step, _, k, ok in result["lines"] if ok}
        done = max(t for t, *_ in result["lines"])
        return len(committed) / done, sum(committed.values()) / done

    steady = [b - a for (a, *_), (b, *_) in zip(clean["lines"], clean["lines"][1:])]
    print(f"clean run: {clean['seconds']:.1f} s for {steps} steps")
    print(f"with {len(faulty['kills'])} failures: {faulty['seconds']:.1f} s")
    for when, victim, step in faulty["kills"]:
        survivor = [t for t, _, group, *_ in faulty["lines"] if group != victim and t >= when]
        gaps = [b - a for a, b in zip([when, *survivor], survivor)]
        back = [t for t, _, group, *_ in faulty["lines"] if group == victim and t > when]
        stall = max(gaps[:20]) - statistics.median(steady)
        print(f"kill of group {victim} at step {step}: stall {stall:.2f} s, healed and stepping after "
              f"{back[0] - when:.1f} s" if back else f"kill of group {victim} at step {step}: never rejoined")
    clean_steps, clean_samples = rates(clean)
    faulty_steps, faulty_samples = rates(faulty)
    print(f"goodput: {faulty_steps / clean_steps:.1%} of committed steps per second, "
          f"{faulty_samples / clean_samples:.1%} of samples per second")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", default="100,200", help="group 0's steps at which to kill a rank")
    args = parser.parse_args()
    kill_at = [int(step) for step in args.kill_at.split(",")]
    clean = run(args.steps, [])
    faulty = run(args.steps, kill_at)
    report(clean, faulty, args.steps)


if __name__ == "__main__":
    main()
