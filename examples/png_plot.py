"""A line plot written as PNG with the standard library only (the GPU hosts we train on have no
matplotlib): curves, axes with min/max ticks, a legend, a 3x5 pixel font scaled up."""
from __future__ import annotations

import struct
import zlib

# 3x5 glyphs, rows top to bottom, 3 bits per row (MSB = left column)
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    " ": (0, 0, 0, 0, 0), "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4), ":": (0, 2, 0, 2, 0),
    "/": (1, 1, 2, 4, 4), "=": (0, 7, 0, 7, 0), "%": (5, 1, 2, 4, 5),
    "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6), "C": (7, 4, 4, 4, 7), "D": (6, 5, 5, 5, 6),
    "E": (7, 4, 6, 4, 7), "F": (7, 4, 6, 4, 4), "G": (7, 4, 5, 5, 7), "H": (5, 5, 7, 5, 5),
    "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 7), "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7),
    "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5), "O": (7, 5, 5, 5, 7), "P": (7, 5, 7, 4, 4),
    "Q": (7, 5, 5, 7, 1), "R": (6, 5, 6, 5, 5), "S": (7, 4, 7, 1, 7), "T": (7, 2, 2, 2, 2),
    "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2), "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5),
    "Y": (5, 5, 2, 2, 2), "Z": (7, 1, 2, 4, 7),
}


class Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (3 * width * height))

    def dot(self, x: int, y: int, rgb, size: int = 1) -> None:
        for dy in range(size):
            for dx in range(size):
                xx, yy = x + dx, y + dy
                if 0 <= xx < self.w and 0 <= yy < self.h:
                    i = 3 * (yy * self.w + xx)
                    self.px[i:i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, size=1) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            self.dot(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), rgb, size)

    def text(self, x: int, y: int, s: str, rgb=(0, 0, 0), scale: int = 2) -> None:
        for c in s.upper():
            for r, bits in enumerate(_FONT.get(c, _FONT[" "])):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        self.dot(x + col * scale, y + r * scale, rgb, scale)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w])
                       for y in range(self.h))

        def chunk(kind, data):
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
        return (b"\x89PNG\r\n\x1a\n"
                + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))


def plot(path: str, title: str, xlabel: str, series: dict, width=800, height=500) -> None:
    """``series``: label -> (xs, ys). Writes ``path``."""
    c = Canvas(width, height)
    left, right, top, bottom = 70, 20, 40, 50
    xs = [x for xs_, _ in series.values() for x in xs_]
    ys = [y for _, ys_ in series.values() for y in ys_]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def at(x, y):
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom))
    c.line(left, top, left, height - bottom, (0, 0, 0))
    c.line(left, height - bottom, width - right, height - bottom, (0, 0, 0))
    c.text(left, 10, title)
    c.text(width // 2 - 4 * len(xlabel), height - 20, xlabel)
    c.text(4, height - bottom - 5, f"{y0:.2f}")
    c.text(4, top, f"{y1:.2f}")
    c.text(left, height - bottom + 8, f"{x0:g}")
    c.text(width - right - 8 * len(f"{x1:g}"), height - bottom + 8, f"{x1:g}")
    for i, (label, (sx, sy)) in enumerate(series.items()):
        rgb = COLORS[i % len(COLORS)]
        pts = [at(x, y) for x, y in zip(sx, sy)]
        for (a, b), (p, q) in zip(pts, pts[1:]):
            c.line(round(a), round(b), round(p), round(q), rgb, 2)
        c.line(width - 260, top + 10 + 18 * i, width - 230, top + 10 + 18 * i, rgb, 3)
        c.text(width - 222, top + 5 + 18 * i, label)
    with open(path, "wb") as f:
        f.write(c.png())
