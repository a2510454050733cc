"""A sharded module's compiled call saved to disk, so that a later process loads it instead of tracing again:
``compile_sharded(precompile=True)``. Each graph is keyed by what it depends on (``run_key`` per run, ``ModuleState``
and the inputs per call) instead of Dynamo's guards, which cannot be saved for a sharded module; why and what it
costs: ``ARCHITECTURE.md``, "Precompiled graphs".
"""

from __future__ import annotations

import hashlib
import importlib
import platform
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch._dynamo.package import _hash_sourcelines  # private: the checksum Dynamo stores for each traced source
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from simplefsdp.ir.hardware import CACHE_DIR
from simplefsdp.runtime.cpu_isa import check_vector_isas_once_per_machine
from simplefsdp.runtime.mesh import mesh_by_value

PLAIN = (bool, int, float, str, type(None))
ABSENT = "<absent>"
ARTIFACTS = CACHE_DIR / "precompiled"


def _sharded_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


def _no_guards(entries: list) -> list[bool]:
    return [False] * len(entries)


def run_key(module: nn.Module, arguments: str) -> str:
    """What a compiled graph of ``module`` depends on that stays fixed in a run: the machine (a cache shared by hosts of
    other CPUs or GPUs stays apart), versions, simplefsdp's source (our passes change compiled graphs without being
    traced), ``compile_sharded``'s ``arguments``, the parameters' and buffers' names, this rank and its process
    groups."""
    meshes = {param.device_mesh for param in module.parameters() if isinstance(param, DTensor)}
    groups = sorted(f"{mesh_by_value(mesh)} at {mesh.get_coordinate()}" for mesh in meshes)
    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in module.named_buffers(remove_duplicate=False)]
    sources = sorted(Path(__file__).resolve().parents[1].rglob("*.py"))
    source = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    machine = platform.node(), platform.machine(), torch.backends.cpu.get_cpu_capability(), gpus
    return repr((machine, torch.__version__, sys.version, source, arguments, names, groups))


def _described(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad
    if isinstance(value, PLAIN):
        return type(value), value
    raise TypeError(f"precompile keys a compiled graph by its inputs, which must be tensors or constants (bool, int, "
                    f"float, str, None), got {type(value).__name__}; pass precompile=False to compile_sharded")


class ModuleState:
    """What Dynamo's guards would check on ``module`` at every call, read in a fraction of a millisecond: every
    module's plain attributes (``training`` among them) as they were named at the first call, its parameters' and
    buffers' shapes, dtypes and ``requires_grad``, and the gradient-sync state (``runtime/grad_sync.py``)."""

    def __init__(self, module: nn.Module) -> None:
        modules = list(module.modules())
        self.plain = [(vars(sub), name) for sub in modules for name, value in vars(sub).items()
                      if isinstance(value, PLAIN)]
        self.tensors = [(table, name) for sub in modules for table in (sub._parameters, sub._buffers)
                        for name in table]
        self.sync = vars(module).get("_gradient_sync")
        self.accumulators = [accumulator for sub in modules
                             for accumulator in vars(sub).get("_grad_accumulators", {}).values()]

    def __call__(self) -> tuple:
        state = [table.get(name, ABSENT) for table, name in self.plain]  # an attribute deleted since: ABSENT
        for table, name in self.tensors:
            tensor = table.get(name)
            state.append(None if tensor is None else (tensor.shape, tensor.dtype, tensor.requires_grad))
        if self.sync is not None:
            state += [self.sync.enabled, self.sync.reductions_registered]
            if self.sync.reductions_registered:  # a pending sum routes gradients
                state += [accumulator.grad is None for accumulator in self.accumulators]
        return tuple(state)


def _inputs(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    global_state = torch._C._dynamo.guards.GlobalStateGuard().__getstate__()  # grad mode, autocast, ...
    return str(spec), tuple(_described(leaf) for leaf in leaves), global_state, str(torch.get_default_device())


def sources_unchanged(compiled: Any) -> bool:
    """Whether every source Dynamo traced for ``compiled`` (an ``aot_compile`` result) reads as it did then."""
    return all(_hash_sourcelines(importlib.import_module(source.module), source.firstlineno, source.lastlineno)
               == source.checksum for source in compiled.source_info().inlined_sources)


class PrecompiledCall:
    """``module``'s compiled call: for each state of its inputs and modules, the graph an earlier process saved for
    it, else one compiled by ``backend`` and saved."""

    def __init__(self, module: nn.Module, backend: Callable, run: str) -> None:
        self.module, self.backend, self.run = module, backend, run
        self.state: ModuleState | None = None  # made at the first call, once the model is complete
        self.graphs: dict[tuple, Callable] = {}
        self.last: tuple[tuple, Callable] | None = None  # the last call's state and graph: one comparison, no hash

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.state = self.state or ModuleState(self.module)
        state = (_inputs(args, kwargs), self.state())
        if self.last is None or self.last[0] != state:
            if (graph := self.graphs.get(state)) is None:
                key = hashlib.sha256(repr((self.run, state)).encode()).hexdigest()[:40]  # alike in every process
                graph = self.graphs[state] = self._load(key) or self._compile(key, args, kwargs)
            self.last = state, graph
        return self.last[1](self.module, *args, **kwargs)

    def _load(self, key: str) -> Callable | None:
        path = ARTIFACTS / f"{key}.aot"
        if not path.exists():
            return None
        check_vector_isas_once_per_machine()  # what our backend runs first; a load would run Inductor's own (10 s)
        try:
            with open(path, "rb") as file:
                compiled = torch.compiler.load_compiled_function(file)
            return compiled if sources_unchanged(compiled) else None
        except Exception as error:  # an artifact torch cannot read back, a source gone: compile again, replace it
            warnings.warn(f"precompile: could not load {path} ({type(error).__name__}: {error}); compiling again")
            return None

    def _compile(self, key: str, args: tuple, kwargs: dict) -> Callable:
        limit = torch._dynamo.config.recompile_limit
        if len(self.graphs) >= limit:
            raise RuntimeError(f"precompile holds {len(self.graphs)} graphs for this model (Dynamo's recompile "
                               f"limit is {limit}): each new input shape compiles a graph of its own. Pass "
                               "precompile=False to compile_sharded where shapes vary; Dynamo then compiles them "
                               "dynamic.")
        compiling = torch.compile(_sharded_forward, fullgraph=True, backend=self.backend,
                                  options={"guard_filter_fn": _no_guards})
        try:
            compiled = compiling.aot_compile(((self.module, *args), kwargs))
        except torch._dynamo.exc.Unsupported as error:
            raise RuntimeError(f"precompile needs the forward in one graph, and Dynamo breaks it: "
                               f"{str(error).splitlines()[0]}. Fix the break, or pass precompile=False to "
                               "compile_sharded.") from error
        try:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(ARTIFACTS / f"{key}.aot"))
        except OSError as error:
            warnings.warn(f"precompile: could not save to {ARTIFACTS} ({error}); set SIMPLEFSDP_CACHE to a writable "
                          "directory to load this graph in the next run")
        return compiled
