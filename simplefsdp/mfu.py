"""Model FLOPs utilization: FLOPs counted on the IR's graphs over the hardware profile's peak."""

from __future__ import annotations

import torch

from simplefsdp.ir.cpu_measure import measuring_threads
from simplefsdp.ir.hardware import cpu_profile, gpu_profile
from simplefsdp.ir.schedule import read_schedule
from simplefsdp.models.llama import build_model


def step_flops(model_name: str, layers: int | None, batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward and backward of ``model_name`` (with ``layers`` blocks, if given) on ``batch_size`` x
    ``seq_len`` tokens, counted on an unsharded meta-device copy (sharding moves no FLOPs), without activation
    checkpointing's recomputation."""
    from simplefsdp.ir.capture import capture_graphs  # imported here: tracing loads Dynamo, which an eager rank skips

    with torch.device("meta"):
        model = build_model(model_name, n_layers=layers)
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    graphs = capture_graphs(model, (tokens,), fused_attention=False)
    schedules = (read_schedule(graphs.forward, "forward"), read_schedule(graphs.backward, "backward"))
    return sum(node.flops for schedule in schedules for node in schedule.nodes)


def peak_flops_per_second(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s in ``dtype`` of one rank's device: a GPU profile's data-sheet peak (None without a profile), or
    the ``cpu`` profile's matmul rate (measured with half the cores per rank) scaled to this rank's thread count."""
    if device.type == "cpu":
        return cpu_profile().peak_rate(dtype) * torch.get_num_threads() / measuring_threads()
    profile = gpu_profile(torch.cuda.get_device_name(device))
    return profile.peak_rate(dtype) if profile else None
