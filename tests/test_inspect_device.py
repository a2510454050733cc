"""``simplefsdp.inspect`` with ``device="cuda"`` (fake CUDA tensors) and the CUDA-only ops its schedules read; where
the torch build or the machine cannot trace CUDA, the refusal."""

import dataclasses
import operator

import pytest
import torch
from test_inspect import inspect_debug

import simplefsdp
from simplefsdp.ir.hardware import get_profile
from simplefsdp.ir.schedule import read_schedule
from simplefsdp.models.llama import build_model


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="torch is a CUDA build: device='cuda' is not refused for "
                    "the build (test_device_cuda_traces_the_kernels_a_gpu_dispatches runs where a GPU is visible)")
def test_device_cuda_on_a_cpu_only_build_is_one_line_naming_the_fix():
    with pytest.raises(ValueError) as error:
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=8, device="cuda")
    message = str(error.value)
    assert "\n" not in message and "CPU-only build" in message and "pip install torch==" in message


@pytest.mark.skipif(not torch.backends.cuda.is_built() or torch.cuda.is_available(),
                    reason="pins the refusal of a CUDA build of torch on a machine with no GPU")
def test_device_cuda_without_a_gpu_is_one_line_naming_the_fix():
    with pytest.raises(ValueError) as error:
        simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 8, dtype=torch.long),), world_size=8, device="cuda")
    message = str(error.value)
    assert "\n" not in message and "needs a CUDA device" in message and "device='meta'" in message


def test_default_device_is_cuda_only_for_a_gpu_profile_where_a_gpu_is_visible():
    from simplefsdp.inspection import check_device

    gpu = torch.cuda.is_available()
    assert check_device(get_profile("h100")) == ("cuda" if gpu else "meta")
    assert check_device(dataclasses.replace(get_profile("h100"), name="cpu")) == "meta"
    with pytest.raises(ValueError, match="unknown device 'gpu'; choose one of: meta, cuda"):
        check_device(get_profile("h100"), "gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake CUDA tensors need a CUDA build of torch and a visible "
                    "GPU: autograd reads the CUDA context even for fake tensors (pytorch/pytorch#92627)")
def test_device_cuda_traces_the_kernels_a_gpu_dispatches(tmp_path):
    """Fake CUDA tensors: the attention kernel is dispatch's own choice (flash or efficient on a GPU), the bucket
    copies and collectives run on CUDA, and the prediction agrees with the meta trace of the same step."""
    reports = {device: inspect_debug("fully_shard", device=device, activation_checkpointing="selective")
               for device in ("cuda", "meta")}
    cuda = reports["cuda"]
    ops = {node.op for schedule in cuda.schedules for node in schedule.nodes}
    attention = {"aten._scaled_dot_product_flash_attention.default",
                 "aten._scaled_dot_product_efficient_attention.default",
                 "aten._scaled_dot_product_cudnn_attention.default"}
    assert ops & attention, sorted(ops)
    assert "simplefsdp.all_gather_copy_in.default" in ops and "simplefsdp.all_gather_copy_out.default" in ops
    assert "device(type='cuda'" in cuda.forward.code and "device(type='cpu'" not in cuda.forward.code
    assert [stage.name for stage in cuda.stages] == [stage.name for stage in reports["meta"].stages]
    for stage, meta in zip(cuda.stage_records(), reports["meta"].stage_records()):
        assert stage["collectives"] == meta["collectives"] and stage["wire_bytes"] == meta["wire_bytes"]


def test_attention_wrapped_to_replay_its_random_numbers_is_priced_as_attention():
    """On CUDA, AOTAutograd wraps cuDNN attention in ``graphsafe_run_with_rng_state``; the schedule reads the op."""
    aten = torch.ops.aten
    cudnn = aten._scaled_dot_product_cudnn_attention.default
    q = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16, device="meta")
    out = cudnn(q, q, q, None, True, 0.0, True)
    graph = torch.fx.Graph()
    query, rng_state = graph.placeholder("query"), graph.placeholder("rng_state")
    query.meta["val"], rng_state.meta["val"] = q, torch.empty(2, dtype=torch.int64, device="meta")
    arguments = (query, query, query, None, True, 0.0, True)
    nodes = [graph.call_function(cudnn, arguments),
             graph.call_function(torch.ops.higher_order.graphsafe_run_with_rng_state, (cudnn, *arguments),
                                 {"rng_state": rng_state})]
    for node in nodes:
        node.meta["val"] = out
    graph.output(tuple(graph.call_function(operator.getitem, (node, 0)) for node in nodes))
    schedule = read_schedule(torch.fx.GraphModule({}, graph), "forward")
    plain, wrapped = (schedule.node(node.name) for node in nodes)
    # causal attention: 2 matmuls of 2 * 128 * 128 * 64 FLOPs per head, 4 heads, half of them skipped
    assert wrapped.op == plain.op == "aten._scaled_dot_product_cudnn_attention.default"
    assert wrapped.flops == plain.flops == 2 * 2 * 128 * 128 * 64 * 4 // 2
