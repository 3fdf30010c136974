"""benchmarks/corpus/horizons_prototype.py (not wired into the sidecar) on synthetic memory:
growth read at the horizon that fits it, from a minute to hours, and the time to the moment
allocation fails."""
from __future__ import annotations

import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "corpus"))
import horizons_prototype as hp  # noqa: E402

MiB = 1 << 20
BASE = 1500 * MiB


def feed(level, seconds: float, poll: float = 1.0) -> hp.History:
    h = hp.History()
    for i in range(int(seconds / poll) + 1):
        h.add(i * poll, level(i * poll))
    return h


@pytest.mark.parametrize("spacing", [3.3, 80.0, 1200.0])
def test_a_staircase_of_any_spacing_is_read_at_its_rate(spacing):
    step = 20 * MiB
    rate = step / spacing
    h = feed(lambda t: BASE + step * math.floor(t / spacing), 30 * spacing + 5)
    r = hp.estimate(h)
    assert r is not None and r.rate == pytest.approx(rate, rel=0.1)
    assert r.step == pytest.approx(step)


def test_the_time_to_oom_is_to_the_step_that_does_not_fit():
    spacing, step = 100.0, 20 * MiB
    h = feed(lambda t: BASE + step * math.floor(t / spacing), 3000.0)   # last step at 3000
    fail = BASE + step * 30 + 5 * step    # five more steps reach it: the fifth fails
    assert hp.seconds_to_fail(h, fail) == pytest.approx(5 * spacing, rel=0.05)


def test_a_ramp_that_began_an_hour_ago_is_read_from_its_start_not_diluted():
    rate = 0.05 * MiB  # 0.05 MiB/s: ~8 h from 1.5 GiB free
    h = feed(lambda t: BASE + max(0.0, t - 3 * 3600) * rate, 4 * 3600, poll=0.5)
    r = hp.estimate(h)
    assert r is not None and r.rate == pytest.approx(rate, rel=0.1)
    assert r.horizon <= 3600


def test_a_slow_leak_is_forecast_hours_ahead_within_a_tenth():
    rate, free = 0.05 * MiB, 1536 * MiB
    h = feed(lambda t: BASE + t * rate, 2 * 3600, poll=0.5)
    truth = (free - 2 * 3600 * rate) / rate
    assert hp.seconds_to_fail(h, BASE + free) == pytest.approx(truth, rel=0.1)


def test_a_sawtooth_and_a_plateau_are_not_growth():
    period = 20.0

    def saw(t: float) -> float:   # flat for 2 min, then 600 MiB in 10 s, freed, every 20 s
        return BASE + (0 if t < 120 else 30 * MiB * min(20, int((t % period) / 0.5)))

    h = hp.History()
    for i in range(6000):   # 10 min at 10 Hz, read every second after the first minute
        h.add(i / 10, saw(i / 10))
        if i >= 600 and i % 10 == 0:
            assert hp.estimate(h) is None, i / 10
    # growth that stopped half an hour ago, after an hour of steps every 2 minutes
    stopped = feed(lambda t: BASE + 20 * MiB * math.floor(min(t, 3600) / 120), 5400.0)
    assert hp.estimate(stopped) is None


def test_a_pause_no_longer_than_the_ones_before_is_still_growth():
    # 6 min bursts of steps, 10 min idle, for hours; read in an idle gap
    def bursty(t: float) -> float:
        cycle, into = divmod(t, 960.0)
        return BASE + 8 * MiB * (cycle * 36 + min(36, math.floor(into / 10)))

    h = feed(bursty, 5 * 960 + 600)    # 4 min into an idle gap
    r = hp.estimate(h)
    assert r is not None and r.rate == pytest.approx(8 * MiB * 36 / 960, rel=0.25)


def test_history_is_bounded_for_a_day_of_10_hz_polls():
    h = hp.History()
    for i in range(0, 24 * 3600 * 10, 7):    # every 0.7 s, a day
        h.add(i / 10, BASE + i)
    assert all(len(tier) <= hp.TIER_BUCKETS for tier in h.tiers)


def test_on_a_device_allocation_fails_19_mib_short_of_full_not_a_headroom_short():
    total, others = 141 * 1024 * MiB, 2048 * MiB
    assert hp.fail_level(device_total=total, others_bytes=others) == total - others - 19 * MiB
    assert hp.fail_level(budget=5 * 1024 * MiB, device_total=total) == 5 * 1024 * MiB
