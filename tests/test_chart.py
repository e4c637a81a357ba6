"""eqfuse.chart: the PNG it writes is valid, bars are as long as their values, text draws, bad input is refused."""

import struct
import zlib

import pytest

from eqfuse.chart import (
    FONT,
    GLYPH_W,
    PNG_SIGNATURE,
    SERIES_COLOURS,
    WHITE,
    Image,
    bar_chart_png,
    draw_text,
    encode_png,
    render_chart,
    text_width,
)

GROUPS = ["RMSNorm 4096x4096 fp16", "Softmax 8192x1024 bf16"]
SERIES = {"eager": [41.2, 20.3], "torch.compile": [22.0, None], "eqfuse": [20.4, 10.9]}


def decode_png(data: bytes):
    """(width, height, rows of RGB bytes), checking what our encoder promises: CRCs, filter 0, RGB 8-bit."""
    assert data[:8] == PNG_SIGNATURE
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC on {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data)
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, *rest = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, rest) == (8, 2, [0, 0, 0])
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    stride = 1 + 3 * width
    assert all(raw[y * stride] == 0 for y in range(height)), "every row uses filter 0"
    return width, height, [raw[y * stride + 1:(y + 1) * stride] for y in range(height)]


def colour_runs(img: Image, colour) -> list[int]:
    """For each band of consecutive rows holding ``colour``, the most pixels of it on one row.

    Top to bottom: the legend swatch first, then one band per bar drawn in that colour."""
    runs, prev = [], False
    for y in range(img.height):
        count = sum(img.pixel(x, y) == colour for x in range(img.width))
        if count and not prev:
            runs.append(0)
        if count:
            runs[-1] = max(runs[-1], count)
        prev = bool(count)
    return runs


def test_png_file_is_valid_and_matches_the_rendered_image(tmp_path):
    path = tmp_path / "chart.png"
    bar_chart_png(path, "Median time", GROUPS, SERIES)
    width, height, rows = decode_png(path.read_bytes())
    img = render_chart("Median time", GROUPS, SERIES)
    assert (width, height) == (img.width, img.height) == (1200, img.height)
    assert b"".join(rows) == bytes(img.pixels)


def test_encode_png_round_trips_pixels():
    rgb = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30, 40, 50, 60, 70, 80, 90])  # 3x2
    assert decode_png(encode_png(3, 2, rgb)) == (3, 2, [rgb[:9], rgb[9:]])
    with pytest.raises(ValueError, match="expected 3x2x3"):
        encode_png(3, 2, rgb[:-1])


def test_height_grows_with_the_groups():
    small = render_chart("t", ["a"], {"s": [1.0]})
    big = render_chart("t", ["a", "b", "c", "d"], {"s": [1.0, 2.0, 3.0, 4.0]})
    assert big.width == small.width == 1200
    assert big.height > small.height


def test_bar_length_is_proportional_to_value():
    img = render_chart("t", ["a", "b", "c"], {"x": [3.0, 1.0, 2.0], "y": [6.0, 6.0, 6.0]})
    swatch, *bars = colour_runs(img, SERIES_COLOURS[0])
    assert len(bars) == 3
    assert abs(bars[0] - 3 * bars[1]) <= 2 and abs(bars[2] - 2 * bars[1]) <= 2
    # The second series is drawn on the same scale: 6 is twice 3.
    _, *ys = colour_runs(img, SERIES_COLOURS[1])
    assert all(abs(b - 2 * bars[0]) <= 2 for b in ys)


def test_missing_value_draws_no_bar():
    full = render_chart("t", ["a", "b"], {"x": [1.0, 2.0]})
    missing = render_chart("t", ["a", "b"], {"x": [1.0, None]})
    assert len(colour_runs(full, SERIES_COLOURS[0])) == 3  # swatch + two bars
    assert len(colour_runs(missing, SERIES_COLOURS[0])) == 2  # swatch + one bar
    # Same layout, so the difference is the missing bar (and its "n/a" in place of "2.00").
    assert missing.pixels != full.pixels


def test_normalise_to_draws_speedups():
    # Times: "fast" takes half the reference's time, so its bar is twice as long.
    img = render_chart("t", ["a"], {"ref": [4.0], "fast": [2.0]}, normalise_to="ref")
    _, ref_bar = colour_runs(img, SERIES_COLOURS[0])
    _, fast_bar = colour_runs(img, SERIES_COLOURS[1])
    assert abs(fast_bar - 2 * ref_bar) <= 2


def test_text_draws_pixels_within_its_width():
    img = Image(200, 40)
    draw_text(img, 10, 10, "RMSNorm 20.4x", scale=2)
    xs = [x for y in range(img.height) for x in range(img.width) if img.pixel(x, y) != WHITE]
    assert xs, "text drew nothing"
    assert min(xs) == 10 and max(xs) < 10 + text_width("RMSNorm 20.4x", 2)


def test_font_covers_printable_ascii_and_boxes_the_rest():
    assert all(chr(c) in FONT for c in range(32, 127))
    assert all(len(rows) in (0, 7, 8) and all(r < 1 << GLYPH_W for r in rows) for rows in FONT.values())
    # Distinct glyphs for the characters a chart label uses.
    used = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.,:;-_+x%()/=[]<>*#"
    assert len({FONT[c] for c in used}) == len(set(used))

    def ink(text):
        img = Image(30, 30)
        draw_text(img, 0, 0, text)
        return sum(img.pixels[i] != 255 for i in range(0, len(img.pixels), 3))

    assert ink(" ") == 0
    assert ink("µ") == 4 * 4 * 5  # the box: 2 rows of 5 and 5 rows of 2 pixels, each 2x2


def test_series_length_mismatch_is_refused():
    with pytest.raises(ValueError, match="'eqfuse' has 1 values but there are 2 groups"):
        render_chart("t", ["a", "b"], {"eager": [1.0, 2.0], "eqfuse": [1.0]})


def test_negative_and_non_numbers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="group 'b': value -1.0 is negative"):
        bar_chart_png(tmp_path / "x.png", "t", ["a", "b"], {"s": [1.0, -1.0]})
    with pytest.raises(ValueError, match="not a finite number"):
        render_chart("t", ["a"], {"s": [float("nan")]})
    with pytest.raises(ValueError, match="normalise_to='nope' is not one of the series"):
        render_chart("t", ["a"], {"s": [1.0]}, normalise_to="nope")
    assert not (tmp_path / "x.png").exists()
