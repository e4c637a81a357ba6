"""A grouped horizontal bar chart written as a PNG, with the standard library only.

The benchmark command draws its results with this; eqfuse does not depend on matplotlib
or PIL, so the chart carries its own PNG encoder and a 5x7 bitmap font.

    bar_chart_png("bench.png", "RMSNorm, median time", ["4096x4096 fp16", "8192x1024 bf16"],
                  {"eager": [41.2, 20.3], "torch.compile": [22.0, 11.5], "eqfuse": [20.4, 10.9]})

One block of bars per group (workload), one colour per series (contender), each bar
labelled with its value; a missing value (None) draws "n/a" instead of a bar.
``render_chart`` returns the picture in memory, ``encode_png`` turns any RGB canvas into
PNG bytes.
"""

from __future__ import annotations

import math
import struct
import zlib

# --- the font ---------------------------------------------------------------------------
# 5x7 glyphs, one line per character: the character, then its rows top to bottom as hex,
# bit 4 (0x10) the leftmost column. After the HD44780 character ROM. Letters with a
# descender (g j p q y , ;) have an 8th row, drawn below the line; the space is added below.
GLYPH_W, GLYPH_H = 5, 7
_FONT_TABLE = r"""
! 04 04 04 04 04 00 04
" 0a 0a 0a 00 00 00 00
# 0a 0a 1f 0a 1f 0a 0a
$ 04 0f 14 0e 05 1e 04
% 18 19 02 04 08 13 03
& 0c 12 14 08 15 12 0d
' 04 04 08 00 00 00 00
( 02 04 08 08 08 04 02
) 08 04 02 02 02 04 08
* 00 04 15 0e 15 04 00
+ 00 04 04 1f 04 04 00
, 00 00 00 00 00 0c 04 08
- 00 00 00 1f 00 00 00
. 00 00 00 00 00 0c 0c
/ 00 01 02 04 08 10 00
0 0e 11 13 15 19 11 0e
1 04 0c 04 04 04 04 0e
2 0e 11 01 02 04 08 1f
3 1f 02 04 02 01 11 0e
4 02 06 0a 12 1f 02 02
5 1f 10 1e 01 01 11 0e
6 06 08 10 1e 11 11 0e
7 1f 01 02 04 08 08 08
8 0e 11 11 0e 11 11 0e
9 0e 11 11 0f 01 02 0c
: 00 0c 0c 00 0c 0c 00
; 00 0c 0c 00 0c 0c 04 08
< 02 04 08 10 08 04 02
= 00 00 1f 00 1f 00 00
> 08 04 02 01 02 04 08
? 0e 11 01 02 04 00 04
@ 0e 11 01 0d 15 15 0e
A 0e 11 11 11 1f 11 11
B 1e 11 11 1e 11 11 1e
C 0e 11 10 10 10 11 0e
D 1c 12 11 11 11 12 1c
E 1f 10 10 1e 10 10 1f
F 1f 10 10 1e 10 10 10
G 0e 11 10 17 11 11 0f
H 11 11 11 1f 11 11 11
I 0e 04 04 04 04 04 0e
J 07 02 02 02 02 12 0c
K 11 12 14 18 14 12 11
L 10 10 10 10 10 10 1f
M 11 1b 15 15 11 11 11
N 11 11 19 15 13 11 11
O 0e 11 11 11 11 11 0e
P 1e 11 11 1e 10 10 10
Q 0e 11 11 11 15 12 0d
R 1e 11 11 1e 14 12 11
S 0f 10 10 0e 01 01 1e
T 1f 04 04 04 04 04 04
U 11 11 11 11 11 11 0e
V 11 11 11 11 11 0a 04
W 11 11 11 15 15 15 0a
X 11 11 0a 04 0a 11 11
Y 11 11 11 0a 04 04 04
Z 1f 01 02 04 08 10 1f
[ 0e 08 08 08 08 08 0e
\ 00 10 08 04 02 01 00
] 0e 02 02 02 02 02 0e
^ 04 0a 11 00 00 00 00
_ 00 00 00 00 00 00 1f
` 08 04 02 00 00 00 00
a 00 00 0e 01 0f 11 0f
b 10 10 16 19 11 11 1e
c 00 00 0e 10 10 11 0e
d 01 01 0d 13 11 11 0f
e 00 00 0e 11 1f 10 0e
f 06 09 08 1c 08 08 08
g 00 00 0f 11 11 0f 01 0e
h 10 10 16 19 11 11 11
i 04 00 0c 04 04 04 0e
j 02 00 06 02 02 02 12 0c
k 10 10 12 14 18 14 12
l 0c 04 04 04 04 04 0e
m 00 00 1a 15 15 11 11
n 00 00 16 19 11 11 11
o 00 00 0e 11 11 11 0e
p 00 00 1e 11 11 1e 10 10
q 00 00 0f 11 11 0f 01 01
r 00 00 16 19 10 10 10
s 00 00 0e 10 0e 01 1e
t 08 08 1c 08 08 09 06
u 00 00 11 11 11 13 0d
v 00 00 11 11 11 0a 04
w 00 00 11 11 15 15 0a
x 00 00 11 0a 04 0a 11
y 00 00 11 11 11 0f 01 0e
z 00 00 1f 02 04 08 1f
{ 02 04 04 08 04 04 02
| 04 04 04 04 04 04 04
} 08 04 04 02 04 04 08
~ 00 00 08 15 02 00 00
"""
FONT: dict[str, tuple[int, ...]] = {" ": ()}
for _line in _FONT_TABLE.strip("\n").splitlines():
    FONT[_line[0]] = tuple(int(row, 16) for row in _line[2:].split())
# Characters the font lacks (non-ASCII, say) show as a box, so they are visibly missing.
_BOX = (0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F)

# --- layout and colours -----------------------------------------------------------------
WIDTH = 1200
TEXT_SCALE = 2  # 5x7 pixels is too small to read at 1:1 on a 1200 px wide chart
TITLE_SCALE = 3
CHAR_H = GLYPH_H * TEXT_SCALE
MARGIN = 20
BAR_H, BAR_GAP, GROUP_GAP = 20, 4, 20
SWATCH = CHAR_H

WHITE = (255, 255, 255)
TEXT = (40, 40, 40)
FAINT = (150, 150, 150)  # "n/a", tick labels
GRID = (228, 228, 228)
AXIS = (90, 90, 90)
# Series colours, in order (Tableau 10): distinct from each other and from the greys above.
SERIES_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
                  (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207)]


class Image:
    """An RGB canvas: ``pixels`` holds width * height * 3 bytes, row after row."""

    def __init__(self, width: int, height: int, background=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill_rect(self, x: int, y: int, w: int, h: int, colour) -> None:
        """Fill the rectangle, clipped to the canvas."""
        x0, y0 = max(x, 0), max(y, 0)
        x1, y1 = min(x + w, self.width), min(y + h, self.height)
        if x0 >= x1 or y0 >= y1:
            return
        run = bytes(colour) * (x1 - x0)
        for row in range(y0, y1):
            start = (row * self.width + x0) * 3
            self.pixels[start:start + len(run)] = run

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i:i + 3])


def text_width(text: str, scale: int = TEXT_SCALE) -> int:
    """Width in pixels of ``text`` drawn by ``draw_text``: one blank column between glyphs."""
    return max(len(text) * (GLYPH_W + 1) * scale - scale, 0)


def draw_text(img: Image, x: int, y: int, text: str, colour=TEXT, scale: int = TEXT_SCALE) -> None:
    """Draw ``text`` with its top-left corner at (x, y)."""
    for ch in text:
        for r, bits in enumerate(FONT.get(ch, _BOX)):
            for c in range(GLYPH_W):
                if bits >> (GLYPH_W - 1 - c) & 1:
                    img.fill_rect(x + c * scale, y + r * scale, scale, scale, colour)
        x += (GLYPH_W + 1) * scale


# --- PNG --------------------------------------------------------------------------------
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    # Length, type, data, then the CRC of type and data (PNG spec, section 5.3).
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """PNG bytes for an 8-bit RGB picture given as width * height * 3 bytes, row after row."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"encode_png: {len(rgb)} bytes of pixels, expected {width}x{height}x3 = {width * height * 3}")
    stride = width * 3
    # Every scanline starts with its filter type; 0 (none) keeps the encoder trivial and
    # zlib still squeezes a chart's flat colours well.
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, colour type 2 = RGB
    return (PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))


# --- the chart --------------------------------------------------------------------------
def _validated(groups, series, normalise_to) -> None:
    if not groups:
        raise ValueError("bar chart: no groups to draw")
    if not series:
        raise ValueError("bar chart: no series to draw")
    if len(series) > len(SERIES_COLOURS):
        raise ValueError(f"bar chart: {len(series)} series, but only {len(SERIES_COLOURS)} colours to tell them apart")
    for name, values in series.items():
        if len(values) != len(groups):
            raise ValueError(f"bar chart: series {name!r} has {len(values)} values but there are "
                             f"{len(groups)} groups; give one value (or None) per group")
        for group, v in zip(groups, values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"bar chart: series {name!r}, group {group!r}: {v!r} is not a finite number")
            if v < 0:
                raise ValueError(f"bar chart: series {name!r}, group {group!r}: value {v} is negative; "
                                 "bar lengths must be >= 0")
    if normalise_to is not None and normalise_to not in series:
        raise ValueError(f"bar chart: normalise_to={normalise_to!r} is not one of the series {list(series)}")


def _speedups(series, reference):
    """Each value as a speedup over the reference series in the same group: ref / value.

    The values are times, so a contender twice as fast draws 2.00x. Where either time is
    missing, or zero (no finite ratio), the result is missing."""
    ref = series[reference]
    return {name: [r / v if r and v else None for r, v in zip(ref, values)]
            for name, values in series.items()}


def _fmt(v: float) -> str:
    # About three significant figures: 1234, 20.4, 3.07.
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _axis_ticks(top: float) -> list[float]:
    """Round tick values from 0 to at least ``top``: steps of 1, 2 or 5 times a power of ten."""
    top = top or 1.0  # all zeros: still draw an axis
    raw = top / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if raw <= m * mag * (1 + 1e-9))
    n = math.ceil(top / step - 1e-9)
    return [i * step for i in range(n + 1)]


def _fit(text: str, width: int) -> str:
    """``text`` cut short with ".." so that it is at most ``width`` pixels wide."""
    if text_width(text) <= width:
        return text
    keep = (width + TEXT_SCALE) // ((GLYPH_W + 1) * TEXT_SCALE) - 2
    return text[:max(keep, 0)] + ".."


def render_chart(title: str, groups: list[str], series: dict[str, list[float | None]], unit: str = "us",
                 normalise_to: str | None = None) -> Image:
    """The chart ``bar_chart_png`` writes, as an ``Image`` (its width and height are the PNG's)."""
    _validated(groups, series, normalise_to)
    if normalise_to is None:
        values, suffix, caption = series, "", unit
    else:
        values, suffix = _speedups(series, normalise_to), "x"
        caption = f"speedup over {normalise_to} (higher is better)"
    names = list(series)
    labels = {n: [None if v is None else _fmt(v) + suffix for v in vs] for n, vs in values.items()}
    char_w = (GLYPH_W + 1) * TEXT_SCALE

    # Legend: swatch and name per series, left to right, wrapping onto further rows.
    legend_y = MARGIN + GLYPH_H * TITLE_SCALE + 14
    legend, x, y = [], MARGIN, legend_y
    for name in names:
        w = SWATCH + 8 + text_width(name)
        if x > MARGIN and x + w > WIDTH - MARGIN:
            x, y = MARGIN, y + CHAR_H + 8
        legend.append((x, y, name))
        x += w + 3 * char_w

    # Columns: group labels | bars | room for the longest value label.
    label_w = min(max(text_width(g) for g in groups), int(WIDTH * 0.4))
    value_w = max([text_width(lbl) for ls in labels.values() for lbl in ls if lbl] + [text_width("n/a")]) + 10
    plot_x0 = MARGIN + label_w + 12
    plot_x1 = WIDTH - MARGIN - value_w
    plot_y0 = y + CHAR_H + 20
    block_h = len(names) * BAR_H + (len(names) - 1) * BAR_GAP
    plot_y1 = plot_y0 + 10 + len(groups) * block_h + (len(groups) - 1) * GROUP_GAP + 10
    height = plot_y1 + 8 + CHAR_H + 10 + CHAR_H + MARGIN

    img = Image(WIDTH, height)
    draw_text(img, MARGIN, MARGIN, title, TEXT, TITLE_SCALE)
    for x, y, name in legend:
        img.fill_rect(x, y, SWATCH, SWATCH, SERIES_COLOURS[names.index(name)])
        draw_text(img, x + SWATCH + 8, y, name)

    # The scale: the last tick is at the right end of the plot, and at least the longest bar.
    ticks = _axis_ticks(max((v for vs in values.values() for v in vs if v is not None), default=0))
    def to_x(v: float) -> int:
        return plot_x0 + round(v / ticks[-1] * (plot_x1 - plot_x0))

    # Grid first, so that the bars cover it.
    for t in ticks:
        tx = to_x(t)
        img.fill_rect(tx, plot_y0, 1, plot_y1 - plot_y0, GRID)
        img.fill_rect(tx, plot_y1, 1, 5, AXIS)
        tick = f"{t:g}"
        draw_text(img, tx - text_width(tick) // 2, plot_y1 + 8, tick, FAINT)
    if normalise_to is not None:  # the reference's own 1.00x, dashed
        for dy in range(plot_y0, plot_y1, 6):
            img.fill_rect(to_x(1.0), dy, 1, 3, AXIS)
    img.fill_rect(plot_x0, plot_y0, 1, plot_y1 - plot_y0, AXIS)
    img.fill_rect(plot_x0, plot_y1, plot_x1 - plot_x0 + 1, 1, AXIS)
    draw_text(img, (plot_x0 + plot_x1 - text_width(caption)) // 2, plot_y1 + 8 + CHAR_H + 10, caption, TEXT)

    text_dy = (BAR_H - CHAR_H) // 2  # centres text on a bar
    for gi, group in enumerate(groups):
        top = plot_y0 + 10 + gi * (block_h + GROUP_GAP)
        label = _fit(group, label_w)
        draw_text(img, plot_x0 - 12 - text_width(label), top + (block_h - CHAR_H) // 2, label)
        for si, name in enumerate(names):
            y, v = top + si * (BAR_H + BAR_GAP), values[name][gi]
            if v is None:
                draw_text(img, plot_x0 + 6, y + text_dy, "n/a", FAINT)
                continue
            end = to_x(v)
            img.fill_rect(plot_x0 + 1, y, end - plot_x0, BAR_H, SERIES_COLOURS[si])
            draw_text(img, end + 6, y + text_dy, labels[name][gi])
    return img


def bar_chart_png(path, title: str, groups: list[str], series: dict[str, list[float | None]], unit: str = "us",
                  normalise_to: str | None = None) -> None:
    """Write a grouped horizontal bar chart to the PNG file ``path``.

    ``groups``: one label per workload. ``series``: contender name -> one value per group,
    None where there is none (drawn as "n/a"). ``unit`` names the axis. ``normalise_to``:
    a series name; the values are then taken as times and drawn as speedups over that
    series (its time / each time), so the reference draws 1.00x.
    Raises ValueError for values that do not fit (wrong count, negative, not a number)."""
    img = render_chart(title, groups, series, unit, normalise_to)
    with open(path, "wb") as f:
        f.write(encode_png(img.width, img.height, img.pixels))
