"""The public entry point: ``compile_sharded``."""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from simplefsdp.names import MODES
from simplefsdp.passes.bucket_plan import BucketMode, find_blocks
from simplefsdp.passes.options import check_pass_options
from simplefsdp.runtime.activation_checkpoint import checkpoint_hugging_face_layers_fully
from simplefsdp.runtime.agreed_profile import agreed_profile
from simplefsdp.runtime.block_regions import (block_regions_refusal, distinct_blocks, settings_read,
                                              two_blocks_a_region)
from simplefsdp.runtime.compiled_call import set_compiled_call
from simplefsdp.runtime.gloo_exit import settle_gloo_collectives_at_exit
from simplefsdp.runtime.hugging_face import install_output_capturing_hooks, refuse_saving_shards, train_without_cache
from simplefsdp.runtime.grad_sync import add_gradient_sync_methods
from simplefsdp.runtime.mesh import check_mesh, data_parallel_groups, default_mesh
from simplefsdp.runtime.mixed_precision import MixedPrecision, cast_floating_inputs
from simplefsdp.runtime.quantize import Quantize, check_read_once
from simplefsdp.runtime.rank_agreement import agreement_groups, check_same_model_on_all_ranks, same_input_shapes
from simplefsdp.runtime.replicate_compute import ReplicateComputation, gather_tied_once_per_call, reduce_pending
from simplefsdp.runtime.sharding import broadcast_buffers, check_not_sharded, holds_values, shard_parameters
from simplefsdp.runtime.tensor_parallel import tensor_parallel_mesh

if TYPE_CHECKING:
    from simplefsdp.passes.install import OverlapPasses

ModuleT = TypeVar("ModuleT", bound=nn.Module)
COMPILE_OPTIONS = ("fullgraph", "dynamic", "mode", "options", "disable")


def agreed_arguments(arguments: dict[str, Any], backend: str | Callable) -> dict[str, Any]:
    """The arguments of ``compile_sharded`` that every rank must pass alike, comparable across processes (a backend
    function by its name; not the mesh, which is each rank's own sub-mesh under tensor parallelism)."""
    agreed = {name: value for name, value in arguments.items() if name not in ("mesh", "backend")}
    return {**agreed, "backend": backend if isinstance(backend, str) else getattr(backend, "__qualname__", "?")}


def check_precompile(precompile: bool, compile: bool, backend: str | Callable, options: dict[str, Any]) -> None:
    """Raise ``ValueError`` where ``precompile=True`` cannot save the compiled graphs."""
    if not precompile:
        return
    if not compile or backend != "inductor":
        raise ValueError("precompile=True saves Inductor's compiled graphs: pass compile=True and backend='inductor', "
                         "or drop precompile")
    if options.get("dynamic") or options.get("fullgraph") is False:
        raise ValueError("precompile=True compiles one whole graph per input shape: leave dynamic and fullgraph unset, "
                         "or drop precompile")


DYNAMIC_REGIONS = ("compile_blocks_once with dynamic=True fails in torch 2.13's Dynamo (symbolic parameter shapes in a "
                   "region); leave dynamic unset: shapes that change are compiled dynamic after the first change")


def blocks_once_by_default(model: nn.Module, blocks: tuple[str, ...], tensor_parallel: bool, dynamic: bool) -> bool:
    """Whether ``compile_blocks_once=None`` compiles ``model``'s ``blocks`` once, the same on every rank: where two
    blocks are alike (a region of blocks that differ in a setting, as Hugging Face's ``layer_idx``, is traced for
    each: slower than the whole graph) and neither tensor parallelism, ``dynamic=True`` nor a refusal rules it out."""
    return (not tensor_parallel and not dynamic and distinct_blocks(model, blocks) < len(blocks)
            and block_regions_refusal(model, blocks) is None)


def compile_sharded(
    model: ModuleT | None = None,
    *,
    mesh: DeviceMesh | None = None,
    mode: str = "fully_shard",
    mp_policy: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    compile: bool = True,
    backend: str | Callable = "inductor",
    buckets: BucketMode = "auto",
    reorder: bool = True,
    prefetch: int = 1,
    memory_budget: int | None = None,
    blocks: list[str] | None = None,
    quantize: Quantize | None = None,
    compile_blocks_once: bool | None = None,
    precompile: bool = False,
    sharded_lookup: bool = True,
    **compile_options: Any,
) -> ModuleT | Callable[[ModuleT], ModuleT]:
    """Shard ``model``'s parameters over the data-parallel mesh and compile its forward, in place.

    ``mode``: ``"fully_shard"`` (1-D mesh, ZeRO-3), ``"replicate"`` (1-D mesh, DDP-like) or ``"hybrid_shard"``
    (2-D ``(replicate, shard)`` mesh); ``mesh`` defaults to the whole world. Returns the same module, with FSDP2's
    ``set_requires_gradient_sync(flag)`` and a ``no_sync()`` context manager for gradient accumulation without
    communication; called without ``model``, a decorator. Every argument is checked before any collective runs.

    With the Inductor backend our passes bucket and reorder the collectives of both graphs: ``buckets`` is ``"auto"``
    (cost model, within ``memory_budget`` bytes of gathered parameters in flight), ``"block"`` (one bucket per
    repeated block, plus head and tail), ``None``, or a manual plan of module names
    (``[["tok_embeddings"], ["layers.0"], ...]``); ``reorder`` prefetches all-gathers ``prefetch`` buckets ahead and
    sinks waits. ``blocks`` names the repeated blocks (default: ``find_blocks(model)``). All-reduces (``replicate``,
    ``hybrid_shard``) are merged from per-block units up to DDP's 25 MiB (``"auto"``) or bucketed by bytes as DDP's
    (``"block"``). ``quantize`` (``Quantize``) sends weights and gradients in low-bit formats.
    ``compile_blocks_once`` compiles each distinct block's compute once for its repeats (``runtime/block_regions.py``):
    cold compile grows less with depth. ``None`` (default): on where ``blocks_once_by_default`` says (compiled by
    Inductor, or a fake or meta model, as ``inspect`` traces), and a call a region cannot run runs the block's own
    forward; ``True``: on, and anything it cannot run is an error; ``False``: the whole graph traced block by block.

    FSDP x TP: apply ``parallelize_module(model, mesh_2d["tp"], plan)`` first, then pass ``mesh=mesh_2d["dp"]``;
    TP's DTensor parameters are sharded over dp as well, and the passes touch only the data-parallel collectives.

    ``sharded_lookup``: an ``nn.Embedding`` outside the blocks (not tied) looks its ids up where its rows are sharded,
    exchanging tokens instead of gathering the table, at calls whose ranks' inputs agree in shape
    (``runtime/sharded_lookup.py``); ``False``: its table is gathered as every other parameter.

    ``precompile=True`` saves each compiled graph under ``SIMPLEFSDP_CACHE`` and loads it in later runs without
    tracing (``runtime/precompile.py``): a warm restart in seconds. One graph per input shape, no graph breaks.
    """
    arguments = {name: value for name, value in locals().items() if name not in ("model", "compile_options")}
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise TypeError(f"mp_policy must be simplefsdp.MixedPrecision or None, got {type(mp_policy).__name__}")
    if quantize is not None and not isinstance(quantize, Quantize):
        raise TypeError(f"quantize must be simplefsdp.Quantize(...) or None, got {type(quantize).__name__}")
    if quantize is not None and quantize.gather and mode == "replicate":
        raise ValueError("mode='replicate' gathers no weights: pass Quantize(gather=None, reduce=...) to quantize its "
                         "gradient exchange, or mode='fully_shard' to gather weights in int8")
    if unknown := sorted(set(compile_options) - set(COMPILE_OPTIONS)):
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; compile_sharded passes only these on to "
                        f"torch.compile: {', '.join(COMPILE_OPTIONS)}")
    check_precompile(precompile, compile, backend, compile_options)
    # what a precompiled graph depends on, before the passes join the options
    requested = repr((agreed_arguments(arguments, backend), compile_options)) if precompile else ""
    check_pass_options(model if isinstance(model, nn.Module) else None, buckets, reorder, prefetch, memory_budget,
                       blocks)
    if model is None:
        return functools.partial(compile_sharded, **arguments, **compile_options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_sharded expects a torch.nn.Module, got {type(model).__name__}; "
                        "wrap plain functions in an nn.Module first")
    passes = compile and backend == "inductor" and (buckets is not None or reorder)
    if passes:  # imported here, as compile_in_place below: an eager model never loads Inductor's compiler (seconds)
        from simplefsdp.passes.install import OverlapPasses, check_no_custom_post_pass, inductor_options
        check_no_custom_post_pass(compile_options)
    check_not_sharded(model)
    if quantize is not None and quantize.reduce and quantize.error_feedback:
        check_read_once(model, compile)
    mesh = mesh if mesh is not None else default_mesh(mode)
    check_mesh(mesh, mode)
    if mesh.device_type == "cpu":  # gloo: see gloo_exit for torch 2.13's abort at exit it prevents
        settle_gloo_collectives_at_exit()
    tp_mesh = tensor_parallel_mesh(model, mesh, mode)
    if tp_mesh is not None and quantize is not None:
        raise ValueError("quantize does not support tensor-parallel (DTensor) parameters yet; pass quantize=None "
                         "with parallelize_module, or drop tensor parallelism to quantize")
    if compile_blocks_once and compile_options.get("dynamic"):
        raise ValueError(DYNAMIC_REGIONS)
    if tp_mesh is not None and compile_blocks_once:
        raise ValueError("compile_blocks_once does not run tensor-parallel blocks yet (a region takes plain tensors, "
                         "not parallelize_module's DTensors); pass compile_blocks_once=False with parallelize_module")
    block_fqns = find_blocks(model) if blocks is None else tuple(blocks)
    strict_regions = compile_blocks_once is not None
    values = holds_values(model)
    if compile_blocks_once is None:  # and a fake or meta model not compiled: the regions inspect traces
        by_default = (compile or not values) and backend == "inductor"
        compile_blocks_once = by_default and blocks_once_by_default(
            model, block_fqns, tp_mesh is not None, bool(compile_options.get("dynamic")))
        if compile and by_default and not compile_blocks_once and len(block_fqns) > 1 and (
                refusal := block_regions_refusal(model, block_fqns)):
            say(f"compiling the whole graph, not each distinct block once: {refusal}")
    elif compile_blocks_once and (refusal := block_regions_refusal(model, block_fqns)):
        raise ValueError(refusal)
    keyed = settings_read(model, block_fqns) if compile_blocks_once and not strict_regions else frozenset()
    if values:  # a meta model gets its shards from materialize_sharded; a fake one (inspect's) is only traced
        model.to(mesh.device_type)
    # The first collective: ranks that differ in model or arguments would go on to issue different collectives.
    check_same_model_on_all_ranks(model, mesh, agreed_arguments(arguments, backend))
    if values:
        broadcast_buffers(model, mesh)
    if passes:  # "auto" buckets are priced on the hardware rank 0 computes on, the same numbers on every rank
        overlap = OverlapPasses(buckets, reorder, prefetch, memory_budget, agreed_profile(mesh.device_type),
                                block_fqns, data_parallel_groups(mesh), agreement_groups(mesh, tp_mesh))
        compile_options = inductor_options(overlap, compile_options)
        if precompile:  # a precompiled graph holds the plan, which follows rank 0's hardware profile of this run
            requested += overlap.uuid().hex()
    whole_graph_options = compile_options
    if compile_blocks_once and backend == "inductor":
        from simplefsdp.passes.region_inputs import RecomputeRegionInputs
        # Inductor 2.13 reuses a buffer that a later block's region call still reads: wrong norm gradients
        compile_options = {**compile_options, "options": {**(compile_options.get("options") or {}),
                           "allow_buffer_reuse": False, "joint_custom_pre_pass": RecomputeRegionInputs()}}

    mp_policy = mp_policy or MixedPrecision()
    replicate = ReplicateComputation(mp_policy.param_dtype, mp_policy.reduce_dtype,
                                     reshard_after_forward=reshard_after_forward and mode != "replicate",
                                     quantize=quantize, tensor_parallel=tp_mesh)
    # before sharding gives modules subclasses: transformers finds a model's hooks by its class
    install_output_capturing_hooks(model)
    train_without_cache(model)
    shard_parameters(model, mesh, mode, replicate, block_fqns, sharded_lookup)
    gather_tied_once_per_call(model, replicate)
    if mp_policy.param_dtype is not None:
        cast_floating_inputs(model, mp_policy.param_dtype)
    add_gradient_sync_methods(model, replicate.sync, functools.partial(reduce_pending, replicate))
    checkpoint_hugging_face_layers_fully(model)  # before regions copy the blocks
    refuse_saving_shards(model)
    if compile_blocks_once:  # the blocks found before sharding, which gives modules subclasses
        from simplefsdp.runtime.block_regions import install_block_regions
        uninstall_regions = install_block_regions(model, block_fqns, replicate, gathers_in_region=backend == "inductor",
                                                  strict=strict_regions, keyed=keyed)
    if compile:
        from simplefsdp.runtime.compile import compile_in_place
        from simplefsdp.runtime.precompile import run_key
        compile_in_place(model, backend, compile_options, run_key(model, requested) if requested else None)
        if compile_blocks_once and not strict_regions and not precompile:
            from simplefsdp.runtime.regions_step_back import whole_graph_where_regions_fail

            def regions_keyed_by(keyed: frozenset[str]) -> Callable[[], None] | None:
                """Regions that also differ in ``keyed``'s values, compiled, where each serves two blocks on average."""
                if not two_blocks_a_region(model, block_fqns, keyed):
                    return None
                uninstall = install_block_regions(model, block_fqns, replicate, gathers_in_region=backend == "inductor",
                                                  strict=False, keyed=keyed)
                compile_in_place(model, backend, compile_options)
                return uninstall

            whole_graph_where_regions_fail(model, uninstall_regions, regions_keyed_by, functools.partial(
                compile_in_place, model, backend, whole_graph_options), say, keyed)
        if passes and buckets == "auto" and overlap.agree_over and not precompile:
            plan_per_block_where_first_inputs_differ(model, overlap)
        if not values:  # last, so that it runs first: materialize_sharded fills a meta model before its first call
            from simplefsdp.runtime.meta_init import refuse_calls_until_materialized
            refuse_calls_until_materialized(model)
    return model


def plan_per_block_where_first_inputs_differ(model: nn.Module, overlap: OverlapPasses) -> None:
    """At ``model``'s first call, before anything compiles, plan ``"block"`` buckets where the ranks' input shapes
    differ: "auto" buckets, priced on each rank's shapes, could differ between ranks."""
    compiled = model._compiled_call_impl

    def first_call(*args: Any, **kwargs: Any) -> Any:
        model._compiled_call_impl = compiled
        if not same_input_shapes(args, kwargs, overlap.agree_over):
            overlap.buckets = "block"
            say("the ranks' first inputs differ in shape, and buckets='auto' prices compute on each rank's shapes: "
                "planning buckets='block' instead, the same on every rank")
        return compiled(*args, **kwargs)

    set_compiled_call(model, first_call)


def say(message: str) -> None:
    """Print what a default did instead, once: on global rank 0 (or a process without a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"simplefsdp: {message}", file=sys.stderr, flush=True)
