"""Reading ``simplefsdp bench``'s profiled step: peak memory, collectives, communication and waits."""

from __future__ import annotations

WINDOW = "simplefsdp.bench.profiled_step"


def read_profile(prof, backend: str) -> dict:
    """Peak allocated bytes, collectives, communication and wait times inside the ``WINDOW`` event."""
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
    allocated = before = peak = collectives = comm_ns = wait_ns = waits = 0
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
        elif inside and event.name == "_c10d_functional::wait_tensor":
            waits += 1
            wait_ns += event.duration_time_ns
    return {
        "profiled_step_ms": (end - begin) / 1e6,
        "peak_bytes": max(before, peak),
        "collectives_per_step": collectives,
        "comm_ms_per_step": comm_ns / 1e6,
        "wait_ms_per_step": wait_ns / 1e6 if waits or not collectives else None,
    }


def allocation_delta(live: dict[int, int], ptr: int, size: int) -> int:
    """Bytes a profiler allocation event adds to what this profile allocated and still holds (frees of earlier
    blocks count nothing; the event's ``total_allocated`` drifts between profiles)."""
    if size > 0:
        live[ptr] = size
        return size
    return -live.pop(ptr, 0)
