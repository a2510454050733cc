"""Meta-device initialization: allocate only this rank's shards, then fill them as an unsharded init would.

Each ``torch.nn.init`` call or random fill (``normal_``, ...) on a sharded parameter runs on a full temporary tensor,
drawing from the global generator as the unsharded init would, and this rank keeps its shard; other in-place ops
(``fill_``) run on the shard. The same seed gives the same parameters, with one full parameter alive at a time.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

from simplefsdp.runtime.compiled_call import set_compiled_call
from simplefsdp.runtime.quantize import materialize_error_buffers

RANDOM_FILLS = {
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.geometric_,
}


def materialize_sharded(model: nn.Module, init_fn: Callable[[], None] | None = None) -> nn.Module:
    """Allocate ``model``'s shards (built on ``meta``, then ``compile_sharded``) and initialize them in place;
    ``init_fn`` (default ``model.init_weights``) must set every parameter and buffer."""
    params = list(model.parameters())
    if not params or not all(isinstance(p, DTensor) for p in params):
        raise ValueError("materialize_sharded expects a model built on 'meta' and passed through compile_sharded first")
    init_fn = init_fn or getattr(model, "init_weights", None)
    if init_fn is None:
        raise ValueError(f"{type(model).__name__} has no init_weights(); pass init_fn=... that initializes it in place")
    model.to_empty(device=params[0].device_mesh.device_type)
    materialize_error_buffers(model, params[0].device_mesh.device_type)
    with torch.no_grad(), _init_functions_on_full_tensors(), _FullRandomFills():
        init_fn()
    return model


def refuse_calls_until_materialized(model: nn.Module) -> None:
    """Make a call of the compiled ``model`` (sharded on ``meta``) raise while a parameter or buffer is still on
    ``meta``, before Dynamo traces and before any collective; once ``materialize_sharded`` has filled it, calls run
    the compiled call as it was. Without it, Inductor failed about 40 s into the first call ("meta and cpu!")."""
    compiled = model._compiled_call_impl

    def first_call(*args, **kwargs):
        if meta := [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]:
            raise RuntimeError(f"{type(model).__name__} was called with {len(meta)} parameter(s) or buffer(s) still on "
                               f"the meta device (first: {meta[0]}): compile_sharded shards a meta model but does not "
                               "fill it; call simplefsdp.materialize_sharded(model) after compile_sharded and before "
                               "the first call")
        model._compiled_call_impl = compiled
        return compiled(*args, **kwargs)

    set_compiled_call(model, first_call)


def _keep_shard(target: DTensor, fill: Callable[[torch.Tensor], object]) -> DTensor:
    """Run ``fill`` on a full temporary tensor shaped like ``target``; copy this rank's part into ``target``."""
    full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
    fill(full)
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    target.to_local().copy_(full[tuple(slice(start, start + size) for start, size in zip(offset, shape))])
    return target


@contextlib.contextmanager
def _init_functions_on_full_tensors() -> Iterator[None]:
    """Temporarily make each public ``torch.nn.init`` function handle a DTensor through ``_keep_shard``."""
    originals = {name: fn for name, fn in vars(nn.init).items()
                 if callable(fn) and name.endswith("_") and not name.startswith("_")}

    def on_full_tensor(fn):
        @functools.wraps(fn)
        def wrapper(tensor, *args, **kwargs):
            if isinstance(tensor, DTensor):
                return _keep_shard(tensor, lambda full: fn(full, *args, **kwargs))
            return fn(tensor, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(nn.init, name, on_full_tensor(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


class _FullRandomFills(TorchFunctionMode):
    """Random fills called directly on a DTensor (``w.normal_()``) go through ``_keep_shard``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_FILLS and isinstance(args[0], DTensor):
            return _keep_shard(args[0], lambda full: func(full, *args[1:], **kwargs))
        return func(*args, **kwargs)
