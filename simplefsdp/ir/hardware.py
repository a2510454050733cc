"""Hardware profiles: plain numbers the cost model prices a schedule with.

``h100`` and ``a100`` are datasheet figures at the efficiency NCCL and cuBLAS reach in practice; ``cpu`` is measured
on this machine (``cpu_measure``) and cached under ``~/.cache/simplefsdp/`` (``SIMPLEFSDP_CACHE``). Describe your own
cluster as ``HardwareProfile(...)`` or as a JSON file with the same fields and pass its path."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from simplefsdp.names import PROFILE_NAMES


@dataclass(frozen=True)
class HardwareProfile:
    """What one accelerator and its links sustain; bandwidths in bytes/s, latencies and overheads in seconds.
    ``flops_per_s`` maps a dtype name (``"bfloat16"``) to the dense matmul rate reached, ``peak_flops_per_s`` to the
    data-sheet peak (MFU's denominator; empty for a measured profile). ``intra_node_bandwidth`` is the NCCL bus
    bandwidth within a node, ``inter_node_bandwidth`` that of one accelerator's network link. ``dispatch_overhead`` is
    the host's cost of every graph node, views included (0 where the host runs ahead, as on GPUs)."""

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


# NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32), 3.35 TB/s HBM3 (datasheet). NVLink 4:
# 450 GB/s per direction, ~370 GB/s NCCL bus bandwidth (NVIDIA, github.com/NVIDIA/nccl-tests/issues/212); one 400 Gb/s
# NDR NIC per GPU: 46-48 GB/s through NCCL (NVIDIA, github.com/NVIDIA/nccl-tests/issues/290).
H100 = _datasheet_gpu("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, hbm=3.35e12, nvlink=370e9,
                      nic=47e9, intra_node_latency=1e-6, inter_node_latency=4e-6, collective_latency=10e-6,
                      kernel_overhead=2e-6)
# NVIDIA A100 SXM4 80GB: 312 TFLOP/s dense bf16, 19.5 TFLOP/s fp32, 2.04 TB/s HBM2e; NVLink 3 at 300 GB/s per direction
# (~230 GB/s NCCL bus bandwidth), one 200 Gb/s HDR NIC per GPU.
A100 = _datasheet_gpu("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}, hbm=2.04e12, nvlink=230e9,
                      nic=23e9, intra_node_latency=1.5e-6, inter_node_latency=5e-6, collective_latency=12e-6,
                      kernel_overhead=3e-6)

# H100 nodes joined by one 100 Gb/s Ethernet link per GPU (~11 GB/s through NCCL), where low-bit communication pays.
H100_100G = dataclasses.replace(H100, name="h100-100g", inter_node_bandwidth=11e9)
BUILT_IN = {"h100": H100, "a100": A100, "h100-100g": H100_100G}
CACHE_DIR = Path(os.environ.get("SIMPLEFSDP_CACHE", Path.home() / ".cache" / "simplefsdp"))
MEASURING_RANKS = 2
# What a rank of the caller's own job (torchrun, train's ranks) set in the environment: not for our two ranks.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    """The ``cpu`` profile of this machine, cached per host, core count and torch version; a call that finds no cache
    measures (~10 s, ``cpu_measure``), says so in one line on stderr, and writes the cache atomically."""
    key = f"{platform.node()}-{os.cpu_count()}cores-torch{torch.__version__}".replace(os.sep, "_")
    path = CACHE_DIR / f"cpu-{key}.json"
    with contextlib.suppress(OSError, TypeError, ValueError):  # none yet, or written by a version with other fields
        return load_profile(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    said = (f"measuring this CPU once (~10 s), cached in {path}" if writable else
            f"measuring this CPU (~10 s); {path.parent} is not writable: set SIMPLEFSDP_CACHE to keep the profile")
    print(f"simplefsdp: {said}", file=sys.stderr, flush=True)
    profile = measure_cpu_profile()
    if writable:  # processes measuring at once each replace the file whole: a reader never sees half of one
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
            file.write(profile.to_json())
        os.replace(file.name, path)
    return profile


def measure_cpu_profile(timeout: float = 300.0) -> HardwareProfile:
    """Measure this CPU with two ranks, each a fresh interpreter running ``simplefsdp.ir.cpu_measure``; raise if
    either fails or they run past ``timeout`` seconds (both are then killed)."""
    package_root = str(Path(__file__).resolve().parents[2])  # the ranks import this copy of simplefsdp
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCH_VARIABLES and not name.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory() as folder:
        logs = [open(Path(folder, f"rank{rank}.log"), "w") for rank in range(MEASURING_RANKS)]
        ranks = [subprocess.Popen([sys.executable, "-m", "simplefsdp.ir.cpu_measure", folder, str(rank)], env=env,
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log) for rank, log in enumerate(logs)]
        try:  # until both exit, one fails or the timeout passes (then None for a rank still running)
            deadline = time.monotonic() + timeout
            while None in (codes := [rank.poll() for rank in ranks]) and not any(codes) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for log in logs:
                log.close()
        if codes != [0] * MEASURING_RANKS:
            failed = next((rank for rank, code in enumerate(codes) if code), 0)
            tail = Path(folder, f"rank{failed}.log").read_text()[-2000:]
            raise RuntimeError(f"measuring the cpu hardware profile failed (exit codes {codes}, None: killed after "
                               f"{timeout:.0f} s); rank {failed} said:\n{tail}\nPass buckets='block' to "
                               "compile_sharded to plan without a profile")
        return load_profile(Path(folder, "profile.json"))
