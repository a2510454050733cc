"""What crosses replica groups, side by side: ``train --fault-tolerant --replica-sync {step,demo,diloco}`` on cpu-small,
2 groups of 1 gloo rank, compiled, on real text; each mode once without failures and once with group 1's rank
SIGKILLed from outside at ``--kill-at`` (it restarts and heals).

    python benchmarks/semi_sync.py --data stdlib.txt --steps 600 --kill-at 300 --out runs/semi_sync

(``--data``: see ``convergence.py``; ``--only``: names from ``MODES``, each with or without ``-killed``.) Prints,
per run: the mean of group 0's last 50 losses, its ratio to ``step``'s and the paired per-step difference (same
batches), the mean of the bytes group 0's step lines show sent across groups and its ratio to ``step``'s, the wall
time and the median step; writes ``loss.png`` (group 0's loss, 10-step means). ``--reuse`` reads the logs in
``--out``.
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

from fault_tolerance import rank_pids

DEMO, DILOCO = ["--replica-sync", "demo"], ["--replica-sync", "diloco", "--sync-every", "32"]
AVERAGING = ["--replica-sync", "diloco", "--outer-lr", "1", "--outer-momentum", "0"]  # the outer step: the mean
MODES = {"step": [], "demo": DEMO, "diloco": DILOCO,  # the defaults; then a few settings each
         "demo-lr5e-4": [*DEMO, "--lr", "5e-4"], "demo-lr2e-3": [*DEMO, "--lr", "2e-3"],
         "demo-lr1.5e-3": [*DEMO, "--lr", "1.5e-3"], "demo-top-k64": [*DEMO, "--demo-top-k", "64"],
         "demo-top-k128": [*DEMO, "--demo-top-k", "128"],
         "diloco-outer-momentum0": [*AVERAGING, "--sync-every", "32"],
         "diloco-outer-momentum0-lr1.5": [*DILOCO, "--outer-momentum", "0", "--outer-lr", "1.5"],
         "diloco-outer-momentum0.3": [*DILOCO, "--outer-momentum", "0.3", "--outer-lr", "1"],
         "diloco-outer-lr0.3": [*DILOCO, "--outer-lr", "0.3"], "diloco-outer-lr1": [*DILOCO, "--outer-lr", "1"],
         "diloco-lr2e-3": [*DILOCO, "--lr", "2e-3"],
         "diloco-h8-int4": [*AVERAGING, "--sync-every", "8", "--outer-quantize", "int4"],
         "diloco-h8-int8": [*AVERAGING, "--sync-every", "8", "--outer-quantize", "int8"],
         "diloco-h16-int4": [*AVERAGING, "--sync-every", "16", "--outer-quantize", "int4"],
         "diloco-h8": [*AVERAGING, "--sync-every", "8"], "diloco-h16": [*AVERAGING, "--sync-every", "16"],
         "diloco-h4": [*AVERAGING, "--sync-every", "4"], "diloco-h8-nesterov": [*DILOCO, "--sync-every", "8"]}
STEP = re.compile(r"^step +(\d+)/\d+  loss (\S+) .*  ([\d.]+) s  cross-group ([\d,]+) B .*group 0 replicas", re.M)


def run(command: list[str], kill_at: int | None) -> str:
    """The job's stdout; with ``kill_at``, group 1's rank is SIGKILLed when group 0 prints that step."""
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, start = [], time.perf_counter()
    for line in job.stdout:
        lines.append(line)
        if kill_at and (match := STEP.match(line)) and int(match[1]) == kill_at:
            for pid in rank_pids(1):
                os.kill(pid, signal.SIGKILL)
    if job.wait():
        raise SystemExit(f"{' '.join(command)} failed:\n{''.join(lines[-20:])}")
    return "".join(lines) + f"wall time {time.perf_counter() - start:.1f} s\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill-at", type=int, default=300, help="group 0's step at which group 1 is killed")
    parser.add_argument("--out", default="runs/semi_sync")
    parser.add_argument("--only", nargs="+", default=None, help="run names (MODE or MODE-killed)")
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves, rows = {}, {}
    killed = ("step", "demo", "demo-top-k64", "diloco", "diloco-h8-int4")
    for name in args.only or [*MODES, *(f"{mode}-killed" for mode in killed)]:
        mode = name.removesuffix("-killed")
        log = out / f"{name}.log"
        command = [sys.executable, "-m", "simplefsdp", "train", "--model", "cpu-small", "--nproc", "1",
                   "--fault-tolerant", "--replica-groups", "2", "--steps", str(args.steps), "--data", args.data,
                   *MODES[mode]]
        if not (args.reuse and log.exists()):
            log.write_text(run(command, args.kill_at if name.endswith("-killed") else None))
        text = log.read_text()
        # group 0's steps (a retried step: its last line); the summaries' bytes lines do not say whose they are
        steps = {int(step): (float(loss), float(seconds), int(sent.replace(",", "")))
                 for step, loss, seconds, sent in STEP.findall(text)}
        curves[name] = [steps[step][0] for step in sorted(steps)]
        rows[name] = (statistics.mean(curves[name][-50:]), round(statistics.mean(sent for *_, sent in steps.values())),
                      float(re.search(r"^wall time (\S+) s$", text, re.M)[1]),
                      f"{statistics.median(seconds for step, (_, seconds, _) in steps.items() if step > 1):.3f} s")
    reference = rows.get("step")
    print("| run | last-50 loss | vs step | paired difference (± 1 s.e.) | cross-group bytes per step | vs step | "
          "wall time | median step |\n|---|---|---|---|---|---|---|---|")
    for name, (loss, sent, wall, median) in rows.items():
        differences = [a - b for a, b in zip(curves[name][-50:], curves.get("step", curves[name])[-50:])]
        paired = f"{statistics.mean(differences):+.4f} ± {statistics.stdev(differences) / 50 ** 0.5:.4f}"
        versus = (f"{loss / reference[0] - 1:+.2%}", f"1/{reference[1] / sent:.1f}" if sent else "0") if reference \
            else ("", "")
        print(f"| {name} | {loss:.4f} | {versus[0]} | {paired} | {sent:,} | {versus[1]} | {wall:.0f} s | {median} |")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for name, losses in curves.items():
        means = [statistics.mean(losses[end - 10:end]) for end in range(10, len(losses) + 1)]
        axes.plot(range(10, len(losses) + 1), means, label=name, linewidth=1,
                  linestyle="--" if name.endswith("-killed") else "-")
    axes.set(xlabel="step", ylabel="loss (group 0, 10-step mean)",
             title="cpu-small, 2 replica groups x 1 gloo rank, Python stdlib sources")
    axes.legend()
    figure.savefig(out / "loss.png", dpi=100)


if __name__ == "__main__":
    main()
