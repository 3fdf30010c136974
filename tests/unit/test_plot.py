"""plot.py: inline SVG that parses, carries its hooks, shows what it was given, escapes text."""
import re
import xml.etree.ElementTree as ET

import pytest

from torch_watchdog.sidecar.present import plot

NS = "{http://www.w3.org/2000/svg}"
GIB = 2 ** 30


def parse(svg: str) -> ET.Element:
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    return ET.fromstring(svg)


def by_class(root: ET.Element, cls: str) -> list:
    return [e for e in root.iter() if cls in (e.get("class") or "").split()]


def texts(root: ET.Element) -> str:
    return " ".join(e.text or "" for e in root.iter())


def test_memory_chart_draws_the_line_marks_and_budget():
    points = [(0.0, 1.0 * GIB), (30.0, 1.5 * GIB), (60.0, 3.0 * GIB)]
    marks = [(5.0, "record"), (6.0, "record"), (7.0, "record"), (1.0, "compile"),
             (40.0, "recompile"), (50.0, "reload"), (59.0, "oom")]
    root = parse(plot.memory_chart(points, marks, budget=4 * GIB, title="server memory"))
    (line,) = by_class(root, "memory-line")
    assert len(line.get("points").split()) == 3
    assert len(by_class(root, "mark")) == len(marks)
    assert len(by_class(root, "mark-record")) == 3
    for kind in ("compile", "recompile", "reload", "oom"):
        assert len(by_class(root, f"mark-{kind}")) == 1
    assert len(by_class(root, "budget")) == 1
    assert root.get("aria-label") == "server memory" and root.find(f"{NS}title").text
    words = texts(root)
    assert "GiB" in words and "budget 4 GiB" in words
    assert "CUDA graph recorded ×3" in words and "out of memory ×1" in words  # the legend


def test_memory_chart_higher_memory_is_drawn_higher():
    root = parse(plot.memory_chart([(0, 100 << 20), (10, 900 << 20)]))
    (line,) = by_class(root, "memory-line")
    (_, y0), (_, y1) = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert y1 < y0  # SVG y grows downwards
    assert "MiB" in texts(root) and not by_class(root, "budget")


@pytest.mark.parametrize("span, unit", [(30, " s"), (1200, " min"), (5 * 3600, " h")])
def test_time_axis_uses_human_units(span, unit):
    root = parse(plot.memory_chart([(0, 1), (span, 2)]))
    assert re.search(r"\d" + unit, texts(root))


def test_empty_inputs_say_so():
    root = parse(plot.memory_chart([]))
    assert "no memory samples yet" in texts(root) and not by_class(root, "memory-line")
    root = parse(plot.histogram({}))
    assert "no shapes" in texts(root) and not by_class(root, "bar")
    assert not by_class(parse(plot.histogram({5: 0})), "bar")


def test_text_is_escaped():
    evil = '<script>alert("x")</script> & "quotes"'
    for svg in (plot.memory_chart([(0, 1), (1, 2)], [(0.5, "recompile")], title=evil),
                plot.histogram({3: 1}, title=evil), plot.memory_chart([], title=evil)):
        root = parse(svg)
        assert "<script" not in svg and not [e for e in root.iter() if e.tag.endswith("script")]
        assert root.get("aria-label") == evil and root.find(f"{NS}title").text == evil


def test_unknown_mark_kind_is_still_drawn_and_escaped():
    root = parse(plot.memory_chart([(0, 1), (1, 2)], [(0.5, 'x"<y')]))
    (mark,) = by_class(root, "mark")
    assert mark.get("class") == 'mark mark-x"<y'


def test_histogram_bars_cover_every_request_and_boundaries_are_drawn():
    counts = {32: 5, 64: 3, 100: 1}
    root = parse(plot.histogram(counts, boundaries=[64, 128], title="seq_len"))
    bars = by_class(root, "bar")
    assert len(bars) == 3
    assert sorted(int(b.find(f"{NS}title").text.split(": ")[1].split()[0]) for b in bars) \
        == [1, 3, 5]
    assert len(by_class(root, "boundary")) == 2
    heights = {b.find(f"{NS}title").text.split(":")[0]: float(b.get("height")) for b in bars}
    assert heights["32"] > heights["64"] > heights["100"]


def test_histogram_bins_wide_ranges_into_at_most_about_100_bars():
    counts = {size: 1 for size in range(1, 20_001)}
    root = parse(plot.histogram(counts, boundaries=[512, 20_000]))
    bars = by_class(root, "bar")
    assert 50 <= len(bars) <= 100
    total = sum(int(b.find(f"{NS}title").text.split(": ")[1].split()[0]) for b in bars)
    assert total == 20_000  # binning loses no request


def test_human_units_never_print_an_exponent():
    from torch_watchdog.sidecar.present.plot import human_bytes, human_duration
    assert human_bytes(1010 * 2 ** 20) == "0.986 GiB" and human_bytes(941236224) == "898 MiB"
    assert human_duration(200_000) == "2.31 d" and human_duration(75_580) == "21 h"
    for n in (999.6 * 2 ** 20, 1023.9 * 2 ** 30, 3e15, 1e9 * 86400):
        assert "e+" not in human_bytes(n) + human_duration(n)


def test_budget_steps_start_when_the_budget_applied():
    mib = 2 ** 20
    points = [(float(t), (400 + t) * mib) for t in range(100)]
    root = parse(plot.memory_chart(points, budget=[(55.0, 1010 * mib)]))
    (line,) = by_class(root, "budget")
    start_x = float(line.get("d")[1:].split(",")[0])
    (memory,) = by_class(root, "memory-line")
    xs = [float(p.split(",")[0]) for p in memory.get("points").split()]
    assert start_x == pytest.approx(xs[55], abs=0.5)   # not from the left edge
    assert "budget 0.986 GiB" in texts(root)


def test_histogram_axis_names_what_it_counts():
    root = parse(plot.histogram({8: 1, 16: 2}, unit="distinct shapes"))
    assert "distinct shapes per size" in texts(root) and "requests" not in texts(root)
