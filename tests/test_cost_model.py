"""Cost model: h100 collective predictions against published NCCL figures; roofline; profiles as data."""

import json

import pytest
import torch

from simplefsdp.ir.cost_model import collective_seconds, node_time
from simplefsdp.ir.hardware import H100, HardwareProfile, get_profile
from simplefsdp.ir.schedule import COMPUTE, ScheduleNode

GiB = 2**30

# Published nccl-tests bus bandwidths on H100 SXM nodes (8 GPUs per node, NVSwitch, 400 Gb/s NDR per GPU):
# (collective, message bytes, GPUs, measured busbw GB/s, source)
PUBLISHED = [
    # all_reduce_perf, 8 GiB float, one 8x H100 node: 479.41 GB/s (NVLink SHARP on by default).
    ("all_reduce", 8 * GiB, 8, 479.41, "github.com/NVIDIA/nccl-tests/issues/347"),
    # NVIDIA (sjeaugey): non-allreduce collectives reach ~370 GB/s busbw on 8 H100 at large sizes.
    ("all_gather", 4 * GiB, 8, 370.0, "github.com/NVIDIA/nccl-tests/issues/212"),
    # all_gather_perf -b 2G, 32 nodes x 8 H100 (256 GPUs), 8x 400 Gb/s NICs per node: ~200 GB/s busbw.
    ("all_gather", 2 * GiB, 256, 200.0, "github.com/NVIDIA/nccl/issues/1218"),
]


def bus_bandwidth(kind: str, size: float, gpus: int, seconds: float) -> float:
    """nccl-tests' busbw: algorithm bandwidth times 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    factor = 2 * (gpus - 1) / gpus if kind == "all_reduce" else (gpus - 1) / gpus
    return factor * size / seconds / 1e9


@pytest.mark.parametrize("kind, size, gpus, measured, source", PUBLISHED)
def test_h100_collectives_match_published_nccl_bandwidth(kind, size, gpus, measured, source):
    predicted = bus_bandwidth(kind, size, gpus, collective_seconds(kind, size, tuple(range(gpus)), H100))
    print(f"{kind} {size / GiB:.0f} GiB on {gpus} GPUs: predicted {predicted:.0f} GB/s, "
          f"published {measured} ({source})")
    assert abs(predicted - measured) / measured <= 0.30


def test_group_spanning_nodes_is_slower_than_one_node():
    within = collective_seconds("all_gather", 1 * GiB, tuple(range(8)), H100)
    across = collective_seconds("all_gather", 1 * GiB, tuple(range(0, 64, 8)), H100)  # one rank on each of 8 nodes
    assert across > 5 * within


def test_one_rank_group_costs_nothing():
    assert collective_seconds("all_reduce", GiB, (0,), H100) == 0.0


def test_roofline_picks_the_slower_of_compute_and_memory():
    matmul = ScheduleNode("mm", COMPUTE, "aten.mm.default", "", (), flops=2 * 8192**3,
                          bytes_read=2 * 2 * 8192**2, bytes_written=2 * 8192**2)
    copy = ScheduleNode("copy", COMPUTE, "aten.clone.default", "", (), bytes_read=GiB, bytes_written=GiB)
    view = ScheduleNode("view", COMPUTE, "aten.view.default", "", (), alias_of="mm")
    rate = H100.flops_per_s["bfloat16"]
    # approx's default rel=1e-6: the same formula in float64, a few roundings of 2^-53 apart
    assert node_time(matmul, H100, torch.bfloat16) == pytest.approx(H100.kernel_overhead + 2 * 8192**3 / rate)
    assert node_time(copy, H100) == pytest.approx(H100.kernel_overhead + 2 * GiB / H100.memory_bandwidth)
    assert node_time(view, H100) == 0.0


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(H100.to_json())
    loaded = get_profile(str(path))
    assert loaded == H100 and isinstance(loaded, HardwareProfile)
    assert json.loads(path.read_text())["devices_per_node"] == 8


def test_unknown_hardware_name_is_one_clear_line():
    with pytest.raises(ValueError) as error:
        get_profile("tpu9000")
    message = str(error.value)
    assert "\n" not in message and "tpu9000" in message and "h100" in message and "JSON" in message
