"""The ``cpu`` profile against reality: cpu-small on 2 gloo ranks, predicted vs measured step time and peak memory.

    .venv/bin/python benchmarks/calibration.py   # exits 1 when outside 1.5x (time) or 25% (memory)

A timed check, so it lives here rather than in the test suite (which must not
time things); its recorded results are in benchmarks/inspect.md.

The profile is measured by the same two processes just before and just after
they time the steps (the mean of the two is used), so prediction and
measurement see the same share of this shared, busy machine.

The measured run compiles with ``fx_backend()``: the same AOTAutograd forward and
backward graphs that ``inspect`` prices, run as plain FX (Inductor's C++ code
generation would cost minutes of test time on this machine). A step is one
forward and one backward with a gradient of ones for the logits, as traced.
Peak memory is the highest "Total Allocated" of the CPU allocator's
``torch.profiler`` memory events during one step, plus what the step starts
with (parameter shards, buffers, tokens).
"""

import dataclasses
import json
import os
import statistics
import tempfile
import time

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import simplefsdp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ranks import run_on_ranks  # noqa: E402  (the tests' multi-rank harness)
from simplefsdp.ir.capture import fx_backend
from simplefsdp.ir.cpu_measure import measure_cpu_profile_in_group
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.render import format_bytes, format_seconds
from simplefsdp.models.llama import build_model

BATCH, SEQ, STEPS = 4, 128, 10


def step(model, tokens):
    logits = model(tokens)
    torch.autograd.backward(logits, torch.ones_like(logits))


def measure_rank() -> tuple[HardwareProfile, float, int]:
    """On one gloo rank: the cpu profile measured just before, median step seconds, peak bytes."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # two ranks share this machine's cores
    before = measure_cpu_profile_in_group()  # calibrate in the same processes, around the timed steps
    torch.manual_seed(0)
    model = build_model("cpu-small")
    simplefsdp.compile_sharded(model, backend=fx_backend())
    tokens = torch.randint(0, 256, (BATCH, SEQ))
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step(model, tokens)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    held = sum(p.to_local().nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers()) + tokens.nbytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, tokens)
    with tempfile.TemporaryDirectory() as folder:
        trace = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as file:
            events = json.load(file)["traceEvents"]
    peak = max(event["args"]["Total Allocated"] for event in events if event.get("name") == "[memory]")
    return average_profile(before, measure_cpu_profile_in_group()), statistics.median(times[1:]), held + peak


def average_profile(first: HardwareProfile, second: HardwareProfile) -> HardwareProfile:
    """The field-by-field mean of two measurements of the same machine."""
    fields = {}
    for name, value in dataclasses.asdict(first).items():
        other = getattr(second, name)
        if isinstance(value, dict):
            fields[name] = {key: (value[key] + other[key]) / 2 for key in value}
        elif isinstance(value, float):
            fields[name] = (value + other) / 2
        else:
            fields[name] = value
    return HardwareProfile(**fields)


def main() -> int:
    with torch.device("meta"):
        model = build_model("cpu-small")
    measured = run_on_ranks(2, measure_rank)
    hardware = measured[0][0]
    # The ranks ran the traced graphs as plain FX (no passes), so predict those.
    report = simplefsdp.inspect(model, (torch.zeros(BATCH, SEQ, dtype=torch.long),), world_size=2, hardware=hardware,
                                buckets=None, reorder=False)
    step_time = statistics.median(seconds for _, seconds, _ in measured)
    peak = max(bytes_ for _, _, bytes_ in measured)
    predicted_time, predicted_peak = report.prediction.step_time, report.prediction.memory.peak_bytes
    print(
        f"cpu-small, 2 gloo ranks, {BATCH}x{SEQ} tokens per rank: step predicted {format_seconds(predicted_time)}, "
        f"measured median {format_seconds(step_time)} (ratio {predicted_time / step_time:.2f}); peak memory "
        f"predicted {format_bytes(predicted_peak)}, measured {format_bytes(peak)} (ratio {predicted_peak / peak:.2f})"
    )
    time_ok = 1 / 1.5 <= predicted_time / step_time <= 1.5
    memory_ok = abs(predicted_peak - peak) <= 0.25 * peak
    print(f"step time within 1.5x: {'yes' if time_ok else 'NO'}; "
          f"peak memory within 25%: {'yes' if memory_ok else 'NO'}")
    return 0 if time_ok and memory_ok else 1


if __name__ == "__main__":
    sys.exit(main())
