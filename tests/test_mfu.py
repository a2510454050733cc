"""MFU's two halves: a step's FLOPs (PaLM's accounting, against the IR's count on the traced graphs), and the
hardware profile's peak."""

from __future__ import annotations

import dataclasses

import torch

import pytest
from transformers import LlamaConfig, MixtralConfig

from simplefsdp.ir.capture import capture_graphs
from simplefsdp.ir.hardware import get_profile
from simplefsdp.ir.schedule import read_schedule
from simplefsdp.mfu import step_flops
from simplefsdp.models.workload import load_workload


def _traced_flops(model: torch.nn.Module, batch: int, seq: int) -> float:
    """The FLOPs of every node of the forward and backward graphs traced from ``model`` on meta (attention unfused,
    as ``torch.utils.flop_counter`` counts each matmul)."""
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    graphs = capture_graphs(model, (tokens,), fused_attention=False)
    return sum(node.flops for graph, stage in ((graphs.forward, "forward"), (graphs.backward, "backward"))
               for node in read_schedule(graph, stage).nodes)


@pytest.mark.parametrize("model_name, layers, batch, seq", [("debug", None, 2, 32), ("cpu-small", 1, 1, 48)])
def test_step_flops_are_the_flops_of_the_traced_forward_and_backward(model_name, layers, batch, seq):
    """PaLM's accounting (6 FLOPs per matmul weight per token, attention's 12 * L * B * S^2 * dim) equals, exactly,
    the FLOPs traced from the model."""
    workload = load_workload(model_name, layers)
    with torch.device("meta"):
        model = workload.build(0)
    traced = _traced_flops(model, batch, seq)
    assert traced > 0 and step_flops(model, workload.attention, batch, seq) == traced


@pytest.mark.parametrize("tied", [False, True])
def test_step_flops_of_a_hugging_face_model_are_its_traced_flops(tmp_path, tied):
    """The same for ``--model hf:DIR``, whose MFU ``train`` prints: a Llama with grouped-query attention, its output
    layer its own or its token embedding (Qwen2.5-0.5B's layout: the tied weight counted once, as a matmul)."""
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied,
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    workload = load_workload(f"hf:{tmp_path}")
    with torch.device("meta"):
        model = workload.build(0)
    traced = _traced_flops(model, batch=2, seq=16)
    assert traced > 0 and step_flops(model, workload.attention, batch_size=2, seq_len=16) == traced


def test_a_mixture_of_experts_has_no_mfu(tmp_path):
    """Each token runs a few of a mixture's experts, which PaLM's accounting does not count: ``train`` prints n/a."""
    MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    assert load_workload(f"hf:{tmp_path}").attention is None


def test_peak_is_the_data_sheet_for_gpus_and_the_measured_rate_for_cpus():
    h100 = get_profile("h100")
    for dtype in (torch.bfloat16, torch.float32):
        assert h100.peak_rate(dtype) == h100.peak_flops_per_s[str(dtype).removeprefix("torch.")]
        assert h100.peak_rate(dtype) != h100.matmul_rate(dtype)  # the data sheet, not the rate reached
    assert h100.peak_rate(torch.float64) == h100.peak_flops_per_s["float32"]  # no entry: the fp32 peak
    measured = dataclasses.replace(h100, peak_flops_per_s={})
    assert measured.peak_rate(torch.bfloat16) == measured.matmul_rate(torch.bfloat16)
