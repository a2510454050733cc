"""inspect's timeline chart: what each colour means, where the exposed communication is, the unit of memory."""

import dataclasses

import pytest
import torch
from matplotlib.colors import to_hex

import simplefsdp
from simplefsdp.ir.render import byte_unit, format_bytes
from simplefsdp.models.llama import build_model
from simplefsdp.plots import timeline_figure


@pytest.fixture(scope="module")
def report():
    """The debug Llama at world 2 with the default passes: both collective kinds, some communication exposed."""
    torch.manual_seed(0)
    return simplefsdp.inspect(build_model("debug"), (torch.zeros(1, 128, dtype=torch.long),), world_size=2,
                              hardware="h100")


def test_timeline_names_each_colour_and_draws_the_predicted_waits_in_red_in_the_unit_of_the_peak(report):
    prediction = report.prediction
    figure = timeline_figure(report.title, report.schedules, prediction, report.hardware)
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "forward compute", "backward compute", "all-gather (a bar per bucket)", "reduce-scatter (a bar per bucket)",
        "exposed communication (compute waits)"]
    lanes, _, *zooms = figure.axes
    red = [bars for bars in lanes.collections if to_hex(bars.get_facecolor()[0]) == "#d62728"]
    drawn = [ends for path in red[0].get_paths() for ends in (path.get_extents().x0, path.get_extents().x1)]
    waits = prediction.exposed_intervals()
    assert drawn and drawn == pytest.approx([end * 1e3 for interval in waits for end in interval])  # ms, as drawn
    start, end = max(waits, key=lambda interval: interval[1] - interval[0])
    assert any(zoom.get_xlim()[0] <= start * 1e3 and end * 1e3 <= zoom.get_xlim()[1] for zoom in zooms)
    huge = dataclasses.replace(prediction, memory=dataclasses.replace(prediction.memory, peak_bytes=3 << 30))
    for predicted, unit in ((prediction, "MiB"), (huge, "GiB")):  # the axis in the unit of the title's peak
        figure = timeline_figure(report.title, report.schedules, predicted, report.hardware)
        assert figure.axes[1].get_ylabel() == f"live memory per rank ({unit})"
        assert f"peak {format_bytes(predicted.memory.peak_bytes)}" in figure.get_suptitle()
        assert format_bytes(predicted.memory.peak_bytes).endswith(unit)


def test_byte_unit_is_the_unit_format_bytes_writes():
    assert [byte_unit(size) for size in (1023, 1024, 3 << 20, 53 << 30)] == [
        ("B", 1), ("KiB", 1024), ("MiB", 1 << 20), ("GiB", 1 << 30)]
    assert [format_bytes(size) for size in (1023, 1536, 3 << 20, 53 << 30)] == [
        "1023 B", "1.50 KiB", "3.00 MiB", "53.00 GiB"]
