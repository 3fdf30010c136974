"""Inline-SVG charts (memory over time, shape histogram): pure, stdlib only, no script.

Every function returns one self-contained `<svg>` string with a `<title>` and an aria-label,
all text escaped, and stable class hooks for tests and screenshots: `memory-line`,
`mark mark-<kind>`, `budget`, `bar`, `boundary`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Union
from xml.sax.saxutils import escape, quoteattr

from torch_watchdog.sidecar.present.units import fmt_bytes, fmt_duration

# what each mark kind means on the time axis, and its colour (colour-blind-safe palette)
MARK_STYLE = {
    "record": ("CUDA graph recorded", "#0072b2"),
    "compile": ("compile", "#009e73"),
    "recompile": ("recompile", "#e69f00"),
    "recompile_limit": ("recompile limit: eager", "#cc79a7"),
    "reload": ("reload", "#56b4e9"),
    "freeze": ("recording frozen", "#000000"),
    "oom": ("out of memory", "#d55e00"),
}
_MARGIN = (70, 20, 40, 44)  # left, right, top, bottom (room for axis labels and the legend)
_MAX_BINS = 100
_FONT = 'font-family="sans-serif" font-size="11"'


Budget = Union[float, Sequence[tuple[float, float]], None]


def memory_chart(points: Sequence[tuple[float, float]], marks: Sequence[tuple[float, str]] = (), *,
                 budget: Budget = None, width: int = 900, height: int = 300,
                 title: str = "", baseline: Optional[float] = None,
                 time_origin: Optional[float] = None, breaks: Sequence[float] = (),
                 budget_label: str = "budget") -> str:
    """Memory (bytes) over time (seconds) as a line, event marks along the time axis, and the
    budget as a dashed line: one value for the whole chart, or (t, bytes) steps, each from
    when it applied (a SIGHUP's new budget, other processes' memory on the GPU). With
    `baseline`, the growth above it ("+40 MiB"): a zoom for small growth on top of a large
    footprint (weights, a ballast). Time is labelled from `time_origin` (default: the first
    point or mark). `breaks`: times where the line stops and starts again (a reload's or a
    restart's new process: nothing was measured in between, and a line across the gap would
    draw memory that no process had); a point at or after a break starts a new stretch.
    `budget_label` names the dashed line (what it is when it is not the budget itself)."""
    title = title or "memory over time"
    if not points:
        return _empty(title, "no memory samples yet", width)
    pts = sorted(points)
    steps = _budget_steps(budget, pts[0][0])
    if baseline is not None:
        pts = [(t, max(0.0, v - baseline)) for t, v in pts]
        steps = [(t, v - baseline) for t, v in steps if v > baseline]
    times = [t for t, _ in pts] + [t for t, _ in marks]
    t0, t1 = min(times), max(times)
    top = max([v for _, v in pts] + [v for _, v in steps])
    y_unit, y_step = _byte_scale(top)
    y_max = max(y_step, math.ceil(top * 1.05 / y_step) * y_step)
    box = _Box(width, height, t0, t1 if t1 > t0 else t0 + 1.0, 0.0, y_max)
    parts = [_open(title, width, height), _time_axis(box, time_origin),
             _value_axis(box, y_unit, y_step, "" if baseline is None else "+")]
    if steps:
        parts += _budget_line(box, steps, "" if baseline is None else "+", budget_label)
    for stretch in _stretches(pts, breaks):
        line = " ".join(f"{box.x(t):.1f},{box.y(v):.1f}" for t, v in stretch)
        # 2 px: a flat stretch then always covers one pixel row fully, whatever its y (1.5 px
        # between two rows rendered as two light-grey rows: no line in a screenshot)
        parts.append(f'<polyline class="memory-line" fill="none" stroke="#333" '
                     f'stroke-width="2" points="{line}"/>')
    parts.extend(_marks(box, marks))
    parts.append(_legend(box, marks))
    parts.append("</svg>")
    return "".join(parts)


def _stretches(pts: list[Any], breaks: Sequence[float]) -> list[list[Any]]:
    """The sorted points cut before the first point at or after each break."""
    out: list[list[Any]] = [[]]
    cuts = sorted(breaks)
    i = 0
    for t, v in pts:
        while i < len(cuts) and cuts[i] <= t:
            if out[-1]:
                out.append([])
            i += 1
        out[-1].append((t, v))
    return out


def _budget_steps(budget: Budget, start: float) -> list[tuple[float, float]]:
    if budget is None:
        return []
    if isinstance(budget, (int, float)):
        return [(start, float(budget))] if budget > 0 else []
    return sorted((float(t), float(v)) for t, v in budget if v > 0)


def _budget_line(box: "_Box", steps: list[Any], sign: str, label: str) -> list[str]:
    """The budget as a dashed step line from its first step (when it applied) to the right
    edge, labelled with its last value."""
    x0 = max(box.left, box.x(steps[0][0]))
    path = [f"M{x0:.1f},{box.y(steps[0][1]):.1f}"]
    for t, v in steps[1:]:
        x = max(box.left, box.x(t))
        path.append(f"H{x:.1f}V{box.y(v):.1f}")
    path.append(f"H{box.right}")
    last = steps[-1][1]
    return [f'<path class="budget" fill="none" d="{"".join(path)}" stroke="#d55e00" '
            f'stroke-dasharray="6 4"><title>{label} {sign}{human_bytes(last)}</title></path>',
            _text(box.right - 4, box.y(last) - 4, f"{label} {sign}{human_bytes(last)}", "end",
                  "#d55e00")]


def histogram(counts: Mapping[int, int], *, boundaries: Sequence[int] = (), width: int = 900,
              height: int = 220, title: str = "", unit: str = "requests") -> str:
    """`unit` (requests, distinct shapes …) per size as bars (at most ~100 bins); suggested
    bucket boundaries as vertical lines. The count axis is labelled with `unit`."""
    title = title or f"{unit} per size"
    sizes = [s for s, c in counts.items() if c > 0]
    if not sizes:
        return _empty(title, "no shapes", width)
    lo, hi = min(sizes), max(sizes + list(boundaries))
    bin_w = max(1, math.ceil((hi - lo + 1) / _MAX_BINS))
    if bin_w > 1:  # each bar is a range of sizes: the title says how wide
        title = title.replace(" per size", f" per {bin_w} sizes")
    bins: dict[int, int] = {}
    for size, n in counts.items():
        if n > 0:
            start = lo + (size - lo) // bin_w * bin_w
            bins[start] = bins.get(start, 0) + n
    box = _Box(width, height, lo, lo + math.ceil((hi - lo + 1) / bin_w) * bin_w, 0.0,
               max(bins.values()) * 1.1)
    parts = [_open(title, width, height), _size_axis(box), _count_axis(box, unit)]
    for start, n in sorted(bins.items()):
        x0, x1, y = box.x(start), box.x(start + bin_w), box.y(n)
        label = f"{start}" if bin_w == 1 else f"{start}–{start + bin_w - 1}"
        parts.append(f'<rect class="bar" x="{x0:.1f}" y="{y:.1f}" '
                     f'width="{max(1.0, x1 - x0 - 1):.1f}" height="{box.bottom - y:.1f}" '
                     f'fill="#0072b2"><title>'
                     f'{escape(label)}: {n} {escape(unit)}</title></rect>')
    for b in boundaries:
        x = box.x(b + 0.5 if bin_w == 1 else b)
        parts.append(f'<line class="boundary" x1="{x:.1f}" x2="{x:.1f}" y1="{box.top}" '
                     f'y2="{box.bottom}" stroke="#d55e00" stroke-dasharray="3 3">'
                     f'<title>bucket boundary {int(b)}</title></line>')
    parts.append("</svg>")
    return "".join(parts)


class _Box:
    """The plot area and the data → pixel mapping."""

    def __init__(self, width: int, height: int, x0: float, x1: float, y0: float, y1: float):
        self.left, self.right = _MARGIN[0], width - _MARGIN[1]
        self.top, self.bottom = _MARGIN[2], height - _MARGIN[3]
        self.x0, self.x1, self.y0, self.y1 = x0, x1, y0, (y1 if y1 > y0 else y0 + 1.0)

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def y(self, v: float) -> float:
        return self.bottom - (v - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)


def _open(title: str, width: int, height: int) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label={quoteattr(title)}>'
            f'<title>{escape(title)}</title>'
            f'<text x="{_MARGIN[0]}" y="16" font-family="sans-serif" font-size="13" '
            f'font-weight="bold">{escape(title)}</text>')


def _empty(title: str, message: str, width: int) -> str:
    return (_open(title, width, 60) + _text(width / 2, 40, message, "middle", "#666")
            + "</svg>")


def _text(x: float, y: float, s: str, anchor: str = "start", fill: str = "#333") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}" {_FONT}>'
            f'{escape(s)}</text>')


def _axis_line(box: _Box) -> str:
    return (f'<path class="axis" fill="none" stroke="#999" d="M{box.left},{box.top} '
            f'V{box.bottom} H{box.right}"/>')


def _time_axis(box: _Box, origin: Optional[float] = None) -> str:
    """Ticks labelled in time since `origin` (default: the left edge)."""
    origin = box.x0 if origin is None else origin
    span = box.x1 - box.x0
    unit, div = ("h", 3600.0) if span >= 3 * 3600 else ("min", 60.0) if span >= 180 else ("s", 1.0)
    step = _nice_step(span / div / 6) * div
    parts = [_axis_line(box)]
    k = math.ceil((box.x0 - origin) / step - 1e-9)
    while origin + k * step <= box.x1 + 1e-9:
        x = box.x(origin + k * step)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{box.bottom}" y2="{box.bottom + 4}" '
                     f'stroke="#999"/>')
        parts.append(_text(x, box.bottom + 15, f"{_num(k * step / div)} {unit}", "middle"))
        k += 1
    return "".join(parts)


def _value_axis(box: _Box, unit: tuple[str, float], step: float, sign: str = "") -> str:
    name, div = unit
    parts = []
    k = 0
    while k * step <= box.y1 + 1e-9:
        y = box.y(k * step)
        parts.append(f'<line x1="{box.left}" x2="{box.right}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#eee"/>')
        parts.append(_text(box.left - 6, y + 4, f"{sign if k else ''}{_num(k * step / div)} {name}",
                           "end"))
        k += 1
    return "".join(parts)


def _size_axis(box: _Box) -> str:
    span = box.x1 - box.x0
    step = max(1, int(_nice_step(span / 8)))
    parts = [_axis_line(box)]
    first = math.ceil(box.x0 / step) * step
    for v in range(int(first), int(box.x1) + 1, step):
        parts.append(_text(box.x(v), box.bottom + 15, str(v), "middle"))
    parts.append(_text(box.right, box.bottom + 30, "size", "end", "#666"))
    return "".join(parts)


def _count_axis(box: _Box, unit: str) -> str:
    step = _nice_step(box.y1 / 4)
    parts = []
    k = 0
    while k * step <= box.y1:
        y = box.y(k * step)
        parts.append(f'<line x1="{box.left}" x2="{box.right}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#eee"/>')
        parts.append(_text(box.left - 6, y + 4, _num(k * step), "end"))
        k += 1
    parts.append(_text(box.left - 6, box.top - 6, unit, "start" if len(unit) > 9 else "end",
                       "#666"))
    return "".join(parts)


def _marks(box: _Box, marks: Sequence[tuple[float, str]]) -> list[str]:
    out = []
    for t, kind in marks:
        label, colour = MARK_STYLE.get(kind, (kind, "#666"))
        x = box.x(t)
        # rare, and the ones that matter
        big = kind in ("oom", "reload", "freeze", "recompile_limit")
        y0 = box.top if big else box.bottom - 10
        out.append(f'<line class={quoteattr("mark mark-" + kind)} x1="{x:.1f}" x2="{x:.1f}" '
                   f'y1="{y0}" y2="{box.bottom}" stroke="{colour}" '
                   f'stroke-width="{2 if big else 1}"><title>{escape(label)} at '
                   f'{escape(human_duration(t - box.x0))}</title></line>')
    return out


def _legend(box: _Box, marks: Sequence[tuple[float, str]]) -> str:
    counts: dict[str, int] = {}
    for _, kind in marks:
        counts[kind] = counts.get(kind, 0) + 1
    parts, x = ['<g class="legend">'], float(box.left)
    for kind in sorted(counts, key=lambda k: (list(MARK_STYLE).index(k) if k in MARK_STYLE
                                               else len(MARK_STYLE), k)):
        label, colour = MARK_STYLE.get(kind, (kind, "#666"))
        text = f"{label} ×{counts[kind]}"
        parts.append(f'<rect x="{x:.1f}" y="{box.bottom + 24}" width="10" height="10" '
                     f'fill="{colour}"/>')
        parts.append(_text(x + 14, box.bottom + 33, text))
        x += 24 + 6.5 * len(text)
    parts.append("</g>")
    return "".join(parts)


def _byte_scale(top: float) -> tuple[tuple[str, float], float]:
    """The unit to label the value axis in, and a round step giving ~4–8 grid lines."""
    unit = ("GiB", 2.0 ** 30) if top >= 2 ** 30 else ("MiB", 2.0 ** 20) if top >= 2 ** 20 \
        else ("KiB", 1024.0) if top >= 1024 else ("B", 1.0)
    return unit, _nice_step(max(top, 1.0) / unit[1] / 5) * unit[1]


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    mag: float = 10 ** math.floor(math.log10(raw))  # an int from 1 up: ticks print as ints
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-6 else f"{v:.3g}"


# the one rule for sizes and durations (units.py), under the names the chart's callers use
human_bytes = fmt_bytes
human_duration = fmt_duration
