"""simplefsdp: Fully Sharded Data Parallel compiled by ``torch.compile``."""

from simplefsdp.api import compile_sharded
from simplefsdp.inspection import inspect
from simplefsdp.runtime.activation_checkpoint import apply_activation_checkpointing
from simplefsdp.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from simplefsdp.runtime.clip_grad import clip_grad_norm_
from simplefsdp.runtime.meta_init import materialize_sharded
from simplefsdp.runtime.mixed_precision import MixedPrecision
from simplefsdp.runtime.quantize import Quantize

__all__ = ["compile_sharded", "inspect", "MixedPrecision", "Quantize", "clip_grad_norm_", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "materialize_sharded", "apply_activation_checkpointing"]
