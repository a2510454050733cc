"""Where the CPU of a step goes, on every core of the machine, for each contender (issue 64): Linux ``perf`` samples
the whole machine while the ranks run exactly ``--steps`` steps, and each sample is put in a category by its thread,
library and symbol.

    python benchmarks/step_cpu.py --model cpu-small --nproc 2 --steps 100 --out FILE.md

Each contender (``bench``'s builders: ``local``, the floor, ``fsdp2-compile`` and ``simplefsdp`` by default) is
launched on its own ranks, built, warmed up; then ``perf record -a -k mono`` runs while the ranks time ``--steps``
steps (a barrier before each, as ``bench``), and only the samples between the first step's start and the last one's
end are read (``perf report --time``). Categories: the matmuls (MKL's sgemm), other ATen kernels, Inductor's kernels,
copies (``copy_``, ``cat``, ``memcpy``), the interpreter, everything else in user space (dispatch, the allocator,
libc), the kernel on the ranks' own threads (page faults, syscalls), gloo's threads (``gloo_tcp_loop`` and
``pt_gloo_runloop``, kernel and user), and idle (no thread on a core). On a CPU every rank's step is the CPU its
threads use plus the time its core sits idle, so the categories over the floor's are where the step's time goes.
Needs ``perf`` and the right to sample the whole machine (root, or ``kernel.perf_event_paranoid`` <= 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from simplefsdp.bench.contenders import CONTENDERS
from simplefsdp.bench.measure import build, step_batch, train_step
from simplefsdp.models.workload import load_workload
from simplefsdp.runtime.launch import is_launched_rank
from simplefsdp.runtime.mesh import init_distributed

FREQUENCY = 499  # samples per second and core
CATEGORIES = ("matmul (MKL sgemm)", "other ATen kernels", "Inductor kernels", "copies", "Python interpreter",
              "dispatch, allocator, libc", "kernel, ranks' threads", "gloo threads, user", "gloo threads, kernel",
              "idle")


def category(comm: str, dso: str, kernel: bool, symbol: str) -> str:
    """The category of ``CATEGORIES`` of a sample of thread ``comm`` in library ``dso`` at ``symbol``."""
    if comm == "swapper" or "safe_halt" in symbol or "idle" in symbol:
        return "idle"
    if comm.startswith(("gloo_tcp_loop", "pt_gloo")):
        return "gloo threads, kernel" if kernel else "gloo threads, user"
    if kernel:
        return "kernel, ranks' threads"
    if symbol.startswith("mkl_blas"):
        return "matmul (MKL sgemm)"
    if re.search(r"copy_kernel|memmove|memcpy|cat_serial|memset", symbol):
        return "copies"
    if "libpython" in dso:
        return "Python interpreter"
    if dso.endswith(".main.so") or symbol == "kernel":  # Inductor's compiled C++
        return "Inductor kernels"
    return "other ATen kernels" if "libtorch_cpu" in dso else "dispatch, allocator, libc"


def rank_main(args: argparse.Namespace) -> None:
    """Build and warm up ``args.contender``, then time ``args.steps`` steps between the parent's marker files."""
    init_distributed()
    rank, marker = dist.get_rank(), Path(args.marker)
    torch._dynamo.config.recompile_limit = 64
    workload = load_workload(args.model, args.layers)
    with torch.device("meta"):
        shapes = workload.build(args.seed)
    tokens = workload.tokens(shapes, None, args.seed)
    model, optimizer = build(next(c for c in CONTENDERS if c.name == args.contender), args, workload)
    for step in range(1, args.warmup + 1):
        train_step(model, optimizer, step_batch(args, workload, tokens, step))
    dist.barrier()
    if rank == 0:
        marker.with_suffix(".ready").touch()
        while not marker.with_suffix(".go").exists():
            time.sleep(0.05)
    dist.barrier()
    times, start = [], time.monotonic()
    for step in range(args.warmup + 1, args.warmup + args.steps + 1):
        batch = step_batch(args, workload, tokens, step)
        dist.barrier()
        begin = time.perf_counter()
        train_step(model, optimizer, batch)
        times.append(time.perf_counter() - begin)
    dist.barrier()
    end = time.monotonic()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if rank == 0:
        slowest = [max(rank_times[index] for rank_times in everyone) for index in range(args.steps)]
        marker.with_suffix(".done").write_text(json.dumps(
            {"start": start, "end": end, "median_step": statistics.median(slowest)}))
    dist.destroy_process_group()


def cpu_by_category(data: Path, start: float, end: float, steps: int, nproc: int) -> dict[str, float]:
    """Milliseconds of CPU per step and rank in each category, from the samples of ``data`` in [start, end]."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "comm,dso,sym", "-F", "sample,comm,dso,sym",
         "--stdio", "--time", f"{start:.6f},{end:.6f}"], capture_output=True, text=True, check=True).stdout
    samples: dict[str, int] = defaultdict(int)
    for line in report.splitlines():
        match = re.match(r"\s*(\d+)\s+(.+?)\s+(\S+)\s+\[(.)\]\s+(.*)$", line)
        if match and not line.startswith("#"):
            count, comm, dso, kind, symbol = match.groups()
            samples[category(comm, dso, kind == "k", symbol.strip())] += int(count)
    return {name: samples[name] * 1e3 / FREQUENCY / steps / nproc for name in CATEGORIES}


def measure(contender: str, args: argparse.Namespace, folder: Path) -> dict:
    """Launch ``contender``'s ranks, sample the machine through their measured steps; the step and its categories."""
    marker, data = folder / contender, folder / f"{contender}.data"
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                 if name in ("model", "layers", "batch_size", "seq_len", "steps", "warmup") and value is not None]
    ranks = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={args.nproc}", __file__, *forwarded, f"--contender={contender}",
                              f"--marker={marker}"])
    while not marker.with_suffix(".ready").exists():
        if ranks.poll() is not None:
            sys.exit(f"{contender}'s ranks exited before measuring (code {ranks.returncode})")
        time.sleep(0.2)
    perf = subprocess.Popen(["perf", "record", "-a", "-k", "mono", "-F", str(FREQUENCY), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # perf is sampling
    marker.with_suffix(".go").touch()
    ranks.wait()
    perf.send_signal(signal.SIGINT)
    perf.wait()
    if ranks.returncode != 0:
        sys.exit(f"{contender}'s ranks failed (code {ranks.returncode})")
    window = json.loads(marker.with_suffix(".done").read_text())
    return {"step": window["median_step"] * 1e3,
            **cpu_by_category(data, window["start"], window["end"], args.steps, args.nproc)}


def table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    floor = rows.get("local")
    lines = [f"`{' '.join(sys.argv)}`: {args.model}, {args.batch_size}x{args.seq_len} tokens per rank, {args.nproc} "
             f"gloo ranks on {os.cpu_count()} cores, torch {torch.__version__}; milliseconds per step and rank "
             "(over the floor)", "", "| | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for key in ("step", *CATEGORIES, "sum of categories"):
        values = {name: sum(row[c] for c in CATEGORIES) if key == "sum of categories" else row[key]
                  for name, row in rows.items()}
        base = floor and (sum(floor[c] for c in CATEGORIES) if key == "sum of categories" else floor[key])
        cells = [f"{value:.1f}" + ("" if name == "local" or floor is None else f" ({value - base:+.1f})")
                 for name, value in values.items()]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cpu-small")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default="local,fsdp2-compile,simplefsdp")
    parser.add_argument("--out", default=None, help="also write the table (Markdown) here")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--marker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    vars(args).update(seed=0, lr=None, backend="inductor", param_dtype=None, reduce_dtype=None, grad_accum=1,
                      grad_accum_reduce=None, quantize_gather=None, quantize_reduce=None, error_feedback=True,
                      quantize_block_size=256, foreach=False)
    if is_launched_rank():
        rank_main(args)
        return
    if shutil.which("perf") is None:
        sys.exit("step_cpu.py samples the machine with Linux perf, which is not on PATH: install it (the "
                 "linux-tools or perf package)")
    with tempfile.TemporaryDirectory() as folder:
        rows = {name: measure(name, args, Path(folder)) for name in args.only.split(",")}
    text = table(rows, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
