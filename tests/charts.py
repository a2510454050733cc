"""Checking a PNG chart: a real image drawn by matplotlib, of the size its kind of chart has."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from matplotlib.image import imread


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a matplotlib PNG, after checking that it is one and has more than a few colours."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert b"Matplotlib version" in data, f"{path} was not drawn by matplotlib"  # its Software text chunk
    pixels = imread(path)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10, f"{path} is (nearly) blank"
    return struct.unpack(">II", data[16:24])
