"""simplefsdp: Fully Sharded Data Parallel compiled by ``torch.compile``.

The public names load on first use (PEP 562): a launcher never imports Dynamo and Inductor, nor an eager rank
Inductor's compiler, which cost seconds of CPU per process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_MODULES = {
    "compile_sharded": "simplefsdp.api",
    "inspect": "simplefsdp.inspection",
    "apply_activation_checkpointing": "simplefsdp.runtime.activation_checkpoint",
    "latest_checkpoint": "simplefsdp.runtime.checkpoint",
    "load_checkpoint": "simplefsdp.runtime.checkpoint",
    "save_checkpoint": "simplefsdp.runtime.checkpoint",
    "clip_grad_norm_": "simplefsdp.runtime.clip_grad",
    "materialize_sharded": "simplefsdp.runtime.meta_init",
    "MixedPrecision": "simplefsdp.runtime.mixed_precision",
    "Quantize": "simplefsdp.runtime.quantize",
}
__all__ = list(_MODULES)

if TYPE_CHECKING:
    from simplefsdp.api import compile_sharded
    from simplefsdp.inspection import inspect
    from simplefsdp.runtime.activation_checkpoint import apply_activation_checkpointing
    from simplefsdp.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from simplefsdp.runtime.clip_grad import clip_grad_norm_
    from simplefsdp.runtime.meta_init import materialize_sharded
    from simplefsdp.runtime.mixed_precision import MixedPrecision
    from simplefsdp.runtime.quantize import Quantize


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'simplefsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
