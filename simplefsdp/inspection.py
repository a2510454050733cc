"""``simplefsdp.inspect`` and ``simplefsdp inspect``: trace a sharded model in one process, with no data, on a fake
process group, and predict its step at each stage of ``OverlapPasses.stages``."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # private: fake CUDA tensors, no GPU memory
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from simplefsdp import plots
from simplefsdp.api import DYNAMIC_REGIONS, blocks_once_by_default, compile_sharded
from simplefsdp.ir.capture import TraceError, capture_graphs, cyclic_gc_paused
from simplefsdp.ir.hardware import HardwareProfile, get_profile
from simplefsdp.ir.replica_sync import replica_sync_price, replica_sync_problem
from simplefsdp.ir.simulator import simulate
from simplefsdp.inspect_report import InspectReport, InspectStage
from simplefsdp.models.llama import Llama
from simplefsdp.names import DEVICES, MODES
from simplefsdp.models.llama_tp import check_tensor_parallel, tensor_parallel_plan
from simplefsdp.models.workload import blocks, load_workload
from simplefsdp.passes.bucket_plan import BucketMode, find_blocks
from simplefsdp.passes.install import OverlapPasses
from simplefsdp.passes.options import check_pass_options
from simplefsdp.passes.region_inputs import recompute_region_inputs
from simplefsdp.runtime.activation_checkpoint import apply_activation_checkpointing
from simplefsdp.runtime.block_regions import READ_SETTING
from simplefsdp.runtime.fake_world import fake_world
from simplefsdp.runtime.mesh import MESH_DIM_NAMES, check_tensor_parallel_world, data_parallel_groups
from simplefsdp.runtime.mixed_precision import MixedPrecision, mixed_precision_option
from simplefsdp.runtime.quantize import Quantize, quantize_option
from simplefsdp.runtime.regions_step_back import compiler_failure
from simplefsdp.runtime.sharding import check_not_sharded


def inspect(
    model: nn.Module,
    example_inputs: tuple,
    *,
    world_size: int | None = None,
    rank: int = 0,
    mode: str = "fully_shard",
    hardware: str | HardwareProfile = "h100",
    mp_policy: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    buckets: BucketMode = "auto",
    reorder: bool = True,
    prefetch: int = 1,
    memory_budget: int | None = None,
    title: str | None = None,
    dynamic: bool = False,
    activation_checkpointing: str = "none",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    quantize: Quantize | None = None,
    replica_groups: int = 1,
    replica_sync: dict | None = None,
    device: str | None = None,
    tp: int = 1,
    tp_plan: dict[str, ParallelStyle] | None = None,
    compile_blocks_once: bool | None = None,
) -> InspectReport:
    """Trace ``model`` as ``compile_sharded`` shards it on ``world_size`` ranks (default 1), run our passes, predict.
    ``rank``: the rank whose graphs are traced (its shards and coordinate; the plans must not depend on it).

    Copies with no data on a fake process group; ``model`` is not changed. ``device``: ``"meta"`` or ``"cuda"`` (fake
    CUDA tensors; docs/inspect-and-cost-model.md), default as ``check_device``. ``hardware``: a profile name (``h100``,
    ``a100``, ``cpu``), a JSON path or a ``HardwareProfile``; it also prices ``buckets="auto"``. The pass options and
    ``quantize`` are ``compile_sharded``'s. ``dynamic`` traces sizes as symbols, priced at ``example_inputs``' sizes.
    ``activation_checkpointing`` (``none``, ``selective``, ``full``) checkpoints each of ``model.layers`` as ``train``.
    ``loss_fn(output, *example_inputs)`` (``loss_fn(output, target)`` with a ``target``), when given, is traced after
    the model, so the step includes its loss. A Hugging Face model is traced with ``use_cache=False`` (a note says so).
    ``replica_groups`` > 1 prices ``train --fault-tolerant``: that many groups of ``world_size`` ranks exchanging after
    backward as ``replica_sync`` says (``replica_sync_price``'s keywords; default: averaging gradient shards).
    ``tp`` > 1 prices FSDP x TP on a ``(world_size // tp, tp)`` mesh: ``parallelize_module`` with ``tp_plan`` (default:
    the reference Llama's, ``models/llama_tp.py``) over tp, then ``fully_shard`` over dp. ``compile_blocks_once``: as
    ``compile_sharded``'s (``None``: the regions its default compiles), and each distinct block is traced once.
    """
    profile = get_profile(hardware)
    world_size = 1 if world_size is None else world_size
    mesh_shape = _mesh_shape(mode, world_size, profile.devices_per_node, tp)
    if tp > 1 and not tp_plan:  # the reference Llama's plan, checked for tp ranks
        if not isinstance(model, Llama):
            raise ValueError(f"tp={tp} needs a tp_plan for {type(model).__name__} (module FQN -> ParallelStyle, as "
                             "parallelize_module takes); only the reference Llama has a default")
        check_tensor_parallel(model.config, tp)
        tp_plan = tensor_parallel_plan(model.config)
    check_pass_options(model, buckets, reorder, prefetch, memory_budget)
    check_not_sharded(model)
    if compile_blocks_once and dynamic:
        raise ValueError(DYNAMIC_REGIONS)
    device = check_device(profile, device)
    if problem := replica_sync_problem(**(replica_sync or {})):
        raise ValueError(problem)
    mp_policy = mp_policy or MixedPrecision()

    def trace(blocks_once: bool | None) -> tuple[list, list, list[torch.Tensor], tuple[str, ...]]:
        """The forward's and backward's stages, this rank's shards and the notes, traced with ``blocks_once``."""
        # Fake CUDA tensors belong to one FakeTensorMode; meta tensors need none.
        with FakeTensorMode() if device == "cuda" else contextlib.nullcontext():
            copy_model = _empty_copy(model, device)
            copy_inputs = tuple(_empty(x, device) if isinstance(x, torch.Tensor) else x for x in example_inputs)
            copy_target = None if target is None else _empty(target, device)
        notes = _without_cache(copy_model)
        if activation_checkpointing != "none" and not find_blocks(copy_model):
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} checkpoints each repeated block, "
                             f"and {type(model).__name__} has none; pass activation_checkpointing='none'")
        apply_activation_checkpointing(blocks(copy_model), activation_checkpointing)
        if loss_fn is not None:  # the copy's forward, as checkpointing wraps a block's: module names do not change
            copy_model.forward = functools.partial(_forward_and_loss, copy_model.forward, loss_fn, copy_target)
        with fake_world(world_size, rank), cyclic_gc_paused():
            mesh_device = "cuda" if device == "cuda" else "cpu"
            if tp > 1:
                mesh_2d = init_device_mesh(mesh_device, mesh_shape, mesh_dim_names=("dp", "tp"))
                parallelize_module(copy_model, mesh_2d["tp"], tp_plan)
                mesh = mesh_2d["dp"]
            else:
                mesh = init_device_mesh(mesh_device, mesh_shape, mesh_dim_names=MESH_DIM_NAMES[mode])
            passes = OverlapPasses(buckets, reorder, prefetch, memory_budget, profile, find_blocks(model),
                                   data_parallel_groups(mesh))
            # None where the default compiles regions: blocks that differ in a setting share one, as at run time
            regions = blocks_once if blocks_once is not None else blocks_once_by_default(
                copy_model, find_blocks(copy_model), tp > 1, dynamic)
            # Sharded by compile_sharded itself, so the graphs traced here are those that run.
            compile_sharded(copy_model, mesh=mesh, mode=mode, mp_policy=mp_policy, compile=False, quantize=quantize,
                            reshard_after_forward=reshard_after_forward,
                            compile_blocks_once=None if blocks_once is None and regions else regions)
            graphs = capture_graphs(copy_model, copy_inputs, dynamic=dynamic, fused_attention=device == "meta",
                                    joint_pass=recompute_region_inputs if regions else None)
            # The captured graphs are ours: the passes rewrite them in place, and each stage keeps its schedule.
            return (list(passes.stages(graphs.forward, "forward", graphs.param_fqns)),
                    list(passes.stages(graphs.backward, "backward", graphs.param_fqns)),
                    [p.to_local() for p in copy_model.parameters() if p.requires_grad], notes)

    try:
        forward_stages, backward_stages, shards, notes = trace(compile_blocks_once)
    except TraceError as error:  # regions Dynamo, AOTAutograd or Inductor refused: the whole graph, as at run time
        if compile_blocks_once is not None or (reason := compiler_failure(error.__cause__)) is None:
            raise
        forward_stages, backward_stages, shards, notes = trace(False)
        if read := re.search(READ_SETTING, reason):  # compile_sharded tries a region per value of it
            notes += (f"traced as the whole graph: the blocks differ in {read[1]!r}, which their compute reads; "
                      "compile_sharded compiles a region per value of it where each serves two blocks on average "
                      "(not traced here), else the whole graph",)
        else:
            notes += (f"traced as the whole graph: compile_blocks_once could not trace this model's blocks as regions "
                      f"({reason[:300]}), and compile_sharded steps back the same way",)
    compute_dtype = mp_policy.param_dtype or next(model.parameters(), torch.empty(0)).dtype
    stages = [InspectStage(forward.name, forward.schedule, backward.schedule, forward.plan, backward.plan,
                           simulate(forward.schedule, backward.schedule, profile, compute_dtype))
              for forward, backward in zip(forward_stages, backward_stages)]
    title = title or (f"{type(model).__name__}, {mode}, world {world_size} (mesh {mesh_shape}"
                      f"{f', rank {rank}' if rank else ''}), hardware {profile.name}")
    fault_tolerant = None
    if replica_groups > 1:
        fault_tolerant = replica_sync_price(shards, replica_groups, world_size, profile, **(replica_sync or {}))
        fault_tolerant["step_seconds"] = stages[-1].prediction.step_time + fault_tolerant["seconds_per_step"]
    # the ranks of a tensor-parallel group compute on the same tokens
    return InspectReport(title, stages, profile, _tokens(example_inputs) // tp, fault_tolerant, notes)


def _tokens(example_inputs: tuple) -> int:
    """Tokens in the first tensor input: all its elements for token ids, all but the last (feature) dimension else."""
    first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), torch.empty(0))
    return first.numel() if not first.is_floating_point() or first.dim() == 0 else first.numel() // first.shape[-1]


def _mesh_shape(mode: str, world_size: int, devices_per_node: int, tp: int = 1) -> tuple[int, ...]:
    """The mesh ``mode`` uses on ``world_size`` ranks: 1-D, (nodes, ranks per node) for hybrid_shard, (dp, tp)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}; pass e.g. world_size=8")
    check_tensor_parallel_world(world_size, tp, mode)
    if tp > 1:
        return (world_size // tp, tp)
    if mode != "hybrid_shard":
        return (world_size,)
    per_node = min(devices_per_node, world_size)
    if world_size % per_node:
        raise ValueError(f"world size {world_size} does not fit the hybrid_shard mesh (nodes, {per_node} ranks "
                         f"per node); pass a multiple of {per_node}, or a profile whose devices_per_node divides it")
    return (world_size // per_node, per_node)


def check_device(profile: HardwareProfile, device: str | None = None) -> str:
    """``device``, or the default for ``profile`` (``cuda`` for a GPU profile where a CUDA device is present, else
    ``meta``); ``ValueError`` naming the fix when this torch cannot trace it."""
    if device is None:
        return "cuda" if profile.name != "cpu" and torch.cuda.is_available() else "meta"
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")
    if device == "cuda" and not torch.backends.cuda.is_built():
        raise ValueError(f"device='cuda' traces fake CUDA tensors and this torch {torch.__version__} is a CPU-only "
                         "build; install a CUDA build (pip install torch==2.14.1 from PyPI) or pass device='meta'")
    if device == "cuda" and not torch.cuda.is_available():
        # Autograd reads the CUDA context even for fake CUDA tensors (pytorch/pytorch#92627).
        raise ValueError("device='cuda' needs a CUDA device (any GPU; fake tensors allocate no GPU memory): "
                         "PyTorch's autograd engine reads the CUDA context even for fake tensors, and this machine "
                         "has none; run where a GPU is visible or pass device='meta'")
    return device


def _empty(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """An empty tensor like ``tensor`` on ``device`` (fake under an active ``FakeTensorMode``)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


def _empty_copy(model: nn.Module, device: str) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are empty tensors on ``device`` (nothing allocated)."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        empty = _empty(tensor, device)
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _forward_and_loss(forward: Callable, loss_fn: Callable, target: torch.Tensor | None, *inputs) -> torch.Tensor:
    return loss_fn(forward(*inputs), *inputs) if target is None else loss_fn(forward(*inputs), target)


def _without_cache(model: nn.Module) -> tuple[str, ...]:
    """Turn off a Hugging Face model's key-value cache (``config.use_cache``), which training never reads and
    Dynamo cannot trace on fake tensors; the note saying so, if it was on."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return ()
    config.use_cache = False
    return ("traced with use_cache=False: Hugging Face's key-value cache serves generation, and training reads none",)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Trace the named model with no data (``--device``), run the passes, print the summary, write ``--out``."""
    try:
        workload = load_workload(args.model, args.layers)
    except ValueError as error:
        raise SystemExit(f"simplefsdp inspect: {error}") from None
    with torch.device("meta"):
        model = workload.build(seed=0)
    longest = workload.max_seq_len
    seq_len = args.seq_len or longest
    if workload.user_batch:  # the user's batch decides its own shapes
        inputs, target = workload.user_batch(0, args.rank, args.batch_size)
        shape = f"a batch of {args.batch_size}"
    elif seq_len is None:
        raise SystemExit(f"simplefsdp inspect: --model {args.model} names no longest sequence; pass --seq-len N")
    elif args.batch_size < 1 or seq_len < 1 or longest and seq_len > longest:
        raise SystemExit(f"simplefsdp inspect: --batch-size must be at least 1 and --seq-len between 1 and "
                         f"{longest} (the maximum of {args.model})")
    else:
        inputs = (torch.zeros(args.batch_size, seq_len, dtype=torch.long, device="meta"),)
        target, shape = inputs[0], f"{args.batch_size}x{seq_len} tokens"
    try:
        device = check_device(get_profile(args.hardware), args.device)
        name = f"{args.model} (layers={args.layers})" if args.layers else args.model
        layout, per = (f"tp {args.tp}, ", "tp group") if args.tp > 1 else ("", "rank")
        title = (f"{name}, {args.mode}, world {args.world_size}{f' (rank {args.rank})' if args.rank else ''}, "
                 f"{layout}hardware {args.hardware}, {shape} per {per}, params {args.param_dtype},"
                 f" activation checkpointing {args.activation_checkpointing}, traced on {device}")
        report = inspect(
            model, inputs, world_size=args.world_size, rank=args.rank, mode=args.mode, hardware=args.hardware,
            mp_policy=mixed_precision_option(args), reshard_after_forward=args.reshard_after_forward,
            buckets=args.buckets, reorder=args.reorder, prefetch=args.prefetch, memory_budget=args.memory_budget,
            title=title, dynamic=args.dynamic, activation_checkpointing=args.activation_checkpointing,
            loss_fn=workload.loss, target=target, quantize=quantize_option(args), replica_groups=args.replica_groups,
            device=device, tp=args.tp, compile_blocks_once=args.compile_blocks_once,
            replica_sync=dict(sync=args.replica_sync, sync_every=args.sync_every, chunk=args.demo_chunk,
                              top_k=args.demo_top_k, outer_quantize=args.outer_quantize))
    except (ValueError, TypeError, TraceError) as error:
        raise SystemExit(f"simplefsdp inspect: {error}") from None
    print(report.summary(), end="")
    if args.out:
        for path in report.save(args.out):
            print(f"wrote {path}")
        if reason := plots.missing():
            print(f"skipped {Path(args.out, 'timeline.png')}: {reason}")
    return 0
