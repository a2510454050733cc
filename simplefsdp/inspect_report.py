"""What ``simplefsdp.inspect`` returns: the step's graphs, plans and prediction at each stage of the passes, as text,
JSON, generated code and a timeline picture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from simplefsdp import plots
from simplefsdp.ir.cost_model import wire_bytes
from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.render import chrome_trace, stage_table, text_summary
from simplefsdp.ir.schedule import Schedule
from simplefsdp.ir.simulator import Prediction
from simplefsdp.passes.bucket_plan import BucketPlan
from simplefsdp.passes.reorder import ReorderPlan


@dataclass(frozen=True)
class InspectStage:
    """The step's graphs at one stage (``traced``, ``bucketed``, ``reordered``), the plans applied, the prediction."""

    name: str
    forward: Schedule
    backward: Schedule
    forward_plan: BucketPlan | ReorderPlan | None
    backward_plan: BucketPlan | ReorderPlan | None
    prediction: Prediction

    @property
    def schedules(self) -> list[Schedule]:
        """The forward and the backward schedule, in run order."""
        return [self.forward, self.backward]


@dataclass
class InspectReport:
    """The step at each stage of the passes, ``traced`` first; ``forward``, ``backward`` and ``prediction`` are the
    last stage's, the graphs that run. ``tokens``: tokens per step per device, from the example input (over tp)."""

    title: str
    stages: list[InspectStage]
    hardware: HardwareProfile
    tokens: int
    fault_tolerant: dict | None = None  # what crosses replica groups (``ir/replica_sync.py``), ``replica_groups`` > 1
    notes: tuple[str, ...] = ()  # what was changed to trace the model, a line each

    @property
    def final(self) -> InspectStage:
        """The stage after every pass that is on: the graphs that run."""
        return self.stages[-1]

    def stage(self, name: str) -> InspectStage:
        """The stage called ``name``; ``KeyError`` naming the stages this report has when there is none."""
        found = [stage for stage in self.stages if stage.name == name]
        if not found:
            raise KeyError(f"no {name!r} stage; this report has {', '.join(s.name for s in self.stages)} "
                           "(a pass that is off has no stage)")
        return found[0]

    @property
    def forward(self) -> Schedule:
        return self.final.forward

    @property
    def backward(self) -> Schedule:
        return self.final.backward

    @property
    def prediction(self) -> Prediction:
        return self.final.prediction

    @property
    def schedules(self) -> list[Schedule]:
        """The final forward and backward schedule, in run order."""
        return self.final.schedules

    def plans(self) -> str:
        """The bucket plan and the reorder plan of both graphs, as text (what ``plan.txt`` holds)."""
        headings = {"bucketed": "bucket plan", "reordered": "reorder plan"}
        sections = [f"{headings[stage.name]}\n{stage.forward_plan}\n{stage.backward_plan}\n"
                    for stage in self.stages[1:]]
        return "\n".join(sections) or "no passes applied (buckets=None, reorder=False): the graphs run as traced\n"

    def summary(self) -> str:
        """The text summary: one row per stage, the plans, then the final graphs' predictions and collectives."""
        table = stage_table(self.stage_records())
        final = text_summary(f"{self.final.name} graphs (what runs)", self.schedules, self.prediction, self.hardware)
        if ft := self.fault_tolerant:
            sync = ft["replica_sync"] + (f" --outer-quantize {ft['outer_quantize']}" if ft["outer_quantize"] else "")
            table += (f"fault-tolerant: {ft['replica_groups']} replica groups, --replica-sync {sync}: "
                      f"{ft['exchange_bytes'] / 2**20:.2f} MiB exchanged per rank every {ft['exchange_every']} step(s)"
                      f" (torchft, not overlapped): {ft['exchange_seconds'] * 1e3:.3f} ms; cross-group bytes per step "
                      f"{ft['bytes_per_step']:,.0f}; step {ft['step_seconds'] * 1e3:.3f} ms\n")
        notes = "".join(f"note: {note}\n" for note in self.notes)
        return f"{self.title}\n{notes}{self.symbolic_sizes()}{table}\n{self.plans()}\n{final}"

    def symbolic_sizes(self) -> str:
        """A line naming each symbolic size and the hint it is priced at; empty when every size is static."""
        symbols = {**self.forward.symbols, **self.backward.symbols}
        hints = ", ".join(f"{symbol}={hint}" for symbol, hint in sorted(symbols.items()))
        return f"symbolic sizes, priced at their hints: {hints}\n" if symbols else ""

    def stage_records(self) -> list[dict]:
        """Per stage, what ``summary.json`` lists: collectives, wire bytes per rank (``ir.cost_model.wire_bytes``),
        predicted step and exposed communication in seconds, peak bytes, tokens per second per device."""
        return [dict(
            name=stage.name, collectives=sum(len(schedule.collectives()) for schedule in stage.schedules),
            wire_bytes=sum(wire_bytes(node.collective) for schedule in stage.schedules
                           for node in schedule.collectives()),
            step_seconds=stage.prediction.step_time, exposed_comm_seconds=stage.prediction.exposed_communication,
            peak_bytes=stage.prediction.memory.peak_bytes,
            tokens_per_second_per_device=self.tokens / stage.prediction.step_time) for stage in self.stages]

    def save(self, directory: str | Path) -> list[Path]:
        """Write the final graphs (forward.py, backward.py), each stage's (``forward.0-traced.py``, ...), plan.txt,
        summary.txt, summary.json, trace.json and, when matplotlib is installed, timeline.png; return their paths."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        contents = {"forward.py": self.forward.code, "backward.py": self.backward.code}
        for index, stage in enumerate(self.stages):
            for schedule in stage.schedules:
                contents[f"{schedule.phase}.{index}-{stage.name}.py"] = schedule.code
        contents.update({
            "plan.txt": self.plans(),
            "summary.txt": self.summary(),
            "summary.json": json.dumps({"stages": self.stage_records(), "fault_tolerant": self.fault_tolerant},
                                       indent=2) + "\n",
            "trace.json": chrome_trace(self.schedules, self.prediction, self.hardware),
        })
        for name, text in contents.items():
            (folder / name).write_text(text)
        paths = [folder / name for name in contents]
        if not plots.missing():
            paths.append(plots.timeline_chart(folder / "timeline.png", self.title, self.schedules, self.prediction,
                                              self.hardware))
        return paths
