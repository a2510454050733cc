"""Compiling a module in place, with Inductor's FX graph cache valid across processes, each graph compiled by one
process of a host while the others wait for it and load it, graph breaks named once, and each recompile named on
rank 0 by the input that changed."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import sys
import time
import warnings
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch import _TorchCompileInductorWrapper  # private: torch.compile's Inductor backend, mode and options applied
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler  # private: AOTAutograd's key
from torch._inductor import config as inductor_config
from torch._inductor.codecache import FxGraphCachePickler  # private: the pickler of the FX graph cache key
from torch._inductor.compile_fx import compile_fx  # private: Inductor's compile of a Dynamo graph
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from simplefsdp.ir.capture import compiling_regions
from simplefsdp.runtime.block_regions import without_output_structure_guards
from simplefsdp.runtime.compiled_call import set_compiled_call
from simplefsdp.runtime.cpu_isa import check_vector_isas_once_per_machine
from simplefsdp.runtime.graph_loading import trace_ops_without_proxies_on_load
from simplefsdp.runtime.hugging_face import graph_break_fix
from simplefsdp.runtime.mesh import mesh_by_value
from simplefsdp.runtime.sharded_lookup import agree_on_shapes_every_call
from simplefsdp.runtime.unused_outputs import KeepGradientsOfUnusedOutputs


_COMPILED_MODELS = itertools.count()


def compile_in_place(module: nn.Module, backend: str | Callable, options: dict[str, Any],
                     precompile_run: str | None = None) -> None:
    """``module.compile(...)``, keeping the module object and ``state_dict`` keys, naming graph breaks and recompiles;
    with ``precompile_run`` (``runtime/precompile.py: run_key``) graphs are saved and loaded across processes. The call
    (``nn.Module._compiled_call_impl``, private) is a frame of ours: Dynamo skips frames of ``torch.nn`` code, so
    ``module.compile()`` would compile nothing of a root ``nn.Sequential`` or ``nn.Linear``."""
    key_caches_by_value()
    trace_ops_without_proxies_on_load()

    def sharded_call(*args, **kwargs):
        return module._call_impl(*args, **kwargs)

    # Dynamo keeps graphs, and counts recompiles against its limit (8), per code object: a copy of the code per model
    # keeps one model's graphs (sync on and off, new shapes) from running another model eagerly past the limit. It
    # records which sizes changed (automatic dynamic shapes) per code's file, line and name: a name per model keeps
    # another model's shapes from compiling this one dynamic at its first call.
    sharded_call.__code__ = sharded_call.__code__.replace(co_name=f"sharded_call_{next(_COMPILED_MODELS)}")

    if backend == "inductor":
        options = dict(options)
        backend = InductorOncePerHost(options.pop("mode", None), options.pop("options", None), options.get("dynamic"))
    if precompile_run is not None:
        from simplefsdp.runtime.precompile import PrecompiledCall
        call = PrecompiledCall(module, backend, precompile_run)
    else:
        if options.get("mode") is None:  # torch.compile takes a mode or options; a mode only for another backend
            filtered = {**(options.get("options") or {}), "guard_filter_fn": without_output_structure_guards}
            options = {**options, "options": filtered}
        compiled = torch.compile(sharded_call, backend=KeepGradientsOfUnusedOutputs(backend), **options)
        call = _tell_graph_breaks_and_recompiles(_rank_consistent_dynamo(compiled, module), module)
    set_compiled_call(module, agree_on_shapes_every_call(module, call))


# Dynamo's settings under every compiled call, so every rank compiles and runs the same graphs: past its recompile
# limit a frame raises instead of running eagerly (below), and ``.item()`` or ``.tolist()`` is traced into the graph
# as a value unknown until run time, not a graph break, after which each rank's frames would be compiled for its own
# data's values and could differ in their collectives (JetMoE's expert sizes, measured in docs/models-from-other-
# libraries.md).
RANK_CONSISTENT_DYNAMO = {"fail_on_recompile_limit_hit": True, "capture_scalar_outputs": True}


def _rank_consistent_dynamo(compiled: Callable, module: nn.Module) -> Callable:
    """``compiled``, called under ``RANK_CONSISTENT_DYNAMO`` and raising where Dynamo would run a frame eagerly past
    its recompile limit: that rank's collectives, unbucketed and in eager order, would not match the other ranks'
    compiled graphs (gloo fails, NCCL hangs). Where the call broke the graph, the error names the break: Dynamo then
    compiles the code between breaks frame by frame, a graph for each setting a frame's guards tell apart."""
    dynamo_config = torch._dynamo.config

    def call(*args, **kwargs):
        users_settings = {key: getattr(dynamo_config, key) for key in RANK_CONSISTENT_DYNAMO}
        for key, value in RANK_CONSISTENT_DYNAMO.items():  # set and reset: 6 us each, config.patch's 190 us
            setattr(dynamo_config, key, value)
        breaks_before = dict(counters["graph_break"])
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            limit = (f"Dynamo hit its recompile limit (torch._dynamo.config.recompile_limit = "
                     f"{dynamo_config.recompile_limit}) on this rank")
            eager = "would run the model eagerly, issuing collectives the other ranks' compiled graphs do not"
            breaks = [reason for reason, count in counters["graph_break"].items()
                      if count > breaks_before.get(reason, 0)]
            if breaks:
                fix = graph_break_fix(module, breaks) or ("make the forward trace as one graph: "
                                                          "torch.compile(model, fullgraph=True) stops at its first")
                raise RuntimeError(f"{limit} compiling {type(module).__name__} between its graph breaks "
                                   f"({'; '.join(reason.splitlines()[0] for reason in breaks)}), and {eager}. "
                                   f"Fix: {fix}") from error
            raise RuntimeError(f"{limit} and {eager}. Run with TORCH_LOGS=recompiles to see which guard fails; pass "
                               "dynamic=True where shapes vary, or raise torch._dynamo.config.recompile_limit on "
                               "every rank.") from error
        finally:
            for key, value in users_settings.items():
                setattr(dynamo_config, key, value)

    return call


class InductorOncePerHost(_TorchCompileInductorWrapper):
    """``torch.compile``'s Inductor backend (same mode and options), compiling each graph under a file lock keyed by
    the graph: of the ranks of a host compiling the same graph, one compiles it, the others load it from the cache."""

    def __call__(self, model_, inputs_, *, config_patches=None):
        check_vector_isas_once_per_machine()  # here, not at compile_sharded: its cost is the first step's
        # the backward compiled with the forward, under the lock: AOTAutograd caches a graph once both are compiled
        with (compiling_regions(model_), _graph_lock(model_, inputs_),
              torch._functorch.config.patch(force_non_lazy_backward_lowering=True)):
            return compile_fx(model_, inputs_, config_patches={**self.config, **(config_patches or {})},
                              compile_region_name=self.name)


def _graph_lock(gm: torch.fx.GraphModule, example_inputs) -> contextlib.AbstractContextManager:
    """This host's lock of Dynamo's graph ``gm`` (its code and inputs), held while it compiles. No lock where the FX
    graph cache is off, or under ``aot_compile`` (``runtime/precompile.py``), which keys AOTAutograd's cache per
    process: nothing would be loaded."""
    if not inductor_config.fx_graph_cache or torch._functorch.config.bypass_autograd_cache_key:
        return contextlib.nullcontext()
    key = hashlib.sha256(f"{gm.code}{[_described(value) for value in example_inputs]}".encode()).hexdigest()[:32]
    return _file_lock(os.path.join(cache_dir(), "simplefsdp-compile-locks", key))


def _described(value: Any) -> Any:
    if isinstance(value, DTensor):
        return _dtensor_by_value(value)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype
    return _mesh_by_value(value)


@contextlib.contextmanager
def _file_lock(path: str):
    """Hold an exclusive ``flock`` on ``path``; the kernel releases it if the process dies."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def key_caches_by_value() -> None:
    """Make the compile caches' keys hold what a compiled graph depends on, the same in every process (idempotent):
    a ``DeviceMesh`` input by value, not by torch 2.13's per-process ``_hash`` (no second process would hit), and a
    ``DTensor`` with its local shard's shape and strides (with uneven shards a rank would load another's graph)."""
    FxGraphCachePickler._reduce_fake_script_object = _reduce_mesh_by_value
    AOTAutogradCachePickler._reduce_tensor_subclass = _reduce_dtensor_with_local_shard


_reduce_by_pickling = FxGraphCachePickler._reduce_fake_script_object
_reduce_by_flattening = AOTAutogradCachePickler._reduce_tensor_subclass


def _mesh_by_value(value: Any) -> Any:
    """A (fake script object of a) ``DeviceMesh`` as a string of what it is; other values as they are."""
    if isinstance(mesh := getattr(value, "real_obj", None), DeviceMesh):
        return mesh_by_value(mesh)
    return value


def _reduce_mesh_by_value(pickler: FxGraphCachePickler, fake: Any) -> tuple:
    if isinstance(described := _mesh_by_value(fake), str):
        return str, (described,)
    return _reduce_by_pickling(pickler, fake)


def _dtensor_by_value(tensor: DTensor) -> str:
    """A DTensor as a string of what a graph compiled for it depends on: mesh, placements, global shape and dtype,
    and this rank's local shard's shape and strides."""
    local = tensor._local_tensor
    return f"DTensor {tensor._stable_hash_for_caching()} local {tuple(local.shape)} {local.stride()}"


def _reduce_dtensor_with_local_shard(pickler: AOTAutogradCachePickler, tensor: torch.Tensor) -> tuple:
    if isinstance(tensor, DTensor):
        return str, (_dtensor_by_value(tensor),)
    return _reduce_by_flattening(pickler, tensor)


def _tell_graph_breaks_and_recompiles(compiled: Callable, module: nn.Module) -> Callable:
    """``compiled``, warning after its first call of the graph breaks Dynamo made, and printing one line on rank 0
    after a later call that compiled a graph again: which input changed, from what to what, and the call's seconds
    (a smaller last batch stalled training silently for over a minute)."""
    last_inputs: dict[str, str] | None = None
    name = type(module).__name__

    def call(*args, **kwargs):
        nonlocal last_inputs
        inputs = _described_inputs(args, kwargs)
        if last_inputs is None:
            result = _warn_on_graph_breaks(compiled, module, args, kwargs)
        else:
            graphs, start = compiled_graphs(), time.perf_counter()
            result = compiled(*args, **kwargs)
            if compiled_graphs() > graphs and (not dist.is_initialized() or dist.get_rank() == 0):
                print(f"simplefsdp: recompiled {name} {_first_change(last_inputs, inputs)} in "
                      f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        last_inputs = inputs
        return result

    return call


def _described_inputs(args: tuple, kwargs: dict) -> dict[str, str]:
    """Each input by its path (``args[0]``, ``kwargs['mask']``): a tensor's shape and dtype, a constant's value."""
    described = {}
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        key = ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])
        if isinstance(leaf, torch.Tensor):
            described[key] = f"{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
        elif isinstance(leaf, (bool, int, float, str, type(None))):
            described[key] = repr(leaf)
        else:
            described[key] = type(leaf).__name__
    return described


def _first_change(before: dict[str, str], after: dict[str, str]) -> str:
    """The first input that differs between two calls' ``_described_inputs``, as "for input <path> <old> -> <new>"."""
    for path in [*after, *(path for path in before if path not in after)]:
        if before.get(path) != after.get(path):
            return f"for input {path} {before.get(path, 'absent')} -> {after.get(path, 'absent')}"
    return ("with no input changed in shape, dtype or value (another guard failed: run with TORCH_LOGS=recompiles "
            "to see which)")


def _warn_on_graph_breaks(compiled: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``compiled(*args, **kwargs)``, warning of each graph break Dynamo made in it, its fix last where known."""
    before = Counter(counters["graph_break"])
    result = compiled(*args, **kwargs)
    if breaks := Counter(counters["graph_break"]) - before:
        reasons = "; ".join(f"{reason.splitlines()[0]} (x{count})" for reason, count in breaks.items())
        fix = graph_break_fix(module, list(breaks)) or "pass fullgraph=True to fail on the first one"
        warnings.warn(f"{type(module).__name__} graph-breaks {sum(breaks.values())} time(s): {reasons}. Training "
                      "stays correct (each compiled piece keeps its own collectives) but communication cannot "
                      f"overlap across a break.\nFix: {fix}.", stacklevel=3)
    return result


def graph_cache_hits() -> tuple[int, int]:
    """(hits, lookups) of Inductor's FX graph cache in this process so far."""
    stats = counters["inductor"]
    return stats["fxgraph_cache_hit"], stats["fxgraph_cache_hit"] + stats["fxgraph_cache_miss"]


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process so far (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]
