"""Llama 3 8B shapes traced at world size 8 on meta tensors: sharded parameter bytes and step FLOPs.

Two of the 32 transformer blocks keep the test to seconds; every block is the
same, so the per-block and head/tail figures are those of the full model (the
32-block CLI run is recorded in benchmarks/inspect.md).
"""

import pytest
import torch

import simplefsdp
from simplefsdp.models.llama import build_model, get_config
from simplefsdp.runtime.mixed_precision import MixedPrecision

LAYERS, SEQ, WORLD = 2, 8192, 8


@pytest.fixture(scope="module")
def traced():
    with torch.device("meta"):
        model = build_model("llama3-8b", n_layers=LAYERS)
    report = simplefsdp.inspect(
        model, (torch.zeros(1, SEQ, dtype=torch.long),), world_size=WORLD, hardware="h100",
        mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    return model, report


def test_sharded_parameter_bytes_are_params_times_dtype_size_over_world(traced):
    model, report = traced
    params = sum(p.numel() for p in model.parameters())
    # every Llama 3 8B dimension (4096, 1024, 14336, 128256) divides by 8: no padding
    shards = sum(graph_input.bytes for graph_input in report.forward.inputs if graph_input.param_fqn)
    assert shards == params * 4 // WORLD
    assert report.prediction.memory.peak_by_category["sharded_params"] == params * 4 // WORLD


def test_step_flops_are_six_params_tokens_plus_attention(traced):
    """FLOPs per rank per step = 6 * N * T + 7 * L * B * S^2 * dim, within 5%.

    N: parameters that take part in matmuls (all but the token embedding, a lookup);
    T = B * S tokens. Attention: flash forward = 2 matmuls of 2*B*H*S^2*D FLOPs, backward = 5 (it recomputes
    Q K^T), so 14 * B * S^2 * (H * D) per layer with H * D = dim, halved: the causal kernels skip the masked half.
    """
    model, report = traced
    config = get_config("llama3-8b")
    matmul_params = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    tokens = 1 * SEQ
    expected = 6 * matmul_params * tokens + 7 * LAYERS * 1 * SEQ**2 * config.dim
    flops = sum(node.flops for schedule in report.schedules for node in schedule.nodes)
    assert abs(flops - expected) <= 0.05 * expected


def test_the_written_forward_holds_the_flash_kernel_once_in_its_one_block_body(traced, tmp_path):
    """What ``inspect`` writes shows the blocks' compute (issue 65): the blocks compile once (the default), and the
    forward's file holds their one region body, with the device's attention kernel (the flash kernel for h100 on
    meta) once and no CPU attention op. Every call naming a written body: ``test_block_regions``."""
    _, report = traced
    report.save(tmp_path)
    forward = (tmp_path / "forward.py").read_text()
    assert list(report.forward.regions.values()) == [tuple(f"layers.{index}" for index in range(LAYERS))]
    assert forward.count("aten._scaled_dot_product_flash_attention.default(") == 1, forward
    assert "for_cpu" not in forward
