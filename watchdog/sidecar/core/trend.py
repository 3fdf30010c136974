"""A server's memory samples and the growth rates of any recent window (pure).

The rates follow the memory's envelope, the highest reading of the last ENVELOPE_S: an
allocator that frees its cache and takes it back (a sawtooth) grows only when its peaks climb.
A step of the envelope above `jump_bytes` in one poll (a model load, a KV pool, a compile's
workspace, the first request of a new largest size) is left out, unless such steps form a
staircase: at least STAIR_STEPS of them, none more than STAIR_GAP_S after the one before,
spread over STAIR_SPREAD_S, within twice the window. An allocator serving a leak from 20 MiB
segments, or a server keeping large tensors, grows in such steps only. Even in a staircase a
step OUTLIER times its median is a one-off.

A rate is read over the window, its recent half, quarter and eighth: the eighth's where all
grow and the envelope rose at least MIN_RISES times (growth that speeds up is read from its
latest part; one allocator step is no trend), else none or the lowest fall (growth that
stopped is not growth). The growth outside recordings leaves out intervals ending within
SETTLE_S of a recording (a recording's memory shows in NVML up to a few polls after its event).
Prefix sums make each part two lookups; the steps are few, and kept apart.
"""
from __future__ import annotations

import array
import bisect
import collections
import math
from typing import NamedTuple, Optional

SETTLE_S = 2.0
LEAK_MIN_POINTS = 10      # intervals outside recordings needed to measure growth outside them
LEAK_MIN_FRACTION = 0.2   # … covering at least this part of the window
ENVELOPE_S = 30.0
SUSTAIN_S = 15.0          # `floor`: the lowest reading this long back (growth that lasts)
STAIR_STEPS = 3
STAIR_SPREAD_S = 30.0
STAIR_GAP_S = 20.0
OUTLIER = 8.0
PARTS = (1.0, 0.5, 0.25, 0.125)
MIN_RISES = 3             # rises of the envelope in the window, or it is not growing
MIN_SPAN = 1 / 6          # a rate needs this part of the window in samples (10 s of 60): a
                          # burst of first recordings is not a trend yet


class Step(NamedTuple):
    t: float
    size: float
    outside: bool   # outside recordings (counted in the growth outside them)


class Sums(NamedTuple):
    """Running sums from the first sample to one sample, over the envelope's changes but its
    steps: growth, and outside recordings (growth, seconds, intervals); and its rises."""
    growth: float = 0.0
    outside_growth: float = 0.0
    outside_seconds: float = 0.0
    outside_intervals: int = 0
    rises: int = 0


class _SumColumns:
    """The per-sample Sums, a column each: `[i]` gives one sample's Sums."""
    __slots__ = ("growth", "outside_growth", "outside_seconds", "outside_intervals", "rises")

    def __init__(self) -> None:
        self.growth, self.outside_growth, self.outside_seconds = (array.array("d"),
                                                                  array.array("d"),
                                                                  array.array("d"))
        self.outside_intervals, self.rises = array.array("q"), array.array("q")

    def __getitem__(self, i: int) -> Sums:
        return Sums(self.growth[i], self.outside_growth[i], self.outside_seconds[i],
                    self.outside_intervals[i], self.rises[i])

    def append(self, s: Sums) -> None:
        self.growth.append(s.growth)
        self.outside_growth.append(s.outside_growth)
        self.outside_seconds.append(s.outside_seconds)
        self.outside_intervals.append(s.outside_intervals)
        self.rises.append(s.rises)

    def keep_last(self, n: int) -> None:
        for col in (self.growth, self.outside_growth, self.outside_seconds,
                    self.outside_intervals, self.rises):
            del col[:-n]


class Trend:
    def __init__(self, jump_bytes: int = 16 << 20, maxlen: int = 36_000):
        self.jump_bytes = jump_bytes
        self.maxlen = maxlen
        # per sample, in columns of machine numbers (8 bytes a value, not a Python object
        # each: ~56 bytes a poll, not ~270; the values, and so every reading, are the same)
        self._t = array.array("d")
        self._sums = _SumColumns()
        self._records = array.array("q")                  # recordings so far, per sample
        self.steps: list[Step] = []                        # the envelope's steps up, in order
        self._last: Optional[tuple[float, float, int]] = None   # t, envelope, recordings
        self._changed = -math.inf                            # when recordings last changed
        self._high: collections.deque[tuple[float, int]] = collections.deque()  # max over time
        self._low: collections.deque[tuple[float, int]] = collections.deque()   # min over time

    @property
    def floor(self) -> Optional[int]:
        """The lowest memory of the last SUSTAIN_S: what a passing peak does not raise."""
        return self._low[0][1] if self._low else None

    def append(self, t: float, mem: int, records: int) -> None:
        """One poll: its time, the server's memory then, and the recordings so far."""
        high, low = self._high, self._low  # monotonic deques: the max and the min over time
        while high and high[-1][1] <= mem:
            high.pop()
        high.append((t, mem))
        while high[0][0] <= t - ENVELOPE_S:
            high.popleft()
        while low and low[-1][1] >= mem:
            low.pop()
        low.append((t, mem))
        while low[0][0] <= t - SUSTAIN_S:
            low.popleft()
        env = high[0][1]
        growth, out_growth, out_seconds, out_n, rises = self._sums[-1] if self._t else Sums()
        if self._last is not None:
            t0, e0, r0 = self._last
            if records != r0:
                self._changed = t
            change = env - e0
            outside = t > self._changed + SETTLE_S
            if change > self.jump_bytes:
                self.steps.append(Step(t, change, outside))
                change = 0.0
            elif change > 0:
                rises += 1
            growth += change
            if outside:
                out_growth += change
                out_seconds += t - t0
                out_n += 1
        self._last = (t, env, records)
        self._t.append(t)
        self._sums.append(Sums(growth, out_growth, out_seconds, out_n, rises))
        self._records.append(records)
        if len(self._t) > 2 * self.maxlen:  # amortised trim: keep the newest maxlen
            del self._t[:-self.maxlen]
            self._sums.keep_last(self.maxlen)
            del self._records[:-self.maxlen]
            first = self._t[0]
            self.steps = [s for s in self.steps if s.t > first]

    def counted_steps(self, since: float) -> list[Step]:
        """The steps that are growth, oldest first: the staircase the latest step ends (steps
        no more than STAIR_GAP_S apart, within twice the window from `since`), less its
        outliers; none when the steps are one-offs."""
        steps = self.steps
        if not steps or not self._t:
            return []
        horizon = since - (self._t[-1] - since)
        run = [steps[-1]]
        for step in reversed(steps[:-1]):
            if step.t <= horizon or run[-1].t - step.t > STAIR_GAP_S:
                break
            run.append(step)
        if len(run) < STAIR_STEPS or run[0].t - run[-1].t < STAIR_SPREAD_S:
            return []
        sizes = sorted(s.size for s in run)
        limit = OUTLIER * sizes[len(sizes) // 2]
        return [s for s in reversed(run) if s.size <= limit]

    def records_since(self, since: float) -> Optional[int]:
        """Recordings from the first sample at or after `since` to the last; None without."""
        i = bisect.bisect_left(self._t, since)
        return None if i >= len(self._t) else self._records[-1] - self._records[i]

    def first_record_since(self, since: float) -> Optional[float]:
        """The time of the first sample from `since` on whose recordings count has grown past
        the count at `since` (the span's first recording); None where none came."""
        i = bisect.bisect_left(self._t, since)
        if i >= len(self._t):
            return None
        k = bisect.bisect_right(self._records, self._records[i], lo=i)
        return self._t[k] if k < len(self._t) else None

    def outside_share(self, since: float) -> Optional[float]:
        """The part of the envelope's growth from `since` on (its steps too, less one-offs: a
        step over OUTLIER times the lower median step, or a lone one over OUTLIER times
        `jump_bytes`: a model load, a ballast) that came outside recordings; None where it
        did not grow."""
        t, sums = self._t, self._sums
        i = bisect.bisect_left(t, since)
        if i >= len(t):
            return None
        si, sj = sums[i], sums[-1]
        growth, outside = sj.growth - si.growth, sj.outside_growth - si.outside_growth
        steps = self.steps[bisect.bisect_right(self.steps, t[i], key=_step_t):]
        if steps:
            sizes = sorted(s.size for s in steps)
            limit = OUTLIER * (sizes[(len(sizes) - 1) // 2] if len(sizes) > 1
                               else self.jump_bytes)
            for s in steps:
                if s.size <= limit:
                    growth += s.size
                    outside += s.size if s.outside else 0.0
        return outside / growth if growth > 0 else None

    def rates(self, since: float) -> tuple[Optional[float], Optional[float]]:
        """The growth rate (bytes/s) over the samples from `since` on, and the growth outside
        recordings; None where there are fewer than 3 samples or MIN_SPAN of the window, or too
        few intervals outside recordings to tell."""
        parts = self._parts(since)
        if parts is None:
            return None, None
        growth, leak, rises = parts
        rates = [rate for _, rate in growth]
        return _rate(rates, rises), (_rate(leak, rises) if len(leak) == len(PARTS) else None)

    def recent(self, since: float) -> Optional[list[tuple[float, float]]]:
        """(seconds, bytes/s) of the window and each recent part of it, the window first, where
        every part grows and the envelope rose MIN_RISES times (the parts `rates` reads the
        latest of); None otherwise."""
        parts = self._parts(since)
        if parts is None:
            return None
        growth, _, rises = parts
        return growth if _growing([rate for _, rate in growth], rises) else None

    def _parts(self, since: float,
               ) -> Optional[tuple[list[tuple[float, float]], list[float], int]]:
        """Per part of the window from `since` (the whole, its recent half, quarter, eighth):
        (its seconds, its growth rate), and the rates outside recordings of the parts with
        enough intervals outside them; and the envelope's rises. None where the window has
        too few samples."""
        t, sums = self._t, self._sums
        j = len(t) - 1
        i = bisect.bisect_left(t, since)
        if j - i < 2 or t[j] - t[i] < MIN_SPAN * (t[j] - since):
            return None
        last, first = t[j], t[i]
        steps = self.counted_steps(since)
        tails = _tails(steps)
        sj = sums[j]
        rises = sj.rises - sums[i].rises
        growth: list[tuple[float, float]] = []
        leak: list[float] = []
        for part in PARTS:
            k = bisect.bisect_left(t, last - part * (last - first))
            if j - k < 2:
                break
            sk, tk = sums[k], t[k]
            stepped = outside = 0.0
            if steps:  # the counted steps after tk
                first_in = bisect.bisect_right(steps, tk, key=_step_t)
                stepped, outside = tails[first_in]
                if part == 1.0:
                    rises += len(steps) - first_in
            growth.append((last - tk, (sj.growth - sk.growth + stepped) / (last - tk)))
            span = sj.outside_seconds - sk.outside_seconds
            used = sj.outside_intervals - sk.outside_intervals
            if used < LEAK_MIN_POINTS or span <= 0 or span < LEAK_MIN_FRACTION * (last - tk):
                continue
            leak.append((sj.outside_growth - sk.outside_growth + outside) / span)
        return growth, leak, rises


def _step_t(step: Step) -> float:
    return step.t


def _tails(steps: list[Step]) -> list[tuple[float, float]]:
    """Per step, the sizes of it and the steps after it, summed (all, and outside recordings),
    and (0, 0) after the last: a part's share of the steps is one lookup."""
    total, out = 0.0, 0.0
    sums = [(total, out)]
    for step in reversed(steps):
        total += step.size
        out += step.size if step.outside else 0.0
        sums.append((total, out))
    return sums[::-1]


def _rate(rates: list[float], rises: int) -> Optional[float]:
    """The most recent part's rate where every part grows (and the window rose MIN_RISES
    times: one allocator step near full is no trend), else the lowest, at most 0."""
    if not rates:
        return None
    if _growing(rates, rises):
        return rates[-1]
    return min(0.0, min(rates))


def _growing(rates: list[float], rises: int) -> bool:
    """Every part grows, and the window rose MIN_RISES times."""
    return bool(rates) and min(rates) > 0 and rises >= MIN_RISES
