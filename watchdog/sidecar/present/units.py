"""One way to write sizes, durations and times, for every surface: the status page, `status`,
the chart and the report. The same number must read the same everywhere (a budget read
21.9 GiB in `status`, 22 GiB on the page and 22.5 GiB in the report).

Sizes in binary units (KiB, MiB, GiB, like the chart and nvidia-smi), three significant
digits, never four digits of a unit (0.986 GiB, not 1,010 MiB) and never an exponent;
durations in the largest unit with the next one while it matters (42.5 s, 1 min 5 s,
12 min, 1 h 30 min, 21 h, 3.2 d); times of day as the sidecar's host's local
clock, HH:MM:SS. Unknown values are "?".
"""
from __future__ import annotations

import time
from typing import Optional

UNKNOWN = "?"
_BYTE_UNITS = (("B", 1), ("KiB", 1024), ("MiB", 2 ** 20), ("GiB", 2 ** 30), ("TiB", 2 ** 40))


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return UNKNOWN
    for name, div in _BYTE_UNITS:
        value = n / div
        if abs(float(f"{value:.3g}")) < 1000 or name == "TiB":
            if name == "B":
                return f"{n:.0f} B"
            return f"{value:,.0f} {name}" if abs(value) >= 1000 else f"{value:.3g} {name}"
    return f"{n:.0f} B"  # unreachable: TiB takes every larger value


def fmt_mb(mb: Optional[float]) -> str:
    """A size the core keeps in decimal MB (per graph, the causes' details), as shown."""
    return fmt_bytes(None if mb is None else mb * 1e6)


def fmt_duration(s: Optional[float]) -> str:
    if s is None:
        return UNKNOWN
    sign, s = ("-" if s < 0 else ""), abs(s)
    if s < 59.95:  # what .3g would round to 60 s reads as a minute
        return f"{sign}{s:.3g} s"
    whole = round(s)
    if whole < 600:  # minutes and seconds while the seconds still matter: 1 min 5 s
        return sign + _two(whole // 60, "min", whole % 60, "s")
    if whole < 3600 - 30:
        return f"{sign}{round(s / 60)} min"
    minutes = round(s / 60)
    if minutes < 600:  # hours and minutes up to 10 h: 1 h 30 min
        return sign + _two(minutes // 60, "h", minutes % 60, "min")
    if s < 2 * 86400:
        return f"{sign}{round(s / 3600)} h"
    return f"{sign}{s / 86400:,.0f} d" if s >= 1000 * 86400 else f"{sign}{s / 86400:.3g} d"


def _two(big: int, big_unit: str, small: int, small_unit: str) -> str:
    return f"{big} {big_unit}" + (f" {small} {small_unit}" if small else "")


def fmt_clock(t: Optional[float]) -> str:
    return "--:--:--" if not t else time.strftime("%H:%M:%S", time.localtime(t))


def counted(n: int, word: str) -> str:
    """"1 compile", "2 compiles", "1,990 compiles": a count and its noun."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def fmt_share(part: Optional[float], whole: Optional[float]) -> str:
    """`part` as a share of `whole`: "97 %"; "?" when either is unknown."""
    if part is None or not whole:
        return UNKNOWN
    return f"{100 * part / whole:.0f} %"
