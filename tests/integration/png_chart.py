"""A dependency-free PNG bar chart (zlib + struct), so the peak-memory chart always exists.

One horizontal bar group per label, one bar per series, value printed after each
bar, text drawn with a built-in 5x7 pixel font (upper case, digits, a few signs).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

# One glyph per line: the character, a space, then 7 rows of 5 bits as 2 hex digits each.
_FONT_TABLE = """\
A 0E11111F111111
B 1E11111E11111E
C 0E11101010110E
D 1C12111111121C
E 1F10101E10101F
F 1F10101E101010
G 0E11101711110F
H 1111111F111111
I 0E04040404040E
J 0702020202120C
K 11121418141211
L 1010101010101F
M 111B1515111111
N 11111915131111
O 0E11111111110E
P 1E11111E101010
Q 0E11111115120D
R 1E11111E141211
S 0F10100E01011E
T 1F040404040404
U 1111111111110E
V 11111111110A04
W 1111111515150A
X 11110A040A1111
Y 1111110A040404
Z 1F01020408101F
0 0E11131519110E
1 040C040404040E
2 0E11010204081F
3 1F02040201110E
4 02060A121F0202
5 1F101E0101110E
6 0608101E11110E
7 1F010204080808
8 0E11110E11110E
9 0E11110F01020C
_ 0000000000001F
- 0000001F000000
. 00000000000C0C
, 000000000C0408
( 02040808080402
) 08040202020408
/ 00010204081000
: 000C0C000C0C00
% 18190204081303
= 00001F001F0000
"""


def _parse_font(table: str) -> dict[str, tuple[int, ...]]:
    font = {" ": (0,) * 7}
    for line in table.splitlines():
        char, hexrows = line[0], line[2:]
        if len(hexrows) != 14:
            raise ValueError(f"font glyph {char!r} needs 14 hex digits, got {hexrows!r}")
        font[char] = tuple(int(hexrows[i:i + 2], 16) for i in range(0, 14, 2))
    return font


FONT = _parse_font(_FONT_TABLE)
SCALE = 2                      # each font pixel is SCALE x SCALE
CHAR_W = 6 * SCALE             # 5 columns + 1 spacing
CHAR_H = 7 * SCALE
COLORS = [(66, 133, 244), (244, 160, 0), (15, 157, 88), (219, 68, 55)]
WHITE, BLACK, GRAY = (255, 255, 255), (0, 0, 0), (200, 200, 200)


class Canvas:
    """An RGB pixel buffer with rectangle and text drawing, encodable as PNG."""

    def __init__(self, width: int, height: int, background: tuple[int, int, int] = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x: int, y: int, w: int, h: int, color: tuple[int, int, int]) -> None:
        """Fill a rectangle, clipped to the canvas."""
        x0, y0, x1, y1 = max(0, x), max(0, y), min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0:
            return
        row = bytes(color) * (x1 - x0)
        for yy in range(y0, y1):
            start = (yy * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = BLACK) -> None:
        """Draw `s` upper-cased (characters without a glyph are blank) with its top-left at (x, y)."""
        for i, ch in enumerate(s.upper()):
            rows = FONT.get(ch, FONT[" "])
            for r, bits in enumerate(rows):
                for c in range(5):
                    if bits & (0x10 >> c):
                        self.rect(x + i * CHAR_W + c * SCALE, y + r * SCALE, SCALE, SCALE, color)

    def png(self) -> bytes:
        """The canvas as PNG bytes (8-bit RGB, no filtering)."""
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def bar_chart_png(title: str, labels: list[str], series: dict[str, list[float | None]], unit: str,
                  bar_width: int = 480) -> bytes:
    """A horizontal grouped bar chart: for each label, one bar per series (None = no bar)."""
    names = list(series)
    values = [v for vs in series.values() for v in vs if v is not None]
    top = max(values, default=0.0) or 1.0
    bar_h, gap, pad = CHAR_H + 2, 10, 10
    label_w = max((len(s) for s in labels), default=1) * CHAR_W + pad
    value_w = 12 * CHAR_W
    group_h = len(names) * bar_h + gap
    legend_h = CHAR_H + pad
    width = pad + label_w + bar_width + value_w + pad
    height = pad + CHAR_H + pad + legend_h + len(labels) * group_h + pad
    canvas = Canvas(width, height)
    canvas.text(pad, pad, title)
    y = pad + CHAR_H + pad
    x = pad
    for k, name in enumerate(names):
        canvas.rect(x, y + 2, 10, 10, COLORS[k % len(COLORS)])
        canvas.text(x + 14, y, name)
        x += 14 + (len(name) + 2) * CHAR_W
    y += legend_h
    x0 = pad + label_w
    canvas.rect(x0 - 1, y, 1, len(labels) * group_h, GRAY)
    for i, label in enumerate(labels):
        gy = y + i * group_h
        canvas.text(pad, gy + (len(names) * bar_h - CHAR_H) // 2, label)
        for k, name in enumerate(names):
            v = series[name][i]
            if v is None:
                continue
            w = max(1, round(bar_width * v / top))
            canvas.rect(x0, gy + k * bar_h, w, bar_h - 2, COLORS[k % len(COLORS)])
            canvas.text(x0 + w + 4, gy + k * bar_h, f"{v:.2f} {unit}")
    return canvas.png()


def write_bar_chart(path: Path, title: str, labels: list[str], series: dict[str, list[float | None]],
                    unit: str) -> Path:
    """Write `bar_chart_png(...)` to `path` and return it."""
    path = Path(path)
    path.write_bytes(bar_chart_png(title, labels, series, unit))
    return path
