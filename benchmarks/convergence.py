"""Loss curves of cpu-small on 2 gloo ranks trained on real text: with and without low-bit communication
(``--runs low_bit``), or with AdamW and GaLoreAdamW (``--runs galore``).

    python benchmarks/convergence.py --runs low_bit --data stdlib.txt --steps 600 --out runs/low_bit
    python benchmarks/convergence.py --runs galore --data stdlib.txt --steps 600 --out runs/galore

``--data``: Python's standard-library sources concatenated, e.g.
``python -c "import pathlib, sysconfig; r = pathlib.Path(sysconfig.get_paths()['stdlib']);
pathlib.Path('stdlib.txt').write_bytes(b''.join(p.read_bytes() for p in sorted(r.glob('*.py'))))"``.
Prints the mean of the last 50 losses of each run, relative to the first run (and the paired difference per step,
with its standard error), each run's median step time, rank 0's peak RSS and optimizer state bytes, and writes
``loss.png``: the curves, and each run's difference from the first run as a 50-step moving average. ``--reuse``
reads the logs of runs already in ``--out`` instead of training again.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

GALORE = ["--optimizer", "galore", "--galore-rank", "64", "--galore-update-every", "200"]
RUNS = {"low_bit": {
    "full precision": [],
    "int8 gather, int8 reduce + EF": ["--quantize-gather", "int8", "--quantize-reduce", "int8"],
    "int4 reduce + EF": ["--quantize-reduce", "int4"],
    "int4 reduce, no EF": ["--quantize-reduce", "int4", "--no-error-feedback"],
    "int4 reduce, block 4096 + EF": ["--quantize-reduce", "int4", "--quantize-block-size", "4096"],
    "int4 reduce, block 4096, no EF": ["--quantize-reduce", "int4", "--quantize-block-size", "4096",
                                       "--no-error-feedback"],
}, "galore": {
    "AdamW": [],
    "GaLore r=64, T=200": [*GALORE, "--lr", "1e-3"],  # AdamW's lr; GaLore's own (train's default for it) below
    "GaLore r=64, T=200, sharded projector": [*GALORE, "--lr", "1e-3", "--galore-shard-projector"],
    "GaLore r=64, T=200, lr 1e-2": [*GALORE, "--lr", "1e-2"],  # GaLore's lr for its small Llamas (scale 0.25)
    "GaLore r=64, T=200, lr 1e-2, sharded projector": [*GALORE, "--lr", "1e-2", "--galore-shard-projector"],
    "GaLore r=64, T=200, lr 1e-2, bf16 projector": [*GALORE, "--lr", "1e-2", "--galore-projector-dtype", "bfloat16"],
}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", choices=sorted(RUNS), default="low_bit")
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default=None, help="where logs and loss.png go (runs/<--runs>)")
    parser.add_argument("--only", nargs="+", default=None, help="names of runs in --runs (all)")
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    out = Path(args.out or f"runs/{args.runs}")
    out.mkdir(parents=True, exist_ok=True)
    curves, summaries, runs = {}, {}, RUNS[args.runs]
    for name in args.only or list(runs):
        log = out / (re.sub(r"\W+", "_", name) + ".log")
        command = [sys.executable, "-m", "simplefsdp", "train", "--model", "cpu-small", "--nproc", "2", "--steps",
                   str(args.steps), "--data", args.data, *runs[name]]
        if not (args.reuse and log.exists()):
            log.write_text(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        curves[name] = [float(loss) for loss in re.findall(r"^step +\d+/\d+ +loss (\S+)", log.read_text(), re.M)]
        summaries[name] = [re.search(pattern, log.read_text())[1] for pattern in (
            r"median step (\S+ s)", r"peak RSS rank 0 (\S+ MiB)", r"optimizer state bytes per rank: (\d+)")]
    first = curves[next(iter(curves))]
    print("| run | mean of last 50 losses | vs first run | paired difference per step (± 1 s.e.) | median step | "
          "peak RSS rank 0 | optimizer state bytes per rank |\n|---|---|---|---|---|---|---|")
    for name, losses in curves.items():
        mean, differences = statistics.mean(losses[-50:]), [a - b for a, b in zip(losses[-50:], first[-50:])]
        error = statistics.stdev(differences) / len(differences) ** 0.5
        print(f"| {name} | {mean:.4f} | {mean / statistics.mean(first[-50:]) - 1:+.2%} | "
              f"{statistics.mean(differences):+.4f} ± {error:.4f} | {' | '.join(summaries[name])} |")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 7), layout="constrained")
    FigureCanvasAgg(figure)
    curve_axes, difference_axes = figure.subplots(2)
    for name, losses in curves.items():
        curve_axes.plot(range(1, len(losses) + 1), losses, label=name, linewidth=0.8)
        differences = [a - b for a, b in zip(losses, first)]
        averaged = [statistics.mean(differences[end - 50:end]) for end in range(50, len(differences) + 1)]
        difference_axes.plot(range(50, len(differences) + 1), averaged, label=name, linewidth=1)
    curve_axes.set(xlabel="step", ylabel="loss", title="cpu-small, 2 gloo ranks, Python stdlib sources")
    difference_axes.set(xlabel="step", ylabel=f"loss - {next(iter(curves))}'s (50-step mean)")
    curve_axes.legend()
    figure.savefig(out / "loss.png", dpi=100)


if __name__ == "__main__":
    main()
