"""Reading a PNG screenshot into pixels, with nothing but zlib.

Enough for what Chromium writes (8-bit RGB or RGBA, not interlaced): the five
row filters of the PNG specification, undone row by row.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

SIGNATURE = b"\x89PNG\r\n\x1a\n"
RGB, RGBA = 2, 6

Pixel = tuple[int, int, int]


@dataclass(frozen=True)
class Image:
    width: int
    height: int
    rows: list[list[Pixel]]  # rows[y][x]: (red, green, blue); alpha dropped

    def count(self, y: int, colour: Pixel, tolerance: int = 2) -> int:
        """Pixels of row `y` within `tolerance` of `colour` in every channel."""
        red, green, blue = colour
        return sum(
            1
            for r, g, b in self.rows[y]
            if abs(r - red) <= tolerance
            and abs(g - green) <= tolerance
            and abs(b - blue) <= tolerance
        )


def _paeth(left: int, up: int, up_left: int) -> int:
    guess = left + up - up_left
    distances = (abs(guess - left), abs(guess - up), abs(guess - up_left))
    if distances[0] <= distances[1] and distances[0] <= distances[2]:
        return left
    return up if distances[1] <= distances[2] else up_left


def _unfilter(kind: int, line: bytearray, previous: bytes, channels: int) -> None:
    if kind == 0:
        return
    for i in range(len(line)):
        left = line[i - channels] if i >= channels else 0
        up = previous[i]
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 2:
            line[i] = (line[i] + up) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
        elif kind == 4:
            up_left = previous[i - channels] if i >= channels else 0
            line[i] = (line[i] + _paeth(left, up, up_left)) & 0xFF
        else:
            raise ValueError(f"unknown PNG filter {kind}")


def read_png(data: bytes) -> Image:
    if not data.startswith(SIGNATURE):
        raise ValueError("not a PNG file")
    position, compressed = len(SIGNATURE), bytearray()
    header = None
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            compressed += body
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError("PNG without a header")
    width, height, depth, colour_type, _, _, interlace = header
    if depth != 8 or colour_type not in (RGB, RGBA) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour_type}")
    channels = 3 if colour_type == RGB else 4
    raw = zlib.decompress(bytes(compressed))
    stride = width * channels
    previous = bytes(stride)
    rows: list[list[Pixel]] = []
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(raw[start + 1 : start + 1 + stride])
        _unfilter(raw[start], line, previous, channels)
        rows.append([(line[x], line[x + 1], line[x + 2]) for x in range(0, stride, channels)])
        previous = bytes(line)
    return Image(width, height, rows)
