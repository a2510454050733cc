"""Reading ``simplefsdp bench``'s profiled step: peak memory, collectives, communication, bytes sent and waits."""

from __future__ import annotations

import math

WINDOW = "simplefsdp.bench.profiled_step"
# Bytes a rank sends per byte of its input to a backend collective on n ranks (measure.METHODS["wire"] says how).
SEND_FACTORS = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
                "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
                "broadcast": lambda n: (n - 1) / n}


def read_profile(prof, backend: str, world: int) -> dict:
    """Peak allocated bytes, collectives, communication time, bytes sent (``SEND_FACTORS``, inputs recorded by
    ``record_shapes``, on ``world`` ranks) and wait times inside the ``WINDOW`` event."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        events.append(event)
        stack.extend(event.children)
    events.sort(key=lambda event: event.start_time_ns)
    window = next(event for event in events if event.name == WINDOW)
    begin, end = window.start_time_ns, window.end_time_ns
    live: dict[int, int] = {}
    allocated = before = peak = collectives = comm_ns = wait_ns = waits = sent = 0
    for event in events:
        inside = begin <= event.start_time_ns <= end
        if event.tag == _EventType.Allocation and str(event.extra_fields.device).startswith("cpu"):
            allocated += allocation_delta(live, event.extra_fields.ptr, event.extra_fields.alloc_size)
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
    return {
        "profiled_step_ms": (end - begin) / 1e6,
        "peak_bytes": max(before, peak),
        "collectives_per_step": collectives,
        "comm_ms_per_step": comm_ns / 1e6,
        "wire_bytes": sent,
        "wait_ms_per_step": wait_ns / 1e6 if waits or not collectives else None,
    }


def allocation_delta(live: dict[int, int], ptr: int, size: int) -> int:
    """Bytes a profiler allocation event adds to what this profile allocated and still holds (frees of earlier
    blocks count nothing; the event's ``total_allocated`` drifts between profiles). A block allocated at an address
    still held replaces it: its free went unrecorded (a block freed on another thread, such as gloo's)."""
    if size > 0:
        replaced, live[ptr] = live.get(ptr, 0), size
        return size - replaced
    return -live.pop(ptr, 0)


def sent_bytes(name: str, inputs: list, world: int) -> float:
    """Bytes one rank sends for the backend collective ``name`` (e.g. ``gloo:all_gather``) of tensor ``inputs``."""
    factor = next((factor for kind, factor in SEND_FACTORS.items() if kind in name), lambda n: 0)  # e.g. barrier
    tensors = [meta for item in inputs for meta in (item if isinstance(item, list) else [item])
               if hasattr(meta, "sizes")]
    return factor(world) * sum(math.prod(meta.sizes) * meta.dtype.itemsize for meta in tensors)
