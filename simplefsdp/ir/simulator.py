"""Two-stream replay of a schedule: predicted step time, exposed communication, overlap, peak memory.

The compute stream runs nodes in program order. A collective is issued when the compute stream reaches it and runs
on the communication stream, after the collectives issued before it. A wait blocks the compute stream until its
collective ends; that stall is exposed communication. The backward starts when the forward's compute stream ends.
The lower bound of any schedule of these nodes on two streams is ``max(total compute, total communication)``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from simplefsdp.ir.cost_model import node_time
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.memory import MemoryProfile, memory_profile
from simplefsdp.ir.schedule import COLLECTIVE, WAIT, Schedule


@dataclass(frozen=True)
class Span:
    """One node's interval on a stream, in seconds from the start of the step."""
    name: str
    phase: str
    stream: str
    start: float
    end: float
    fqn: str
    op: str


@dataclass
class Prediction:
    """What the simulator predicts for one training step (forward + backward) on one rank."""
    step_time: float
    compute_time: float
    communication_time: float
    exposed_communication: float
    lower_bound: float
    memory: MemoryProfile
    spans: list[Span] = field(repr=False)
    stalls: dict[tuple[str, str], float] = field(repr=False)
    node_end_times: list[float] = field(repr=False)

    @property
    def overlap_fraction(self) -> float:
        """Share of communication time hidden behind compute (1.0 when there is none)."""
        return max(0.0, 1.0 - self.exposed_communication / self.communication_time) if self.communication_time else 1.0

    def stall(self, phase: str, name: str) -> float:
        """Seconds the compute stream waited on the collective ``name`` of ``phase`` (0.0: hidden)."""
        return self.stalls.get((phase, name), 0.0)

    def exposed_intervals(self) -> list[tuple[float, float]]:
        """``(start, end)`` of each time the compute stream waits on communication, the communication after its last
        compute included: the gaps between compute spans, whose lengths sum to ``exposed_communication``."""
        intervals, clock = [], 0.0
        for span in (span for span in self.spans if span.stream == "compute"):
            if span.start > clock:
                intervals.append((clock, span.start))
            clock = span.end
        if self.step_time > clock:
            intervals.append((clock, self.step_time))
        return intervals


def simulate(forward: Schedule, backward: Schedule, hardware: HardwareProfile,
             compute_dtype: torch.dtype | None = None) -> Prediction:
    """Replay ``forward`` then ``backward`` on two streams with ``hardware``'s costs, matmuls in ``compute_dtype``."""
    compute_clock = comm_clock = total_compute = total_comm = exposed = 0.0
    spans, stalls, collective_end, node_end_times = [], {}, {}, []
    for schedule in (forward, backward):
        for node in schedule.nodes:
            duration = node_time(node, hardware, compute_dtype)
            if node.kind == COLLECTIVE:
                start = max(compute_clock, comm_clock)
                comm_clock = collective_end[schedule.phase, node.name] = start + duration
                total_comm += duration
                spans.append(Span(node.name, schedule.phase, "communication", start, comm_clock, node.fqn, node.op))
            elif node.kind == WAIT:
                key = (schedule.phase, node.waits_for)
                stall = max(0.0, collective_end.get(key, 0.0) - compute_clock)
                stalls[key] = stalls.get(key, 0.0) + stall
                exposed += stall
                compute_clock += stall
            elif duration > 0:
                spans.append(Span(node.name, schedule.phase, "compute", compute_clock, compute_clock + duration,
                                  node.fqn, node.op))
                compute_clock += duration
                total_compute += duration
            node_end_times.append(compute_clock)
    step_time = max(compute_clock, comm_clock)
    return Prediction(step_time=step_time, compute_time=total_compute, communication_time=total_comm,
                      exposed_communication=exposed + (step_time - compute_clock),  # + comm. after the compute
                      lower_bound=max(total_compute, total_comm), memory=memory_profile(forward, backward),
                      spans=spans, stalls=stalls, node_end_times=node_end_times)
