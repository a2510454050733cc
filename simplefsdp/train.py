"""``simplefsdp train``: train a model (``--model``: a reference name, ``hf:PATH`` or ``package.module:function``) with
``compile_sharded`` on local ranks."""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import plots
from simplefsdp.api import check_precompile, compile_sharded
from simplefsdp.data import step_seq_len
from simplefsdp.ir.hardware import cpu_profile
from simplefsdp.ir.replica_sync import replica_sync_problem
from simplefsdp.mfu import peak_flops_per_second, step_flops
from simplefsdp.models.llama_tp import check_tensor_parallel, parallelize_llama
from simplefsdp.models.workload import Workload, blocks, load_workload, micro_batches
from simplefsdp.names import DEFAULT_LR
from simplefsdp.optim import DeMo, DiLoCo, GaLoreAdamW, state_bytes
from simplefsdp.passes.options import check_pass_options
from simplefsdp.runtime.activation_checkpoint import apply_activation_checkpointing
from simplefsdp.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from simplefsdp.runtime.clip_grad import clip_grad_norm_
from simplefsdp.runtime.fault_tolerance import INSTALL, ReplicaGroup
from simplefsdp.runtime.grad_sync import reduces_every_micro_batch
from simplefsdp.runtime.launch import is_launched_rank, launch_local_ranks, launch_replica_groups, leave_rank
from simplefsdp.runtime.mesh import check_tensor_parallel_world, device_type, init_distributed
from simplefsdp.runtime.meta_init import materialize_sharded
from simplefsdp.runtime.mixed_precision import dtype_named, mixed_precision_option
from simplefsdp.runtime.quantize import quantize_option


def check_arguments(args: argparse.Namespace) -> None:
    """Exit with a message naming the bad option and the fix; runs before any rank starts."""
    if reason := workload_problem(args):
        fail(reason)
    for option in ("nproc", "steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(args, option) < 1:
            fail(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if args.checkpoint_every < 0:
        fail(f"--checkpoint-every must be 0 (only the last step) or positive, got {args.checkpoint_every}")
    if args.max_norm is not None and args.max_norm <= 0:
        fail(f"--max-norm must be positive, got {args.max_norm}; leave it out to train without clipping")
    if args.resume and args.checkpoint_dir is None:
        fail("--resume needs --checkpoint-dir DIR, the directory the earlier run saved into")
    if args.resume and latest_checkpoint(checkpoint_root(args)) is None:
        fail(f"--resume: no checkpoint to resume from in {checkpoint_root(args)} "
             "(the directory does not exist or holds no complete step-* checkpoint)")
    try:
        check_pass_options(None, args.buckets, args.reorder, args.prefetch, args.memory_budget)
    except (TypeError, ValueError) as error:
        fail(str(error))
    if args.plot and (reason := plots.missing()):
        fail(f"--plot {args.plot}: {reason}")
    if args.replica_sync != "step" and not args.fault_tolerant:
        fail(f"--replica-sync {args.replica_sync} is what crosses replica groups: add --fault-tolerant")
    for applies, problem in ((args.fault_tolerant, fault_tolerant_problem), (args.tp != 1, tensor_parallel_problem),
                             (args.optimizer == "galore", galore_problem), (args.precompile, precompile_problem)):
        if applies and (reason := problem(args)):
            fail(reason)


def workload_problem(args: argparse.Namespace) -> str | None:
    """Why ``--model`` cannot train as asked (with the fix), or None."""
    try:
        workload = load_workload(args.model, args.layers)
    except ValueError as error:
        return str(error)
    if workload.config is None and (args.init_on_meta or args.tp != 1):
        return (f"--init-on-meta and --tp take the reference models (their init_weights and TP plan); for --model "
                f"{args.model} drop them")
    if workload.config is None and args.optimizer == "galore" and not args.galore_rank and not workload.width:
        return f"--optimizer galore: name the subspace's rank for --model {args.model} with --galore-rank R"
    return None


def precompile_problem(args: argparse.Namespace) -> str | None:
    """Why ``--precompile`` cannot run with ``args``, if it cannot."""
    if args.variable_seq_len:
        return "--precompile compiles a graph per sequence length: drop --variable-seq-len or --precompile"
    try:
        check_precompile(True, args.compile, args.backend, {})
    except ValueError as error:
        return f"--precompile: {error}"
    return None


def checkpoint_root(args: argparse.Namespace) -> str | None:
    """Where this rank's checkpoints go: ``--checkpoint-dir``, written by replica group 0 alone; or each group's
    ``group-G`` folder in it where every group keeps state of its own (``--replica-sync`` demo or diloco)."""
    if args.checkpoint_dir and args.fault_tolerant and args.replica_sync != "step":
        return os.path.join(args.checkpoint_dir, f"group-{args.replica_group or 0}")
    return args.checkpoint_dir


def galore_problem(args: argparse.Namespace) -> str | None:
    """Why ``--optimizer galore`` cannot run as asked (with the fix), or None."""
    if args.galore_rank is not None and args.galore_rank < 1 or args.galore_update_every < 1:
        return "--galore-rank and --galore-update-every must be at least 1"
    if args.tp != 1:
        return "--optimizer galore projects gradients' columns, which --tp shards; train with --optimizer adamw"
    if args.fault_tolerant:
        return ("--optimizer galore does not combine with --fault-tolerant yet (a healing group would need the "
                "projectors); train with --optimizer adamw")
    return None


def tensor_parallel_problem(args: argparse.Namespace) -> str | None:
    """Why ``--tp`` cannot run as asked (with the fix), or None."""
    world = int(os.environ["WORLD_SIZE"]) if is_launched_rank() else args.nproc
    try:
        check_tensor_parallel_world(world, args.tp, args.mode)
        check_tensor_parallel(load_workload(args.model).config, args.tp)
    except ValueError as error:
        return f"--tp {args.tp}: {error}"
    if args.fault_tolerant or args.init_on_meta:
        return f"--tp {args.tp} does not combine with --fault-tolerant or --init-on-meta yet; drop one of them"
    return None


def fault_tolerant_problem(args: argparse.Namespace) -> str | None:
    """Why ``--fault-tolerant`` cannot run as asked (with the fix), or None."""
    if importlib.util.find_spec("torchft") is None:
        return f"--fault-tolerant needs torchft; {INSTALL}"
    if args.mode != "fully_shard":
        return f"--fault-tolerant runs fully_shard inside each replica group; drop --mode {args.mode}"
    if args.replica_groups < 1 or args.max_restarts < 0:
        return "--replica-groups must be at least 1 and --max-restarts at least 0"
    if min(args.sync_every, args.demo_chunk, args.demo_top_k) < 1:
        return "--sync-every, --demo-chunk and --demo-top-k must be at least 1"
    if args.outer_lr <= 0 or not 0 <= args.outer_momentum < 1:
        return f"--outer-lr must be positive and --outer-momentum in [0, 1); got {args.outer_lr}, {args.outer_momentum}"
    if problem := replica_sync_problem(args.replica_sync, args.outer_quantize):
        return problem
    if args.replica_sync != "step" and args.optimizer != "adamw":
        return f"--replica-sync {args.replica_sync} brings its own optimizer; drop --optimizer {args.optimizer}"
    if is_launched_rank() and (args.replica_group is None or args.lighthouse is None):
        return "--fault-tolerant under torchrun needs --replica-group G and --lighthouse http://HOST:PORT"
    return None


def print_line(message: str, **_) -> None:
    """Print ``message`` and its newline in one write: lines of replica groups sharing a pipe never interleave."""
    sys.stdout.write(f"{message}\n")
    sys.stdout.flush()


def fail(message: str) -> None:
    raise SystemExit(f"simplefsdp train: {message}")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Train on this process when launched by torchrun, else launch ``--nproc`` local ranks."""
    check_arguments(args)
    if not is_launched_rank():
        if not torch.cuda.is_available():
            cpu_profile()  # measure the CPU for MFU now, while no rank runs, unless its profile is cached
        if args.fault_tolerant and args.replica_group is None:
            return launch_replica_groups(args.replica_groups, args.nproc, argv, args.lighthouse)
        return launch_local_ranks(args.nproc, argv, args.max_restarts if args.fault_tolerant else 0)
    train(args)
    leave_rank()


def build(args: argparse.Namespace, workload: Workload) -> torch.nn.Module:
    """The sharded model, initialized from ``--seed`` the same way with or without ``--init-on-meta``."""
    with torch.device("meta" if args.init_on_meta else "cpu"):
        model = workload.build(args.seed)
    mesh = None
    if args.tp > 1:  # TP first, as torchtitan: the plan names the modules before checkpointing wraps them
        mesh_2d = init_device_mesh(device_type(), (dist.get_world_size() // args.tp, args.tp),
                                   mesh_dim_names=("dp", "tp"))
        parallelize_llama(model, mesh_2d["tp"])
        mesh = mesh_2d["dp"]
    apply_activation_checkpointing(blocks(model), args.activation_checkpointing)
    compile_sharded(
        model, mesh=mesh, mode=args.mode, mp_policy=mixed_precision_option(args), compile=args.compile,
        reshard_after_forward=args.reshard_after_forward, backend=args.backend, buckets=args.buckets,
        reorder=args.reorder, prefetch=args.prefetch, memory_budget=args.memory_budget, quantize=quantize_option(args),
        compile_blocks_once=args.compile_blocks_once, precompile=args.precompile)
    if args.init_on_meta:
        torch.manual_seed(args.seed)
        materialize_sharded(model)
    return model


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module, width: int | None) -> torch.optim.Optimizer:
    """``--optimizer``: fused AdamW (one kernel per step instead of a dozen foreach ops, each paying DTensor's
    dispatch: torchtitan's default), or GaLoreAdamW at ``--galore-rank`` (``width / 4`` by default); under
    ``--fault-tolerant``, ``--replica-sync demo`` or ``diloco`` brings its own (DeMo; DiLoCo over fused AdamW)."""
    lr = learning_rate(args.lr, args.optimizer)
    if args.fault_tolerant and args.replica_sync == "demo":
        return DeMo(model.parameters(), lr=lr, chunk=args.demo_chunk, top_k=args.demo_top_k)
    if args.fault_tolerant and args.replica_sync == "diloco":
        return DiLoCo(model.parameters(), lr=lr, sync_every=args.sync_every, outer_lr=args.outer_lr,
                      outer_momentum=args.outer_momentum, outer_quantize=args.outer_quantize, fused=True)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return GaLoreAdamW(model.parameters(), lr=lr, rank=args.galore_rank or width // 4, seed=args.seed,
                       update_every=args.galore_update_every, shard_projector=args.galore_shard_projector,
                       projector_dtype=dtype_named(args.galore_projector_dtype))


def learning_rate(lr: float | None, optimizer: str) -> float:
    """``--lr``, else ``optimizer``'s rate in ``DEFAULT_LR`` (AdamW's 1e-3, GaLore's recommended 1e-2)."""
    return DEFAULT_LR[optimizer] if lr is None else lr


def train(args: argparse.Namespace) -> None:
    """The training loop of one rank; rank 0 prints progress and a closing summary."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = load_workload(args.model, args.layers)
    model = build(args, workload)
    dp_rank, dp_world = rank // args.tp, world // args.tp  # a tensor-parallel group trains one batch
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(args, model, workload.width)
    replicas = ReplicaGroup(model, optimizer, args.replica_group, args.replica_groups, args.lighthouse,
                            sync=args.replica_sync) if args.fault_tolerant else None
    data_rank, data_world = ((args.replica_group * world + rank, args.replica_groups * world) if replicas
                             else (dp_rank, dp_world))
    tokens = workload.tokens(model, args.data, args.seed)
    device = next(model.parameters()).device
    say = print_line if rank == 0 else (lambda *_, **__: None)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * dp_world
    flops_per_step, peak = (step_flops(model, workload.attention, args.batch_size, args.seq_len) * args.grad_accum
                            * dp_world, peak_flops_per_second(device, dtype_named(args.param_dtype) or torch.float32)
                            ) if rank == 0 and workload.attention else (0, None)
    layout = f"mesh (dp {dp_world}, tp {args.tp})" if args.tp > 1 else f"mode {args.mode}"
    say(f"simplefsdp train: {args.model} ({num_params / 1e6:.2f}M params in {len(blocks(model))} blocks) on {world} "
        f"rank(s), {layout}, {args.grad_accum} x {args.batch_size}x{args.seq_len} tokens per "
        f"{'dp ' * (args.tp > 1)}rank per step")
    if args.optimizer == "galore" and args.lr is None:
        say(f"--optimizer galore: lr {DEFAULT_LR['galore']:g}, GaLore's recommended rate (pass --lr to change it)")

    start = 0
    if args.resume:
        path = latest_checkpoint(checkpoint_root(args))
        try:
            start = load_checkpoint(path, model, optimizer)
        except ValueError as error:
            fail(str(error))
        say(f"resumed from {path} at step {start}")

    trained, step_times, losses, mfus, cross_group_bytes = [], [], [], [], []
    reduce_every = reduces_every_micro_batch(args.grad_accum_reduce, args.mode)
    if args.compile:  # imported here: an eager rank never loads Inductor's compiler
        from simplefsdp.runtime.compile import compiled_graphs, graph_cache_hits
        say("compiling the forward and backward graphs in the first step ...", flush=True)
    begin = time.perf_counter()  # a step's time includes its quorum under --fault-tolerant
    for step in replicas.steps(start, args.steps) if replicas else range(start + 1, args.steps + 1):
        seq_len = step_seq_len(step, args.seq_len, args.seed) if args.variable_seq_len else args.seq_len
        batch = workload.batch(tokens, step, args.batch_size * args.grad_accum, seq_len, args.seed, data_rank,
                               data_world)
        graphs = compiled_graphs() if args.compile else 0
        trained.append(step)
        loss_sum = torch.zeros((), device=device)
        for index, (inputs, target) in enumerate(micro_batches(batch, args.grad_accum, device)):
            model.set_requires_gradient_sync(reduce_every or index == args.grad_accum - 1)
            loss = workload.loss(model(*inputs), target) / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        if replicas:
            replicas.average_gradients()
        grad_note = "" if args.max_norm is None else f"  grad norm {clip_grad_norm_(model, args.max_norm).item():.3f}"
        if replicas:
            committed = replicas.step_optimizer(step)
        else:
            optimizer.step()
            committed = True
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / world)
        step_times.append(time.perf_counter() - begin)
        share = seq_len / args.seq_len  # FLOPs scaled by tokens: exact but for attention's quadratic part
        mfus.append(share * flops_per_step / step_times[-1] / (peak * world) if peak else float("nan"))
        if len(step_times) == 1 and args.compile:
            hits, lookups = graph_cache_hits()
            # one rank of a host compiles a graph and the others load it (``InductorOncePerHost``): counted over the
            # ranks, so that a cold run says it compiled whichever rank prints
            compiled = torch.tensor(lookups - hits, device=device)
            dist.all_reduce(compiled)
            cached = (f" ({max(0, lookups - int(compiled.item()))} of {lookups} graphs from Inductor's cache)"
                      if lookups else "")
            say(f"compiled in {step_times[0]:.1f} s{cached}", flush=True)
        note = "  recompiled" if len(step_times) > 1 and args.compile and compiled_graphs() > graphs else ""
        if replicas:
            cross_group_bytes.append(replicas.sent_bytes)
            note += f"  cross-group {replicas.sent_bytes:,} B"
            if committed and args.replica_sync == "diloco" and step % args.sync_every == 0:
                note += f"  outer step, checksum {replicas.checksum()}"
            note += f"  group {args.replica_group} replicas {replicas.participants}/{args.replica_groups}"
            note += "" if committed else "  not committed"
        say(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
            f"{share * tokens_per_step / step_times[-1]:10,.0f} tok/s  "
            f"{_mfu(mfus[-1])}  {step_times[-1]:.3f} s{grad_note}{note}", flush=True)
        saves = committed and not (replicas and args.replica_group and args.replica_sync == "step")
        due = step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0)
        if args.checkpoint_dir and saves and due:
            say(f"saved {save_checkpoint(checkpoint_root(args), step, model, optimizer)}", flush=True)
        begin = time.perf_counter()

    if step_times:
        summarize(say, args, trained[0] - 1, losses, step_times, mfus, tokens_per_step, world, optimizer)
        if replicas:
            say(f"cross-group bytes per step: {round(statistics.mean(cross_group_bytes))}")
            say(f"group {args.replica_group}: rank 0's parameter checksum {replicas.checksum()}")
        if args.plot and rank == 0:
            title = f"simplefsdp train: {args.model}, {world} rank(s), mode {args.mode}"
            say(f"wrote {plots.loss_chart(args.plot, title, trained, losses)}")
    else:
        say(f"summary: the checkpoint is already at step {start} >= --steps {args.steps}; nothing to train")
    # No rank leaves while another still needs it: rank 0 hosts the group's stores (torch's and torchft's
    # manager), which a slower rank still reads in its last quorum. ``run`` then exits without gloo's teardown.
    dist.barrier()


def summarize(say, args, start, losses, step_times, mfus, tokens_per_step, world, optimizer) -> None:
    """Rank 0's closing lines: loss change, compile time, median step time, throughput, MFU and memory; the
    optimizer's state bytes on this rank."""
    steady = slice(1, None) if len(step_times) > 1 else slice(None)
    median = statistics.median(step_times[steady])
    say(f"summary: loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start + 1}-{args.steps}; first step "
        f"{step_times[0]:.1f} s; median step {median:.3f} s; {tokens_per_step / median:,.0f} tok/s total, "
        f"{tokens_per_step / world / median:,.0f} tok/s per rank; {_mfu(statistics.median(mfus[steady]))}; "
        f"peak RSS rank 0 {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")
    say(f"optimizer state bytes per rank: {state_bytes(optimizer)}")


def _mfu(mfu: float) -> str:
    """``MFU 12.34%``, or ``MFU n/a`` where the model's FLOPs or the device's peak are unknown."""
    return "MFU    n/a" if mfu != mfu else f"MFU {mfu:6.2%}"
