"""Hardware profiles: plain numbers the cost model prices a schedule with.

``h100`` and ``a100`` are datasheet figures at the efficiency NCCL and cuBLAS reach in practice; ``cpu`` is measured
on this machine and cached under ``~/.cache/simplefsdp/``. Describe your own cluster as ``HardwareProfile(...)`` or
as a JSON file with the same fields and pass its path.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import platform
import statistics
import tempfile
import timeit
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class HardwareProfile:
    """What one accelerator and its links sustain; bandwidths in bytes/s, latencies and overheads in seconds.

    ``flops_per_s`` maps a dtype name (``"bfloat16"``) to the dense matmul rate reached, ``peak_flops_per_s`` to the
    data-sheet peak (MFU's denominator; empty for a measured profile). ``intra_node_bandwidth`` is the NCCL bus
    bandwidth within a node, ``inter_node_bandwidth`` that of one accelerator's network link. ``dispatch_overhead``
    is the host's cost of every graph node, views included (0 where the host runs ahead, as on GPUs).
    """

    name: str
    flops_per_s: dict[str, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    collective_latency: float
    kernel_overhead: float
    dispatch_overhead: float
    devices_per_node: int
    memory_capacity: int
    peak_flops_per_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """FLOP/s for ``dtype``; dtypes without an entry run at the ``float32`` rate."""
        return self.flops_per_s.get(str(dtype).removeprefix("torch."), self.flops_per_s["float32"])

    def peak_rate(self, dtype: torch.dtype) -> float:
        """Data-sheet peak FLOP/s for ``dtype``; a measured profile's peak is its measured ``matmul_rate``."""
        peaks = self.peak_flops_per_s or self.flops_per_s
        return peaks.get(str(dtype).removeprefix("torch."), peaks["float32"])

    def to_json(self) -> str:
        """The profile as JSON, readable back by ``load_profile``."""
        return json.dumps(dataclasses.asdict(self), indent=2)


def _datasheet_gpu(name: str, peak: dict[str, float], hbm: float, nvlink: float, nic: float, intra_node_latency: float,
                   inter_node_latency: float, collective_latency: float, kernel_overhead: float) -> HardwareProfile:
    """A GPU of an 8-GPU, 80 GiB node; large kernels reach ~75% of matmul peak and ~80% of HBM bandwidth."""
    return HardwareProfile(
        name=name, flops_per_s={dtype: 0.75 * rate for dtype, rate in peak.items()}, peak_flops_per_s=peak,
        memory_bandwidth=0.8 * hbm, intra_node_bandwidth=nvlink, inter_node_bandwidth=nic,
        intra_node_latency=intra_node_latency, inter_node_latency=inter_node_latency,
        collective_latency=collective_latency, kernel_overhead=kernel_overhead, dispatch_overhead=0.0,
        devices_per_node=8, memory_capacity=80 * 2**30,
    )


# NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32), 3.35 TB/s HBM3 (datasheet).
# NVLink 4 is 450 GB/s per direction; NCCL's effective bus bandwidth over it is ~370 GB/s
# (NVIDIA, github.com/NVIDIA/nccl-tests/issues/212). One 400 Gb/s NDR NIC per GPU gives
# 46-48 GB/s through NCCL (NVIDIA, github.com/NVIDIA/nccl-tests/issues/290).
H100 = _datasheet_gpu("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, hbm=3.35e12, nvlink=370e9,
                      nic=47e9, intra_node_latency=1e-6, inter_node_latency=4e-6, collective_latency=10e-6,
                      kernel_overhead=2e-6)
# NVIDIA A100 SXM4 80GB: 312 TFLOP/s dense bf16, 19.5 TFLOP/s fp32, 2.04 TB/s HBM2e; NVLink 3
# at 300 GB/s per direction (~230 GB/s NCCL bus bandwidth), one 200 Gb/s HDR NIC per GPU.
A100 = _datasheet_gpu("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}, hbm=2.04e12, nvlink=230e9,
                      nic=23e9, intra_node_latency=1.5e-6, inter_node_latency=5e-6, collective_latency=12e-6,
                      kernel_overhead=3e-6)

# H100 nodes joined by one 100 Gb/s Ethernet link per GPU (~11 GB/s through NCCL), where low-bit communication pays.
H100_100G = dataclasses.replace(H100, name="h100-100g", inter_node_bandwidth=11e9)
BUILT_IN = {"h100": H100, "a100": A100, "h100-100g": H100_100G}
PROFILE_NAMES = (*BUILT_IN, "cpu")
CACHE_DIR = Path(os.environ.get("SIMPLEFSDP_CACHE", Path.home() / ".cache" / "simplefsdp"))


def get_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (``h100``, ``a100``, ``cpu``), from a JSON file path, or ``hardware`` itself."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware in BUILT_IN:
        return BUILT_IN[hardware]
    if hardware == "cpu":
        return cpu_profile()
    if str(hardware).endswith(".json") and Path(hardware).is_file():
        return load_profile(Path(hardware))
    raise ValueError(f"unknown hardware profile {hardware!r}; use one of {', '.join(PROFILE_NAMES)} "
                     "or the path of a JSON file with HardwareProfile's fields")


def gpu_profile(device_name: str) -> HardwareProfile | None:
    """The built-in profile of the GPU named ``device_name`` (an H200 computes like an H100), or None."""
    return next((profile for key, profile in {**BUILT_IN, "h200": H100}.items() if key in device_name.lower()), None)


def local_profile(device_type: str) -> HardwareProfile:
    """The profile of the device this process computes on: ``cpu`` (measured), or the GPU's (``h100`` if unknown)."""
    return cpu_profile() if device_type == "cpu" else gpu_profile(torch.cuda.get_device_name()) or H100


def load_profile(path: Path) -> HardwareProfile:
    """Read a profile written by ``HardwareProfile.to_json``."""
    return HardwareProfile(**json.loads(Path(path).read_text()))


def cpu_profile() -> HardwareProfile:
    """The ``cpu`` profile of this machine, cached per host, core count and torch version; measuring takes ~10 s."""
    key = f"{platform.node()}-{os.cpu_count()}cores-torch{torch.__version__}".replace(os.sep, "_")
    path = CACHE_DIR / f"cpu-{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")
    except OSError:  # a read-only home: measure every time (set SIMPLEFSDP_CACHE to keep it)
        return measure_cpu_profile()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # every rank of a job may ask at once: one measures, the others wait
        if path.is_file():
            try:
                return load_profile(path)
            except (TypeError, ValueError):  # written by a version with other fields: measure again
                pass
        profile = measure_cpu_profile()
        path.write_text(profile.to_json())
        return profile


def measure_cpu_profile() -> HardwareProfile:
    """Measure this CPU as a 2-rank gloo job uses it: two local processes, each with half the cores."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_measuring_rank, args=(folder,), nprocs=2, start_method="spawn")
        return load_profile(Path(folder, "profile.json"))


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
    return max(1, (os.cpu_count() or 1) // 2)


def _measuring_rank(rank: int, folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    torch.set_num_threads(measuring_threads())
    profile = measure_cpu_profile_in_group()
    if rank == 0:
        Path(folder, "profile.json").write_text(profile.to_json())
    dist.destroy_process_group()


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def _matmul_rate(dtype: torch.dtype) -> float:
    """Median FLOP/s of linear-layer matmuls (``x @ w.T``) of 256 to 1024 wide: what small models run."""
    rates = []
    for size in (256, 512, 1024):
        x = torch.randn(512, size, dtype=dtype)
        w = torch.randn(2 * size, size, dtype=dtype)
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
    """(latency s, bus bandwidth B/s) of all-gathers in the default group, fitted to a small and a large message.

    Each all-gather follows a short matmul, as in a training step, so the latency includes the ranks drifting apart
    between collectives; the matmul's own time is measured alone and subtracted.
    """
    import torch.distributed as dist

    ranks, sizes = dist.get_world_size(), (1 << 12, 1 << 22)  # bytes per all-gather output
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    compute = _median_seconds(lambda: torch.mm(a, b), repeats=9)
    times = []
    for size in sizes:
        shard = torch.ones(size // 4 // ranks, dtype=torch.float32)
        output = torch.empty(size // 4, dtype=torch.float32)

        def step() -> None:
            torch.mm(a, b)
            dist.all_gather_single(output, shard)

        times.append(_median_seconds(step, repeats=15) - compute)
    bus_fraction = (ranks - 1) / ranks  # a ring all-gather moves this share of the output through each rank
    small, large = times
    bandwidth = bus_fraction * (sizes[1] - sizes[0]) / max(large - small, 1e-9)
    return max(small - bus_fraction * sizes[0] / bandwidth, 0.0), bandwidth
