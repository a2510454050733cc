"""simplefsdp: Fully Sharded Data Parallel compiled by ``torch.compile``."""

from simplefsdp.api import compile_sharded
from simplefsdp.inspection import inspect
from simplefsdp.runtime.mixed_precision import MixedPrecision

__all__ = ["compile_sharded", "inspect", "MixedPrecision"]
