"""Reading ``simplefsdp bench``'s profiled step: peak memory, collectives, communication, bytes sent and waits."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from typing import Iterator

import torch

WINDOW = "simplefsdp.bench.profiled_step"
# Bytes a rank sends per byte of its input to a backend collective on n ranks (measure.METHODS["wire"] says how).
SEND_FACTORS = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
                "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
                "broadcast": lambda n: (n - 1) / n}


@contextlib.contextmanager
def frees_counted_on_every_thread() -> Iterator[None]:
    """Inside, c10's CPU allocator counts in the profiler's ``total_allocated`` the frees of every thread, not only of
    threads the profiler records: gloo's worker threads free buffers of collectives. The switch is c10's flag
    ``caffe2_report_cpu_memory_usage`` (private: no Python API sets it), set in ``libc10``."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage")
    previous, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = previous


def read_profile(prof, backend: str, world: int) -> dict:
    """Peak allocated bytes (of a profile taken inside ``frees_counted_on_every_thread``: what the process allocated
    since the profile's first allocation, less what it freed on any thread), collectives, communication time, bytes
    sent (``SEND_FACTORS``, inputs recorded by ``record_shapes``, on ``world`` ranks) and wait times inside the
    ``WINDOW`` event."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        events.append(event)
        stack.extend(event.children)
    events.sort(key=lambda event: event.start_time_ns)
    window = next(event for event in events if event.name == WINDOW)
    begin, end = window.start_time_ns, window.end_time_ns
    first = None
    before = peak = collectives = comm_ns = wait_ns = waits = sent = 0
    for event in events:
        inside = begin <= event.start_time_ns <= end
        if event.tag == _EventType.Allocation and str(event.extra_fields.device).startswith("cpu"):
            fields = event.extra_fields
            first = fields.total_allocated - fields.alloc_size if first is None else first
            allocated = fields.total_allocated - first
            if event.start_time_ns < begin:
                before = allocated
            elif inside:
                peak = max(peak, allocated)
        elif inside and event.name.startswith("c10d::") and "barrier" not in event.name:
            collectives += 1
        elif inside and event.name.startswith(f"{backend}:"):
            comm_ns += event.duration_time_ns
            sent += sent_bytes(event.name, event.extra_fields.inputs, world)
        elif inside and event.name == "_c10d_functional::wait_tensor":
            waits += 1
            wait_ns += event.duration_time_ns
    return {"profiled_step_ms": (end - begin) / 1e6, "peak_bytes": max(before, peak),
            "collectives_per_step": collectives, "comm_ms_per_step": comm_ns / 1e6, "wire_bytes": sent,
            "wait_ms_per_step": wait_ns / 1e6 if waits or not collectives else None}


def sent_bytes(name: str, inputs: list, world: int) -> float:
    """Bytes one rank sends for the backend collective ``name`` (e.g. ``gloo:all_gather``) of tensor ``inputs``."""
    factor = next((factor for kind, factor in SEND_FACTORS.items() if kind in name), lambda n: 0)  # e.g. barrier
    tensors = [meta for item in inputs for meta in (item if isinstance(item, list) else [item])
               if hasattr(meta, "sizes")]
    return factor(world) * sum(math.prod(meta.sizes) * meta.dtype.itemsize for meta in tensors)
