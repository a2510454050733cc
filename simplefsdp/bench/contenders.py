"""The ways to train the model that ``simplefsdp bench`` compares, FSDP2 eager (the reference) first."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from simplefsdp.api import compile_sharded
from simplefsdp.passes.bucket_plan import find_blocks
from simplefsdp.runtime.mixed_precision import mixed_precision_option
from simplefsdp.runtime.quantize import Quantize, quantize_option

REFERENCE = "fsdp2-eager"
CHECKED = ("simplefsdp", "simplefsdp-nopasses")  # the rows whose loss must match the reference's
PASSES_OFF = {"buckets": None, "reorder": False}


@dataclass(frozen=True)
class Contender:
    """A way to train the model: ``wrap`` turns the freshly built model into the module to train. ``compiled``: it
    must compile graphs of its own; ``distributed``: it trains the global batch across ranks."""

    name: str
    summary: str
    wrap: Callable[[nn.Module, argparse.Namespace], nn.Module]
    compiled: bool = True
    distributed: bool = True


def _simplefsdp(model: nn.Module, args: argparse.Namespace, **options) -> nn.Module:
    options.setdefault("quantize", quantize_option(args))
    return compile_sharded(model, mp_policy=mixed_precision_option(args), backend=args.backend, **options)


def _fsdp2(model: nn.Module, args: argparse.Namespace, compile_blocks: bool = False) -> nn.Module:
    """``fully_shard`` on each transformer block, then the root, as torchtitan applies it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = mixed_precision_option(args)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtypes.param_dtype, reduce_dtype=dtypes.reduce_dtype)
    for name in find_blocks(model):  # torchtitan's order: the compiled block replaces the block, then is sharded
        block = model.get_submodule(name)
        if compile_blocks:
            parent, _, child = name.rpartition(".")
            block = torch.compile(block, backend=args.backend)
            model.get_submodule(parent).register_module(child, block)
        fully_shard(block, mp_policy=mp_policy)
    if compile_blocks:  # torchtitan compiles the loss on its own too (compile.components: model and loss)
        model.loss = torch.compile(model.loss, backend=args.backend)
    return fully_shard(model, mp_policy=mp_policy)


def _ddp_compiled(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    ddp.compile(backend=args.backend)
    return ddp


def _local(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """The plain model, compiled. Dynamo caches graphs per code object and reuses one wherever its guards
    pass, so the model's class becomes a subclass of its own: no other contender's graph fits it."""
    model.__class__ = type(f"Local{type(model).__name__}", (type(model),), {})
    model.compile(backend=args.backend)
    return model


CONTENDERS = [
    Contender(REFERENCE, "fully_shard on each block and the root, eager", _fsdp2, compiled=False),
    Contender("simplefsdp", "compile_sharded with default options", _simplefsdp),
    Contender("simplefsdp-nopasses", "compile_sharded(" + ", ".join(f"{k}={v!r}" for k, v in PASSES_OFF.items()) + ")",
              partial(_simplefsdp, **PASSES_OFF)),
    Contender("simplefsdp-int8", "compile_sharded(quantize=Quantize('int8', 'int8')): int8 gathers, int8 gradients "
              "with error feedback", partial(_simplefsdp, quantize=Quantize("int8", "int8"))),
    Contender("simplefsdp-replicate", "compile_sharded(mode='replicate'): DDP's layout, bucketed all-reduces",
              partial(_simplefsdp, mode="replicate")),
    Contender("fsdp2-compile", "fully_shard on each block and the root, each block and the loss torch.compile'd",
              partial(_fsdp2, compile_blocks=True)),
    Contender("ddp-compile", "DistributedDataParallel, torch.compile'd (full precision)", _ddp_compiled),
    Contender("local", "one process per rank, its own per-rank batch, no communication, compiled (full precision)",
              _local, distributed=False),
]
