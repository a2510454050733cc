"""Model FLOPs utilization: training FLOPs per token, and a small table of peak FLOP/s per device.

Kept apart so it can later read the IR's FLOP count and the cost model's hardware profiles.
"""

from __future__ import annotations

import torch

from simplefsdp.models.llama import LlamaConfig

# Dense bf16 peak FLOP/s by GPU name fragment (vendor data sheets).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
# Nominal fp32 FLOP/s of one CPU core: 2 AVX2 FMA units x 8 lanes x 2 FLOPs x ~3 GHz.
CPU_CORE_PEAK_FLOPS = 96e9


def training_flops_per_token(config: LlamaConfig, num_params: int, seq_len: int) -> float:
    """Forward plus backward FLOPs per token: 6 per matmul weight, plus 12 * layers * dim * seq_len for attention.

    The token embedding is a lookup, not a matmul, so its weights are not counted.
    """
    matmul_params = num_params - (0 if config.tie_embeddings else config.vocab_size * config.dim)
    return 6 * matmul_params + 12 * config.n_layers * config.dim * seq_len


def peak_flops_per_second(device_type: str) -> float | None:
    """Peak FLOP/s of the device one rank computes on; None for a GPU not in the table."""
    if device_type == "cpu":
        return torch.get_num_threads() * CPU_CORE_PEAK_FLOPS
    name = torch.cuda.get_device_name()
    return next((peak for fragment, peak in GPU_PEAK_FLOPS.items() if fragment in name), None)
