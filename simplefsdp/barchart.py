"""Horizontal bar charts as PNG files, with no plotting library: a pixel buffer, a 3x5 font, zlib.

Text is drawn in capitals from a small built-in font (digits, A-Z and ``.-()/:% ``);
other characters are drawn as blanks.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

# Each glyph: five rows of three pixels, top to bottom, "1" = ink.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    "-": "000000111000000", ".": "000000000000010", "(": "010100100100010", ")": "010001001001010",
    "/": "001001010100100", ":": "000010000010000", "%": "101001010100101",
}
_SCALE = 2
_ADVANCE = 4 * _SCALE
_ROW = 22
_LABEL_WIDTH = 200
_BAR_WIDTH = 440
_WIDTH = _LABEL_WIDTH + _BAR_WIDTH + 140
_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75), (127, 127, 127)]


@dataclass(frozen=True)
class Panel:
    """One chart: a title and ``(label, value or None, value text)`` rows; None draws no bar."""

    title: str
    rows: list[tuple[str, float | None, str]]


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def rect(self, x: int, y: int, w: int, h: int, color: tuple[int, int, int]) -> None:
        for row in range(max(0, y), min(self.height, y + h)):
            start, stop = max(0, x), min(self.width, x + w)
            if stop > start:
                self.pixels[(row * self.width + start) * 3 : (row * self.width + stop) * 3] = bytes(color) * (stop - start)

    def text(self, x: int, y: int, text: str, color: tuple[int, int, int] = (0, 0, 0)) -> None:
        for index, char in enumerate(text.upper()):
            glyph = _FONT.get(char, "0" * 15)
            for bit, ink in enumerate(glyph):
                if ink == "1":
                    self.rect(x + index * _ADVANCE + bit % 3 * _SCALE, y + bit // 3 * _SCALE, _SCALE, _SCALE, color)

    def png(self) -> bytes:
        stride = self.width * 3
        raw = b"".join(b"\x00" + self.pixels[row * stride : (row + 1) * stride] for row in range(self.height))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def write_bar_chart(path: str | Path, panels: list[Panel]) -> None:
    """Draw ``panels`` one below the other, bars scaled to each panel's largest value, and write a PNG."""
    height = sum(_ROW * (len(panel.rows) + 2) for panel in panels) + _ROW
    canvas = _Canvas(_WIDTH, height)
    y = _ROW // 2
    for panel in panels:
        canvas.text(8, y, panel.title)
        y += _ROW
        largest = max((value for _, value, _ in panel.rows if value is not None), default=0.0) or 1.0
        for index, (label, value, value_text) in enumerate(panel.rows):
            canvas.text(8, y + 6, label)
            length = 0 if value is None else max(1, round(_BAR_WIDTH * value / largest))
            canvas.rect(_LABEL_WIDTH, y + 2, length, _ROW - 6, _COLORS[index % len(_COLORS)])
            canvas.text(_LABEL_WIDTH + length + 8, y + 6, value_text)
            y += _ROW
        y += _ROW
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(canvas.png())
