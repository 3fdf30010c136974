"""core/trend.py: Trend.still_until's promise, checked against the rates themselves."""
from __future__ import annotations

import random

import pytest

from torch_watchdog.sidecar.core.trend import Trend

MB = 1 << 20
WINDOW = 60.0


def history(rng: random.Random) -> tuple[Trend, float, int, int]:
    """A server's memory: steps small and large, recordings, still stretches, poll gaps."""
    trend, t, mem, records = Trend(), 1.8e9 + rng.random(), 10 << 30, 0
    for _ in range(rng.randint(5, 1500)):
        t += rng.choice((0.1, 0.1, 0.1, 0.05, 0.5, 3.0, 20.0)) * (0.9 + 0.2 * rng.random())
        r = rng.random()
        if r < 0.05:
            mem += rng.choice((-2, 2, 4)) * MB                # a wobble, kept in the growth
        elif r < 0.06:
            mem += 1 << 30                                    # a step, left out
        elif r < 0.07:
            records += 1
        trend.append((t, mem, records))
    return trend, t, mem, records


@pytest.mark.parametrize("seed", range(300))
def test_the_rates_stay_still_until_the_horizon(seed):
    """For any poll before the horizon, with still samples appended at any times up to it,
    the rates are (0.0, 0.0): what core/step.py keeps without computing them."""
    rng = random.Random(seed)
    trend, t, mem, records = history(rng)
    until = trend.still_until(t - WINDOW, WINDOW)
    checked = 0
    while True:
        t += rng.choice((0.1, 0.1, 0.01, 1.0, 5.0)) * rng.random() + 1e-3
        if t >= until:
            break
        trend.append((t, mem, records))
        assert trend.rates(t - WINDOW) == (0.0, 0.0), (seed, t, until)
        checked += 1
    assert checked or until < t + 0.2  # seeds with a still window get polls to check


def test_a_still_server_is_still_for_a_while_and_not_after_a_move():
    trend, t = Trend(), 1.8e9
    for k in range(700):
        t += 0.1
        trend.append((t, 5 << 30 if k < 50 else (5 << 30) + 2 * MB, 0))
    until = trend.still_until(t - WINDOW, WINDOW)
    assert t + 5.0 < until <= t + WINDOW / 8  # polls at 10 Hz: the quarter keeps 150 samples
    trend.append((t + 0.1, (5 << 30) + 4 * MB, 0))  # a move: not still while it is in the window
    assert trend.still_until(t + 0.1 - WINDOW, WINDOW) == float("-inf")


@pytest.mark.parametrize("seed", range(20))
def test_append_same_is_append(seed):
    rng = random.Random(seed)
    a, b, t, mem, records = Trend(), Trend(), 1.8e9, 5 << 30, 0
    for _ in range(2000):
        t += rng.choice((0.1, 0.1, 2.5)) * rng.random()
        if rng.random() < 0.05:
            mem += rng.choice((-2, 2, 1 << 10)) * MB
        if rng.random() < 0.02:
            records += 1
        a.append((t, mem, records))
        b.append_same(t, mem, records)
        assert a.rates(t - WINDOW) == b.rates(t - WINDOW)
        assert a.still_until(t - WINDOW, WINDOW) == b.still_until(t - WINDOW, WINDOW)
