"""Model FLOPs utilization: a step's FLOPs by PaLM's accounting (checked against the IR's count on the traced graphs
in ``tests/test_mfu.py``) over the hardware profile's peak."""

from __future__ import annotations

import torch
from torch import nn

from simplefsdp.ir.cpu_measure import measuring_threads
from simplefsdp.ir.hardware import cpu_profile, gpu_profile


def step_flops(model: nn.Module, attention: tuple[int, int], batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward and backward of ``model`` on ``batch_size`` x ``seq_len`` tokens, without activation
    checkpointing's recomputation: 6 per matmul weight and token (forward 2, backward 4: each 2-D weight of a module
    other than an embedding, which is a lookup; a tied output layer counted once) and attention's two matmuls,
    ``12 * layers * batch * seq_len^2 * width`` for ``attention = (layers, width)``, the width of its queries (heads x
    head dim). Counted from the shapes, not traced: tracing costs seconds per block."""
    weights = {id(p): p.numel() for module in model.modules() if not isinstance(module, nn.Embedding)
               for p in module.parameters(recurse=False) if p.ndim == 2}
    layers, width = attention
    tokens = batch_size * seq_len
    return 6 * sum(weights.values()) * tokens + 12 * layers * tokens * seq_len * width


def peak_flops_per_second(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s in ``dtype`` of one rank's device: a GPU profile's data-sheet peak (None without a profile), or
    the ``cpu`` profile's matmul rate (measured with half the cores per rank) scaled to this rank's thread count."""
    if device.type == "cpu":
        return cpu_profile().peak_rate(dtype) * torch.get_num_threads() / measuring_threads()
    profile = gpu_profile(torch.cuda.get_device_name(device))
    return profile.peak_rate(dtype) if profile else None
