"""Capturing the forward and backward graphs that ``torch.compile`` hands to Inductor, run as plain FX.

AOTAutograd runs with Inductor's decompositions and min-cut partitioner, so the split, checkpoint tags, saved tensors,
collectives and their order are an Inductor compile's; Inductor's post-grad pattern passes are not run, so elementwise
ops stay unfused. On meta or fake tensors nothing is allocated. Private APIs used: ``ARCHITECTURE.md``'s table."""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass
from typing import Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._C import DispatchKey
from torch._decomp import global_decomposition_table
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import TracingContext, detect_fake_mode
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
from torch._inductor.decomposition import select_decomp_table
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import fake_tensor_tls
from torch.distributed.tensor import DTensor

from simplefsdp.runtime.unused_outputs import drop_unread_region_inputs

_SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, then as it was, and Dynamo's collection after it compiles off:
    tracing a large model builds a heap of FX nodes and fake tensors that each full collection walks again
    (``inspect`` of Llama 3 8B at 512 ranks: 41.1 -> 37.3 s, peak RSS +165 MiB; Dynamo's own collection, 1.4 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch._dynamo.config.patch(run_gc_after_compile=False):
            yield
    finally:
        if enabled:
            gc.enable()


def _real_tensors_made_fake() -> contextlib.AbstractContextManager:
    """Inside, a real tensor an op meets while tracing becomes a fake one, as Dynamo does for a function it treats as a
    leaf: indexing a meta tensor by a list (Falcon's ``qkv[:, :, :, [-2]]``) makes the index a real meta tensor,
    which the fake mode refuses otherwise. Tracing runs nothing, so no data is read."""
    return mock.patch.object(fake_tensor_tls, "allow_non_fake_inputs_override", True)


@dataclass
class CapturedGraphs:
    """The forward and backward FX graphs of one compiled call, and which placeholders hold which parameter."""
    forward: fx.GraphModule
    backward: fx.GraphModule
    param_fqns: dict[str, str]


class TraceError(RuntimeError):
    """The model could not be traced into one forward and one backward graph."""


class _BothGraphsCaptured(Exception):
    """Raised by ``capture_graphs``'s backend once it holds both graphs: Dynamo stops before guards and a run."""


def capture_graphs(model: nn.Module, example_inputs: tuple, *, fused_attention: bool = True,
                   dynamic: bool = False, joint_pass: Callable[[fx.GraphModule], object] | None = None
                   ) -> CapturedGraphs:
    """Trace ``model`` on ``example_inputs`` as ``torch.compile`` does and return its graphs, without running them. With
    ``fused_attention`` ``scaled_dot_product_attention`` is traced as the fused kernel a GPU runs (flash, or
    memory-efficient attention where it has a mask), even on meta tensors; with ``dynamic`` the inputs' sizes are
    traced as symbols. Raises ``TraceError`` naming the fix when the forward does not trace as one graph."""
    graphs: dict[str, fx.GraphModule] = {}
    dynamo_inputs: list[str | None] = []
    names = {id(param): name for name, param in model.named_parameters()}

    def record_inputs(inputs: list) -> None:
        dynamo_inputs[:] = [names.get(id(value)) for value in inputs]

    def record_graph(phase: str, gm: fx.GraphModule) -> None:
        graphs[phase] = gm
        if phase == "backward":
            raise _BothGraphsCaptured

    backend = fx_backend(record_graph, record_inputs, fused_attention=fused_attention, joint_pass=joint_pass)

    def call(*inputs):  # the model's forward hooks join its graph, as in compile_sharded's compiled call
        return model(*inputs)

    # AOTAutograd compiles the backward with the forward (not at the first backward), so both are in hand before
    # Dynamo builds guards or runs anything: about 6% of inspect's time at Llama 3 8B.
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), _real_tensors_made_fake():
        try:
            torch.compile(call, backend=backend, fullgraph=True, dynamic=dynamic)(*example_inputs)
        except Exception as error:  # Dynamo raises many types; all mean "does not trace"
            if isinstance(getattr(error, "inner_exception", None), _BothGraphsCaptured):
                forward = graphs["forward"]
                return CapturedGraphs(forward, graphs["backward"], _parameter_placeholders(forward, dynamo_inputs))
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise TraceError(f"could not trace {type(model).__name__} into one graph ({type(error).__name__}: "
                             f"{first_line}); make its forward run under torch.compile(model, fullgraph=True) first"
                             ) from error
    raise TraceError(f"{type(model).__name__} returned no tensor that requires grad, so there is no backward "
                     "graph; inspect a model with trainable parameters whose output depends on them")


def fx_backend(on_graph: Callable[[str, fx.GraphModule], None] | None = None,
               on_inputs: Callable[[list], None] | None = None, *, fused_attention: bool = False,
               joint_pass: Callable[[fx.GraphModule], object] | None = None) -> Callable:
    """A ``torch.compile`` backend: AOTAutograd split as Inductor does it, graphs run as plain FX. ``on_graph`` sees
    the forward and the backward graph as ``(phase, gm)``, ``on_inputs`` Dynamo's example inputs. Used bare, it runs
    exactly the graphs ``inspect`` prices (how the cpu calibration measures them)."""

    def compile_graph(phase: str, gm: fx.GraphModule, _inputs) -> Callable:
        if on_graph is not None:
            on_graph(phase, gm)
        return run_boxed(gm)

    aot_backend = aot_autograd(
        fw_compiler=functools.partial(compile_graph, "forward"),
        bw_compiler=functools.partial(compile_graph, "backward"),
        partition_fn=functools.partial(_partition, joint_pass),
        decompositions=select_decomp_table(),
    )

    def backend(gm: fx.GraphModule, inputs: list) -> Callable:
        if fused_attention:
            _use_fused_attention(gm)
        if on_inputs is not None:
            on_inputs(inputs)
        with _composites_differentiable_on_meta(), compiling_regions(gm):  # AOTAutograd traces here
            return aot_backend(gm, inputs)

    return backend


def _partition(joint_pass: Callable[[fx.GraphModule], object] | None, joint: fx.GraphModule, *args, **kwargs):
    """Inductor's min-cut partition of ``joint``, after ``joint_pass`` if any."""
    if joint_pass is not None:
        joint_pass(joint)
        joint.recompile()
    return min_cut_rematerialization_partition(joint, *args, compiler="inductor", **kwargs)


@contextlib.contextmanager
def compiling_regions(gm: fx.GraphModule) -> Iterator[None]:
    """For a Dynamo graph with compiled-once blocks (``invoke_subgraph``): partition with ``recompute_views``, so a
    region's forward saves a weight it reads, not the weight's transpose, and ``recompute_region_inputs`` can point
    the backward at the gathered weight (regathered in backward); trace each region's schema once; conjugate complex
    tensors into new ones, as a region cannot pass a conjugate view (complex multiplication's backward saves one) to
    its backward in torch 2.13 (no ``Conjugate`` kernel for ``invoke_subgraph``); and keep Inductor from laying out
    convolutions' outputs channels-last, strides a region's graphs were not traced with (ConvNeXt's blocks then fail
    to view their input). Else nothing. First, the calls of a region that takes a DTensor (a block's gathers) are
    inlined into ``gm``, and the region inputs a subgraph never reads are dropped (``runtime/unused_outputs.py``; for
    ``inspect`` and ``precompile``, which do not compile through its backend)."""
    _inline_gather_regions(gm)
    drop_unread_region_inputs(gm)
    if not gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        yield
        return
    with (torch._functorch.config.patch(recompute_views=True), torch._inductor.config.patch(layout_optimization=False),
          _region_schemas_traced_once(),
          mock.patch.dict(select_decomp_table(), {torch.ops.aten._conj.default: torch.conj_physical})):
        yield


def _inline_gather_regions(gm: fx.GraphModule) -> None:
    """Replace each call of a region that takes a DTensor (``runtime/block_regions.py``: a block's gathers, traced
    once by Dynamo) by the region's nodes, named by the calling block (``nn_module_stack``, checkpoint bodies included):
    its collectives join the outer graph, where the passes bucket and reorder them as if traced per block, and
    AOTAutograd sees no region with DTensor inputs, which it cannot partition. A returned clone becomes its source."""
    calls = [node for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
             if any(isinstance(arg, fx.Node) and isinstance(arg.meta.get("example_value"), DTensor)
                    for arg in node.args[2:])]
    regions = {call.args[0] for call in calls}
    for index, call in enumerate(calls):
        region, stack = getattr(gm, call.args[0].target), call.meta.get("nn_module_stack")
        values = dict(zip(region.graph.find_nodes(op="placeholder"), call.args[2:]))
        clones = region.graph.output_node().args[0]
        with gm.graph.inserting_before(call):
            for node in region.graph.nodes:
                if node in clones:
                    continue
                if node.op == "get_attr":  # a checkpoint's body: a copy per call, named by the calling block
                    name = f"{node.target}_of_gather_{index}"
                    gm.add_submodule(name, _with_module_stack(getattr(region, node.target), stack))
                    values[node] = gm.graph.get_attr(name)
                    values[node].meta = dict(node.meta)
                elif node.op not in ("placeholder", "output"):
                    values[node] = gm.graph.node_copy(node, values.__getitem__)
                    values[node].meta["nn_module_stack"] = stack
        for user in list(call.users):  # a region returns clones: it may not return a view of its input
            out = clones[user.args[1]]
            assert out.target in ("clone", torch.clone), f"a gather region returns clones, not {out.format_node()}"
            user.replace_all_uses_with(values[out.args[0]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(call)
    for node in regions:
        if not node.users:
            gm.graph.erase_node(node)
    if calls:
        gm.recompile()


def _with_module_stack(module: fx.GraphModule, stack: dict | None) -> fx.GraphModule:
    """A copy of ``module`` whose nodes all carry ``stack`` as their ``nn_module_stack``."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.nodes:
        node.meta["nn_module_stack"] = stack
    return fx.GraphModule(module, graph)


@contextlib.contextmanager
def _region_schemas_traced_once() -> Iterator[None]:
    """Inside, autograd's check that a region call mutates no input reads the schema of the region's first call in
    this compile: torch 2.13 traces the region again for every call (0.1-0.5 s a block, AOTAutograd calls it three
    times per block), where its functionalization already keeps one schema per (region, identifier, operand types)
    in the compile's ``InvokeSubgraphCache``; this keeps the autograd check's there too."""
    generate = InvokeSubgraphHOP.gen_schema

    def gen_schema(hop, subgraph, identifier, *operands):
        context = TracingContext.try_get()
        cache = context.hop_dispatch_set_cache.get_cache(hop) if context is not None else None
        if cache is None:
            return generate(hop, subgraph, identifier, *operands)
        key = ("autograd", id(subgraph), identifier, tuple(type(operand) for operand in operands))
        if (schema := cache.get_functionalize_schema_entry(key)) is None:
            schema = generate(hop, subgraph, identifier, *operands)
            cache.add_functionalize_schema_entry(key, schema)
        return schema

    with mock.patch.object(InvokeSubgraphHOP, "gen_schema", gen_schema):
        yield


@contextlib.contextmanager
def _composites_differentiable_on_meta() -> Iterator[None]:
    """Inside, an op that autograd differentiates through its decomposition (``CompositeImplicitAutograd``) keeps its
    gradient on meta tensors while AOTAutograd traces, as in eager: torch 2.13's Python dispatcher ran its meta kernel
    below autograd (``torch.where(mask, x, -inf)`` in T5's decoder left its relative attention bias without one)."""
    ops = {op for table in global_decomposition_table.values() for op in table
           if isinstance(op, OpOverload) and DispatchKey.Meta in op.py_kernels
           and op.has_kernel_for_dispatch_key(DispatchKey.CompositeImplicitAutograd)
           and not op.has_kernel_for_dispatch_key(DispatchKey.Autograd)
           and not op.has_kernel_for_dispatch_key(DispatchKey.AutogradMeta)}
    for op in ops:
        op.py_impl(DispatchKey.AutogradMeta)(op.decompose)
    try:
        yield
    finally:
        for op in ops:
            del op.py_kernels[DispatchKey.AutogradMeta]
            op._dispatch_cache.clear()  # py_impl clears it on registering; nothing public does on removing


def run_boxed(gm: fx.GraphModule) -> Callable[[list], object]:
    """Run ``gm`` by ``fx.Interpreter`` with the boxed calling convention, freeing tensors as early as Inductor does.
    A fresh interpreter per call: one keeps the values of its last run (the forward's saved tensors) until the next.
    On fake inputs the graph runs in their ``FakeTensorMode``, so its factory ops allocate nothing either."""

    def run(args: list) -> object:
        with detect_fake_mode(args) or contextlib.nullcontext():
            return fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True  # AOTAutograd's (private) marker for a boxed callable
    return run


def _parameter_placeholders(forward: fx.GraphModule, dynamo_inputs: list[str | None]) -> dict[str, str]:
    """Placeholder name → parameter FQN, from AOTAutograd's descriptor of each forward input."""
    fqns = {}
    for placeholder in forward.graph.find_nodes(op="placeholder"):
        desc = placeholder.meta.get("desc")
        while hasattr(desc, "base"):  # a DTensor's inner tensor points at the DTensor input
            desc = desc.base
        index = getattr(desc, "idx", None)
        if index is not None and index < len(dynamo_inputs) and dynamo_inputs[index] is not None:
            fqns[placeholder.name] = dynamo_inputs[index]
    return fqns


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` through the kernel a GPU runs: flash without a mask, memory-efficient attention
    with one (a boolean mask made an additive bias first, as SDPA makes it; Hugging Face passes a causal mask under
    ``torch.compile``), rather than the math a meta tensor dispatches to, which saves every attention probability."""
    if enable_gqa or query.dim() != 4:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    bias = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                                                  scale=scale)[0]


def _use_fused_attention(gm: fx.GraphModule) -> None:
    """Point every attention call of Dynamo's graph and its subgraphs (checkpointed blocks) at ``_fused_attention``."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target in _SDPA_TARGETS:
                    node.target = _fused_attention
            module.recompile()
