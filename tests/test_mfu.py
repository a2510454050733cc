"""MFU's two halves: FLOPs counted on the IR's graphs, and the hardware profile's peak."""

from __future__ import annotations

import dataclasses

import torch

from simplefsdp.ir.hardware import get_profile
from simplefsdp.mfu import step_flops
from simplefsdp.models.llama import build_model, get_config


def test_step_flops_are_six_params_tokens_plus_attention():
    """6 FLOPs per matmul weight per token (forward 2, backward 4), and attention's two matmuls:
    4 * B * S^2 * dim per layer forward, twice that backward, so 12 * L * B * S^2 * dim.
    The embedding (a lookup) and the norms' weights (elementwise) take part in no matmul."""
    batch, seq = 2, 32
    config = get_config("debug")
    model = build_model("debug")
    matmul_params = sum(p.numel() for p in model.parameters() if p.ndim == 2) - model.tok_embeddings.weight.numel()
    expected = 6 * matmul_params * batch * seq + 12 * config.n_layers * batch * seq**2 * config.dim
    assert step_flops("debug", None, batch, seq) == expected


def test_peak_is_the_data_sheet_for_gpus_and_the_measured_rate_for_cpus():
    h100 = get_profile("h100")
    for dtype in (torch.bfloat16, torch.float32):
        assert h100.peak_rate(dtype) == h100.peak_flops_per_s[str(dtype).removeprefix("torch.")]
        assert h100.peak_rate(dtype) != h100.matmul_rate(dtype)  # the data sheet, not the rate reached
    assert h100.peak_rate(torch.float64) == h100.peak_flops_per_s["float32"]  # no entry: the fp32 peak
    measured = dataclasses.replace(h100, peak_flops_per_s={})
    assert measured.peak_rate(torch.bfloat16) == measured.matmul_rate(torch.bfloat16)
