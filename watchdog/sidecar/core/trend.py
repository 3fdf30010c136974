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
from typing import Optional

SETTLE_S = 2.0
LEAK_MIN_POINTS = 10      # intervals outside recordings needed to measure growth outside them
LEAK_MIN_FRACTION = 0.2   # … covering at least this part of the window
_MARGIN_S = 1e-3          # still_until's margin for times' rounding (2.4e-7 s at 1.8e9 s)


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
        # the last sample whose interval moved a sum other than the counts (a step kept in the
        # growth) or was not counted outside recordings: still_until's window must start after
        self._moved_t = math.inf

    def append(self, sample: tuple) -> None:
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
                if kept:
                    self._moved_t = t
            else:
                self._moved_t = t
        else:
            self._moved_t = t
        self._last = (t, mem, records)
        self._t.append(t)
        self._sums.append((g, lg, ls, ln))
        if len(self._t) > 2 * self.maxlen:  # amortised trim: keep the newest maxlen
            del self._t[:-self.maxlen]
            del self._sums[:-self.maxlen]

    def rate(self, since: float) -> Optional[float]:
        """Growth rate (bytes/s) over the samples from `since` on; None with < 3 of them."""
        i, j = self._span(since)
        if i is None:
            return None
        return (self._sums[j][0] - self._sums[i][0]) / (self._t[j] - self._t[i])

    def leak_rate(self, since: float) -> Optional[float]:
        """Growth outside recordings that goes on: the lowest of its rates over the samples
        from `since` on, their recent half and their recent quarter (a warm-up's growth that
        stopped is not a leak); None when such intervals are too few to tell."""
        i, j = self._span(since)
        if i is None:
            return None
        first, last = self._t[i], self._t[j]
        rates = []
        for part in (1.0, 0.5, 0.25):
            k = bisect.bisect_left(self._t, last - part * (last - first))
            rate = self._outside(k, j)
            if rate is None:
                return None
            rates.append(rate)
        return min(rates)

    def append_same(self, t: float, mem: int, records: int) -> None:
        """append((t, mem, records)), cheaper when it repeats the last sample's memory and
        recordings (a still server's poll): the same sums (a zero step adds nothing to them),
        with its interval counted or not."""
        last = self._last
        if last is None or last[1] != mem or last[2] != records or not last[0] < t:
            self.append((t, mem, records))
            return
        sums = self._sums
        g, lg, ls, ln = sums[-1]
        if t > self._changed + SETTLE_S:
            ls, ln = ls + (t - last[0]), ln + 1
        else:
            self._moved_t = t
        self._last = (t, last[1], last[2])
        self._t.append(t)
        sums.append((g, lg, ls, ln))
        if len(sums) > 2 * self.maxlen:
            del self._t[:-self.maxlen]
            del sums[:-self.maxlen]

    def rates(self, since: float) -> tuple[Optional[float], Optional[float]]:
        """(rate(since), leak_rate(since)) in one pass, the same numbers: the forecast asks
        for both every poll and every server (5.4 us as two calls, ~2 us as one)."""
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

    def still_until(self, since: float, window: float) -> float:
        """Until when `rates(T - window)` stays (0.0, 0.0) for a poll at T >= the last sample's
        time, `since` <= T - window, while the samples appended up to T repeat the last one
        (the same memory and recordings, at increasing times); -inf when that is not known.
        Kept steady by a still server's polls (core/step.py), so not computed each of them.

        Then every interval from the window's start on is flat (no growth kept) and counted
        outside recordings, so each rate is 0.0 over any part with enough intervals: the
        recent quarter (the fewest) keeps LEAK_MIN_POINTS while its start, T - (T - first)/4
        with `first` no later than the window's first sample at the horizon, stays at or
        before the LEAK_MIN_POINTS-th newest sample now. A part's counted seconds (a float
        sum) stay within the rounding bound checked below of its span, far above a fifth."""
        t = self._t
        n = len(t)
        if n <= LEAK_MIN_POINTS or self._moved_t >= since - _MARGIN_S:
            return -math.inf
        last, tenth = t[-1], t[n - LEAK_MIN_POINTS]
        ls = self._sums[-1][2]
        if 0.8 * (last - tenth) <= 4 * (min(n, self.maxlen) + 2) * math.ulp(ls) + _MARGIN_S:
            return -math.inf  # samples too close for the counted seconds' rounding
        cap = last + window / 8
        k = bisect.bisect_left(t, cap - window)
        if k >= n:
            return -math.inf
        return min(cap, (tenth - _MARGIN_S - 0.25 * t[k]) / 0.75)

    def _outside(self, i: int, j: int) -> Optional[float]:
        if j - i < 2:
            return None
        growth = self._sums[j][1] - self._sums[i][1]
        span = self._sums[j][2] - self._sums[i][2]
        used = self._sums[j][3] - self._sums[i][3]
        whole = self._t[j] - self._t[i]
        if used < LEAK_MIN_POINTS or span <= 0 or span < LEAK_MIN_FRACTION * whole:
            return None
        return growth / span

    def _span(self, since: float) -> tuple[Optional[int], int]:
        j = len(self._t) - 1
        i = bisect.bisect_left(self._t, since)
        if j - i < 2 or self._t[j] <= self._t[i]:
            return None, j
        return i, j
