"""Running sums over a server's memory samples: the growth rates of any recent window in
O(log n) per poll (pure).

The forecast needs the trend of the last `window_s` (60 s at 10 Hz: 600 samples) and the
rate of growth outside recordings over that window, its recent half and its recent quarter.
Scanning the window four times a poll was two thirds of an idle poll's CPU; prefix sums make
each rate two lookups. One poll's step above `jump_bytes` (a model load, a ballast, a
compile's workspace) is left out of both rates; an interval ending within `SETTLE_S` of a
recording is left out of the growth outside recordings (a recording's memory shows in NVML up
to a few polls from its event: 1.4 s in the H200 bucketed run's sample log).
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Optional

SETTLE_S = 2.0
LEAK_MIN_POINTS = 10      # intervals outside recordings needed to measure growth outside them
LEAK_MIN_FRACTION = 0.2   # … covering at least this part of the window


class Trend:
    def __init__(self, jump_bytes: int = 16 << 20, maxlen: int = 36_000):
        self.jump_bytes = jump_bytes
        self.maxlen = maxlen
        self._t: list[float] = []
        # per sample, summed from the first: growth (steps out), and outside recordings:
        # growth, seconds and intervals
        self._sums: list[tuple[float, float, float, int]] = []
        self._last: Optional[tuple[float, int, int]] = None   # t, memory, recordings
        self._changed = -math.inf                            # when recordings last changed

    def append(self, sample: tuple[Any, ...]) -> None:
        """(t, the server's memory, recordings so far, ...): the columns after are ignored."""
        t, mem, records = sample[0], sample[1], sample[2]
        if mem is None:
            return
        g, lg, ls, ln = self._sums[-1] if self._sums else (0.0, 0.0, 0.0, 0)
        if self._last is not None:
            t0, m0, r0 = self._last
            if records != r0:
                self._changed = t
            step = mem - m0
            kept = step if abs(step) <= self.jump_bytes else 0.0
            g += kept
            if t > self._changed + SETTLE_S:
                lg, ls, ln = lg + kept, ls + (t - t0), ln + 1
        self._last = (t, mem, records)
        self._t.append(t)
        self._sums.append((g, lg, ls, ln))
        if len(self._t) > 2 * self.maxlen:  # amortised trim: keep the newest maxlen
            del self._t[:-self.maxlen]
            del self._sums[:-self.maxlen]

    def rates(self, since: float) -> tuple[Optional[float], Optional[float]]:
        """The growth rate (bytes/s) over the samples from `since` on, and the growth outside
        recordings that goes on: the lowest of its rates over those samples, their recent half
        and their recent quarter (a warm-up's growth that stopped is not a leak). None where
        there are fewer than 3 samples, or too few intervals outside recordings to tell."""
        t, sums = self._t, self._sums
        j = len(t) - 1
        i = bisect.bisect_left(t, since)
        if j - i < 2 or t[j] <= t[i]:
            return None, None
        first, last = t[i], t[j]
        sj = sums[j]
        slope = (sj[0] - sums[i][0]) / (last - first)
        leak: Optional[float] = None
        for part in (1.0, 0.5, 0.25):
            k = bisect.bisect_left(t, last - part * (last - first))
            if j - k < 2:
                return slope, None
            sk = sums[k]
            span, used = sj[2] - sk[2], sj[3] - sk[3]
            if used < LEAK_MIN_POINTS or span <= 0 or span < LEAK_MIN_FRACTION * (last - t[k]):
                return slope, None
            rate = (sj[1] - sk[1]) / span
            if leak is None or rate < leak:  # min(), keeping the first of equals
                leak = rate
        return slope, leak

    def _span(self, since: float) -> tuple[Optional[int], int]:
        j = len(self._t) - 1
        i = bisect.bisect_left(self._t, since)
        if j - i < 2 or self._t[j] <= self._t[i]:
            return None, j
        return i, j
