"""Model FLOPs utilization: FLOPs counted on the IR's graphs over the hardware profile's peak."""

from __future__ import annotations

import torch

from simplefsdp.ir.capture import capture_graphs
from simplefsdp.ir.hardware import BUILT_IN, cpu_profile, measuring_threads
from simplefsdp.ir.schedule import read_schedule
from simplefsdp.models.llama import build_model

# GPU name fragment -> built-in profile whose data-sheet peak it shares (H200 computes like H100).
GPU_PROFILES = {"H200": "h100", "H100": "h100", "A100": "a100"}


def step_flops(model_name: str, batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward and backward of ``model_name`` on ``batch_size`` x ``seq_len`` tokens.

    Counted on the IR's graphs of an unsharded copy traced on the meta device
    (sharding moves no FLOPs); activation checkpointing's recomputation is not counted.
    """
    with torch.device("meta"):
        model = build_model(model_name)
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    graphs = capture_graphs(model, (tokens,), fused_attention=False)
    schedules = (read_schedule(graphs.forward, "forward"), read_schedule(graphs.backward, "backward"))
    return sum(node.flops for schedule in schedules for node in schedule.nodes)


def peak_flops_per_second(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s in ``dtype`` of the device one rank computes on; None for a GPU without a profile.

    A GPU's is its profile's data-sheet peak. A CPU rank's is the ``cpu`` profile's
    measured matmul rate (cached; measured once, about ten seconds, with half the
    cores per rank), scaled to this rank's thread count.
    """
    if device.type == "cpu":
        return cpu_profile().peak_rate(dtype) * torch.get_num_threads() / measuring_threads()
    name = torch.cuda.get_device_name(device)
    profile = next((BUILT_IN[p] for fragment, p in GPU_PROFILES.items() if fragment in name), None)
    return profile.peak_rate(dtype) if profile else None
