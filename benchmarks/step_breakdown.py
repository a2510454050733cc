"""Where each millisecond of a step over the no-communication floor goes: simplefsdp beside FSDP2 with each block
compiled, on the same model, batches and ranks (issue 64).

    python benchmarks/step_breakdown.py --model hf:benchmarks/hf-llama-4x256 --nproc 2 --steps 10 --out FILE.md

Each contender (``bench``'s builders: ``local``, the floor, then ``fsdp2-compile`` and ``simplefsdp``) is built,
warmed up, and timed phase by phase for ``--steps`` steps: forward with the loss, backward, the optimizer step,
``zero_grad``. On a CPU every phase ends when its work is done (gloo waits inside it), so the phases add up to the
step; each is the median over steps of the slowest rank's. Each measured step also reads the CPU time the process
spent: its main thread's (``time.thread_time``), the main thread idle (the step's wall time less that: waiting for
another rank or thread, or descheduled), and its other threads' (gloo's, Inductor's workers): the median over
steps, the mean over ranks. Where ranks fill the cores, no step is shorter than their CPU time summed over ranks
divided by the cores. One more step runs under torch.profiler, with Inductor's kernels recorded by name
(``cpp.enable_kernel_profile``), and the main thread's self time in that step is split into:
compute (everything below not named), copies and casts (``copy_``, ``cat``, ``split``, ``clone``, ``_to_copy`` and
Inductor kernels made of only those), waits for collectives (``wait_tensor``), issuing collectives (``c10d::*``),
the rank guard (``simplefsdp::agree_on_collectives``), FSDP2's hooks (its ``FSDP::*`` scopes' own time: Python,
copies and waits it does not record as ops) and the rest (Python and dispatch between recorded ops). The backend's
own collective time runs on its thread, beside: on a 2-core machine running 2 ranks it takes CPU from compute.
A last step runs under the profiler's memory events: what is live at its peak, by the phase that allocated it
(``memory_at_peak``).
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
MEMORY_PHASES = ("before the step", "forward", "backward", "optimizer")
PARTS = ("compute", "copies and casts", "collective waits", "issuing collectives", "rank guard", "FSDP2 hooks",
         "Python and dispatch")
CPU = ("main thread's CPU", "main thread idle", "other threads' CPU")
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


def timed_step(model, optimizer, batch, device) -> dict[str, float]:
    (inputs, target), = micro_batches(batch, 1, device)
    marks = [time.perf_counter()]
    loss = model(*inputs, target)
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    optimizer.step()
    marks.append(time.perf_counter())
    optimizer.zero_grad()
    marks.append(time.perf_counter())
    return {phase: end - start for phase, start, end in zip(PHASES, marks, marks[1:])}


def profiled_parts(model, optimizer, batch, device) -> dict[str, float]:
    """Seconds of each of ``PARTS`` in the main thread's self time of one step, and ``gloo`` on its own thread."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("breakdown.step"):
            timed_step(model, optimizer, batch, device)
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


def memory_at_peak(model, optimizer, batch, device) -> dict[str, float]:
    """MiB live at the peak of one more step (CPU allocations, as ``bench``'s peak), by when they were allocated: held
    from before the step (the parameters' shards and the optimizer's state, counted from the tensors), in the
    forward, the backward or the optimizer step; and the phase the peak falls in (``"peak in"``)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    (inputs, target), = micro_batches(batch, 1, device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("breakdown.forward"):
            loss = model(*inputs, target)
        with record_function("breakdown.backward"):
            loss.backward()
        with record_function("breakdown.optimizer"):
            optimizer.step()
            optimizer.zero_grad()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        events.append(stack.pop())
        stack.extend(events[-1].children)
    events.sort(key=lambda event: event.start_time_ns)
    windows = [(event.start_time_ns, event.end_time_ns, event.name.removeprefix("breakdown."))
               for event in events if event.name.startswith("breakdown.")]
    live: dict[int, tuple[int, str]] = {}
    by_phase, peak, at_peak = dict.fromkeys(MEMORY_PHASES[1:], 0), -1, {}
    for event in (event for event in events if event.tag == _EventType.Allocation):
        if not str(event.extra_fields.device).startswith("cpu"):
            continue
        ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if ptr in live:  # a free of this block, or (its free unrecorded: freed on gloo's thread) a new one
            freed, phase = live.pop(ptr)
            by_phase[phase] -= freed
        if size > 0:
            phase = next((name for start, end, name in windows if start <= event.start_time_ns <= end), "optimizer")
            live[ptr] = (size, phase)
            by_phase[phase] += size
        if sum(by_phase.values()) > peak:
            peak, at_peak = sum(by_phase.values()), {**by_phase, "peak in": next(
                (name for start, end, name in windows if start <= event.start_time_ns <= end), "optimizer")}
    state = [t for group in optimizer.state.values() for t in group.values() if isinstance(t, torch.Tensor)]
    held = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in [*model.parameters(), *state])
    return {"before the step": held / 2**20, **{name: at_peak[name] / 2**20 for name in MEMORY_PHASES[1:]},
            "peak in": at_peak["peak in"]}


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
            timed_step(model, optimizer, step_batch(args, workload, tokens, step), device)
        steps, cpu = [], []
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            dist.barrier()
            main_thread, process = time.thread_time(), time.process_time()
            steps.append(timed_step(model, optimizer, step_batch(args, workload, tokens, step), device))
            main_thread, process = time.thread_time() - main_thread, time.process_time() - process
            cpu.append({"main thread's CPU": main_thread, "other threads' CPU": process - main_thread,
                        "main thread idle": sum(steps[-1].values()) - main_thread})
        parts = profiled_parts(model, optimizer, step_batch(args, workload, tokens, 0), device)
        memory = memory_at_peak(model, optimizer, step_batch(args, workload, tokens, 0), device)
        everyone = [None] * world
        dist.all_gather_object(everyone, (steps, parts, memory, cpu))
        slowest = [max((r[0][index] for r in everyone), key=lambda s: sum(s.values())) for index in range(args.steps)]
        phases = {phase: statistics.median(step[phase] for step in slowest) for phase in PHASES}
        rows[name] = {**phases, "step": statistics.median(sum(step.values()) for step in slowest),
                      **{part: statistics.mean(r[1].get(part, 0.0) for r in everyone)
                         for part in (*PARTS, "gloo (its thread)")},
                      **{key: statistics.mean(statistics.median(step[key] for step in r[3]) for r in everyone)
                         for key in CPU},
                      "memory": max((r[2] for r in everyone), key=lambda m: sum(m[p] for p in MEMORY_PHASES))}
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
    for key in ("step", *PHASES, "*CPU time per measured step, median*", *CPU, "*main thread, one profiled step*",
                *PARTS, "gloo (its thread)"):
        if key.startswith("*"):  # a heading
            lines.append(f"| {key} |" + " |" * len(names))
            continue
        cells = [f"{rows[name][key] * 1e3:.1f}" + ("" if name == "local" else
                 f" ({(rows[name][key] - floor[key]) * 1e3:+.1f})") for name in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", "Live at the peak of one more step, MiB (the rank of the higher peak), by when it was allocated:", "",
              "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in (*MEMORY_PHASES, "peak"):
        cells = [f"{sum(rows[n]['memory'][p] for p in MEMORY_PHASES):.1f}" if key == "peak" else
                 f"{rows[n]['memory'][key]:.1f}" for n in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| peak falls in | " + " | ".join(rows[n]["memory"]["peak in"] for n in names) + " |")
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
