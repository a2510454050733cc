"""PNG charts with matplotlib (the optional ``plot`` extra): bench bars, training loss, predicted timeline. No
pyplot: each chart is its own ``Figure`` on the Agg canvas, so nothing global changes in the caller's session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from simplefsdp.ir.hardware import HardwareProfile
from simplefsdp.ir.render import byte_unit, collective_rows, format_bytes, format_seconds
from simplefsdp.ir.schedule import Schedule
from simplefsdp.ir.simulator import Prediction

_COLOURS = {"forward": "#8fa8c8", "backward": "#9cc39c", "all_gather": "#2b5fd9", "reduce_scatter": "#e08b00",
            "all_reduce": "#7b3fb5", "all_to_all": "#1a9e8f", "exposed": "#d62728"}
_LABELS = {"forward": "forward compute", "backward": "backward compute", "all_gather": "all-gather (a bar per bucket)",
           "reduce_scatter": "reduce-scatter (a bar per bucket)", "all_reduce": "all-reduce (a bar per bucket)",
           "all_to_all": "all-to-all", "exposed": "exposed communication (compute waits)"}


def missing() -> str | None:
    """Why charts cannot be drawn here (matplotlib missing, and how to install it), or None when they can."""
    found = importlib.util.find_spec("matplotlib")
    return None if found else "matplotlib is not installed; pip install 'simplefsdp[plot]'"


def _canvas(width: float, height: float):
    """An empty figure on the Agg canvas, ``width`` x ``height`` inches; ImportError naming the extra without
    matplotlib."""
    if reason := missing():
        raise ImportError(f"drawing a PNG chart needs matplotlib: {reason}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _figure(width: float, height: float, rows: int = 1, **subplots):
    """A figure on the Agg canvas and its ``rows`` axes, top to bottom."""
    figure = _canvas(width, height)
    return figure, figure.subplots(rows, 1, squeeze=False, **subplots)[:, 0]


def _edge(colour: str) -> str:
    """``colour`` darkened, for the edges between adjacent bars (of one bucket and the next)."""
    from matplotlib.colors import to_hex, to_rgb

    return to_hex([channel * 0.55 for channel in to_rgb(colour)])


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
    """``timeline_figure`` written to ``path``."""
    return _save(timeline_figure(title, schedules, prediction, hardware), path)


def timeline_figure(title: str, schedules: list[Schedule], prediction: Prediction, hardware: HardwareProfile):
    """The predicted step as a ``Figure``: lanes of compute by phase, collectives by kind and exposed communication
    in red, zooms on the (up to two) longest waits, the memory curve in the title's unit; a legend names each colour."""
    from matplotlib.patches import Patch

    step = prediction.step_time * 1e3
    peak = prediction.memory.peak_bytes
    unit, scale = byte_unit(peak)
    figure = _canvas(12, 7.5)
    figure.suptitle(f"{title}\nstep {format_seconds(prediction.step_time)}, exposed communication "
                    f"{format_seconds(prediction.exposed_communication)}, peak {format_bytes(peak)}", fontsize=9)
    kinds = {(row["phase"], row["name"]): row["kind"] for row in collective_rows(schedules, prediction, hardware)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for span in prediction.spans:
        key = (2, span.phase) if span.stream == "compute" else (1, kinds[span.phase, span.name])
        bars.setdefault(key, []).append((span.start * 1e3, (span.end - span.start) * 1e3))
    exposed = [(start * 1e3, (end - start) * 1e3) for start, end in prediction.exposed_intervals()]
    zooms = _zoom_windows(exposed, step)
    grid = figure.add_gridspec(3, len(zooms), height_ratios=(1, 1, 1.6))
    lanes = figure.add_subplot(grid[0, :])
    memory = figure.add_subplot(grid[2, :], sharex=lanes)
    _draw_lanes(lanes, bars, exposed, (-step / 100, step * 1.01))
    boundary = prediction.node_end_times[len(schedules[0].nodes) - 1] * 1e3
    for phase, centre in (("forward", boundary / 2), ("backward", (boundary + step) / 2)):
        lanes.text(centre, 2, phase, ha="center", va="center", fontsize=8)
    for column, (left, right) in enumerate(zooms):
        lanes.axvspan(left, right, color="#000", alpha=0.08, linewidth=0, zorder=0)
        axes = figure.add_subplot(grid[1, column])
        _draw_lanes(axes, bars, exposed, (left, right))
        waits = [width for start, width in exposed if left <= start + width / 2 <= right]
        axes.set_title(f"zoom: {left:.4g} to {right:.4g} ms (grey band above)", loc="left", fontsize=8)
        axes.set_title(f"{format_seconds(sum(waits) / 1e3)} exposed" + (
            f" in {len(waits)} waits" if len(waits) > 2 else
            f": {' + '.join(format_seconds(width / 1e3) for width in waits)}" if len(waits) > 1 else ""),
            loc="right", fontsize=8, color=_COLOURS["exposed"])
    for axes in figure.axes:
        axes.axvline(boundary, color="#333", linestyle="--", linewidth=0.8)
    memory.plot([time * 1e3 for time in prediction.node_end_times],
                [live / scale for live in prediction.memory.curve], color="#444")
    memory.axhline(peak / scale, color="#444", linestyle=":", linewidth=0.8)
    memory.annotate(f"peak {format_bytes(peak)}", (0, peak / scale), xytext=(4, -2), textcoords="offset points",
                    xycoords=("axes fraction", "data"), va="top", fontsize=8)
    memory.set(xlabel="time (ms)", ylabel=f"live memory per rank ({unit})")
    handles = [Patch(facecolor=_COLOURS[name], edgecolor=_edge(_COLOURS[name]) if lane == 1 else "none",
                     label=_LABELS[name]) for lane, name in sorted(bars, key=lambda key: list(_COLOURS).index(key[1]))]
    handles.append(Patch(color=_COLOURS["exposed"], label=_LABELS["exposed"]))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    return figure


def _zoom_windows(exposed: list[tuple[float, float]], step: float, count: int = 2) -> list[tuple[float, float]]:
    """Up to ``count`` windows ``(left, right)`` of the step (ms), a 25th of it wide or three times the interval, each
    around the longest ``exposed`` interval ``(start, width)`` not yet in one, in time order; else the step's start."""
    windows: list[tuple[float, float]] = []
    for start, width in sorted(exposed, key=lambda interval: -interval[1]):
        if len(windows) < count and not any(left <= start + width / 2 <= right for left, right in windows):
            size = min(max(3 * width, step / 25), step)
            left = min(max(start + (width - size) / 2, 0.0), step - size)
            windows.append((left, left + size))
    return sorted(windows) or [(0.0, step / 25)]


def _draw_lanes(axes, bars: dict[tuple[int, str], list[tuple[float, float]]], exposed: list[tuple[float, float]],
                window: tuple[float, float]) -> None:
    """The compute, communication and exposed lanes of ``bars`` and ``exposed`` (``(start, width)`` in ms) over
    ``window``, with a diamond on each exposed interval so that one narrower than a pixel still shows."""
    for (lane, name), spans in bars.items():
        colour = _COLOURS[name]
        axes.broken_barh(spans, (lane - 0.4, 0.8), facecolor=colour,
                         edgecolor=_edge(colour) if lane == 1 else "none", linewidth=0.5)
    red = _COLOURS["exposed"]
    axes.broken_barh(exposed, (-0.4, 0.8), color=red)
    axes.plot([start + width / 2 for start, width in exposed], [0] * len(exposed), "D", color=red, markersize=4)
    axes.set(xlim=window, ylim=(-0.6, 2.6))
    axes.set_yticks([0, 1, 2], ["exposed", "communication", "compute"])
