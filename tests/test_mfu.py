"""MFU's two halves: a step's FLOPs (PaLM's accounting, against the IR's count on the traced graphs), and the
hardware profile's peak."""

from __future__ import annotations

import dataclasses

import torch

import pytest

from simplefsdp.ir.capture import capture_graphs
from simplefsdp.ir.hardware import get_profile
from simplefsdp.ir.schedule import read_schedule
from simplefsdp.mfu import step_flops
from simplefsdp.models.llama import build_model


@pytest.mark.parametrize("model_name, layers, batch, seq", [("debug", None, 2, 32), ("cpu-small", 1, 1, 48)])
def test_step_flops_are_the_flops_of_the_traced_forward_and_backward(model_name, layers, batch, seq):
    """PaLM's accounting (6 FLOPs per matmul weight per token, attention's 12 * L * B * S^2 * dim) equals, exactly,
    the FLOPs of every node of the forward and backward graphs traced from the model (attention unfused, as
    ``torch.utils.flop_counter`` counts each matmul)."""
    with torch.device("meta"):
        model = build_model(model_name, n_layers=layers)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    graphs = capture_graphs(model, (tokens,), fused_attention=False)
    traced = sum(node.flops for graph, stage in ((graphs.forward, "forward"), (graphs.backward, "backward"))
                 for node in read_schedule(graph, stage).nodes)
    assert traced > 0 and step_flops(model_name, layers, batch, seq) == traced


def test_peak_is_the_data_sheet_for_gpus_and_the_measured_rate_for_cpus():
    h100 = get_profile("h100")
    for dtype in (torch.bfloat16, torch.float32):
        assert h100.peak_rate(dtype) == h100.peak_flops_per_s[str(dtype).removeprefix("torch.")]
        assert h100.peak_rate(dtype) != h100.matmul_rate(dtype)  # the data sheet, not the rate reached
    assert h100.peak_rate(torch.float64) == h100.peak_flops_per_s["float32"]  # no entry: the fp32 peak
    measured = dataclasses.replace(h100, peak_flops_per_s={})
    assert measured.peak_rate(torch.bfloat16) == measured.matmul_rate(torch.bfloat16)
