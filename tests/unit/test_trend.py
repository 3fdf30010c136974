"""core/trend.py: the rates from running sums are the rates their definition gives, computed
from the samples themselves."""
from __future__ import annotations

import bisect
import random

import pytest

from torch_watchdog.sidecar.core.trend import LEAK_MIN_FRACTION, LEAK_MIN_POINTS, SETTLE_S, Trend

MB = 1 << 20
WINDOW = 60.0


def history(rng: random.Random) -> list[tuple[float, int, int]]:
    """A server's memory: steps small and large, recordings, still stretches, poll gaps."""
    out, t, mem, records = [], 1.8e9 + rng.random(), 10 << 30, 0
    for _ in range(rng.randint(5, 1500)):
        t += rng.choice((0.1, 0.1, 0.1, 0.05, 0.5, 3.0, 20.0)) * (0.9 + 0.2 * rng.random())
        r = rng.random()
        if r < 0.05:
            mem += rng.choice((-2, 2, 4)) * MB                # a wobble, kept in the growth
        elif r < 0.06:
            mem += 1 << 30                                    # a step, left out
        elif r < 0.07:
            records += 1
        elif r < 0.3:
            mem += rng.randint(0, 64) * 1024                  # a slow leak
        out.append((t, mem, records))
    return out


def by_definition(samples, since, jump=16 << 20):
    """(growth rate, growth outside recordings that goes on) over the samples from `since`."""
    t = [s[0] for s in samples]
    i, j = bisect.bisect_left(t, since), len(t) - 1
    if j - i < 2 or t[j] <= t[i]:
        return None, None
    changed, kept, outside = -float("inf"), [0.0], [False]
    for k in range(1, len(samples)):
        if samples[k][2] != samples[k - 1][2]:
            changed = t[k]
        step = samples[k][1] - samples[k - 1][1]
        kept.append(step if abs(step) <= jump else 0.0)
        outside.append(t[k] > changed + SETTLE_S)
    slope = sum(kept[i + 1:j + 1]) / (t[j] - t[i])
    leak = None
    for part in (1.0, 0.5, 0.25):
        k = bisect.bisect_left(t, t[j] - part * (t[j] - t[i]))
        if j - k < 2:
            return slope, None
        counted = [m for m in range(k + 1, j + 1) if outside[m]]
        span = sum(t[m] - t[m - 1] for m in counted)
        if len(counted) < LEAK_MIN_POINTS or span <= 0 or \
                span < LEAK_MIN_FRACTION * (t[j] - t[k]):
            return slope, None
        rate = sum(kept[m] for m in counted) / span
        leak = rate if leak is None else min(leak, rate)
    return slope, leak


@pytest.mark.parametrize("seed", range(200))
def test_the_rates_are_what_their_definition_gives(seed):
    samples = history(random.Random(seed))
    trend = Trend()
    for sample in samples:
        trend.append(sample)
    since = samples[-1][0] - WINDOW
    got, want = trend.rates(since), by_definition(samples, since)
    assert (got[0] is None) == (want[0] is None) and (got[1] is None) == (want[1] is None)
    for g, w in zip(got, want):
        if w is not None:
            assert g == pytest.approx(w, rel=1e-6, abs=1e-3)


def test_a_flat_window_grows_at_zero_and_a_leak_at_its_rate():
    trend, t = Trend(), 1.8e9
    for k in range(600):  # 60 s at 10 Hz, 1 MiB/s
        t += 0.1
        trend.append((t, (10 << 30) + k * (MB // 10), 3))
    slope, leak = trend.rates(t - WINDOW)
    assert slope == pytest.approx(MB, rel=0.01) and leak == pytest.approx(MB, rel=0.01)
    flat = Trend()
    for k in range(600):
        flat.append((1.8e9 + k * 0.1, 10 << 30, 3))
    assert flat.rates(1.8e9 + 59.9 - WINDOW) == (0.0, 0.0)
