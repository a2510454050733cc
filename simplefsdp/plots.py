"""PNG charts with matplotlib (the optional ``plot`` extra): bench bars, training loss, predicted timeline.

No pyplot: each chart is its own ``Figure`` on the Agg canvas, so nothing global changes in the caller's session.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.render import format_bytes, format_seconds, span_colours
from simplefsdp.ir.schedule import Schedule
from simplefsdp.ir.simulator import Prediction


def missing() -> str | None:
    """Why charts cannot be drawn here (matplotlib missing, and how to install it), or None when they can."""
    found = importlib.util.find_spec("matplotlib")
    return None if found else "matplotlib is not installed; pip install 'simplefsdp[plot]'"


def _figure(width: float, height: float, rows: int = 1, **subplots):
    """A figure on the Agg canvas and its ``rows`` axes, top to bottom; ImportError naming the extra without
    matplotlib."""
    if reason := missing():
        raise ImportError(f"drawing a PNG chart needs matplotlib: {reason}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, 1, squeeze=False, **subplots)[:, 0]


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def bar_chart(path: str | Path, title: str, panels: dict[str, dict[str, float | None]]) -> Path:
    """One panel of horizontal bars per metric, ``{metric: {name: value, or None for "n/a"}}``; written to ``path``."""
    names = max(len(values) for values in panels.values())
    figure, axes_list = _figure(9, 1 + len(panels) * (0.6 + 0.35 * names), rows=len(panels))
    figure.suptitle(title, fontsize=10)
    for axes, (metric, values) in zip(axes_list, panels.items()):
        bars = axes.barh(list(values), [value or 0 for value in values.values()], color="#4363d8")
        axes.bar_label(bars, ["n/a" if value is None else f"{value:.3g}" for value in values.values()], padding=3)
        axes.invert_yaxis()  # the first name on top, as in the table
        axes.margins(x=0.15)
        axes.set_xlabel(metric)
    return _save(figure, path)


def loss_chart(path: str | Path, title: str, steps: list[int], losses: list[float]) -> Path:
    """The loss of each step as a line; written to ``path``."""
    figure, (axes,) = _figure(8, 4.5)
    axes.plot(steps, losses, marker="o" if len(steps) <= 60 else None, markersize=3)
    axes.set(title=title, xlabel="step", ylabel="loss")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    return _save(figure, path)


def timeline_chart(path: str | Path, title: str, schedules: list[Schedule], prediction: Prediction,
                   hardware: HardwareProfile) -> Path:
    """The predicted step: compute and communication lanes (collectives coloured by bucket) over the memory curve."""
    figure, (lanes, memory) = _figure(12, 5, rows=2, sharex=True, height_ratios=(1, 2))
    figure.suptitle(f"{title}\nstep {format_seconds(prediction.step_time)}, exposed communication "
                    f"{format_seconds(prediction.exposed_communication)}, "
                    f"peak {format_bytes(prediction.memory.peak_bytes)}",
                    fontsize=9)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for span, colour in zip(prediction.spans, span_colours(schedules, prediction, hardware)):
        lane = 1 if span.stream == "compute" else 0
        bars.setdefault((lane, colour), []).append((span.start * 1e3, (span.end - span.start) * 1e3))
    for (lane, colour), spans in bars.items():
        lanes.broken_barh(spans, (lane - 0.4, 0.8), color=colour)
    lanes.set_yticks([0, 1], ["communication", "compute"])
    memory.plot([time * 1e3 for time in prediction.node_end_times], [live / 2**20 for live in prediction.memory.curve],
                color="#444")
    memory.set(xlabel="time (ms)", ylabel="live memory per rank (MiB)")
    return _save(figure, path)
