"""Memory liveness and the two-stream simulator on small hand-built schedules with known answers."""

import dataclasses

import networkx as nx
import pytest
import torch

from simplefsdp.ir.hardware import H100
from simplefsdp.ir.memory import memory_profile
from simplefsdp.ir.schedule import COLLECTIVE, COMPUTE, WAIT, Collective, GraphInput, Schedule, ScheduleNode
from simplefsdp.ir.simulator import simulate


def schedule(phase, inputs, nodes, outputs):
    return Schedule(phase, inputs, nodes, outputs, code="", dag=nx.DiGraph())


def compute(name, inputs, written=0, flops=0, alias_of=None):
    return ScheduleNode(name, COMPUTE, "op", "", tuple(inputs), flops=flops, bytes_written=written, alias_of=alias_of)


def test_memory_liveness_counts_saved_tensors_tangents_and_gradients():
    forward = schedule(
        "forward",
        [GraphInput("w", 1000, param_fqn="w")],
        [
            compute("a", ["w"], 100), compute("b", ["a"], 200), compute("v", ["b"], alias_of="b"),
            compute("c", ["v"], 50),
        ],
        outputs=["c", "b"],
    )
    backward = schedule(
        "backward",
        [GraphInput("b", 200), GraphInput("tangents_1", 50)],
        [compute("d", ["b", "tangents_1"], 1000)],
        outputs=["d"],
    )
    profile = memory_profile(forward, backward)
    # w 1000 held; a freed after b; c lives to the end of forward; at backward start the tangent (50)
    # arrives, then d (1000) is allocated while b (200) and the tangent are still alive.
    assert profile.curve == [1100, 1200, 1200, 1200, 2000]
    assert profile.peak_bytes == 2250 and profile.peak_at == "backward:d"
    assert profile.peak_by_category == {
        "sharded_params": 1000, "unsharded_params": 0, "gradients": 1000, "comm_buffers": 0, "activations": 250,
    }


def test_simulator_overlaps_a_collective_with_compute_until_its_wait():
    hardware = dataclasses.replace(
        H100, flops_per_s={"float32": 1e12}, memory_bandwidth=1e30, kernel_overhead=0.0,
        collective_latency=0.0, intra_node_latency=0.0, intra_node_bandwidth=1e9,
    )
    gather = Collective("all_gather", "0", (0, 1), torch.float32, bytes=4_000_000)  # 1/2 * 4 MB / 1 GB/s = 2 ms
    forward = schedule("forward", [], [
        ScheduleNode("ag", COLLECTIVE, "all_gather", "", (), collective=gather),
        compute("mm1", [], flops=1e9),  # 1 ms
        ScheduleNode("wait", WAIT, "wait_tensor", "", ("ag",), alias_of="ag", waits_for="ag"),
        compute("mm2", ["wait"], flops=1e9),
    ], outputs=["mm2"])
    prediction = simulate(forward, schedule("backward", [], [], []), hardware)
    # approx's default rel=1e-6: the simulator sums a handful of float64 times, each a few roundings of 2^-53
    assert prediction.step_time == pytest.approx(3e-3)
    assert prediction.compute_time == pytest.approx(2e-3)
    assert prediction.communication_time == pytest.approx(2e-3)
    assert prediction.exposed_communication == pytest.approx(1e-3)
    assert prediction.overlap_fraction == pytest.approx(0.5)
    assert prediction.lower_bound == pytest.approx(2e-3)
    assert prediction.stall("forward", "ag") == pytest.approx(1e-3)
    assert prediction.exposed_intervals() == [pytest.approx((1e-3, 2e-3))]


def test_exposed_intervals_are_the_compute_streams_waits_and_the_communication_after_its_last_compute():
    hardware = dataclasses.replace(
        H100, flops_per_s={"float32": 1e12}, memory_bandwidth=1e30, kernel_overhead=0.0,
        collective_latency=0.0, intra_node_latency=0.0, intra_node_bandwidth=1e9,
    )
    gather = Collective("all_gather", "0", (0, 1), torch.float32, bytes=4_000_000)  # 2 ms
    scatter = Collective("reduce_scatter", "0", (0, 1), torch.float32, bytes=4_000_000)  # 2 ms
    forward = schedule("forward", [], [
        ScheduleNode("ag", COLLECTIVE, "all_gather", "", (), collective=gather),
        ScheduleNode("wait", WAIT, "wait_tensor", "", ("ag",), alias_of="ag", waits_for="ag"),  # waits 0 to 2 ms
        compute("mm", ["wait"], flops=1e9),  # 2 to 3 ms
    ], outputs=["mm"])
    backward = schedule("backward", [], [
        compute("grad", [], flops=1e9),  # 3 to 4 ms
        ScheduleNode("rs", COLLECTIVE, "reduce_scatter", "", ("grad",), collective=scatter),  # 4 to 6 ms, unwaited
    ], outputs=["rs"])
    prediction = simulate(forward, backward, hardware)
    assert prediction.exposed_intervals() == [pytest.approx((0.0, 2e-3)), pytest.approx((4e-3, 6e-3))]
    assert prediction.exposed_communication == pytest.approx(4e-3)
