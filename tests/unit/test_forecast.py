import math
import random

import pytest

from torch_watchdog.sidecar.config import ForecastConfig
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.correlate.calls import Calls, Window
from torch_watchdog.sidecar.core.correlate.memory import Memory
from torch_watchdog.sidecar.core.correlate.shapes import Shapes
from torch_watchdog.sidecar.core import horizons
from torch_watchdog.sidecar.core.forecast import (FAIL_FREE_BYTES, FOREVER, forecast, recorded,
                                                  shape_space)

MB = 1_000_000


def grow(memory: Memory, t: float, level: float, records: int) -> None:
    """One poll of the server's memory, as Memory.on_sample folds it: the window's trend, the
    day's history, and the horizons' estimate."""
    memory.trend.append(t, level, records)
    memory.history.add(t, level)
    memory.reading = horizons.estimate(memory.history)


@pytest.mark.parametrize("space, n", [(50, 100), (200, 500), (2017, 3137), (10, 1000)])
def test_shape_space_recovers_the_number_of_sizes(space, n):
    rng = random.Random(space * n)
    trials = []
    for _ in range(20):
        seen = {rng.randrange(space) for _ in range(n)}
        trials.append(shape_space(n, len(seen)))
    finite = [s for s in trials if math.isfinite(s)]
    assert statistics_median(finite) == pytest.approx(space, rel=0.15)


def statistics_median(values):
    values = sorted(values)
    return values[len(values) // 2]


def test_shape_space_edges():
    assert shape_space(0, 0) is None
    assert shape_space(10, 10) == FOREVER  # every request new: no sign of an end
    assert shape_space(100, 1) == pytest.approx(1, abs=1e-6)


def test_recorded_matches_simulation():
    rng, space, n = random.Random(1), 300, 600
    counts = {}
    for _ in range(n):
        k = rng.randrange(space)
        counts[k] = counts.get(k, 0) + 1
    twice = sum(1 for c in counts.values() if c >= 2)
    assert recorded(space, n) == pytest.approx(twice, rel=0.1)


def state_with(level, total, records, requests, distinct, mb_per_graph, rate=100.0, t=100.0):
    s = State(now=t, first_t=0.0, records=records, calls=Calls(requests=requests),
              shapes=Shapes(distinct=distinct),
              memory=Memory(device_used=level, device_total=total, bytes=level, start=level))
    s.memory.regression.add(1, mb_per_graph * MB)  # slope = mb_per_graph
    for i in range(10):  # request rate from `calls` windows
        s.calls.windows.append(Window(t - 9 + i, int(rate), 1.0, 0, 0.0))
    for i in range(10):  # a flat level
        s.memory.trend.append(t - 9 + i, level, records)
    return s


def test_plateau_below_budget_means_no_oom():
    s = state_with(level=5000 * MB, total=100_000 * MB, records=500, requests=2000,
                   distinct=1400, mb_per_graph=0.5)
    fc = forecast(s, ForecastConfig(headroom_bytes=0))
    assert fc.will_oom is False and fc.seconds == FOREVER
    assert fc.plateau_bytes < fc.budget_bytes


def test_discovery_forecast_when_the_plateau_is_above_budget():
    s = state_with(level=1000 * MB, total=1100 * MB, records=500, requests=2000,
                   distinct=1400, mb_per_graph=0.5)
    fc = forecast(s, ForecastConfig(headroom_bytes=0))
    assert fc.will_oom is True
    assert 0 < fc.seconds_discovery < FOREVER
    # 100 MB of room is 200 more graphs; at 100 req/s that takes seconds, not hours
    assert fc.seconds_discovery < 60


def test_the_trend_ignores_one_poll_steps():
    s = State(now=70.0, memory=Memory(device_used=0, device_total=10_000 * MB))
    level = 1000 * MB
    for i in range(71):
        level += 1 * MB + (3000 * MB if i == 40 else 0)
        grow(s.memory, float(i), level, 0)
    s.memory.device_used = level
    fc = forecast(s, ForecastConfig())
    # 70 polls of +1 MB, one of them inside the 3 GB step, which is left out whole: the
    # window's recent rate, and the horizon's line through the envelope less the step
    assert fc.growth_bytes_per_s == pytest.approx(1.0 * MB)
    room = 10_000 * MB - FAIL_FREE_BYTES - level
    assert fc.seconds_linear == pytest.approx(room / MB, rel=0.05)
    assert fc.trend_horizon_s == 60.0
    assert fc.seconds_discovery is None  # no recordings: the trend is what we have
    assert fc.cause == "memory_growth_unexplained"


def test_the_budget_leaves_out_what_the_driver_reserves():
    """An H200 reports 150.75 GB total, but 645 MB of it are reserved by the driver and can
    never be allocated (NVML v2: free = total - reserved - used). A budget from `total` put
    the OOM ~500 MB too far away and the seed server crashed before the reload."""
    from torch_watchdog.sidecar.config import CorrelateConfig
    from tests.folding import fold
    from torch_watchdog.sidecar.core.observations import DeviceSample, Sample

    total, reserved, used = 150_754_820_096, 644_939_776, 149_796_290_560
    s = fold(State(), [Sample(t=1.0, devices=(DeviceSample("GPU-x", used, total,
                                                           total - reserved - used),))],
             CorrelateConfig())
    fc = forecast(s, ForecastConfig(headroom_bytes=128 << 20))
    # the OOM is where allocation fails, FAIL_FREE_BYTES short of full (headroom_bytes is
    # deprecated: the margin is the policy's lead in seconds)
    assert fc.budget_bytes == total - reserved - FAIL_FREE_BYTES
    assert fc.level_bytes == used


def test_bucketed_warm_up_growth_is_not_projected_into_an_oom():
    """The GPU control run: 9 bucket sizes in hundreds of requests, 10 MB of growth while
    they were recorded, 106 MB of room. The trend alone said OOM in 208 s; every size is
    recorded, so no more growth comes from graphs: no forecast OOM."""
    s = State(now=60.0, calls=Calls(requests=600), shapes=Shapes(distinct=9), records=9,
              memory=Memory(device_used=0, device_total=1000 * MB))
    s.calls.windows.extend(Window(float(t), 10, 1.0, 0, 0.0) for t in range(61))
    for i in range(61):  # the growth came with the recordings, a recording every 6.7 s
        level = 894 * MB + i * MB / 6
        grow(s.memory, float(i), level, i * 9 // 60)
    s.memory.device_used = int(904 * MB)
    fc = forecast(s, ForecastConfig())
    assert fc.seconds_linear < 1000  # the trend through the warm-up
    assert fc.trend_explained  # by the recordings, and they are over
    assert fc.seconds == FOREVER and fc.will_oom is False and fc.plateau_bytes == fc.level_bytes


def test_a_few_sizes_seen_once_are_not_saturation():
    s = State(now=10.0, calls=Calls(requests=12), shapes=Shapes(distinct=9), records=3,
              memory=Memory(device_used=0, device_total=1000 * MB))
    fc = forecast(s, ForecastConfig(headroom_bytes=0))
    assert fc.seconds_discovery is None  # not enough evidence either way: the trend decides


def _host_mode(rss_by_pid, t=100.0, total=64_000 * MB, available=40_000 * MB):
    """A host-memory server (no GPU): flat memory, folded from real samples."""
    from torch_watchdog.sidecar.config import CorrelateConfig
    from tests.folding import fold
    from torch_watchdog.sidecar.core.observations import ProcessSample, Sample

    obs = [Sample(t=t + i, processes=tuple(ProcessSample(pid, True, rss)
                                           for pid, rss in rss_by_pid.items()),
                  host_total_bytes=total, host_available_bytes=available) for i in range(5)]
    return fold(State(), obs, CorrelateConfig())


def test_a_server_already_over_its_budget_is_an_oom_now():
    # flat at 1,550 MB over a 1,300 MB budget: no growth, and still out of memory now
    s = _host_mode({11: 800 * MB, 12: 750 * MB})
    fc = forecast(s, ForecastConfig(process_budget_bytes=1_300 * MB))
    assert fc.seconds == 0.0 and fc.level_bytes == 1_550 * MB
    # under the budget and flat: no OOM forecast
    assert forecast(s, ForecastConfig(process_budget_bytes=2_000 * MB)).seconds == FOREVER


def test_each_process_against_a_per_process_budget():
    s = _host_mode({11: 900 * MB, 12: 300 * MB})
    # the server (1,200 MB) is under 2 x 1,000 MB, but worker 11 is over its own 800 MB
    fc = forecast(s, ForecastConfig(per_process_budget_bytes=800 * MB))
    assert fc.seconds == 0.0 and fc.level_bytes == 900 * MB and fc.budget_bytes == 800 * MB
    assert forecast(s, ForecastConfig(per_process_budget_bytes=1_000 * MB)).seconds == FOREVER


def test_host_memory_mode_forecasts_the_server_not_the_machine():
    """Issue 26: a flat 762 MiB FastAPI server showed "time to OOM ~5.1 h", moving 12 min ->
    5.1 h as other jobs ran: the machine's used memory was the level. Now the server's own
    PSS is, against its cgroup's limit where set, else the machine's available memory on top
    of the server's own."""
    from torch_watchdog.sidecar.config import CorrelateConfig
    from tests.folding import fold
    from torch_watchdog.sidecar.core.observations import ProcessSample, Sample

    def run(limit=None, grow=0):
        obs = [Sample(t=100.0 + i, processes=(ProcessSample(
                   11, True, 762 * MB + grow * i, pss_bytes=762 * MB + grow * i,
                   mem_limit_bytes=limit),),
                   host_total_bytes=16_000 * MB,  # other jobs come and go: 2 GB to 12 GB used
                   host_available_bytes=(14_000 - 10_000 * (i % 2)) * MB) for i in range(120)]
        return forecast(fold(State(), obs, CorrelateConfig()), ForecastConfig(headroom_bytes=0))

    flat = run()
    assert flat.seconds == FOREVER and flat.level_bytes == 762 * MB
    assert flat.budget_bytes == 762 * MB + 4_000 * MB  # the last sample: 4 GB available
    limited = run(limit=2_000 * MB, grow=10 * MB)
    assert limited.budget_bytes == 2_000 * MB and limited.level_bytes == 762 * MB + 1190 * MB
    assert limited.seconds < 10  # 48 MB left at 10 MB/s


def _request_rate_scan(state, window_s):
    """The request rate as computed before it was kept between polls: a scan every time."""
    recent = []
    for t, calls, *_ in reversed(state.calls.windows):
        if t < state.now - window_s:
            break
        recent.append((t, calls))
    recent.reverse()
    if len(recent) < 2:
        return None
    span = recent[-1][0] - recent[0][0]
    return sum(c for _, c in recent[1:]) / span if span > 0 else None




def test_a_saturated_model_refuted_by_new_recordings_leaves_the_forecast_to_the_trend():
    """Bucketed for an hour (9 sizes, 10,000 requests: saturated), then every length: 21 new
    recordings in the last minute, where the model expects none. The trend decides; with the
    recordings flat, the saturated model still says no OOM."""
    def state(records_now: int) -> State:
        s = State(now=60.0, calls=Calls(requests=10_600), shapes=Shapes(distinct=30),
                  records=records_now, memory=Memory(device_used=0, device_total=1000 * MB))
        for i in range(61):
            level = 900 * MB + i * MB
            grow(s.memory, float(i), level, 9 + (records_now - 9) * i // 60)
        s.calls.windows.extend(Window(float(t), 20, 1.0, 0, 0.0) for t in range(0, 61, 2))
        s.memory.device_used = int(960 * MB)
        return s

    refuted = forecast(state(30), ForecastConfig())
    assert refuted.seconds_discovery is None and refuted.seconds == refuted.seconds_linear
    assert refuted.seconds < 60 and refuted.cause == "cudagraph_per_shape"
    held = forecast(state(9), ForecastConfig())
    # the saturated model: no more growth from recordings; the growth with none is a leak
    assert held.seconds_discovery == FOREVER and held.plateau_bytes == held.level_bytes
    assert held.seconds == held.seconds_unexplained < 60
    assert held.cause == "memory_growth_unexplained"


def test_the_window_space_counts_the_sizes_seen_before_it():
    from torch_watchdog.sidecar.core.forecast import window_space
    # 104 requests over 385 sizes (18 seen before): ~87 new ones; the space read back
    s = window_space(104, 87, 18)
    assert 330 < s < 460
    assert window_space(500, 0, 40) == 40.0     # no new size in 500 requests: all seen
    # uniform draws: the estimate is near the truth
    rng = random.Random(3)
    seen = {rng.randrange(200) for _ in range(50)}
    before = len(seen)
    new = len({rng.randrange(200) for _ in range(300)} - seen)
    assert 150 < window_space(300, new, before) < 260


def test_calls_marks_give_the_counts_at_a_moment_back():
    from torch_watchdog import events
    c = Calls()
    for i, t in enumerate((10.0, 20.0, 30.0)):
        c.on_calls(events.Calls(t=t, pid=1, name="m", calls=5, seconds=0.1, stall_calls=0,
                                stall_seconds=0.0, distinct_shapes=0, window_s=10.0),
                   distinct=i + 1)
    assert c.at(5.0) is None
    assert c.at(25.0) == (20.0, 10, 2)
    assert c.at(30.0) == (30.0, 15, 3)


def test_a_graphs_cost_is_read_from_the_spans_recordings_not_the_warm_up_before_them():
    """GPT-2 sweeping new lengths: in the last minute 104 requests brought 87 new sizes (18 seen
    before). For its first 20 s new sizes were warmed up, growing 6 MB with no recording; then
    20 graphs were recorded at 0.5 MB each. What the sizes still to come can add is counted at
    0.5 MB a graph (about 185 MB: a server with 250 MB of room is not forecast to run out),
    not at the minute's growth over its recordings (0.76 MB a graph, 280 MB)."""
    from torch_watchdog import events
    from torch_watchdog.sidecar.core.forecast import graph_bound, window_space

    s = State(now=60.0, calls=Calls(), shapes=Shapes(distinct=105), records=21,
              memory=Memory(device_used=0, device_total=100_000 * MB))
    level = 1000 * MB
    for i in range(61):
        level += 0.3 * MB if i < 20 else 0.25 * MB
        s.memory.trend.append(float(i), level, 0 if i < 20 else 1 + (i - 20) // 2)
    for t, calls, distinct in ((0.0, 1000, 18), (60.0, 104, 105)):
        s.calls.on_calls(events.Calls(t=t, pid=1, name="m", calls=calls, seconds=1.0,
                                      stall_calls=0, stall_seconds=0.0, distinct_shapes=0,
                                      window_s=1.0), distinct=distinct)
    rate = 16 * MB / 60   # the horizon's rate: the warm-up and the recordings together
    bound = graph_bound(s, 60.0, rate)
    to_come = window_space(104, 87, 18) - 21
    assert bound is not None
    assert bound / to_come == pytest.approx(0.5 * MB, rel=0.1)
    assert bound < 250 * MB
    # every recording in one poll: the span's growth per recording, as before
    burst = State(now=60.0, calls=s.calls, shapes=Shapes(distinct=105), records=20,
                  memory=Memory(device_used=0, device_total=100_000 * MB))
    for i in range(61):
        burst.memory.trend.append(float(i), 1000 * MB + i * MB, 0 if i < 59 else 20)
    assert graph_bound(burst, 60.0, MB) == pytest.approx(
        (window_space(104, 87, 18) - 20) * MB * 60 / 20)


def test_the_shape_space_is_read_from_where_new_sizes_began():
    """ResNet served one image size for the first 40 s of the minute (6,000 requests), then 80
    requests brought 80 new sizes with 20 recordings. The 6,000 repeats say how often the old
    size came, not how many new ones follow: read over the whole minute the space looked
    saturated (about 81 sizes: 60 graphs to come, 30 MB at 0.5 MB, under 40 MB of room, no
    OOM forecast). Read from the mark where new sizes began, it has no end in sight (80 new
    sizes in 80 requests): the cap does not hold the OOM forecast back."""
    from torch_watchdog import events
    from torch_watchdog.sidecar.core.forecast import graph_bound

    s = State(now=60.0, calls=Calls(), shapes=Shapes(distinct=81), records=20,
              memory=Memory(device_used=0, device_total=100_000 * MB))
    for i in range(61):
        s.memory.trend.append(float(i), 1000 * MB + max(0, i - 40) * 0.5 * MB,
                              0 if i <= 40 else i - 40)
    marks = [(t, 150, 1) for t in range(0, 41)] + [(t, 4, 5) for t in range(41, 61)]
    for t, calls, distinct in marks:
        s.calls.on_calls(events.Calls(t=float(t), pid=1, name="m", calls=calls, seconds=1.0,
                                      stall_calls=0, stall_seconds=0.0, distinct_shapes=0,
                                      window_s=1.0), distinct=(distinct if t <= 40
                                                               else 1 + 4 * (t - 40)))
    assert graph_bound(s, 60.0, 0.5 * MB) is None   # every request since a new size: no end
    # a minute of steady traffic that brings its new sizes spread out is read whole
    steady = State(now=60.0, calls=Calls(), shapes=Shapes(distinct=45), records=20,
                   memory=s.memory)
    for t in range(61):
        steady.calls.on_calls(events.Calls(t=float(t), pid=1, name="m", calls=10, seconds=1.0,
                                           stall_calls=0, stall_seconds=0.0,
                                           distinct_shapes=0, window_s=1.0),
                              distinct=5 + (40 * t) // 60)
    bound = graph_bound(steady, 60.0, 0.5 * MB)
    assert bound is not None and bound > 0


def test_each_recent_part_lasts_as_long_again_then_the_rate_after_it():
    from torch_watchdog.sidecar.core.forecast import lasting

    parts = [(60.0, 1 * MB), (30.0, 2 * MB), (15.0, 4 * MB), (7.5, 8 * MB)]
    assert lasting(45 * MB, parts, 0.5 * MB) == pytest.approx(45 / 8)   # within the eighth
    # 60 + 30 + 30 + 30 MB over the next minute, the 50 MB left at 0.5 MB/s
    assert lasting(200 * MB, parts, 0.5 * MB) == pytest.approx(60 + 50 / 0.5)
    assert lasting(200 * MB, parts, 0.0) == FOREVER
    assert lasting(-1 * MB, parts, 0.5 * MB) == 0.0   # past the fail level already
    assert lasting(100 * MB, parts, 0.5 * MB, share=0.5) == pytest.approx(60 + 25 / 0.25)


def _burst_after(history_s: int, room: float) -> State:
    """Graph growth at 0.05 MB/s for `history_s`, a recording every poll, then 15 s of a
    burst of recordings at 0.5 MB/s; `room` left under the fail level."""
    s = State(now=float(history_s + 15), memory=Memory(device_used=0, device_total=0))
    level = 1000 * MB
    for i in range(history_s + 16):
        level += 0.5 * MB if i > history_s else 0.05 * MB
        grow(s.memory, float(i), level, i)
    s.memory.device_used = int(level)
    s.memory.device_total = int(level + room + FAIL_FREE_BYTES)
    return s


def test_a_burst_of_recordings_is_not_the_rate_of_growth_read_over_an_hour():
    """Graph growth read over an hour at 0.05 MB/s, then a 15 s burst of recordings at 0.5
    MB/s with 25 MB of room: the burst's rate says an OOM in 50 s (a reload now), but it has
    lasted 15 s. Each part of the window taken to go on for as long again, then the window's
    own rate (0.16 MB/s, above the hour's), the OOM is about 2 minutes away: no reload while
    the burst may end. Over two minutes of history the recent rate is the growth's."""
    slow = forecast(_burst_after(3600, 25 * MB), ForecastConfig())
    assert slow.trend_explained and slow.trend_horizon_s >= 1800
    assert slow.growth_bytes_per_s == pytest.approx(0.5 * MB, rel=0.1)  # the burst's
    assert 100 < slow.seconds < 130
    fast = forecast(_burst_after(100, 25 * MB), ForecastConfig())
    assert fast.trend_explained and fast.trend_horizon_s == 120.0
    assert fast.seconds == pytest.approx(50, rel=0.15)


def test_new_sizes_over_the_trends_horizon_refute_a_saturated_shape_space():
    """Six hours at 6 requests/s over a growing mix: 130,000 requests brought 400 sizes, which
    the cumulative counts call saturated (about 400 sizes, every one recorded). The last 30
    minutes, the horizon the trend reads, brought 130 of them in 10,800 requests, where a
    saturated space brings none: the model does not apply and the trend decides. A window of
    a minute holds 4 or 5 of them, too few to say so (the forecast came and went)."""
    from torch_watchdog import events
    from torch_watchdog.sidecar.core.forecast import outgrown, saturated

    def state(new_in_horizon: int) -> State:
        s = State(now=21_600.0, calls=Calls(), shapes=Shapes(distinct=400), records=400,
                  memory=Memory(device_used=0, device_total=100_000 * MB))
        for t in range(0, 21_601, 60):
            late = t > 21_600 - 1800
            distinct = 400 - new_in_horizon + (new_in_horizon * (t - 19_800) // 1800
                                               if late else 0)
            s.calls.on_calls(events.Calls(t=float(t), pid=1, name="m", calls=360, seconds=1.0,
                                          stall_calls=0, stall_seconds=0.0,
                                          distinct_shapes=0, window_s=60.0), distinct=distinct)
        s.memory.reading = horizons.Reading(1800.0, 0.02 * MB, 0.9, 20, 2 * MB, 21_500.0,
                                            60.0, 90.0)
        return s

    grown = state(130)
    space = shape_space(grown.calls.requests, grown.shapes.distinct)
    assert saturated(space, grown.calls.requests, grown.records)
    assert outgrown(grown, space)
    assert forecast(grown, ForecastConfig()).seconds_discovery is None
    # the same counts with the last half hour's traffic all of sizes seen before: saturated
    settled = state(0)
    assert not outgrown(settled, space)
    assert forecast(settled, ForecastConfig()).seconds_discovery == FOREVER
    # no horizon read (no growth): nothing to refute the saturated space with
    settled.memory.reading = None
    assert not outgrown(settled, space)
