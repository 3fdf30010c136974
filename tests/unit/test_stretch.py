"""benchmarks/corpus/stretch.py on a small synthetic sample log: the stretched growth has the
same levels, K times the duration, the same poll and heartbeat cadence; the rest moves whole."""
from __future__ import annotations

import itertools
import os
import sys

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.core.observations import DeviceSample, ProcessSample, Sample
from torch_watchdog.sidecar.offline.traces import Reader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "corpus"))
import stretch  # noqa: E402

PID, GPU, POLL = 7, "GPU-x", 0.1
START, END = 5.0, 10.0     # the growth: +100 MB a second from 5 s to 10 s, then flat


def level(t: float) -> int:
    steps = 0 if t < START else min(5, int(t - START) + 1)
    return 1000_000_000 + steps * 100_000_000


def sample(t: float) -> Sample:
    used = level(t)
    return Sample(t=t, devices=(DeviceSample(GPU, used, 80 << 30, (80 << 30) - used),),
                  processes=(ProcessSample(PID, True, None, {GPU: used}),))


def log(seconds: float = 20.0) -> list:
    """Polls every 0.1 s, a heartbeat every 2 s, a hello every 3 s, a `calls` every 2 s over
    the 2 s before it, a new shape at 7.05 s, the OOM at 10 s."""
    out = []
    for i in range(int(round(seconds / POLL)) + 1):
        t = round(i * POLL, 6)
        out.append(sample(t))
        if i == 100:
            out.append(events.Oom(t=10.0, pid=PID, source="allocator", device=0,
                                  requested_bytes=1, limit_bytes=None, free_bytes=None,
                                  message=None))
        if i % 30 == 0:
            out.append(events.Hello(t=t + 0.01, pid=PID, torch="x", agent="x", devices=[GPU],
                                    config={}, capabilities={}, watched=["m"], argv=""))
        if i % 20 == 0:
            out.append(events.Heartbeat(t=t + 0.02, pid=PID, seq=i // 20 + 1,
                                        uptime_s=t + 0.02 + 3.0, queue_depth=0, errors=0))
        if i % 20 == 0 and i:
            out.append(events.Calls(t=t + 0.03, pid=PID, name="m", calls=50, seconds=0.5,
                                    stall_calls=0, stall_seconds=0.0, distinct_shapes=3,
                                    window_s=2.0))
        if i == 70:
            out.append(events.NewShape(t=7.05, pid=PID, name="m", shape=[[1, 9]], seconds=0.2,
                                       distinct=4))
    return out


def runs(samples: list[Sample]) -> list[tuple[int, float, float]]:
    """(level, its first poll's time, the next level's first poll's time) for each run of one
    level (the last: to the last poll)."""
    out: list[list] = []
    for s in samples:
        used = s.devices[0].used_bytes
        if out and out[-1][0] == used:
            out[-1][2] = s.t
        else:
            if out:
                out[-1][2] = s.t
            out.append([used, s.t, s.t])
    return [tuple(r) for r in out]


def of(kind: type, observations: list) -> list:
    return [o for o in observations if isinstance(o, kind)]


@pytest.mark.parametrize("k", [10, 60])
def test_the_growth_keeps_its_levels_for_k_times_as_long_at_the_same_poll_cadence(k):
    recorded = log()
    out = list(stretch.stretch(iter(recorded), START, END, k))
    before, after = of(Sample, recorded), of(Sample, out)
    # the same levels, in the same order; inside the window each held k times as long
    got, want, f = runs(after), runs(before), stretch.TimeMap(START, END, k)
    assert [u for u, _, _ in got] == [u for u, _, _ in want] and len(got) == 6
    for (_u, a, b), (_, a0, b0) in zip(got, want):
        assert a == pytest.approx(f(a0)) and b - a == pytest.approx(f(b0) - f(a0), abs=POLL)
    for (_u, a, b), (_, a0, b0) in zip(got[1:-1], want[1:-1]):   # the steps inside the window
        assert b - a == pytest.approx(k * (b0 - a0))
    # polls at 10 Hz throughout, k times as many in the growth
    gaps = [b.t - a.t for a, b in zip(after, after[1:])]
    assert min(gaps) == pytest.approx(POLL) and max(gaps) == pytest.approx(POLL)
    in_window = [s for s in after if START <= s.t < START + k * (END - START)]
    assert len(in_window) == k * len([s for s in before if START <= s.t < END])
    # the OOM and the last poll moved: by the map inside the window, by the shift after it
    assert of(events.Oom, out)[0].t == pytest.approx(START + k * (END - START))
    assert after[-1].t == pytest.approx(20.0 + (k - 1) * (END - START))
    assert of(events.NewShape, out)[0].t == pytest.approx(START + k * (7.05 - START))
    # observations stay in time order
    assert all(b.t >= a.t for a, b in zip(out, out[1:]))


def test_heartbeats_and_hellos_keep_their_cadence_and_calls_their_counts():
    k = 10
    recorded = log()
    out = list(stretch.stretch(iter(recorded), START, END, k))
    beats = of(events.Heartbeat, out)
    gaps = [b.t - a.t for a, b in zip(beats, beats[1:])]
    assert max(gaps) == pytest.approx(2.0, abs=0.05)     # never silent longer than recorded
    assert [b.seq for b in beats] == list(range(1, len(beats) + 1))
    # uptime counts the stretched time from the same start
    assert all(b.uptime_s == pytest.approx(b.t + 3.0) for b in beats)
    stretched_s = 20.0 + (k - 1) * (END - START)
    assert len(beats) == pytest.approx(stretched_s / 2.0, abs=2)
    hellos = of(events.Hello, out)
    gaps = [b.t - a.t for a, b in zip(hellos, hellos[1:])]
    # every 3 s; where the window's start cuts a period, what is left of it (under 1.5 x)
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(3.0) and max(gaps) < 4.5
    calls = of(events.Calls, out)
    assert len(calls) == len(of(events.Calls, recorded))   # the same windows, mapped
    assert sum(c.calls for c in calls) == sum(c.calls for c in of(events.Calls, recorded))
    inside = [c for c in calls if c.t - c.window_s >= START and c.t <= START + k * (END - START)]
    assert inside and all(c.window_s == pytest.approx(2.0 * k) for c in inside)
    for c in calls:   # windows still tile the time: each starts where the one before ended
        assert c.window_s == pytest.approx(c.t - stretch.TimeMap(START, END, k)(
            next(r for r in of(events.Calls, recorded) if r.calls == c.calls
                 and abs(stretch.TimeMap(START, END, k)(r.t) - c.t) < 1e-6).t - 2.0))


def test_k_1_is_the_recorded_log():
    recorded = log()
    assert list(stretch.stretch(iter(recorded), START, END, 1)) == recorded


def test_the_log_is_read_as_it_is_written_not_held_whole():
    """An endless recorded log: the stretched one comes out while it is read, never more
    than LOOKAHEAD_S of recorded time ahead of what came out."""
    read = [0.0]

    def endless():
        for i in itertools.count():
            read[0] = i * POLL
            yield sample(i * POLL)

    k = 360
    out = stretch.stretch(endless(), START, 1e9, k)
    for obs in itertools.islice(out, 50_000):
        original = START + (obs.t - START) / k if obs.t > START else obs.t
        assert read[0] - original <= stretch.LOOKAHEAD_S + 1.0


def test_a_stretched_log_written_reads_back_the_same(tmp_path):
    recorded = log()
    path = tmp_path / "stretched.jsonl"
    out = list(stretch.stretch(iter(recorded), START, END, 10))
    path.write_bytes(b"".join(stretch.encode(o) + b"\n" for o in out))
    assert list(Reader(str(path))) == out


def test_labels_move_with_the_log():
    label = {"file": "x.jsonl.gz", "servers": {"7": {
        "scenario": "leak", "compiled_t": 1.0, "growth_t": START, "oom_t": END, "end_t": 12.0,
        "budget_bytes": 1, "growth_visible_s": END - START}}}
    assert stretch.window(label) == (START, END)
    moved = stretch.stretched_label(label, 60)["servers"]["7"]
    assert moved["oom_t"] == START + 60 * (END - START)
    assert moved["end_t"] == 12.0 + 59 * (END - START)
    assert moved["growth_visible_s"] == 60 * (END - START)
    assert moved["compiled_t"] == 1.0
