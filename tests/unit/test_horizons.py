"""core/horizons.py on synthetic memory: growth read at the horizon that fits it, from a minute
to hours, the time to the moment allocation fails, and a bounded history; and the forecast
and the step that use it."""
from __future__ import annotations

import math

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.config import Config, CorrelateConfig, ForecastConfig, PolicyConfig
from torch_watchdog.sidecar.core import horizons
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.forecast import FAIL_FREE_BYTES, forecast
from torch_watchdog.sidecar.core.observations import DeviceSample, ProcessSample, Sample
from torch_watchdog.sidecar.core.step import Host, step
from tests.folding import fold

MiB = 1 << 20
GiB = 1 << 30
BASE = 1500 * MiB


def feed(level, seconds: float, poll: float = 1.0) -> horizons.History:
    h = horizons.History()
    for i in range(int(seconds / poll) + 1):
        h.add(i * poll, level(i * poll))
    return h


def to_fail(h: horizons.History, fail: float) -> float:
    reading, level = horizons.estimate(h), h.level()
    assert reading is not None and level is not None and h.last_t is not None
    return horizons.seconds_to_fail(reading, fail - level, h.last_t, h.last_rise_t)


@pytest.mark.parametrize("spacing", [3.3, 80.0, 1200.0])
def test_a_staircase_of_any_spacing_is_read_at_its_rate(spacing):
    step_bytes = 20 * MiB
    h = feed(lambda t: BASE + step_bytes * math.floor(t / spacing), 30 * spacing + 5)
    r = horizons.estimate(h)
    assert r is not None and r.rate == pytest.approx(step_bytes / spacing, rel=0.1)
    assert r.step == pytest.approx(step_bytes)


def test_the_time_to_oom_is_to_the_step_that_does_not_fit():
    spacing, step_bytes = 100.0, 20 * MiB
    h = feed(lambda t: BASE + step_bytes * math.floor(t / spacing), 3000.0)  # a step at 3000
    fail = BASE + step_bytes * 30 + 5 * step_bytes   # five more steps reach it: the fifth fails
    assert to_fail(h, fail) == pytest.approx(5 * spacing, rel=0.05)


def test_a_staircase_of_uneven_steps_is_expected_at_its_pace_and_acted_on_at_the_quartile():
    # 20 MiB steps 16 or 20 min apart (18.7 min on average; whole 4 min buckets of the 8 h
    # horizon's tier), the last one just now, room for one more: the expected OOM is a step's
    # time at the growth's pace (the median gap is longer), the earliest the gaps' lower
    # quartile. Read at the quartile, the forecast said 0 s for the last 4 min of a 20 min gap
    gaps, step_bytes = [960.0, 1200.0, 1200.0] * 8, 20 * MiB
    steps = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    h = feed(lambda t: BASE + step_bytes * sum(1 for x in steps if x <= t), steps[-1], poll=5.0)
    reading, level = horizons.estimate(h), h.level()
    assert reading is not None and level is not None and h.last_t is not None
    args = (reading, step_bytes, h.last_t, h.last_rise_t)
    assert horizons.seconds_to_fail(*args, expected=True) == pytest.approx(1120.0, rel=0.05)
    assert horizons.seconds_to_fail(*args) == pytest.approx(960.0, rel=0.05)


def test_the_policy_acts_on_the_earliest_and_the_forecast_says_the_expected():
    from torch_watchdog.sidecar.core.forecast import Forecast
    trend = Forecast(GiB, GiB // 2, seconds_linear=300.0, trend_early_s=100.0)
    assert (trend.seconds, trend.seconds_earliest) == (300.0, 200.0)
    # with the discovery model, the unexplained growth's trend is the one moved
    both = Forecast(GiB, GiB // 2, 300.0, seconds_discovery=500.0, seconds_unexplained=300.0,
                    trend_early_s=100.0)
    assert (both.seconds, both.seconds_earliest) == (300.0, 200.0)
    d = both.as_dict()
    assert (d["seconds_to_oom"], d["seconds_to_oom_earliest"]) == (300.0, 200.0)


def test_growth_in_increments_under_a_mib_adds_up():
    rate = 0.25 * MiB   # a quarter MiB a poll: no single rise counts, their sum does
    h = feed(lambda t: BASE + t * rate, 600.0)
    r = horizons.estimate(h)
    assert r is not None and r.rate == pytest.approx(rate, rel=0.1)


def test_a_ramp_that_began_an_hour_ago_is_read_from_its_start_not_diluted():
    rate = 0.05 * MiB
    h = feed(lambda t: BASE + max(0.0, t - 3 * 3600) * rate, 4 * 3600, poll=0.5)
    r = horizons.estimate(h)
    assert r is not None and r.rate == pytest.approx(rate, rel=0.1)
    assert r.horizon <= 3600


def test_a_slow_leak_is_forecast_hours_ahead_within_a_tenth():
    rate, free = 0.05 * MiB, 1536 * MiB   # 0.05 MiB/s from 1.5 GiB free: ~8 h
    h = feed(lambda t: BASE + t * rate, 2 * 3600, poll=0.5)
    truth = (free - 2 * 3600 * rate) / rate
    assert to_fail(h, BASE + free) == pytest.approx(truth, rel=0.1)


def test_a_sawtooth_and_a_plateau_are_not_growth():
    def saw(t: float) -> float:   # flat for 2 min, then 600 MiB in 10 s, freed, every 20 s
        return BASE + (0 if t < 120 else 30 * MiB * min(20, int((t % 20.0) / 0.5)))

    h = horizons.History()
    for i in range(6000):   # 10 min at 10 Hz, read every second after the first minute
        h.add(i / 10, saw(i / 10))
        if i >= 600 and i % 10 == 0:
            assert horizons.estimate(h) is None, i / 10
    # growth that stopped half an hour ago, after an hour of steps every 2 minutes
    stopped = feed(lambda t: BASE + 20 * MiB * math.floor(min(t, 3600) / 120), 5400.0)
    assert horizons.estimate(stopped) is None


def test_a_pause_no_longer_than_the_ones_before_is_still_growth():
    def bursty(t: float) -> float:   # 6 min bursts of steps, 10 min idle, for hours
        cycle, into = divmod(t, 960.0)
        return BASE + 8 * MiB * (cycle * 36 + min(36, math.floor(into / 10)))

    r = horizons.estimate(feed(bursty, 5 * 960 + 600))    # 4 min into an idle gap
    assert r is not None and r.rate == pytest.approx(8 * MiB * 36 / 960, rel=0.25)


def test_history_is_bounded_for_a_day_of_10_hz_polls():
    h = horizons.History()
    for i in range(0, 24 * 3600 * 10, 7):
        h.add(i / 10, BASE + i)
    assert all(len(tier) <= horizons.TIER_BUCKETS for tier in h.tiers)


# the agent of the server leak_samples meters (pid 7 on GPU-x), saying hello first
HELLO = events.Hello(t=999.0, pid=7, torch="2.11", agent="test", devices=["GPU-x"], config={},
                     capabilities={}, watched=["m"], argv="serve")


def leak_samples(seconds: float, rate: float, total: int = 80 * GiB, used0: int = 70 * GiB,
                 t0: float = 1000.0, poll: float = 0.5) -> list[Sample]:
    """One process leaking `rate` bytes/s on one GPU, its NVML numbers every `poll`."""
    out = []
    for i in range(int(seconds / poll)):
        mine = 2 * GiB + int(i * poll * rate)
        used = used0 + mine - 2 * GiB
        out.append(Sample(t=t0 + i * poll, devices=(DeviceSample("GPU-x", used, total,
                                                                 total - used),),
                          processes=(ProcessSample(7, True, GiB, {"GPU-x": mine}),)))
    return out


def test_a_slow_leak_is_forecast_to_where_allocation_fails_through_the_fold():
    rate = 0.2 * MiB   # 10 GiB free at 0.2 MiB/s: ~14 h; read after 40 min
    obs = leak_samples(2400.0, rate)
    s = fold(State(), obs, CorrelateConfig())
    fc = forecast(s, ForecastConfig())
    assert fc.budget_bytes == 80 * GiB - FAIL_FREE_BYTES
    assert fc.level_bytes is not None and fc.budget_bytes is not None
    truth = (fc.budget_bytes - fc.level_bytes) / rate
    assert fc.seconds == pytest.approx(truth, rel=0.1)
    assert fc.cause == "memory_growth_unexplained" and fc.trend_horizon_s is not None


def test_replay_and_live_estimate_alike_once_a_second_of_the_polls_time():
    obs = leak_samples(300.0, 1 * MiB, poll=0.1)
    a, b = fold(State(), obs, CorrelateConfig()), fold(State(), obs, CorrelateConfig())
    assert a.memory.reading == b.memory.reading is not None
    assert a.memory.next_estimate_t == pytest.approx(obs[-1].t + horizons.EVAL_S, abs=1.0)


def test_a_leak_is_reloaded_as_unexplained_growth_before_the_device_runs_out():
    cfg = Config(policy=PolicyConfig(warmup_s=0, reload_lead_s=60, hold_polls=3))
    host, decided = Host(), []
    step(host, HELLO, cfg)
    step(host, events.Compile(t=999.0, pid=7, compile_id="0/0", function="f", seconds=1.0), cfg)
    room = 300 * MiB   # at 2 MiB/s: ~150 s of growth left
    for o in leak_samples(400.0, 2 * MiB, total=80 * GiB, used0=80 * GiB - room):
        decided += [a for a in step(host, o, cfg).actions if a.kind == "reload"]
        if decided:
            break
    assert decided and decided[0].cause == "memory_growth_unexplained"
    # the OOM (19 MiB free) comes (room - 19 MiB) / rate after the start: decided near the lead
    oom_t = 1000.0 + (room - FAIL_FREE_BYTES) / (2 * MiB)
    assert 30 <= oom_t - decided[0].t <= 90


def test_a_smooth_leak_is_no_staircase_of_its_buckets_steps():
    # 0.05 MiB/s in sub-MiB increments: an 8 h horizon's 4 min buckets rise 12 MiB each, but
    # no poll saw a step; with 10 MiB left it is 200 s from the OOM, not the next bucket's rise
    rate = 0.05 * MiB
    h = feed(lambda t: BASE + t * rate, 8 * 3600, poll=2.0)
    r = horizons.estimate(h)
    assert r is not None and r.step <= horizons.RISE_BYTES
    assert to_fail(h, h.level() + 10 * MiB) == pytest.approx(10 * MiB / rate, rel=0.15)
    # a one-off step the polls saw (a big request's memory kept) leaves it a ramp
    h = feed(lambda t: BASE + t * rate + (300 * MiB if t > 4 * 3600 else 0), 8 * 3600, poll=2.0)
    r = horizons.estimate(h)
    assert r is not None and r.step <= horizons.RISE_BYTES
    # a staircase's steps are seen by the polls: its step is the step
    stairs = feed(lambda t: BASE + 20 * MiB * math.floor(t / 600), 8 * 3600, poll=2.0)
    r = horizons.estimate(stairs)
    assert r is not None and r.step == pytest.approx(20 * MiB, rel=0.01)


def test_a_leak_eight_hours_from_the_oom_is_alerted_an_hour_ahead_once_and_reloaded_at_the_lead():
    # 0.05 MiB/s from 1.5 GiB free: the device fails ~8.4 h after the leak begins. With
    # alert_lead_s one hour, the forecast alert comes about an hour before the OOM, once; the
    # reload near its 60 s lead (3 polls held, 2 s apart), not minutes early
    rate, room = 0.05 * MiB, 1536 * MiB
    cfg = Config(policy=PolicyConfig(warmup_s=0, reload_lead_s=60, alert_lead_s=3600,
                                     hold_polls=3, dry_run=True))
    host: Host = Host()
    step(host, HELLO, cfg)
    oom_t = 1000.0 + (room - FAIL_FREE_BYTES) / rate
    alerts, reloads = [], []
    for o in leak_samples(oom_t - 1000.0, rate, total=80 * GiB, used0=80 * GiB - room, poll=2.0):
        for a in step(host, o, cfg).actions:
            if a.reason == "oom_forecast":
                (alerts if a.kind == "alert" else reloads).append(a.t)
    assert len(alerts) == 1 and 0.9 * 3600 <= oom_t - alerts[0] <= 1.1 * 3600
    assert reloads and 60 <= oom_t - reloads[0] <= 120
