"""Loading a pickled ``GraphModule`` without the tensors its factory calls make.

torch 2.13 rebuilds a pickled ``GraphModule`` (one is in each cached AOTAutograd entry of a compiled-once block: its
backward) by tracing its code with ``Proxy`` operands. A call with no ``Proxy`` operand, a factory (``aten.full``: the
zeros a slice's backward scatters into), runs for real there, and the loaded graph holds its tensor for the life of
the process: on ``cpu-small``, whose rotary embedding slices its queries and keys, zeros of their size, 0.75 MiB a
rank. Every rank that loads the graph from the cache holds them; the rank that compiled it does not.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.fx import Proxy, graph_module
from torch.fx._symbolic_trace import Tracer
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

_deserialize = graph_module._deserialize_graph_module


def trace_ops_without_proxies_on_load() -> None:
    """Make a loaded ``GraphModule`` record an op called with no ``Proxy`` operand as a node, as the graph it was
    pickled from has it, instead of a tensor constant (idempotent; replaces torch's private
    ``torch.fx.graph_module._deserialize_graph_module``)."""
    graph_module._deserialize_graph_module = _deserialize_recording_every_op


def _deserialize_recording_every_op(forward: Callable[..., Any], body: dict[str, Any],
                                    graph_module_cls: type | None = None) -> torch.nn.Module:
    tracer = body.get("_tracer_cls") or Tracer
    module = _deserialize(forward, {**body, "_tracer_cls": _recording_every_op(tracer)}, graph_module_cls)
    module.graph._tracer_cls = tracer  # as torch sets it: the loaded graph pickles as the one it was loaded from
    if "_tracer_cls" in vars(module):
        module._tracer_cls = tracer
    return module


@functools.cache
def _recording_every_op(tracer: type) -> type:
    class RecordingEveryOp(tracer):
        def trace(self, root: Any, *args: Any, **kwargs: Any) -> torch.fx.Graph:
            with _OpsWithoutProxiesRecorded(self):
                return super().trace(root, *args, **kwargs)

    return RecordingEveryOp


class _OpsWithoutProxiesRecorded(TorchFunctionMode):
    """While ``tracer`` traces, an ATen op called with no ``Proxy`` operand becomes a node instead of running."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and not any(
                isinstance(leaf, Proxy) for leaf in pytree.tree_leaves((args, kwargs))):
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)
