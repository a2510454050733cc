"""``simplefsdp train``: train a reference model with ``compile_sharded`` on local ranks."""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from simplefsdp.api import compile_sharded
from simplefsdp.data import global_batch, load_tokens
from simplefsdp.models.llama import CONFIGS, build_model
from simplefsdp.runtime.launch import is_launched_rank, launch_local_ranks
from simplefsdp.runtime.mesh import MODES, init_distributed
from simplefsdp.runtime.mixed_precision import MixedPrecision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simplefsdp.cli import dtype_arg

    parser.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    parser.add_argument("--model", default="cpu-small", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mode", default="fully_shard", choices=MODES)
    parser.add_argument("--param-dtype", type=dtype_arg, default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--reduce-dtype", type=dtype_arg, default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--data", default=None, help="a text file (byte tokens); synthetic tokens when absent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the sharded model eagerly")
    parser.add_argument("--buckets", default="auto", choices=("auto", "block", "none"),
                        help="bucketing of the collectives (none: one collective per parameter)")
    parser.add_argument("--no-reorder", dest="reorder", action="store_false",
                        help="keep the traced order of the collectives (no prefetching)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Train on this process when launched by torchrun, else launch ``--nproc`` local ranks."""
    if args.nproc < 1 or args.steps < 1 or args.batch_size < 1 or args.seq_len < 1:
        raise SystemExit("simplefsdp train: --nproc, --steps, --batch-size and --seq-len must be at least 1")
    if not is_launched_rank():
        return launch_local_ranks(args.nproc, argv)
    train(args)
    return 0


def train(args: argparse.Namespace) -> None:
    """The training loop of one rank; rank 0 prints progress and a closing summary."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    num_params = sum(p.numel() for p in model.parameters())
    compile_sharded(
        model, mode=args.mode, mp_policy=MixedPrecision(args.param_dtype, args.reduce_dtype),
        compile=args.compile, backend=args.backend, buckets=None if args.buckets == "none" else args.buckets,
        reorder=args.reorder,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens = load_tokens(args.data, args.seed)
    device = next(model.parameters()).device
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"simplefsdp train: {args.model} ({num_params / 1e6:.2f}M params) on {world} rank(s), mode {args.mode}, "
        f"{args.batch_size}x{args.seq_len} tokens per rank per step")

    step_times, losses = [], []
    for step in range(1, args.steps + 1):
        batch = global_batch(tokens, step, args.batch_size * world, args.seq_len, args.seed)
        batch = batch.chunk(world)[rank].to(device)
        start = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        step_times.append(time.perf_counter() - start)
        tokens_per_s = args.batch_size * args.seq_len * world / step_times[-1]
        note = "  (includes compilation)" if step == 1 else ""
        say(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  {tokens_per_s:10,.0f} tok/s  "
            f"{step_times[-1]:.3f} s{note}", flush=True)

    steady = step_times[1:] or step_times
    median = statistics.median(steady)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    say(
        "summary: "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps; "
        f"first step {step_times[0]:.1f} s (compilation); median step {median:.3f} s; "
        f"{args.batch_size * args.seq_len * world / median:,.0f} tok/s total, "
        f"{args.batch_size * args.seq_len / median:,.0f} tok/s per rank; peak RSS rank 0 {peak_rss_mib:,.0f} MiB"
    )
    dist.destroy_process_group()
