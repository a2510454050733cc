"""Where each millisecond of a step over the no-communication floor goes: simplefsdp beside FSDP2 with each block
compiled, on the same model, batches and ranks (issue 64).

    python benchmarks/step_breakdown.py --model hf:benchmarks/hf-llama-4x256 --nproc 2 --steps 10 --out FILE.md

Each contender (``bench``'s builders: ``local``, the floor, then ``fsdp2-compile`` and ``simplefsdp``) is built,
warmed up, and timed phase by phase for ``--steps`` steps: forward with the loss, backward, the optimizer step,
``zero_grad``. On a CPU every phase ends when its work is done (gloo waits inside it), so the phases add up to the
step; each is the median over steps of the slowest rank's. One more step runs under torch.profiler, with Inductor's
kernels recorded by name (``cpp.enable_kernel_profile``), and the main thread's self time in that step is split into:
compute (everything below not named), copies and casts (``copy_``, ``cat``, ``split``, ``clone``, ``_to_copy`` and
Inductor kernels made of only those), waits for collectives (``wait_tensor``), issuing collectives (``c10d::*``),
the rank guard (``simplefsdp::agree_on_collectives``), FSDP2's hooks (its ``FSDP::*`` scopes' own time: Python,
copies and waits it does not record as ops) and the rest (Python and dispatch between recorded ops). The backend's
own collective time runs on its thread, beside: on a 2-core machine running 2 ranks it takes CPU from compute.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from simplefsdp.bench.contenders import CONTENDERS
from simplefsdp.bench.measure import build, step_batch
from simplefsdp.models.workload import load_workload, micro_batches
from simplefsdp.runtime.launch import is_launched_rank
from simplefsdp.runtime.mesh import device_type, init_distributed

PHASES = ("forward", "backward", "optimizer", "zero_grad")
PARTS = ("compute", "copies and casts", "collective waits", "issuing collectives", "rank guard", "FSDP2 hooks",
         "Python and dispatch")
COPIES = ("copy", "cat", "split", "clone", "to_copy", "slice", "view", "permute", "expand", "constant_pad")


def part_of(name: str) -> str:
    """The part of ``PARTS`` a main-thread event named ``name`` belongs to."""
    if name == "_c10d_functional::wait_tensor":
        return "collective waits"
    if name.startswith(("c10d::", "_c10d_functional::")):
        return "issuing collectives"
    if name.startswith("simplefsdp::agree_on_collectives"):
        return "rank guard"
    if name.startswith("FSDP::"):
        return "FSDP2 hooks"
    kernel = re.sub(r"^graph_\d+_", "", name)
    if kernel.startswith("cpp_fused_"):  # an Inductor kernel named by the ops it fuses
        ops = kernel.removeprefix("cpp_fused_").rsplit("_", 1)[0]
        return "copies and casts" if all(any(op.startswith(c) for c in COPIES) for op in ops.split("_") if op) \
            else "compute"
    bare = name.removeprefix("aten::").lstrip("_")
    return "copies and casts" if bare.startswith(COPIES) else "compute"


def timed_step(model, optimizer, workload, batch, device) -> dict[str, float]:
    (inputs, target), = micro_batches(batch, 1, device)
    marks = [time.perf_counter()]
    loss = workload.loss(model(*inputs), target)
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    optimizer.step()
    marks.append(time.perf_counter())
    optimizer.zero_grad()
    marks.append(time.perf_counter())
    return {phase: end - start for phase, start, end in zip(PHASES, marks, marks[1:])}


def profiled_parts(model, optimizer, workload, batch, device) -> dict[str, float]:
    """Seconds of each of ``PARTS`` in the main thread's self time of one step, and ``gloo`` on its own thread."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("breakdown.step"):
            timed_step(model, optimizer, workload, batch, device)
    events = prof.events()
    window = next(event for event in events if event.name == "breakdown.step")
    main = window.thread
    parts: dict[str, float] = defaultdict(float)
    recorded = 0.0
    for event in events:
        inside = window.time_range.start <= event.time_range.start <= window.time_range.end
        if not inside or event is window:
            continue
        if event.thread == main:
            parts[part_of(event.name)] += event.self_cpu_time_total / 1e6
            recorded += event.self_cpu_time_total / 1e6
        elif event.name.startswith("gloo:"):
            parts["gloo (its thread)"] += event.cpu_time_total / 1e6
    parts["Python and dispatch"] += window.self_cpu_time_total / 1e6
    return dict(parts)


def rank_main(args: argparse.Namespace) -> None:
    torch._inductor.config.cpp.enable_kernel_profile = True
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.config.recompile_limit = 64
    workload = load_workload(args.model, args.layers)
    with torch.device("meta"):
        shapes = workload.build(args.seed)
    tokens = workload.tokens(shapes, None, args.seed)
    device = torch.device(device_type())
    rows = {}
    for name in ("local", "fsdp2-compile", "simplefsdp"):
        contender = next(c for c in CONTENDERS if c.name == name)
        model, optimizer = build(contender, args, workload)
        for step in range(1, args.warmup + 1):
            timed_step(model, optimizer, workload, step_batch(args, workload, tokens, step), device)
        steps = []
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            dist.barrier()
            steps.append(timed_step(model, optimizer, workload, step_batch(args, workload, tokens, step), device))
        parts = profiled_parts(model, optimizer, workload, step_batch(args, workload, tokens, 0), device)
        everyone = [None] * world
        dist.all_gather_object(everyone, (steps, parts))
        slowest = [max((r[0][index] for r in everyone), key=lambda s: sum(s.values())) for index in range(args.steps)]
        phases = {phase: statistics.median(step[phase] for step in slowest) for phase in PHASES}
        rows[name] = {**phases, "step": statistics.median(sum(step.values()) for step in slowest),
                      **{part: statistics.mean(r[1].get(part, 0.0) for r in everyone)
                         for part in (*PARTS, "gloo (its thread)")}}
        del model, optimizer
    if rank == 0:
        text = table(rows, args)
        print(text)
        if args.out:
            with open(args.out, "w") as out:
                out.write(text)
    dist.barrier()
    dist.destroy_process_group()


def table(rows: dict, args: argparse.Namespace) -> str:
    names = list(rows)
    floor = rows["local"]
    lines = [f"`{' '.join(sys.argv)}`: {args.model}, {args.batch_size}x{args.seq_len} tokens per rank, "
             f"{args.nproc} gloo ranks, AdamW {'foreach' if args.foreach else 'fused'}, torch {torch.__version__}, "
             f"{os.cpu_count()} CPU cores; milliseconds (over the floor)", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in ("step", *PHASES, "", *PARTS, "gloo (its thread)"):
        if not key:
            lines.append("| *main thread, one profiled step* |" + " |" * len(names))
            continue
        cells = [f"{rows[name][key] * 1e3:.1f}" + ("" if name == "local" else
                 f" ({(rows[name][key] - floor[key]) * 1e3:+.1f})") for name in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf:benchmarks/hf-llama-4x256")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--foreach", action="store_true", help="AdamW foreach instead of fused")
    parser.add_argument("--out", default=None, help="also write the table (Markdown) here")
    args = parser.parse_args()
    vars(args).update(seed=0, lr=None, backend="inductor", param_dtype=None, reduce_dtype=None, grad_accum=1,
                      grad_accum_reduce=None, quantize_gather=None, quantize_reduce=None, error_feedback=True,
                      quantize_block_size=256)
    if is_launched_rank():
        rank_main(args)
        return
    # torchrun would read the script's --nproc as an abbreviation of its own --nproc-per-node: the ranks get the rest
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in (
        ("model", args.model), ("batch_size", args.batch_size), ("seq_len", args.seq_len), ("steps", args.steps),
        ("warmup", args.warmup), ("layers", args.layers), ("out", args.out)) if value is not None]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, *forwarded, *(["--foreach"] if args.foreach else [])]
    sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
