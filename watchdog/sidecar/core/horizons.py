"""Growth read at every horizon from a minute to a day, and the time to the moment allocation
fails (pure).

- `History`: the memory's maximum per bucket, in tiers of coarser buckets for longer spans
  (1 s buckets over 2 min ... 12 min buckets over a day, TIER_BUCKETS each): memory bounded per
  server (6 x 130 buckets) for 24 h of 10 Hz polls, O(1) a poll.
- Per horizon H (HORIZONS, 1 min to 24 h), the points of the finest tier that holds H: the
  upper envelope from H's start (the running maximum, from the highest of H's first
  ENVELOPE_S or eighth: a sawtooth's troughs and a staircase's flats do not count, its peaks
  and steps do), less one-off steps (a rise over OUTLIER times the median rise: a model load,
  a KV pool). A horizon is read when the history covers it, its envelope rose at least
  MIN_RISES times over at least SPREAD_S (a sawtooth's first climb is a burst, not a trend),
  and the growth has not stopped (the silence since the last rise is at most PAUSE times the
  longest pause between rises before it: a staircase's flat or a burst's idle gap is a pause
  it has taken before; a plateau's silence outgrows them).
- `estimate`: the horizon whose straight line explains its envelope best (highest R^2, the
  longer on a near tie) decides: a staircase of sparse steps over a long horizon, a ramp that
  began an hour ago over the part since it began, growth that slows over its recent part. The
  rate is that line's slope, the step the median rise; at most RISE_BYTES where the polls saw
  fewer steps (a rise of RISE_BYTES over the highest of the LEVEL_S before it) than half the
  horizon's rises: a ramp in smaller increments, which a coarse tier's buckets sum into rises
  minutes wide, is no staircase, whatever one-off step it took.
- `seconds_to_fail`: to the first step that does not fit under the level where allocation
  fails (reaching it fails): the next step due after the median gap between steps (the
  expected time), or after their lower quartile (the earliest, which the policy acts on),
  then one step every step / rate.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import NamedTuple, Optional

HORIZONS = (60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0,
            86400.0)
TIER_S = (1.0, 5.0, 15.0, 60.0, 240.0, 720.0)   # bucket widths: 2 min ... 26 h of buckets
TIER_BUCKETS = 130
MIN_RISES = 3
OUTLIER = 8.0
MIN_R2 = 0.5          # a line explaining less of the envelope is no trend to forecast with
NEAR_TIE = 0.02       # R^2 this close: the longer horizon (more of the growth's history)
COVER = 0.9           # a horizon is read once the history spans this part of it
LEVEL_S = 30.0        # the level: the highest of this long (an allocator's cache comes back)
ENVELOPE_S = 30.0
RISE_BYTES = 1 << 20  # a rise of the envelope smaller than this is noise
SPREAD_S = 20.0       # the rises a horizon is read from span at least this long
PAUSE = 1.5           # a silence this many times the longest pause before: growth stopped
EVAL_S = 1.0          # an estimate a second of the observations' time is enough: the finest
                      # tier's buckets are a second wide


class History:
    """The memory's maximum per bucket, per tier (bounded), and the highest of LEVEL_S."""

    def __init__(self) -> None:
        self.tiers: list[deque[list[float]]] = [deque(maxlen=TIER_BUCKETS) for _ in TIER_S]
        self.first_t: Optional[float] = None
        self.last_t: Optional[float] = None
        # the latest polls that rose over the highest of the LEVEL_S before them: when the
        # steps came, to the poll (a coarse tier knows them only to its bucket, minutes wide)
        self.rise_times: deque[float] = deque(maxlen=TIER_BUCKETS)
        self._high: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        if self.first_t is None:
            self.first_t = t
        self.last_t = t
        high = self._high   # a monotonic deque: the highest of the last LEVEL_S
        while high and high[0][0] < t - LEVEL_S:
            high.popleft()
        if high and value > high[0][1] + RISE_BYTES:
            self.rise_times.append(t)
        while high and high[-1][1] <= value:
            high.pop()
        high.append((t, value))
        for width, tier in zip(TIER_S, self.tiers, strict=True):
            b = math.floor(t / width)
            if tier and tier[-1][0] == b:
                if value > tier[-1][1]:
                    tier[-1][1] = value
            else:
                tier.append([b, value])

    @property
    def last_rise_t(self) -> Optional[float]:
        """When the latest step came, to the poll."""
        return self.rise_times[-1] if self.rise_times else None

    def points(self, horizon: float) -> list[tuple[float, float]]:
        """[(bucket end time, max)] over the last `horizon`, from the finest tier holding it."""
        assert self.last_t is not None
        tier = _TIER_OF.get(horizon)
        if tier is None:
            tier = TIER_S.index(tier_width(horizon))
        width = TIER_S[tier]
        since, last = self.last_t - horizon, self.last_t
        return [(min((b + 1) * width, last), v) for b, v in self.tiers[tier]
                if (b + 1) * width > since]

    def level(self) -> Optional[float]:
        """The highest of the last LEVEL_S."""
        return self._high[0][1] if self._high else None


class Reading(NamedTuple):
    horizon: float
    rate: float          # bytes/s
    r2: float
    rises: int
    step: float          # the median rise: the size of the growth's allocations
    last_rise_t: float
    soon: float          # the lower quartile of the gaps between rises
    typical: float       # their median


def read_horizon(history: History, horizon: float) -> Optional[Reading]:
    """The growth over the last `horizon`, or None where it is not growth (see the module)."""
    if history.first_t is None or history.last_t is None \
            or history.last_t - history.first_t < COVER * horizon:
        return None
    pts = history.points(horizon)
    if len(pts) < 4:
        return None
    head = pts[0][0] + max(ENVELOPE_S, horizon / 8)
    kept = _rises(pts, head)
    if len(kept) < MIN_RISES:
        return None
    times = [t for t, _ in kept]
    if times[-1] - times[0] < SPREAD_S:
        return None
    pauses = [b - a for a, b in zip(times, times[1:], strict=False)]
    if history.last_t - times[-1] > PAUSE * max(pauses, default=0.0):
        return None
    line = _line(pts, head, kept)
    if line is None:
        return None
    gaps = sorted(pauses)
    step = statistics.median(r for _, r in kept)
    since = history.last_t - horizon
    if 2 * sum(t > since for t in history.rise_times) < len(kept):
        step = min(step, RISE_BYTES)   # the polls saw few of its steps: it grew by less each
    return Reading(horizon, line[0], line[1], len(kept), step, times[-1],
                   gaps[len(gaps) // 4] if gaps else math.inf,
                   statistics.median(gaps) if gaps else math.inf)


def _rises(pts: list[tuple[float, float]], head: float) -> list[tuple[float, float]]:
    """(t, rise) of the envelope after `head`, from the highest before it, less one-offs. A
    rise is counted once the envelope is RISE_BYTES over where the last one left it: growth
    in smaller increments adds up."""
    rises: list[tuple[float, float]] = []
    base = max(v for t, v in pts if t <= head)
    for t, v in pts:
        if t > head and v > base + RISE_BYTES:
            rises.append((t, v - base))
            base = v
    if len(rises) < MIN_RISES:
        return rises
    limit = OUTLIER * statistics.median(r for _, r in rises)
    return [(t, r) for t, r in rises if r <= limit]


def _line(pts: list[tuple[float, float]], head: float,
          kept: list[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """(slope, R^2) of the least-squares line through the envelope less its one-offs, at each
    point from `head` on; None where it does not rise. Two passes: epoch seconds squared
    would cancel in one."""
    env: list[tuple[float, float]] = []
    level, j = 0.0, 0
    for t, _ in pts:
        if t < head:
            continue
        while j < len(kept) and kept[j][0] <= t:
            level += kept[j][1]
            j += 1
        env.append((t, level))
    n = len(env)
    if n < 2:
        return None
    mt = sum(t for t, _ in env) / n
    mv = sum(v for _, v in env) / n
    sxx = sum((t - mt) ** 2 for t, _ in env)
    sxy = sum((t - mt) * (v - mv) for t, v in env)
    syy = sum((v - mv) ** 2 for _, v in env)
    if sxx <= 0 or syy <= 0 or sxy <= 0:
        return None
    return sxy / sxx, sxy * sxy / (sxx * syy)


def tier_width(horizon: float) -> float:
    """The bucket width of the finest tier that holds `horizon`."""
    return next((w for w in TIER_S if horizon / w <= TIER_BUCKETS - 2), TIER_S[-1])


# each horizon's tier (its index in TIER_S), worked out once: an estimate asks for every one
_TIER_OF = {h: TIER_S.index(tier_width(h)) for h in HORIZONS}
_HORIZON_WIDTHS = tuple((h, TIER_S[_TIER_OF[h]]) for h in HORIZONS)

Readings = dict[float, tuple[int, Optional[Reading]]]   # horizon -> (its bucket, its reading)


def estimate(history: History, readings: Optional[Readings] = None) -> Optional[Reading]:
    """The reading of the horizon that explains the recent growth best, or None. With
    `readings`, a horizon is read again only once its tier has a new bucket (a day's horizon
    every 12 min): a longer horizon's line moves with its buckets, and it costs the most."""
    best: Optional[Reading] = None
    for h, width in _HORIZON_WIDTHS:
        if readings is None or history.last_t is None:
            r = read_horizon(history, h)
        else:
            bucket = math.floor(history.last_t / width)
            kept = readings.get(h)
            if kept is None or kept[0] != bucket:
                kept = (bucket, read_horizon(history, h))
                readings[h] = kept
            r = kept[1]
        if r is None or r.r2 < MIN_R2:
            continue
        if best is None or r.r2 >= best.r2 - NEAR_TIE:
            best = r
    return best


def seconds_to_fail(reading: Reading, room: float, now: float,
                    last_rise_t: Optional[float] = None, share: float = 1.0,
                    expected: bool = False) -> float:
    """Seconds until the growth of `reading` (`share` of it lands here) takes the `room` left
    under the level where allocation fails: the steps that still fit, one every step / rate,
    after the next one is due: as soon as the lower quartile of the gaps between steps (the
    earliest), or `expected`, after their median. `last_rise_t`: the latest step, to the
    poll (History)."""
    rate, step = reading.rate * share, reading.step * share
    if rate <= 0 or step <= 0:
        return math.inf
    every = step / rate
    fit = max(0.0, math.ceil(room / step) - 1)   # the step reaching the fail level fails
    last = reading.last_rise_t
    if last_rise_t is not None and last_rise_t > last - TIER_S[-1]:
        last = last_rise_t
    due = max(0.0, last + min(every, reading.typical if expected else reading.soon) - now)
    return due + fit * every
