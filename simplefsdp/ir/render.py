"""Renderers of a predicted step: a text summary, a Chrome/Perfetto trace (``plots.timeline_chart`` draws it)."""

from __future__ import annotations

import json

from simplefsdp.ir.cost_model import collective_time
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.memory import CATEGORIES, MemoryProfile
from simplefsdp.ir.schedule import Schedule
from simplefsdp.ir.simulator import Prediction

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB")


def byte_unit(size: float) -> tuple[str, int]:
    """The largest of B, KiB, MiB, GiB that ``size`` holds one of, and its bytes: ``3 << 20`` → ``("MiB", 2**20)``."""
    power = next((power for power in range(len(_BYTE_UNITS) - 1, 0, -1) if abs(size) >= 1024**power), 0)
    return _BYTE_UNITS[power], 1024**power


def format_bytes(size: float) -> str:
    """``1536`` → ``"1.50 KiB"``, in ``byte_unit(size)``."""
    unit, scale = byte_unit(size)
    return f"{size:.0f} B" if unit == "B" else f"{size / scale:.2f} {unit}"


def format_seconds(seconds: float) -> str:
    """``0.0012`` → ``"1.200 ms"``."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def collective_rows(schedules: list[Schedule], prediction: Prediction, hardware: HardwareProfile) -> list[dict]:
    """One row per collective of the step: phase, kind, bucket, module, group size, dtype, bytes, time, hidden."""
    return [dict(phase=schedule.phase, kind=node.collective.kind, bucket=f"{schedule.phase[0]}{index}",
                 module=node.fqn or "(top)", group=node.collective.group_size,
                 dtype=str(node.collective.dtype).removeprefix("torch."), bytes=node.collective.bytes,
                 time=collective_time(node.collective, hardware), stall=prediction.stall(schedule.phase, node.name),
                 name=node.name)
            for schedule in schedules for index, node in enumerate(schedule.collectives())]


def text_summary(title: str, schedules: list[Schedule], prediction: Prediction, hardware: HardwareProfile) -> str:
    """The predictions in a few lines, then a table with one row per collective."""
    memory = prediction.memory
    split = ", ".join(f"{category} {format_bytes(memory.peak_by_category[category])}" for category in CATEGORIES)
    flops = sum(node.flops for schedule in schedules for node in schedule.nodes)
    lines = [
        title,
        f"predicted step {format_seconds(prediction.step_time)}: compute {format_seconds(prediction.compute_time)}, "
        f"communication {format_seconds(prediction.communication_time)}, "
        f"exposed {format_seconds(prediction.exposed_communication)}, overlap {prediction.overlap_fraction:.1%}, "
        f"lower bound {format_seconds(prediction.lower_bound)}",
        f"peak memory per rank {format_bytes(memory.peak_bytes)} at {memory.peak_at}: {split}",
        *_overflow(memory, hardware),
        f"FLOPs per rank per step {flops:.4g}",
        *(f"{schedule.phase} region {name} (in {schedule.phase}.py): the compute of {len(blocks)} block(s), "
          f"{blocks[0]}{f' to {blocks[-1]}' if len(blocks) > 1 else ''}"
          for schedule in schedules for name, blocks in schedule.regions.items()),
        "",
        f"{'#':>3}  {'phase':8}  {'kind':14}  {'bucket':6}  {'module':32}  {'group':>5}  {'dtype':8}  "
        f"{'bytes':>11}  {'time':>10}  hidden",
    ]
    for number, row in enumerate(collective_rows(schedules, prediction, hardware)):
        hidden = "yes" if row["stall"] == 0 else f"no, stalls {format_seconds(row['stall'])}"
        lines.append(f"{number:>3}  {row['phase']:8}  {row['kind']:14}  {row['bucket']:6}  {row['module']:32}  "
                     f"{row['group']:>5}  {row['dtype']:8}  {format_bytes(row['bytes']):>11}  "
                     f"{format_seconds(row['time']):>10}  {hidden}")
    return "\n".join(lines) + "\n"


# What to shrink, by the memory category that holds the most at a peak over the device's memory
SHRINK = {"activations": "recompute them (--activation-checkpointing selective, or full to keep the least), or lower "
                         "--batch-size or --seq-len",
          "sharded_params": "shard over more ranks (--world-size)", "gradients": "shard over more ranks (--world-size)",
          "unsharded_params": "cap the gathered bytes in flight (--memory-budget BYTES)",
          "comm_buffers": "cap the gathered bytes in flight (--memory-budget BYTES)"}


def _overflow(memory: MemoryProfile, hardware: HardwareProfile) -> list[str]:
    """A line saying the predicted peak is over the device's memory, naming what to shrink; none where it fits."""
    if memory.peak_bytes <= hardware.memory_capacity:
        return []
    largest = max(CATEGORIES, key=memory.peak_by_category.__getitem__)
    return [f"does not fit: the peak is over {hardware.name}'s {format_bytes(hardware.memory_capacity)} per device "
            f"(optimizer state not counted); {largest} hold the most: {SHRINK[largest]}"]


def stage_table(records: list[dict]) -> str:
    """One row per stage record (``InspectReport.stage_records``): collectives, step, exposed communication, peak."""
    lines = [f"{'stage':10}  {'collectives':>11}  {'predicted step':>14}  {'exposed comm.':>13}  {'peak memory':>11}"]
    lines += [f"{record['name']:10}  {record['collectives']:>11}  {format_seconds(record['step_seconds']):>14}  "
              f"{format_seconds(record['exposed_comm_seconds']):>13}  {format_bytes(record['peak_bytes']):>11}"
              for record in records]
    return "\n".join(lines) + "\n"


def chrome_trace(schedules: list[Schedule], prediction: Prediction, hardware: HardwareProfile) -> str:
    """Chrome / Perfetto trace JSON: thread 0 compute, thread 1 communication, a memory counter."""
    buckets = {(row["phase"], row["name"]): row["bucket"] for row in collective_rows(schedules, prediction, hardware)}
    events = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "thread_name", "args": {"name": "compute"}},
        {"ph": "M", "pid": 0, "tid": 1, "name": "thread_name", "args": {"name": "communication"}},
    ]
    for span in prediction.spans:
        args = {"module": span.fqn, "op": span.op, "phase": span.phase}
        if (span.phase, span.name) in buckets:
            args["bucket"] = buckets[span.phase, span.name]
        events.append({"ph": "X", "pid": 0, "tid": 0 if span.stream == "compute" else 1, "name": span.name,
                       "cat": span.phase, "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6, "args": args})
    events += [{"ph": "C", "pid": 0, "name": "memory", "ts": time * 1e6, "args": {"bytes": live}}
               for time, live in zip(prediction.node_end_times, prediction.memory.curve)]
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
