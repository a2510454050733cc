"""The ranks' side of ``simplefsdp bench``: every selected contender built, warmed up, timed step by step, profiled."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from simplefsdp.bench.contenders import CONTENDERS, Contender
from simplefsdp.bench.profiling import WINDOW, frees_counted_on_every_thread, read_profile
from simplefsdp.models.workload import Batch, ModelWithLoss, Workload, load_workload, micro_batches
from simplefsdp.runtime.grad_sync import reduces_every_micro_batch
from simplefsdp.runtime.mesh import device_type, init_distributed
from simplefsdp.train import learning_rate

METHODS = {
    "step_time": "wall time of forward+backward+optimizer step, slowest rank, median and quartiles over the measured "
                 "steps (interleaved across contenders); warm-up: the warm-up steps' total, compilation included",
    "peak_memory": "CPU: bytes allocated since the contender's copy started being built and not yet freed on any "
                   "thread (c10's count, read from torch.profiler memory events), maximum over the profiled step and "
                   "ranks; CUDA: max_memory_allocated over that step less the bytes allocated before the copy was "
                   "built",
    "collectives": "c10d::* operator events (process-group calls, barriers excluded) in the profiled step",
    "comm": "summed duration of the backend's own collective events (e.g. gloo:all_gather) in the profiled step, "
            "and its share of that step (the profiler slows the step)",
    "wire": "bytes one rank sends in the profiled step, mean over ranks: each backend collective event's recorded "
            "input bytes times its send factor on n ranks, n the world (ring algorithms): all-gather n-1, all-reduce "
            "2(n-1)/n, reduce-scatter and all-to-all (n-1)/n, broadcast (n-1)/n (its root's n-1 averaged); gloo runs "
            "a reduce-scatter as an all-reduce of the whole input, so it counts as one",
    "wait": "summed duration of _c10d_functional::wait_tensor events (compiled graphs; n/a for eager FSDP2 and DDP, "
            "whose Work.wait() the profiler does not record) in the profiled step, and its share of it",
}


def build(contender: Contender, args: argparse.Namespace, workload: Workload
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model built from ``--seed`` and wrapped by ``contender``, with its optimizer."""
    model = contender.wrap(ModelWithLoss(workload.build(args.seed).to(device_type()), workload.loss), args)
    implementation = {"foreach": True} if args.foreach else {"fused": True}  # fused: as train, torchtitan's default
    return model, torch.optim.AdamW(model.parameters(), lr=learning_rate(args.lr, "adamw"), **implementation)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, count: int = 1,
               reduce_every: bool = False) -> float:
    """``model(*inputs, target)``, the loss, and backward on each of ``count`` slices of ``batch``, gradients reduced
    after the last only (FSDP2's ``set_requires_gradient_sync``, ours, DDP's ``no_sync``) or, with
    ``reduce_every``, after each; then the optimizer step. The loss, after the device finished the step."""
    chunks, loss = micro_batches(batch, count, device_type()), 0.0
    for index, (inputs, target) in enumerate(chunks):
        sync = reduce_every or index == len(chunks) - 1
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        with contextlib.nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync():
            micro_loss = model(*inputs, target) / len(chunks)
            micro_loss.backward()
        loss = loss + micro_loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    if device_type() == "cuda":
        torch.cuda.synchronize()
    return float(loss)


def accumulation(contender: Contender, args: argparse.Namespace) -> tuple[int, bool]:
    """``(micro_batches, reduce_every)`` of ``contender``: ``--grad-accum-reduce`` applies to simplefsdp's rows; the
    others reduce after the last micro-batch only, as their own no-sync controls are meant to be used."""
    simplefsdp = contender.name.startswith("simplefsdp")
    mode = "replicate" if contender.name == "simplefsdp-replicate" else "fully_shard"
    return args.grad_accum, simplefsdp and reduces_every_micro_batch(args.grad_accum_reduce, mode)


def step_batch(args: argparse.Namespace, workload: Workload, tokens: torch.Tensor, step: int) -> Batch:
    """This rank's batch of ``step``: the same for every contender."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return workload.batch(tokens, step, args.batch_size * args.grad_accum, args.seq_len, args.seed, rank, world)


def gather(values: list[float]) -> torch.Tensor:
    """Every rank's ``values``, shape ``(world, len(values))``, float64."""
    mine = torch.tensor(values, dtype=torch.float64, device=device_type())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).cpu()


class TimedRun:
    """One contender's model and optimizer on this rank, with each step's time and loss."""

    def __init__(self, contender: Contender, args: argparse.Namespace, workload: Workload, tokens: torch.Tensor
                 ) -> None:
        self.contender, self.args, self.workload, self.tokens = contender, args, workload, tokens
        self.model, self.optimizer = build(contender, args, workload)
        self.times, self.losses = [], []

    def step(self, step: int) -> None:
        batch = step_batch(self.args, self.workload, self.tokens, step)
        dist.barrier()
        start = time.perf_counter()
        self.losses.append(train_step(self.model, self.optimizer, batch, *accumulation(self.contender, self.args)))
        self.times.append(time.perf_counter() - start)

    def warm_up(self) -> None:
        """The warm-up steps; raises if a compiled contender compiled nothing (its times would be another's)."""
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        for step in range(1, self.args.warmup + 1):
            self.step(step)
        if self.contender.compiled and counters["stats"]["unique_graphs"] == graphs:
            raise RuntimeError("Dynamo compiled nothing for it: it reused another contender's graph; "
                               "run it alone with --only")

    def results(self) -> dict:
        """Warm-up time and step-time statistics over ranks (slowest rank per step), losses per step."""
        step_times = gather(self.times).max(dim=0).values.tolist()
        rank_losses = gather(self.losses)
        measured = step_times[self.args.warmup:]
        median = statistics.median(measured)
        q1, _, q3 = statistics.quantiles(measured, n=4) if len(measured) > 1 else (median,) * 3
        return {"warmup_s": sum(step_times[:self.args.warmup]), "step_times_s": measured,
                "step_time_s": {"median": median, "q1": q1, "q3": q3, "min": min(measured), "max": max(measured)},
                "tokens_per_s_per_rank": self.args.batch_size * self.args.grad_accum * self.args.seq_len / median,
                "losses": rank_losses.mean(dim=0).tolist(), "last_loss": rank_losses[:, -1].mean().item(),
                "last_loss_per_rank": rank_losses[:, -1].tolist()}


def profile_pass(contender: Contender, args: argparse.Namespace, workload: Workload, tokens: torch.Tensor) -> dict:
    """A fresh copy trains two steps under torch.profiler (memory events on); the second, untimed, is read."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    before = torch.cuda.memory_allocated() if device_type() == "cuda" else 0
    with (frees_counted_on_every_thread(),
          profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof):
        model, optimizer = build(contender, args, workload)
        for step in (1, 2):
            batch = step_batch(args, workload, tokens, step)
            dist.barrier()
            if device_type() == "cuda":
                torch.cuda.reset_peak_memory_stats()
            gc.collect()
            with record_function(WINDOW if step == 2 else "warm-up"):
                train_step(model, optimizer, batch, *accumulation(contender, args))
        cuda_peak = torch.cuda.max_memory_allocated() - before if device_type() == "cuda" else None
        del model, optimizer
    counts = read_profile(prof, dist.get_backend(), dist.get_world_size())
    cpu_peak = counts.pop("peak_bytes")
    peaks, sent = gather([cpu_peak if cuda_peak is None else cuda_peak, counts.pop("wire_bytes")]).T
    return {**counts, "peak_bytes_per_rank": int(peaks.max().item()), "wire_bytes_per_rank": sent.mean().item()}


def _failed(row: dict, error: Exception) -> None:
    row.update(status="failed", reason=f"{type(error).__name__}: {str(error).strip().splitlines()[0]}")


def measure(args: argparse.Namespace) -> dict | None:
    """Run every selected contender on this rank; rank 0 returns the results, the others None. Warm-ups run in turn;
    the measured steps interleave (in an order rotated each step) so that drift in the machine's load falls on all
    contenders alike; the profile passes come last. A contender that raises becomes a failed row."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *_, **__: None)
    # Every compiled contender's graphs stay cached side by side (each one's own classes keep
    # their guards apart); the default limit of 8 entries per code object is too few for that.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    workload = load_workload(args.model, args.layers)
    with torch.device("meta"):
        shapes = workload.build(args.seed)
    tokens = workload.tokens(shapes, None, args.seed)
    selected = [contender for contender in CONTENDERS if args.only is None or contender.name in args.only]
    rows = {c.name: {"name": c.name, "summary": c.summary, "distributed": c.distributed, "status": "ok"}
            for c in selected}
    timed: dict[str, TimedRun] = {}
    for index, contender in enumerate(selected, 1):
        say(f"[{index}/{len(selected)}] {contender.name}: {contender.summary}: warming up ...", flush=True)
        try:
            timed[contender.name] = TimedRun(contender, args, workload, tokens)
            timed[contender.name].warm_up()
        except Exception as error:  # a contender that cannot run here becomes a row with the reason
            timed.pop(contender.name, None)
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
    for name in list(timed):  # popped, so no model outlives its measurement into the profile passes
        rows[name].update(timed.pop(name).results())
    for index, contender in enumerate(selected, 1):
        row = rows[contender.name]
        if row["status"] == "ok":
            try:
                row.update(profile_pass(contender, args, workload, tokens))
            except Exception as error:
                _failed(row, error)
            dist.barrier()
        say(f"[{index}/{len(selected)}] {contender.name}: {_progress(row)}", flush=True)
    dist.barrier()  # no rank leaves (bench/__init__.py: leave_rank) while another still communicates
    if rank:
        return None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "device": device_type(), "cpu_cores": os.cpu_count(), "load_average": os.getloadavg(),
        "process_group_backend": "nccl" if device_type() == "cuda" else "gloo", "world_size": world,
        **{option: getattr(args, option) for option in ("model", "steps", "warmup", "batch_size", "seq_len", "seed",
                                                          "grad_accum", "grad_accum_reduce", "param_dtype",
                                                          "reduce_dtype")},
        "parameters": sum(p.numel() for p in shapes.parameters()), "compile_backend": args.backend,
        "optimizer": f"AdamW(lr={learning_rate(args.lr, 'adamw')}, {'foreach' if args.foreach else 'fused'}=True)",
        "methods": METHODS, "rows": list(rows.values()),
    }


def _progress(row: dict) -> str:
    if row["status"] != "ok":
        return row["reason"]
    return (f"median step {row['step_time_s']['median']:.3f} s, warm-up {row['warmup_s']:.1f} s, "
            f"peak {row['peak_bytes_per_rank'] / 2**20:.1f} MiB/rank, {row['collectives_per_step']} collectives/step, "
            f"last loss {row['last_loss']:.6f}")
