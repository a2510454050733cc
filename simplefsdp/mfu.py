"""Model FLOPs utilization: a step's FLOPs by PaLM's accounting (checked against the IR's count on the traced graphs
in ``tests/test_mfu.py``) over the hardware profile's peak."""

from __future__ import annotations

import torch

from simplefsdp.ir.cpu_measure import measuring_threads
from simplefsdp.ir.hardware import cpu_profile, gpu_profile
from simplefsdp.models.llama import build_model, get_config


def step_flops(model_name: str, layers: int | None, batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward and backward of ``model_name`` (with ``layers`` blocks, if given) on ``batch_size`` x
    ``seq_len`` tokens, without activation checkpointing's recomputation: 6 per matmul weight and token (forward 2,
    backward 4; the embedding is a lookup and the norms' weights are elementwise) and attention's two matmuls,
    ``12 * layers * batch * seq_len^2 * dim``. Counted from the shapes, not traced: tracing costs seconds per block."""
    with torch.device("meta"):
        model = build_model(model_name, n_layers=layers)
    matmul_params = sum(p.numel() for p in model.parameters() if p.ndim == 2) - model.tok_embeddings.weight.numel()
    tokens = batch_size * seq_len
    return 6 * matmul_params * tokens + 12 * len(model.layers) * tokens * seq_len * get_config(model_name).dim


def peak_flops_per_second(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s in ``dtype`` of one rank's device: a GPU profile's data-sheet peak (None without a profile), or
    the ``cpu`` profile's matmul rate (measured with half the cores per rank) scaled to this rank's thread count."""
    if device.type == "cpu":
        return cpu_profile().peak_rate(dtype) * torch.get_num_threads() / measuring_threads()
    profile = gpu_profile(torch.cuda.get_device_name(device))
    return profile.peak_rate(dtype) if profile else None
