"""What measures the ``cpu`` hardware profile: this CPU as a 2-rank gloo job uses it, each rank with half the cores.

``hardware.measure_cpu_profile`` starts the two ranks as fresh interpreters of this module
(``python -m simplefsdp.ir.cpu_measure FOLDER RANK``), so the script that asked is never re-run."""

from __future__ import annotations

import os
import statistics
import sys
import timeit
from datetime import timedelta
from pathlib import Path

import torch

from simplefsdp.ir.hardware import MEASURING_RANKS, HardwareProfile
from simplefsdp.runtime.launch import leave_rank


def measure_cpu_profile_in_group() -> HardwareProfile:
    """The ``cpu`` profile measured with this process's threads by this rank of a gloo group; every rank calls it."""
    rates = {name: _matmul_rate(getattr(torch, name)) for name in ("float32", "bfloat16")}
    bandwidth, dispatch = _copy_bandwidth(), _dispatch_overhead()
    latency, gloo_bandwidth = _gloo_alpha_beta()
    return HardwareProfile(
        name="cpu", flops_per_s=rates, memory_bandwidth=bandwidth, intra_node_bandwidth=gloo_bandwidth,
        inter_node_bandwidth=gloo_bandwidth, intra_node_latency=0.0, inter_node_latency=0.0,
        collective_latency=latency, kernel_overhead=0.0, dispatch_overhead=dispatch,
        devices_per_node=os.cpu_count() or 1, memory_capacity=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )


def measuring_threads() -> int:
    """Threads each of ``measure_cpu_profile``'s two ranks computes with: half the cores."""
    return max(1, (os.cpu_count() or 1) // MEASURING_RANKS)


def _measuring_rank(folder: str, rank: int) -> None:
    """One of the two ranks: join the others through a file store in ``folder``; rank 0 writes ``profile.json``."""
    import torch.distributed as dist

    # A peer that dies before joining or mid-collective fails this rank within a minute, not gloo's default 30.
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), MEASURING_RANKS), rank=rank,
                            world_size=MEASURING_RANKS, timeout=timedelta(minutes=1))
    torch.set_num_threads(measuring_threads())
    profile = measure_cpu_profile_in_group()
    if rank == 0:
        Path(folder, "profile.json").write_text(profile.to_json())
    dist.barrier()  # no rank leaves while the other still uses gloo
    leave_rank()


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def _matmul_rate(dtype: torch.dtype) -> float:
    """Median FLOP/s of linear-layer matmuls (``x @ w.T``) of 256 to 1024 wide: what small models run."""
    rates = []
    for size in (256, 512, 1024):
        x, w = torch.randn(512, size, dtype=dtype), torch.randn(2 * size, size, dtype=dtype)
        rates.append(2 * 512 * size * 2 * size / _median_seconds(lambda: torch.mm(x, w.t())))
    return statistics.median(rates)


def _copy_bandwidth() -> float:
    source, target = torch.randn(1 << 23), torch.empty(1 << 23)
    return 2 * source.nbytes / _median_seconds(lambda: target.copy_(source))


def _dispatch_overhead() -> float:
    """Seconds per node of running a graph of tiny ops the way ``simplefsdp.ir.capture`` runs graphs."""
    from torch import fx

    from simplefsdp.ir.capture import run_boxed

    def tiny_ops(x: torch.Tensor) -> torch.Tensor:
        for _ in range(100):
            x = (x + 1).view(-1)
        return x

    gm = fx.symbolic_trace(tiny_ops)
    run = run_boxed(gm)
    nodes = sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
    return _median_seconds(lambda: run([torch.ones(8)])) / nodes


def _gloo_alpha_beta() -> tuple[float, float]:
    """(latency s, bus bandwidth B/s) of all-gathers in the default group, fitted to a small and a large message,
    each after a short matmul (as in a training step: the ranks drift apart) whose own time is subtracted."""
    import torch.distributed as dist

    ranks, sizes = dist.get_world_size(), (1 << 12, 1 << 22)  # bytes per all-gather output
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    compute = _median_seconds(lambda: torch.mm(a, b), repeats=9)
    times = []
    for size in sizes:
        shard, output = torch.ones(size // 4 // ranks, dtype=torch.float32), torch.empty(size // 4, dtype=torch.float32)

        def step() -> None:
            torch.mm(a, b)
            dist.all_gather_single(output, shard)

        times.append(_median_seconds(step, repeats=15) - compute)
    bus_fraction = (ranks - 1) / ranks  # a ring all-gather moves this share of the output through each rank
    small, large = times
    bandwidth = bus_fraction * (sizes[1] - sizes[0]) / max(large - small, 1e-9)
    return max(small - bus_fraction * sizes[0] / bandwidth, 0.0), bandwidth


if __name__ == "__main__":
    _measuring_rank(sys.argv[1], int(sys.argv[2]))
