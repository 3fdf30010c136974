"""core/trend.py: the rates its running sums give are the rates their definition gives, computed
from the samples themselves; and they read every shape of growth the corpus of GPU runs showed
(staircases of small, medium and large steps, sawtooths, bursts, growth that starts late or
stops) as a user would."""
from __future__ import annotations

import bisect
import random

import pytest

from torch_watchdog.sidecar.core.trend import ENVELOPE_S, LEAK_MIN_FRACTION, LEAK_MIN_POINTS, \
    MIN_RISES, MIN_SPAN, OUTLIER, PARTS, SETTLE_S, STAIR_GAP_S, STAIR_SPREAD_S, STAIR_STEPS, Trend

MB = 1 << 20
WINDOW = 60.0
JUMP = 16 << 20


def history(rng: random.Random) -> list[tuple[float, int, int]]:
    """A server's memory: steps small and large, drops, recordings, still stretches, gaps."""
    out, t, mem, records = [], 1.8e9 + rng.random(), 10 << 30, 0
    step = rng.choice((20, 48)) * MB
    for _ in range(rng.randint(5, 1500)):
        t += rng.choice((0.1, 0.1, 0.1, 0.05, 0.5, 3.0, 20.0)) * (0.9 + 0.2 * rng.random())
        r = rng.random()
        if r < 0.05:
            mem += rng.choice((-2, 2, 4)) * MB                # a wobble
        elif r < 0.06:
            mem += 1 << 30                                    # a one-off step
        elif r < 0.07:
            mem -= rng.randint(1, 600) * MB                   # the allocator lets go
        elif r < 0.12:
            mem += step                                       # a staircase's step
        elif r < 0.13:
            records += 1
        elif r < 0.35:
            mem += rng.randint(0, 64) * 1024                  # a slow leak
        out.append((t, mem, records))
    return out


# over the complexity bound: the definition spelled out, the fast code's reference
def by_definition(samples, since):  # noqa: C901
    """(growth rate, growth outside recordings) over the samples from `since`, from the module
    docstring's definition: every sum taken afresh."""
    t = [s[0] for s in samples]
    i, j = bisect.bisect_left(t, since), len(t) - 1
    if j - i < 2 or t[j] - t[i] < MIN_SPAN * (t[j] - since):
        return None, None
    env = [max(s[1] for s in samples[:k + 1] if s[0] > t[k] - ENVELOPE_S)
           for k in range(len(samples))]
    changed, small, outside, steps = -float("inf"), [0.0], [False], []
    for k in range(1, len(samples)):
        if samples[k][2] != samples[k - 1][2]:
            changed = t[k]
        c = env[k] - env[k - 1]
        outside.append(t[k] > changed + SETTLE_S)
        if c > JUMP:
            steps.append((t[k], c, outside[k]))
            c = 0.0
        small.append(c)
    rises = sum(1 for m in range(i + 1, j + 1) if small[m] > 0)
    horizon = since - (t[j] - since)
    run = []
    for s in reversed(steps):
        if run and (s[0] <= horizon or run[-1][0] - s[0] > STAIR_GAP_S):
            break
        run.append(s)
    counted = []
    if len(run) >= STAIR_STEPS and run[0][0] - run[-1][0] >= STAIR_SPREAD_S:
        median = sorted(s[1] for s in run)[len(run) // 2]
        counted = [s for s in run if s[1] <= OUTLIER * median]
    growth, leak = [], []
    for part in PARTS:
        k = bisect.bisect_left(t, t[j] - part * (t[j] - t[i]))
        if j - k < 2:
            break
        inside = [s for s in counted if s[0] > t[k]]
        growth.append((sum(small[k + 1:j + 1]) + sum(s[1] for s in inside)) / (t[j] - t[k]))
        used = [m for m in range(k + 1, j + 1) if outside[m]]
        span = sum(t[m] - t[m - 1] for m in used)
        if len(used) < LEAK_MIN_POINTS or span <= 0 or span < LEAK_MIN_FRACTION * (t[j] - t[k]):
            continue
        leak.append((sum(small[m] for m in used) + sum(s[1] for s in inside if s[2])) / span)

    rises += sum(1 for s in counted if s[0] > t[i])

    def lowest(rates):
        if not rates:
            return None
        return rates[-1] if min(rates) > 0 and rises >= MIN_RISES else min(0.0, min(rates))

    return lowest(growth), (lowest(leak) if len(leak) == len(PARTS) else None)


@pytest.mark.parametrize("seed", range(120))
def test_the_rates_are_what_their_definition_gives(seed):
    samples = history(random.Random(seed))
    trend = Trend()
    for sample in samples:
        trend.append(*sample)
    since = samples[-1][0] - WINDOW
    got, want = trend.rates(since), by_definition(samples, since)
    assert (got[0] is None) == (want[0] is None) and (got[1] is None) == (want[1] is None)
    for g, w in zip(got, want):
        if w is not None:
            assert g == pytest.approx(w, rel=1e-6, abs=1e-3)


def rate_of(memory, seconds=180.0, records=lambda t: 0, dt=0.1):
    """The growth rate (MiB/s) read at the end of `seconds` of polls of memory(t)."""
    trend, t = Trend(), 0.0
    while t < seconds:
        t += dt
        trend.append(1.8e9 + t, int(memory(t)), records(t))
    slope, _ = trend.rates(1.8e9 + t - WINDOW)
    return slope / MB


def staircase(step_mib, every_s, start=1000 * MB, rate=None):
    return lambda t: start + step_mib * MB * int(t / every_s)


@pytest.mark.parametrize("step_mib, every_s", [(2, 1 / 3), (20, 10 / 3), (48, 8.0)])
def test_a_leak_is_seen_at_its_rate_whatever_its_steps(step_mib, every_s):
    """6 MiB/s kept alive, served from 2 MiB small-pool segments, 20 MiB segments, or large
    allocations of their own: the staircases NVML shows (the corpus' leak-small, -medium,
    -large). The old trend left every step over 16 MiB out and read 0."""
    assert rate_of(staircase(step_mib, every_s)) == pytest.approx(6.0, rel=0.35)


def test_a_flat_server_and_one_off_steps_do_not_grow():
    assert rate_of(lambda t: 1000 * MB) == 0.0
    # weights, a KV pool, the first request of a new largest size: steps that stay
    one_offs = lambda t: 1000 * MB + (20 << 30) * (t > 30) + 300 * MB * (t > 100)  # noqa: E731
    assert rate_of(one_offs) == 0.0
    # a step beside a slow leak leaves the leak's rate
    leak = lambda t: 1000 * MB + 0.5 * MB * t + (2 << 30) * (t > 150)  # noqa: E731
    assert rate_of(leak) == pytest.approx(0.5, rel=0.05)


def test_a_sawtooth_that_does_not_climb_does_not_grow_and_one_that_does_does():
    """600 MiB taken in 30 MiB steps over 10 s, then freed (empty_cache), every 20 s."""
    def saw(climb_mib):
        def memory(t):
            cycle, phase = divmod(t, 20.0)
            up = min(20, int(phase / 0.5)) * 30 * MB if phase < 10 else 0
            return 1000 * MB + up + climb_mib * MB * cycle
        return memory

    ends = [170.0 + k for k in range(20)]  # across a whole cycle
    assert max(rate_of(saw(0), seconds=end) for end in ends) <= 0.0
    # the climb shows while the peak passes the last one (read from the latest eighth)
    assert max(rate_of(saw(50), seconds=end) for end in ends) > 1.0


def test_growth_that_starts_late_is_read_from_the_recent_parts():
    # flat until 160 s, then 5 MiB/s: the window's own rate would say 5 * 20/60
    assert rate_of(lambda t: 1000 * MB + 5 * MB * max(0.0, t - 160)) == pytest.approx(5.0)


def test_growth_that_stopped_is_not_growth():
    assert rate_of(lambda t: 1000 * MB + 5 * MB * min(t, 150)) == 0.0


def test_bursts_with_idle_gaps_grow_in_the_bursts():
    """6 s of traffic recording graphs at 3 MiB/s, then 10 s idle: the growth is read in the
    bursts, at the burst's rate; a gap longer than the window's eighth (7.5 s) reads none."""
    def bursty(t):
        cycles, phase = divmod(t, 16.0)
        return 1000 * MB + 3 * MB * (6 * cycles + min(phase, 6.0))

    assert rate_of(bursty, seconds=180.0) == pytest.approx(3.0 * 4 / 7.5, rel=0.1)
    assert rate_of(bursty, seconds=175.0) == 0.0


def test_a_burst_shorter_than_a_sixth_of_the_window_is_no_trend_yet():
    trend = Trend()
    for k in range(40):  # 4 s of samples, growing fast
        trend.append(1.8e9 + 0.1 * k, (1000 + 10 * k) * MB, k)
    assert trend.rates(1.8e9 + 3.9 - WINDOW) == (None, None)


def test_one_allocator_step_near_full_is_no_trend():
    # flat, one 2 MiB segment 20 s ago: not growth to extrapolate (3 rises in a minute are)
    assert rate_of(lambda t: 1000 * MB + 2 * MB * (t > 160)) == 0.0
    assert rate_of(lambda t: 1000 * MB + 2 * MB * ((t > 172) + (t > 175) + (t > 178))) > 0


def test_the_floor_is_the_lowest_of_the_recent_readings():
    trend = Trend()
    for k in range(300):
        trend.append(1.8e9 + 0.1 * k, (1000 + (600 if k % 200 < 100 else 0)) * MB, 0)
    assert trend.floor == 1000 * MB  # a sawtooth's trough, within the last 15 s


@pytest.mark.parametrize("seed", range(8))
def test_the_rates_asked_poll_after_poll_are_their_definitions_too(seed):
    """The daemon asks every poll: what is kept from one answer to the next (the counted
    steps, their sums) must not outlive the steps and the horizon it was for."""
    samples = history(random.Random(1000 + seed))[:600]
    trend = Trend()
    for n, sample in enumerate(samples, 1):
        trend.append(*sample)
        since = sample[0] - WINDOW
        got = trend.rates(since)
        if n % 40 == 0:
            want = by_definition(samples[:n], since)
            for g, w in zip(got, want):
                assert (g is None) == (w is None)
                if w is not None:
                    assert g == pytest.approx(w, rel=1e-6, abs=1e-3)


def test_the_first_recording_of_a_span_is_found():
    trend = Trend()
    for i in range(30):
        trend.append(float(i), 1000 * MB + i * MB, 0 if i < 12 else 1 + (i - 12) // 3)
    assert trend.first_record_since(0.0) == 12.0
    assert trend.first_record_since(12.0) == 15.0    # counts from the recordings at 12 s
    assert trend.first_record_since(28.0) is None    # none came after
    assert trend.first_record_since(40.0) is None    # no sample then
