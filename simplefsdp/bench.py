"""``simplefsdp bench``: simplefsdp side by side with eager FSDP2, FSDP2 + compile, DDP, FSDP1 and a local floor.

One launch of ``--nproc`` ranks runs every contender, so all of them see the same processes,
the same rendezvous and the same machine load. Dynamo's cache is process-wide and a graph is
reused wherever its guards pass, so each compiled contender's modules are of classes of its
own (``local`` gets a subclass for that), and warming up a compiled contender must compile.
Each contender builds the model from the same seed and trains on the same batches with
AdamW, in two passes:

1. **timing**: ``--warmup`` steps (compilation included; their total is the warm-up time), then
   ``--steps`` measured steps, interleaved across contenders. A barrier before each step aligns
   the ranks; a step's time is the slowest rank's.
2. **profile**: a fresh copy of the model is built under ``torch.profiler`` (memory events on)
   and trains two steps; the second one is read for peak memory, collectives and waits
   (``METHODS`` says exactly how). The profiler slows that step, so it is not timed.

``local`` runs on every rank at once, each on its own per-rank batch with no communication,
so it shares the machine exactly as the data-parallel contenders do. Rank 0 gathers the
results; the launching process prints the table, writes JSON and a PNG, and fails when
simplefsdp's loss differs from FSDP2 eager's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from simplefsdp.api import compile_sharded
from simplefsdp.barchart import Panel, write_bar_chart
from simplefsdp.data import load_tokens, rank_batch
from simplefsdp.models.llama import CONFIGS, build_model, get_config
from simplefsdp.runtime.launch import is_launched_rank, launch_local_ranks
from simplefsdp.runtime.mesh import device_type, init_distributed
from simplefsdp.runtime.mixed_precision import MixedPrecision
from simplefsdp.train import next_token_loss

REFERENCE = "fsdp2-eager"
CHECKED = ("simplefsdp", "simplefsdp-nopasses")
PASSES_OFF = {"buckets": None, "reorder": False}
WINDOW = "simplefsdp.bench.profiled_step"
METHODS = {
    "step_time": (
        "wall time of forward+backward+optimizer step, slowest rank, median and quartiles over the measured steps, "
        "which run interleaved across contenders; warm-up: the warm-up steps' total, compilation included "
        "(Inductor's on-disk caches make a repeated run's compilation faster)"
    ),
    "peak_memory": (
        "CPU: bytes allocated since the contender's fresh copy started being built and not yet freed, summed "
        "from torch.profiler allocation and free events (profile_memory=True), maximum over the profiled step, "
        "maximum over ranks; CUDA: torch.cuda.max_memory_allocated over that step"
    ),
    "collectives": "c10d::* operator events (process-group calls, barriers excluded) in the profiled step",
    "comm": (
        "summed duration of the backend's own collective events (e.g. gloo:all_gather, on its worker threads) in "
        "the profiled step, and its share of that step's duration (the profiler slows the step)"
    ),
    "wait": (
        "summed duration of _c10d_functional::wait_tensor events (compiled graphs); n/a where collectives "
        "are waited on in Work.wait(), which the profiler does not record (eager FSDP2, FSDP1, DDP); in the "
        "profiled step, with its share of that step's duration"
    ),
}


@dataclass(frozen=True)
class Contender:
    """A way to train the model: ``wrap`` turns the freshly built model into the module to train."""

    name: str
    summary: str
    wrap: Callable[[nn.Module, argparse.Namespace], nn.Module]
    compiled: bool = True
    distributed: bool = True


def _simplefsdp(model: nn.Module, args: argparse.Namespace, **options) -> nn.Module:
    mp_policy = MixedPrecision(args.param_dtype, args.reduce_dtype)
    return compile_sharded(model, mp_policy=mp_policy, backend=args.backend, **options)


def _simplefsdp_passes_off(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    return _simplefsdp(model, args, **PASSES_OFF)


def _fsdp2(model: nn.Module, args: argparse.Namespace, compile_blocks: bool = False) -> nn.Module:
    """``fully_shard`` on each transformer block, then the root, as torchtitan applies it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)
    for index, block in enumerate(model.layers):
        if compile_blocks:
            block = torch.compile(block, backend=args.backend)
            model.layers[index] = block
        fully_shard(block, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def _fsdp2_compiled(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    return _fsdp2(model, args, compile_blocks=True)


def _ddp_compiled(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    ddp.compile(backend=args.backend)
    return ddp


def _fsdp1(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp import MixedPrecision as FSDP1MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(model.layers[0])}), use_orig_params=True,
        mixed_precision=FSDP1MixedPrecision(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype),
    )


def _local(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """The plain model, compiled; its class becomes a subclass of its own so no other contender's graph fits it."""
    model.__class__ = type(f"Local{type(model).__name__}", (type(model),), {})
    model.compile(backend=args.backend)
    return model


def contenders() -> list[Contender]:
    """Every contender, the reference (FSDP2 eager) first."""
    nopasses = "compile_sharded(" + ", ".join(f"{k}={v!r}" for k, v in PASSES_OFF.items()) + ")"
    return [
        Contender(REFERENCE, "fully_shard on each block and the root, eager", _fsdp2, compiled=False),
        Contender("simplefsdp", "compile_sharded with default options", _simplefsdp),
        Contender("simplefsdp-nopasses", nopasses, _simplefsdp_passes_off),
        Contender("fsdp2-compile", "fully_shard on each block and the root, each block torch.compile'd", _fsdp2_compiled),
        Contender("ddp-compile", "DistributedDataParallel, torch.compile'd (full precision)", _ddp_compiled),
        Contender("fsdp1", "FullyShardedDataParallel, one unit per block, eager", _fsdp1, compiled=False),
        Contender("local", "one process per rank, its own per-rank batch, no communication, compiled (full precision)",
                  _local, distributed=False),
    ]


CONTENDER_NAMES = [contender.name for contender in contenders()]


def only_arg(text: str) -> list[str]:
    """Parse ``--only NAME[,NAME]``, rejecting unknown names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONTENDER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown contender(s) {', '.join(unknown) or '(none given)'}; choose from: {', '.join(CONTENDER_NAMES)}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simplefsdp.cli import dtype_arg

    parser.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    parser.add_argument("--model", default="cpu-small", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=20, help="measured steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (compilation happens here)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--param-dtype", type=dtype_arg, default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--reduce-dtype", type=dtype_arg, default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--only", type=only_arg, default=None, help=f"NAME[,NAME] of: {', '.join(CONTENDER_NAMES)}")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend for every compiled contender")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", default="runs/bench.json", help="where to write the results as JSON")
    parser.add_argument("--plot", default="runs/bench.png", help="where to write the bar chart (PNG)")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="print the table, plot and check parity from a saved JSON instead of running")
    parser.add_argument("--rank-output", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the comparison on ``--nproc`` local ranks (or this torchrun rank), then report; 1 on a parity failure."""
    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            raise SystemExit(f"simplefsdp bench: --from-json {path}: no such file; write one with --json PATH first")
        return report(json.loads(path.read_text()), args)
    if min(args.nproc, args.steps, args.warmup, args.batch_size, args.seq_len) < 1:
        raise SystemExit("simplefsdp bench: --nproc, --steps, --warmup, --batch-size and --seq-len must be at least 1")
    longest = get_config(args.model).max_seq_len
    if args.seq_len > longest:
        raise SystemExit(f"simplefsdp bench: --seq-len {args.seq_len} is longer than {args.model} supports; "
                         f"use --seq-len {longest} or less")
    command = shlex.join(["python", "-m", "simplefsdp", *argv])
    if is_launched_rank():
        results = measure(args)
        if results is None:
            return 0
        if args.rank_output:
            Path(args.rank_output).write_text(json.dumps(results))
            return 0
        return report({**results, "command": command}, args)
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "results.json"
        code = launch_local_ranks(args.nproc, [*argv, "--rank-output", str(output)])
        if code:
            return code
        return report({**json.loads(output.read_text()), "command": command}, args)


def _sync() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()


def _build(contender: Contender, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    model = contender.wrap(build_model(args.model).to(device_type()), args)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = next_token_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _batch(args: argparse.Namespace, tokens: torch.Tensor, step: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank_batch(tokens, step, args.batch_size, args.seq_len, args.seed, rank, world).to(device_type())


def _gather(values: list[float]) -> torch.Tensor:
    """Every rank's ``values``, shape ``(world, len(values))``, float64."""
    mine = torch.tensor(values, dtype=torch.float64, device=device_type())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).cpu()


class _Timed:
    """One contender's model and optimizer on this rank, with each step's time and loss."""

    def __init__(self, contender: Contender, args: argparse.Namespace, tokens: torch.Tensor) -> None:
        self.args, self.tokens = args, tokens
        self.model, self.optimizer = _build(contender, args)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, step: int) -> None:
        batch = _batch(self.args, self.tokens, step)
        dist.barrier()
        start = time.perf_counter()
        self.losses.append(_step(self.model, self.optimizer, batch).item())
        _sync()
        self.times.append(time.perf_counter() - start)

    def results(self) -> dict:
        """Warm-up time and step-time statistics over ranks (slowest rank per step), losses per step."""
        warmup = self.args.warmup
        step_times = _gather(self.times).max(dim=0).values.tolist()
        rank_losses = _gather(self.losses)
        measured = step_times[warmup:]
        q1, _, q3 = statistics.quantiles(measured, n=4) if len(measured) > 1 else (measured[0],) * 3
        median = statistics.median(measured)
        return {
            "warmup_s": sum(step_times[:warmup]),
            "step_times_s": measured,
            "step_time_s": {"median": median, "q1": q1, "q3": q3, "min": min(measured), "max": max(measured)},
            "tokens_per_s_per_rank": self.args.batch_size * self.args.seq_len / median,
            "losses": rank_losses.mean(dim=0).tolist(),
            "last_loss": rank_losses[:, -1].mean().item(),
            "last_loss_per_rank": rank_losses[:, -1].tolist(),
        }


def _warm_up(contender: Contender, args: argparse.Namespace, tokens: torch.Tensor) -> _Timed:
    """Build ``contender`` and run the warm-up steps; a compiled contender must compile graphs of its own."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    timed = _Timed(contender, args, tokens)
    for step in range(1, args.warmup + 1):
        timed.step(step)
    if contender.compiled and counters["stats"]["unique_graphs"] == graphs:
        raise RuntimeError("Dynamo compiled nothing for it: it reused another contender's graph; run it alone with --only")
    return timed


def _profile_pass(contender: Contender, args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, optimizer = _build(contender, args)
        for step in (1, 2):
            batch = _batch(args, tokens, step)
            dist.barrier()
            if device_type() == "cuda":
                torch.cuda.reset_peak_memory_stats()
            gc.collect()
            with record_function(WINDOW if step == 2 else "warm-up"):
                _step(model, optimizer, batch)
                _sync()
        cuda_peak = torch.cuda.max_memory_allocated() if device_type() == "cuda" else None
        del model, optimizer
    counts = _read_profile(prof, dist.get_backend())
    if cuda_peak is not None:
        counts["peak_bytes"] = cuda_peak
    peaks = _gather([counts.pop("peak_bytes")])
    return {**counts, "peak_bytes_per_rank": int(peaks.max().item())}


def _read_profile(prof, backend: str) -> dict:
    """Peak allocated bytes, collectives, communication and wait times inside the ``WINDOW`` event."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        events.append(event)
        stack.extend(event.children)
    events.sort(key=lambda event: event.start_time_ns)
    window = next(event for event in events if event.name == WINDOW)
    begin, end = window.start_time_ns, window.end_time_ns
    live: dict[int, int] = {}
    allocated = before = peak = collectives = comm_ns = wait_ns = waits = 0
    for event in events:
        inside = begin <= event.start_time_ns <= end
        if event.tag == _EventType.Allocation and str(event.extra_fields.device).startswith("cpu"):
            allocated += _allocation_delta(live, event.extra_fields.ptr, event.extra_fields.alloc_size)
            if event.start_time_ns < begin:
                before = allocated
            elif inside:
                peak = max(peak, allocated)
        elif inside and event.name.startswith("c10d::") and "barrier" not in event.name:
            collectives += 1
        elif inside and event.name.startswith(f"{backend}:"):
            comm_ns += event.duration_time_ns
        elif inside and event.name == "_c10d_functional::wait_tensor":
            waits += 1
            wait_ns += event.duration_time_ns
    return {
        "profiled_step_ms": (end - begin) / 1e6,
        "peak_bytes": max(before, peak),
        "collectives_per_step": collectives,
        "comm_ms_per_step": comm_ns / 1e6,
        "wait_ms_per_step": wait_ns / 1e6 if waits or not collectives else None,
    }


def _allocation_delta(live: dict[int, int], ptr: int, size: int) -> int:
    """Bytes a profiler allocation event adds to what this profile allocated and still holds.

    Frees of blocks allocated before the profile started count nothing. (The event's own
    ``total_allocated`` is not used: the CPU allocator keeps sizes of blocks allocated during
    an earlier profile and freed between profiles, so its total drifts from one profile to the next.)
    """
    if size > 0:
        live[ptr] = size
        return size
    return -live.pop(ptr, 0)


def _failed(row: dict, error: Exception) -> None:
    row.update(status="failed", reason=f"{type(error).__name__}: {str(error).strip().splitlines()[0]}")


def measure(args: argparse.Namespace) -> dict | None:
    """Run every selected contender on this rank; rank 0 returns the results, the others None.

    Each contender is built and warmed up in turn; then the measured steps are interleaved
    (step s of every contender, in an order rotated each step) so that drift in the machine's
    load falls on all of them alike; last, each contender's profile pass. A contender that
    raises becomes a row with the reason (the same error on every rank).
    """
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *_, **__: None)
    # Every compiled contender's graphs stay cached side by side (each one's own classes keep
    # their guards apart); the default limit of 8 entries per code object is too few for that.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    tokens = load_tokens(None, args.seed)
    selected = [contender for contender in contenders() if args.only is None or contender.name in args.only]
    rows = {c.name: {"name": c.name, "summary": c.summary, "distributed": c.distributed, "status": "ok"} for c in selected}
    timed: dict[str, _Timed] = {}
    for index, contender in enumerate(selected, 1):
        say(f"[{index}/{len(selected)}] {contender.name}: {contender.summary}: warming up ...", flush=True)
        try:
            timed[contender.name] = _warm_up(contender, args, tokens)
        except Exception as error:  # a contender that cannot run here becomes a row with the reason
            _failed(rows[contender.name], error)
            say(f"[{index}/{len(selected)}] {contender.name}: {rows[contender.name]['reason']}", flush=True)
    say(f"measuring {args.steps} steps of {', '.join(timed)}, interleaved ...", flush=True)
    for step in range(args.warmup + 1, args.warmup + args.steps + 1):
        names = list(timed)
        turn = step % max(1, len(names))
        for name in names[turn:] + names[:turn]:
            try:
                timed[name].step(step)
            except Exception as error:
                del timed[name]
                _failed(rows[name], error)
    for name, run in timed.items():
        rows[name].update(run.results())
    timed.clear()
    for index, contender in enumerate(selected, 1):
        row = rows[contender.name]
        if row["status"] == "ok":
            try:
                row.update(_profile_pass(contender, args, tokens))
            except Exception as error:
                _failed(row, error)
            dist.barrier()
        say(f"[{index}/{len(selected)}] {contender.name}: {_progress(row)}", flush=True)
    dist.destroy_process_group()
    if rank:
        return None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": device_type(),
        "cpu_cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "process_group_backend": "nccl" if device_type() == "cuda" else "gloo",
        "world_size": world,
        "model": args.model,
        "parameters": sum(p.numel() for p in build_model(args.model).parameters()),
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "param_dtype": str(args.param_dtype).removeprefix("torch.") if args.param_dtype else None,
        "reduce_dtype": str(args.reduce_dtype).removeprefix("torch.") if args.reduce_dtype else None,
        "compile_backend": args.backend,
        "optimizer": f"AdamW(lr={args.lr})",
        "seed": args.seed,
        "methods": METHODS,
        "rows": list(rows.values()),
    }


def _progress(row: dict) -> str:
    if row["status"] != "ok":
        return row["reason"]
    return (f"median step {row['step_time_s']['median']:.3f} s, warm-up {row['warmup_s']:.1f} s, "
            f"peak {row['peak_bytes_per_rank'] / 2**20:.1f} MiB/rank, {row['collectives_per_step']} collectives/step, "
            f"last loss {row['last_loss']:.6f}")


def _tolerance(results: dict) -> tuple[float, float] | None:
    """``(rtol, atol)`` for the loss check: ``torch.testing.assert_close``'s defaults for the parameter
    dtype (fp32: 1.3e-6, 1e-5); None means bitwise: ``aot_eager`` in full fp32, where simplefsdp and
    FSDP2 do the same arithmetic. With a lower ``param_dtype`` they do not: FSDP2 (as torchtitan
    configures it) also casts each sharded module's floating-point forward inputs, here the fp32
    rotary table, while simplefsdp casts only parameters."""
    dtype = getattr(torch, results["param_dtype"] or "float32")
    full_fp32 = dtype == torch.float32 and results["reduce_dtype"] in (None, "float32")
    if results["compile_backend"] == "aot_eager" and full_fp32:
        return None
    return {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}[dtype]


def check_parity(results: dict) -> tuple[bool, list[str]]:
    """Compare each rank's last loss of the simplefsdp rows with FSDP2 eager's; return (ok, verdict lines)."""
    rows = {row["name"]: row for row in results["rows"]}
    reference = rows.get(REFERENCE)
    if reference is None or reference["status"] != "ok":
        return True, [f"loss parity: not checked ({REFERENCE} did not run)"]
    tolerance = _tolerance(results)
    rule = "bitwise" if tolerance is None else f"rtol {tolerance[0]:g}, atol {tolerance[1]:g}"
    ok, lines = True, []
    for name in CHECKED:
        row = rows.get(name)
        if row is None:
            continue
        if row["status"] != "ok":
            ok = False
            lines.append(f"loss parity: FAIL: {name} did not run ({row['reason']})")
            continue
        pairs = list(zip(row["last_loss_per_rank"], reference["last_loss_per_rank"]))
        same = all(
            mine == theirs if tolerance is None else math.isclose(mine, theirs, rel_tol=tolerance[0], abs_tol=tolerance[1])
            for mine, theirs in pairs
        )
        ok = ok and same
        worst = max(abs(mine - theirs) for mine, theirs in pairs)
        lines.append(f"loss parity: {'ok' if same else 'FAIL'}: {name} vs {REFERENCE}, last-step loss per rank, "
                     f"{rule}: largest difference {worst:.3g}")
    return ok, lines


def _ratio(value: float | None, reference: float | None) -> str:
    return "—" if value is None or not reference else f"{value / reference:.2f}x"


def _share(milliseconds: float | None, row: dict) -> str:
    if milliseconds is None:
        return "n/a"
    return f"{milliseconds:.1f} ({100 * milliseconds / row['profiled_step_ms']:.0f}%)"


def format_table(results: dict) -> str:
    """The results as a Markdown table with ratios to FSDP2 eager (and to ``local`` for step time)."""
    rows = {row["name"]: row for row in results["rows"]}
    ok = {name: row for name, row in rows.items() if row["status"] == "ok"}
    ref, local = ok.get(REFERENCE), ok.get("local")
    header = ["contender", "step s (median)", "step s (q1–q3)", "step × FSDP2", "step × local", "tok/s/rank",
              "peak MiB/rank", "mem × FSDP2", "collectives/step", "comm ms/step", "wait ms/step",
              "warm-up s", "last loss", "Δ loss vs FSDP2"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in rows.items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']}: {row['reason']} |" + " — |" * (len(header) - 2))
            continue
        median, peak = row["step_time_s"]["median"], row["peak_bytes_per_rank"]
        wait = row["wait_ms_per_step"]
        delta = ("n/a (own batch)" if not row["distributed"] else
                 "—" if ref is None else f"{row['last_loss'] - ref['last_loss']:+.2e}")
        cells = [
            name, f"{median:.4f}", f"{row['step_time_s']['q1']:.4f}–{row['step_time_s']['q3']:.4f}",
            _ratio(median, ref and ref["step_time_s"]["median"]), _ratio(median, local and local["step_time_s"]["median"]),
            f"{row['tokens_per_s_per_rank']:,.0f}", f"{peak / 2**20:.1f}", _ratio(peak, ref and ref["peak_bytes_per_rank"]),
            str(row["collectives_per_step"]), _share(row["comm_ms_per_step"], row), _share(wait, row),
            f"{row['warmup_s']:.1f}", f"{row['last_loss']:.6f}", delta,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_lines(results: dict) -> list[str]:
    """Whether simplefsdp meets the goal: ≤0.75x FSDP2 eager and ≤1.2x local step time, memory ≤ FSDP2 eager."""
    ok = {row["name"]: row for row in results["rows"] if row["status"] == "ok"}
    mine = ok.get("simplefsdp")
    if mine is None:
        return ["goal: not evaluated (simplefsdp did not run)"]
    checks = [(REFERENCE, "step_time_s", 0.75), ("local", "step_time_s", 1.2), (REFERENCE, "peak_bytes_per_rank", 1.0)]
    lines = []
    for other, field, limit in checks:
        if other not in ok:
            lines.append(f"goal: {field} vs {other}: not evaluated ({other} did not run)")
            continue
        value = mine[field]["median"] if field == "step_time_s" else mine[field]
        base = ok[other][field]["median"] if field == "step_time_s" else ok[other][field]
        ratio = value / base
        verdict = "met" if ratio <= limit else "NOT met"
        lines.append(f"goal: simplefsdp {field} ≤ {limit:g}x {other}: {verdict} ({ratio:.2f}x)")
    return lines


def report(results: dict, args: argparse.Namespace) -> int:
    """Print the table, notes and verdicts; write JSON and PNG; return 1 when loss parity fails, else 0."""
    parity_ok, parity = check_parity(results)
    print(f"\n{results['model']} on {results['world_size']} {results['process_group_backend']} rank(s), "
          f"{results['batch_size']}x{results['seq_len']} tokens per rank per step, {results['steps']} measured steps "
          f"after {results['warmup']} warm-up, torch {results['torch']}, {results['cpu_cores']} CPU cores, "
          f"compile backend {results['compile_backend']}\n")
    print(format_table(results))
    print()
    for line in [*(f"- {name}: {text}" for name, text in results["methods"].items()), *parity, *goal_lines(results)]:
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        write_bar_chart(args.plot, _panels(results))
        print(f"wrote {args.plot}")
    if not parity_ok:
        print("simplefsdp bench: failed: simplefsdp did not reproduce FSDP2 eager's loss; the 'loss parity' lines "
              "above say which row, the rule and the difference", file=sys.stderr)
        return 1
    return 0


def _panels(results: dict) -> list[Panel]:
    rows = results["rows"]
    times = [(row["name"], row["step_time_s"]["median"] if row["status"] == "ok" else None) for row in rows]
    peaks = [(row["name"], row["peak_bytes_per_rank"] / 2**20 if row["status"] == "ok" else None) for row in rows]
    return [
        Panel("median step time (s)", [(name, value, "n/a" if value is None else f"{value:.3f}") for name, value in times]),
        Panel("peak memory per rank (MiB)",
              [(name, value, "n/a" if value is None else f"{value:.1f}") for name, value in peaks]),
    ]
