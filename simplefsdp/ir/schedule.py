"""The schedule: a post-grad FX graph read, without changing it, into ordered compute, collective and wait nodes.

FLOPs come from ``torch.utils.flop_counter`` formulas on the nodes' fake tensors, symbolic sizes at their hints."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import networkx as nx
import torch
import torch.distributed as dist
from torch import fx
from torch._ops import HigherOrderOperator
from torch.distributed.distributed_c10d import _resolve_process_group  # private, but the only way from a name
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from simplefsdp.ir.fqn import node_fqn

COMPUTE, COLLECTIVE, WAIT = "compute", "collective", "wait"

# Collective op by name (ours need no import) → (kind, index of the group-size argument or None, which buffer is full).
COLLECTIVE_OPS = {
    "_c10d_functional.all_gather_into_tensor.default": ("all_gather", 1, "output"),
    "_c10d_functional.all_gather_into_tensor_coalesced.default": ("all_gather", 1, "output"),
    "_c10d_functional.all_gather_into_tensor_out.default": ("all_gather", 1, "output"),
    "simplefsdp.all_gather_by_broadcasts.default": ("all_gather", 1, "output"),  # runtime/gloo_broadcasts.py
    "_c10d_functional.reduce_scatter_tensor.default": ("reduce_scatter", 2, "input"),
    "_c10d_functional.reduce_scatter_tensor_coalesced.default": ("reduce_scatter", 2, "input"),
    "_c10d_functional.all_reduce.default": ("all_reduce", None, "input"),
    "_c10d_functional.all_reduce_coalesced.default": ("all_reduce", None, "input"),
    "_c10d_functional.all_to_all_single.default": ("all_to_all", None, "input"),
}


@dataclass(frozen=True)
class Collective:
    """One collective: its kind, process group, element dtype and the full (unsharded) buffer size."""
    kind: str
    group_name: str
    group_ranks: tuple[int, ...]
    dtype: torch.dtype
    bytes: int

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)


@dataclass(frozen=True)
class ScheduleNode:
    """One operation of the graph. ``alias_of`` names the node whose storage this one shares (views, waits, tuple
    items); these allocate and cost nothing, except the items of an op returning several new tensors (ir.memory)."""
    name: str
    kind: str
    op: str
    fqn: str
    inputs: tuple[str, ...]
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    alias_of: str | None = None
    collective: Collective | None = None
    waits_for: str | None = None
    parts: tuple[ScheduleNode, ...] = ()  # a block compiled once (``invoke_subgraph``): the nodes of its subgraph


@dataclass(frozen=True)
class GraphInput:
    """A graph placeholder that holds a tensor: its size and, for parameter shards, the parameter's FQN."""
    name: str
    bytes: int
    param_fqn: str | None = None


@dataclass
class Schedule:
    """One graph (``phase`` is ``"forward"`` or ``"backward"``) read into ordered nodes and a ``networkx`` DAG;
    ``symbols`` maps each symbolic size of the graph's inputs to the hint its sizes were read at;
    ``data_parallel_groups`` names the process groups our passes may bucket and move collectives of (empty: all)."""
    phase: str
    inputs: list[GraphInput]
    nodes: list[ScheduleNode]
    outputs: list[str | None]
    code: str
    dag: nx.DiGraph = field(repr=False)
    symbols: dict[str, int] = field(default_factory=dict)
    data_parallel_groups: tuple[str, ...] = ()
    regions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a region body's name: the blocks calling it

    def node(self, name: str) -> ScheduleNode:
        """The node called ``name``; ``KeyError`` when there is none."""
        return self.dag.nodes[name]["node"]

    def collectives(self) -> list[ScheduleNode]:
        return [node for node in self.nodes if node.kind == COLLECTIVE]

    def parameter_gathers(self) -> list[ScheduleNode]:
        """The data-parallel all-gathers the passes may bucket and move, program order: those of parameters, which
        depend on no compute with FLOPs, and of quantized gradient sums (uint8: ``hybrid_shard``'s exchange between
        replicas); not an activation's gradient (the sharded lookup's)."""
        computed: set[str] = set()
        for node in self.nodes:
            if node.flops or computed.intersection(node.inputs):
                computed.add(node.name)
        return [node for node in self.data_parallel_collectives() if node.collective.kind == "all_gather"
                and (node.name not in computed or node.collective.dtype == torch.uint8)]

    def data_parallel_collectives(self) -> list[ScheduleNode]:
        """The collectives on ``data_parallel_groups``, program order: not tensor parallelism's."""
        groups = self.data_parallel_groups
        return [node for node in self.collectives() if not groups or node.collective.group_name in groups]


def read_schedule(gm: fx.GraphModule, phase: str, param_fqns: dict[str, str] | None = None,
                  data_parallel_groups: tuple[str, ...] = ()) -> Schedule:
    """Read ``gm`` into a ``Schedule``; ``param_fqns`` maps placeholder names to the FQNs of the parameters in them."""
    param_fqns = param_fqns or {}
    inputs, nodes, outputs = [], [], []
    fqns: dict[str, str] = {}
    regions: dict[fx.GraphModule, tuple[ScheduleNode, ...]] = {}
    dag = nx.DiGraph()
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            if isinstance(fx_node.meta.get("val"), torch.Tensor):
                inputs.append(GraphInput(fx_node.name, tensor_bytes(fx_node.meta["val"]), param_fqns.get(fx_node.name)))
        elif fx_node.op == "output":
            outputs = [arg.name if isinstance(arg, fx.Node) else None for arg in tree_flatten(fx_node.args)[0]]
        elif fx_node.op == "call_function":
            node = _read_node(fx_node, fqns, regions)
            fqns[node.name] = node.fqn
            nodes.append(node)
            dag.add_node(node.name, node=node)
            dag.add_edges_from((source, node.name) for source in node.inputs if source in dag)
    calls = _region_calls(gm, fqns)
    regions = {name: tuple(dict.fromkeys(block for block, _ in sites)) for name, sites in calls.items()}
    return Schedule(phase, inputs, nodes, outputs, _code_with_region_bodies(gm, calls), dag, _symbols(gm),
                    data_parallel_groups, regions)


def _region_calls(gm: fx.GraphModule, fqns: dict[str, str]) -> dict[str, list[tuple[str, str | None]]]:
    """Each region body ``gm`` calls (``invoke_subgraph``'s subgraph, by its attribute name): its calls in program
    order, each as (the block's FQN, the subgraph that pins the call, or None)."""
    calls: dict[str, list[tuple[str, str | None]]] = {}
    for fx_node in gm.graph.nodes:
        if fx_node.op != "call_function":
            continue
        call = _call(fx_node)
        if isinstance(call.target, HigherOrderOperator) and call.target.name() == "invoke_subgraph":
            site = fx_node.args[1].target if pinned(fx_node) else None
            calls.setdefault(call.args[0].target, []).append((fqns.get(fx_node.name) or "?", site))
    return calls


def _code_with_region_bodies(gm: fx.GraphModule, calls: dict[str, list[tuple[str, str | None]]]) -> str:
    """``gm``'s code, then each region body it calls, once, headed by its name and the blocks that call it (and the
    subgraph each call is pinned through)."""
    bodies = [f"\n\n# self.{name}, the region called by "
              f"{', '.join(block if site is None else f'{block} via self.{site}' for block, site in sites)}:\n"
              f"{getattr(gm, name).code}" for name, sites in calls.items()]
    return gm.code + "".join(bodies)


def _symbols(gm: fx.GraphModule) -> dict[str, int]:
    values = [node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder")]
    sizes = [size for value in values for size in (value.shape if isinstance(value, torch.Tensor) else [value])]
    return {str(size.node.expr): _as_size(size) for size in sizes
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol}


class _Call(NamedTuple):  # the op a node runs, its arguments as nodes of the node's own graph
    target: object
    args: tuple
    kwargs: dict


# AOTAutograd's wrappers of a random op it replays (on CUDA: attention with dropout): wrapper -> index of the op.
_RNG_WRAPPERS = {torch.ops.higher_order.graphsafe_run_with_rng_state: 0, torch.ops.higher_order.run_with_rng_state: 1}


def pinned(fx_node: fx.Node) -> bool:
    """Whether ``fx_node`` runs its op through Inductor's ``control_deps`` (``passes.inductor_internals.pin_order``),
    known by name: reading a schedule needs no Inductor, whose import costs seconds."""
    return isinstance(fx_node.target, HigherOrderOperator) and fx_node.target.name() == "control_deps"


def _call(fx_node: fx.Node) -> _Call:
    """What ``fx_node`` runs; for a ``pinned`` node, the one op of its subgraph (with the pinned node's arguments); for
    a node wrapped to replay its random numbers, the wrapped op."""
    if (index := _RNG_WRAPPERS.get(fx_node.target)) is not None:
        kwargs = {name: value for name, value in fx_node.kwargs.items() if name != "rng_state"}
        return _Call(fx_node.args[index], fx_node.args[index + 1:], kwargs)
    if not pinned(fx_node):
        return _Call(fx_node.target, fx_node.args, fx_node.kwargs)
    subgraph = getattr(fx_node.graph.owning_module, fx_node.args[1].target).graph
    inner = next(node for node in subgraph.nodes if node.op == "call_function")
    outer = dict(zip(subgraph.find_nodes(op="placeholder"), fx_node.args[2:]))
    args, kwargs = tree_map(lambda arg: outer.get(arg, arg) if isinstance(arg, fx.Node) else arg,
                            (inner.args, inner.kwargs))
    return _Call(inner.target, args, kwargs)


def _read_node(fx_node: fx.Node, fqns: dict[str, str], regions: dict) -> ScheduleNode:
    """``fqns``: the FQNs of the nodes read so far; a node of no module takes its first input's. ``regions``: the
    parts of each block subgraph read so far (a block compiled once is called once per block)."""
    call = _call(fx_node)
    inputs = tuple(dict.fromkeys(arg.name for arg in fx_node.all_input_nodes if arg.op != "get_attr"))
    fqn = node_fqn(fx_node) or next((fqns[name] for name in inputs if fqns.get(name)), "")
    target = call.target
    op = str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    common = dict(name=fx_node.name, op=op, fqn=fqn, inputs=inputs)
    if target is torch.ops._c10d_functional.wait_tensor.default:
        source = call.args[0]
        while source.target is operator.getitem:  # a tuple item: the wait belongs to the collective that made it
            source = source.args[0]
        return ScheduleNode(kind=WAIT, waits_for=source.name, alias_of=call.args[0].name, **common)
    common["bytes_written"] = _bytes_of(tree_flatten(fx_node.meta.get("val"))[0])
    if op in COLLECTIVE_OPS:
        return ScheduleNode(kind=COLLECTIVE, collective=_read_collective(call, op, common["bytes_written"]), **common)
    if (alias := _aliased_input(call)) is not None:
        return ScheduleNode(kind=COMPUTE, alias_of=alias, **common)
    if isinstance(target, HigherOrderOperator) and target.name() == "invoke_subgraph":
        return _read_region(fx_node, call, common, regions)
    read = dict.fromkeys(arg for arg in tree_flatten((call.args, call.kwargs))[0] if isinstance(arg, fx.Node))
    bytes_read = _bytes_of(arg.meta.get("val") for arg in read)
    return ScheduleNode(kind=COMPUTE, flops=_flops(fx_node, call), bytes_read=bytes_read, **common)


def _read_region(fx_node: fx.Node, call: _Call, common: dict, regions: dict) -> ScheduleNode:
    """A block compiled once: its subgraph's nodes (read once, into ``regions``) as ``parts``, their costs summed."""
    subgraph = getattr(fx_node.graph.owning_module, call.args[0].target)
    if subgraph not in regions:
        fqns: dict[str, str] = {}
        regions[subgraph] = tuple(_read_node(node, fqns, regions) for node in subgraph.graph.nodes
                                  if node.op == "call_function")
    parts = regions[subgraph]
    return ScheduleNode(kind=COMPUTE, flops=sum(part.flops for part in parts), parts=parts,
                        bytes_read=sum(part.bytes_read for part in parts), **common)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements; a symbolic shape at its hint."""
    return _as_size(tensor.numel()) * tensor.element_size()


def _as_size(value) -> int:
    """``value`` as an ``int``: a ``SymInt`` at its hint (``optimization_hint``: adds no guard)."""
    return optimization_hint(value) if isinstance(value, torch.SymInt) else int(value)


def _bytes_of(values) -> int:
    """Bytes of the tensors among ``values``."""
    return sum((tensor_bytes(value) for value in values if isinstance(value, torch.Tensor)), 0)


def _aliased_input(call: _Call) -> str | None:
    """The input whose storage the output of ``call`` shares: views by schema, and tuple items."""
    if call.target is operator.getitem:
        return call.args[0].name
    schema = getattr(call.target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    if alias is None or alias.is_write:
        return None
    return next((arg.name for arg in call.args if isinstance(arg, fx.Node)), None)


def _flops(fx_node: fx.Node, call: _Call) -> int:
    """FLOPs by PyTorch's formula; halved for causal attention, whose kernels skip the masked half."""
    formula = flop_registry.get(getattr(call.target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = tree_map(lambda arg: arg.meta["val"] if isinstance(arg, fx.Node) else arg, (call.args, call.kwargs))
    flops = _as_size(formula(*args, **kwargs, out_val=fx_node.meta["val"]))
    names = [argument.name for argument in call.target._schema.arguments]
    causal = "is_causal" in names and dict(zip(names, args), **kwargs).get("is_causal", False)
    return flops // 2 if causal else flops


def _read_collective(call: _Call, op: str, output_bytes: int) -> Collective:
    kind, size_index, full_buffer = COLLECTIVE_OPS[op]
    ranks = group_ranks(call.args[-1])
    if size_index is not None and len(ranks) != call.args[size_index]:
        ranks = tuple(range(call.args[size_index]))
    sources = tree_flatten(call.args[0])[0]
    size = output_bytes if full_buffer == "output" else _bytes_of(source.meta["val"] for source in sources)
    return Collective(kind=kind, group_name=str(call.args[-1]), group_ranks=ranks, dtype=sources[0].meta["val"].dtype,
                      bytes=size)


def group_ranks(group_name: str) -> tuple[int, ...]:
    """Global ranks of the process group registered as ``group_name`` in this process; ``()`` for an unknown name."""
    if not dist.is_initialized():
        return ()
    try:
        return tuple(dist.get_process_group_ranks(process_group(group_name)))
    except (ValueError, RuntimeError, KeyError):
        return ()


def process_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered as ``group_name`` in this process (as a traced collective names it)."""
    return _resolve_process_group(group_name)
