"""``simplefsdp train``: train a reference model with ``compile_sharded`` on local ranks."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

from simplefsdp.api import compile_sharded
from simplefsdp.data import load_tokens, rank_batch, step_seq_len
from simplefsdp.ir.hardware import cpu_profile
from simplefsdp.mfu import peak_flops_per_second, step_flops
from simplefsdp.models.llama import CONFIGS, build_model
from simplefsdp.runtime.activation_checkpoint import AC_MODES, apply_activation_checkpointing
from simplefsdp.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from simplefsdp.runtime.clip_grad import clip_grad_norm_
from simplefsdp.runtime.launch import is_launched_rank, launch_local_ranks
from simplefsdp.runtime.mesh import MODES, init_distributed
from simplefsdp.runtime.meta_init import materialize_sharded
from simplefsdp.runtime.mixed_precision import MixedPrecision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simplefsdp.cli import dtype_arg

    parser.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    parser.add_argument("--model", default="cpu-small", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=20, help="train until this step (counting resumed steps)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--variable-seq-len", action="store_true",
                        help="each step draws its sequence length in [seq-len/2, seq-len] from --seed")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step; gradients reduce once")
    parser.add_argument("--max-norm", type=float, default=None, help="clip the total gradient norm to this value")
    parser.add_argument("--mode", default="fully_shard", choices=MODES)
    parser.add_argument("--param-dtype", type=dtype_arg, default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--reduce-dtype", type=dtype_arg, default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--activation-checkpointing", default="none", choices=AC_MODES, help="per transformer block")
    parser.add_argument("--init-on-meta", action="store_true", help="build on meta, allocate and initialize shards only")
    parser.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints (DCP) here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps; the last step always")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
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


def check_arguments(args: argparse.Namespace) -> None:
    """Exit with a message naming the bad option and the fix; runs before any rank starts."""
    for option in ("nproc", "steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(args, option) < 1:
            fail(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if args.checkpoint_every < 0:
        fail(f"--checkpoint-every must be 0 (only the last step) or positive, got {args.checkpoint_every}")
    if args.max_norm is not None and args.max_norm <= 0:
        fail(f"--max-norm must be positive, got {args.max_norm}; leave it out to train without clipping")
    if args.resume and args.checkpoint_dir is None:
        fail("--resume needs --checkpoint-dir DIR, the directory the earlier run saved into")
    if args.resume and latest_checkpoint(args.checkpoint_dir) is None:
        fail(f"--resume: no checkpoint to resume from in {args.checkpoint_dir} "
             "(the directory does not exist or holds no complete step-* checkpoint)")


def fail(message: str) -> None:
    raise SystemExit(f"simplefsdp train: {message}")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Train on this process when launched by torchrun, else launch ``--nproc`` local ranks."""
    check_arguments(args)
    if not is_launched_rank():
        if not torch.cuda.is_available():
            cpu_profile()  # measure the CPU for MFU now, while no rank runs, unless its profile is cached
        return launch_local_ranks(args.nproc, argv)
    train(args)
    # A finished rank leaves without running C++ static destructors: with PyTorch 2.13 and
    # gloo these can abort at exit ("terminate called without an active exception"),
    # which would turn a completed run into a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The sharded model, initialized from ``--seed`` the same way with or without ``--init-on-meta``."""
    with torch.device("meta" if args.init_on_meta else "cpu"):
        model = build_model(args.model)
    if not args.init_on_meta:
        torch.manual_seed(args.seed)
        model.init_weights()
    apply_activation_checkpointing(model.layers, args.activation_checkpointing)
    compile_sharded(
        model, mode=args.mode, mp_policy=MixedPrecision(args.param_dtype, args.reduce_dtype),
        compile=args.compile, backend=args.backend, buckets=None if args.buckets == "none" else args.buckets,
        reorder=args.reorder,
    )
    if args.init_on_meta:
        torch.manual_seed(args.seed)
        materialize_sharded(model)
    return model


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``, computed in fp32."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def train(args: argparse.Namespace) -> None:
    """The training loop of one rank; rank 0 prints progress and a closing summary."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens = load_tokens(args.data, args.seed)
    device = next(model.parameters()).device
    say = print if rank == 0 else (lambda *_, **__: None)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    flops_per_step, peak = (step_flops(args.model, args.batch_size, args.seq_len) * args.grad_accum * world,
                            peak_flops_per_second(device, args.param_dtype or torch.float32)) if rank == 0 else (0, None)
    say(f"simplefsdp train: {args.model} ({num_params / 1e6:.2f}M params) on {world} rank(s), mode {args.mode}, "
        f"{args.grad_accum} x {args.batch_size}x{args.seq_len} tokens per rank per step")

    start = 0
    if args.resume:
        path = latest_checkpoint(args.checkpoint_dir)
        try:
            start = load_checkpoint(path, model, optimizer)
        except ValueError as error:
            fail(str(error))
        say(f"resumed from {path} at step {start}")

    step_times, losses, mfus = [], [], []
    for step in range(start + 1, args.steps + 1):
        seq_len = step_seq_len(step, args.seq_len, args.seed) if args.variable_seq_len else args.seq_len
        batch = rank_batch(tokens, step, args.batch_size * args.grad_accum, seq_len, args.seed, rank, world)
        graphs = counters["stats"]["unique_graphs"]
        micro_batches = batch.to(device).chunk(args.grad_accum)
        begin = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for index, micro in enumerate(micro_batches):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            loss = next_token_loss(model, micro) / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        grad_note = ""
        if args.max_norm is not None:
            grad_note = f"  grad norm {clip_grad_norm_(model, args.max_norm).item():.3f}"
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / world)
        step_times.append(time.perf_counter() - begin)
        share = seq_len / args.seq_len  # FLOPs scaled by tokens: exact but for attention's quadratic part
        mfus.append(share * flops_per_step / step_times[-1] / (peak * world) if peak else float("nan"))
        note = "  (includes compilation)" if len(step_times) == 1 and args.compile else ""
        note += "  recompiled" if len(step_times) > 1 and counters["stats"]["unique_graphs"] > graphs else ""
        say(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
            f"{share * tokens_per_step / step_times[-1]:10,.0f} tok/s  "
            f"MFU {mfus[-1]:6.2%}  {step_times[-1]:.3f} s{grad_note}{note}", flush=True)
        if args.checkpoint_dir and (step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0)):
            say(f"saved {save_checkpoint(args.checkpoint_dir, step, model, optimizer)}", flush=True)

    if step_times:
        summarize(say, args, start, losses, step_times, mfus, tokens_per_step, world)
    else:
        say(f"summary: the checkpoint is already at step {start} >= --steps {args.steps}; nothing to train")
    dist.destroy_process_group()


def summarize(say, args, start, losses, step_times, mfus, tokens_per_step, world) -> None:
    """Rank 0's closing line: loss change, compile time, median step time, throughput, MFU and memory."""
    steady = slice(1, None) if len(step_times) > 1 else slice(None)
    median = statistics.median(step_times[steady])
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    say(
        "summary: "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start + 1}-{args.steps}; "
        f"first step {step_times[0]:.1f} s; median step {median:.3f} s; "
        f"{tokens_per_step / median:,.0f} tok/s total, {tokens_per_step / world / median:,.0f} tok/s per rank; "
        f"MFU {statistics.median(mfus[steady]):.2%}; peak RSS rank 0 {peak_rss_mib:,.0f} MiB"
    )
