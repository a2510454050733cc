"""Hardware profiles: plain numbers the cost model prices a schedule with.

A profile is data. ``h100`` and ``a100`` are datasheet figures with the
efficiency NCCL and cuBLAS reach in practice; ``cpu`` is measured on the machine
it runs on (a short matmul, copy and gloo benchmark) and cached under
``~/.cache/simplefsdp/``. Write your own cluster as ``HardwareProfile(...)`` or as
a JSON file with the same fields and pass its path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class HardwareProfile:
    """What one accelerator and its links sustain. Bandwidths in bytes/s, latencies in seconds.

    ``flops_per_s`` maps a dtype name (``"bfloat16"``, ``"float32"``) to the dense
    matmul rate actually reached. ``intra_node_bandwidth`` is the NCCL bus bandwidth
    between accelerators of one node, ``inter_node_bandwidth`` that of one
    accelerator's network link. ``kernel_overhead`` is the fixed cost of launching
    one kernel; ``collective_latency`` that of starting one collective.
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
    devices_per_node: int
    memory_capacity: int

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """FLOP/s for ``dtype``; dtypes without an entry run at the ``float32`` rate."""
        name = str(dtype).removeprefix("torch.")
        return self.flops_per_s.get(name, self.flops_per_s["float32"])

    def to_json(self) -> str:
        """The profile as JSON, readable back by ``load_profile``."""
        return json.dumps(dataclasses.asdict(self), indent=2)


# NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32), 3.35 TB/s HBM3
# (datasheet); ~75% of matmul peak and ~80% of HBM bandwidth are what large kernels reach.
# NVLink 4 is 450 GB/s per direction; NCCL's effective bus bandwidth over it is ~370 GB/s
# (NVIDIA, github.com/NVIDIA/nccl-tests/issues/212). One 400 Gb/s NDR NIC per GPU gives
# 46-48 GB/s through NCCL (NVIDIA, github.com/NVIDIA/nccl-tests/issues/290).
H100 = HardwareProfile(
    name="h100",
    flops_per_s={"bfloat16": 0.75 * 989e12, "float16": 0.75 * 989e12, "float32": 0.75 * 67e12},
    memory_bandwidth=0.8 * 3.35e12,
    intra_node_bandwidth=370e9,
    inter_node_bandwidth=47e9,
    intra_node_latency=1e-6,
    inter_node_latency=4e-6,
    collective_latency=10e-6,
    kernel_overhead=2e-6,
    devices_per_node=8,
    memory_capacity=80 * 2**30,
)

# NVIDIA A100 SXM4 80GB: 312 TFLOP/s dense bf16, 19.5 TFLOP/s fp32, 2.04 TB/s HBM2e; NVLink 3
# at 300 GB/s per direction (~230 GB/s NCCL bus bandwidth), one 200 Gb/s HDR NIC per GPU.
A100 = HardwareProfile(
    name="a100",
    flops_per_s={"bfloat16": 0.75 * 312e12, "float16": 0.75 * 312e12, "float32": 0.75 * 19.5e12},
    memory_bandwidth=0.8 * 2.04e12,
    intra_node_bandwidth=230e9,
    inter_node_bandwidth=23e9,
    intra_node_latency=1.5e-6,
    inter_node_latency=5e-6,
    collective_latency=12e-6,
    kernel_overhead=3e-6,
    devices_per_node=8,
    memory_capacity=80 * 2**30,
)

BUILT_IN = {"h100": H100, "a100": A100}
PROFILE_NAMES = (*BUILT_IN, "cpu")
CACHE_DIR = Path(os.environ.get("SIMPLEFSDP_CACHE", Path.home() / ".cache" / "simplefsdp"))


def get_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (``h100``, ``a100``, ``cpu``), from a JSON file path, or ``hardware`` itself.

    An unknown name raises ``ValueError`` naming the known ones.
    """
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware in BUILT_IN:
        return BUILT_IN[hardware]
    if hardware == "cpu":
        return cpu_profile()
    if str(hardware).endswith(".json") and Path(hardware).is_file():
        return load_profile(Path(hardware))
    raise ValueError(
        f"unknown hardware profile {hardware!r}; use one of {', '.join(PROFILE_NAMES)} "
        "or the path of a JSON file with HardwareProfile's fields"
    )


def load_profile(path: Path) -> HardwareProfile:
    """Read a profile written by ``HardwareProfile.to_json``."""
    return HardwareProfile(**json.loads(Path(path).read_text()))


def cpu_profile(refresh: bool = False) -> HardwareProfile:
    """The ``cpu`` profile of this machine: cached, else measured now (about ten seconds) and cached.

    The cache is keyed by host, core count and torch version; ``refresh`` measures again.
    """
    key = f"{platform.node()}-{os.cpu_count()}cores-torch{torch.__version__}".replace(os.sep, "_")
    path = CACHE_DIR / f"cpu-{key}.json"
    if path.is_file() and not refresh:
        return load_profile(path)
    profile = measure_cpu_profile()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return profile


def measure_cpu_profile() -> HardwareProfile:
    """Measure this CPU: matmul FLOP/s per dtype, copy bandwidth, op overhead, and 2-rank gloo collectives.

    Collectives are timed between two local processes with the thread share a
    2-rank training job gets, so the profile describes that setting.
    """
    threads = max(1, (os.cpu_count() or 1) // 2)
    with _torch_threads(threads):
        rates = {name: _matmul_rate(dtype) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
        bandwidth = _copy_bandwidth()
        overhead = _op_overhead()
    latency, gloo_bandwidth = _gloo_alpha_beta()
    return HardwareProfile(
        name="cpu",
        flops_per_s=rates,
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=gloo_bandwidth,
        inter_node_bandwidth=gloo_bandwidth,
        intra_node_latency=0.0,
        inter_node_latency=0.0,
        collective_latency=latency,
        kernel_overhead=overhead,
        devices_per_node=os.cpu_count() or 1,
        memory_capacity=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )


class _torch_threads:
    """Context manager running torch ops with ``count`` intra-op threads."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __enter__(self) -> None:
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.saved)


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_rate(dtype: torch.dtype, size: int = 512) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / _median_seconds(lambda: torch.mm(a, b))


def _copy_bandwidth(numel: int = 1 << 23) -> float:
    source, target = torch.randn(numel), torch.empty(numel)
    return 2 * source.nbytes / _median_seconds(lambda: target.copy_(source))


def _op_overhead() -> float:
    tiny = torch.ones(8)
    return _median_seconds(lambda: [tiny.add(1) for _ in range(100)]) / 100


_GLOO_SIZES = (1 << 12, 1 << 22)  # bytes per all-gather output


def _gloo_alpha_beta() -> tuple[float, float]:
    """(latency s, bus bandwidth B/s) of a 2-rank gloo all-gather, fitted to a small and a large message."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_gloo_rank, args=(folder,), nprocs=2, start_method="spawn")
        small, large = json.loads(Path(folder, "times.json").read_text())
    bus_fraction = 0.5  # ring all-gather on 2 ranks moves half the output per rank
    bandwidth = bus_fraction * (_GLOO_SIZES[1] - _GLOO_SIZES[0]) / max(large - small, 1e-9)
    return max(small - bus_fraction * _GLOO_SIZES[0] / bandwidth, 0.0), bandwidth


def _gloo_rank(rank: int, folder: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(folder, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.set_num_threads(1)
    times = []
    for size in _GLOO_SIZES:
        shard = torch.ones(size // 8, dtype=torch.float32)
        output = torch.empty(size // 4, dtype=torch.float32)
        times.append(_median_seconds(lambda: dist.all_gather_into_tensor(output, shard), repeats=9))
    if rank == 0:
        Path(folder, "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()
