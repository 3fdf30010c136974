"""A server's state folded from hand-built observation sequences (no I/O, fake times), as the
step folds it (tests/folding.py)."""
import dataclasses

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.config import CorrelateConfig
from tests.folding import fold
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.observations import DeviceSample, ProcessSample, Sample

MB = 1_000_000
CFG = CorrelateConfig()


def sample(t, proc, used=None, total=100_000 * MB, pid=7):
    used = proc if used is None else used
    return Sample(t=t, devices=(DeviceSample("GPU-a", used, total, total - used),),
                  processes=(ProcessSample(pid, True, 1, {"GPU-a": proc}),))


def record(t):
    return events.CudagraphRecord(t=t, pid=7, phase="record", compile_id="0/1", key=[t],
                                  shape=None, seconds=0.01)


def compile_(t, cid="0/0", seconds=1.0):
    kind = events.Recompile if not cid.endswith("/0") else events.Compile
    extra = {"reason": "r"} if kind is events.Recompile else {}
    return kind(t=t, pid=7, compile_id=cid, function="f", seconds=seconds, **extra)


def run(observations, cfg=CFG):
    return fold(State(), observations, cfg)


def test_mb_per_graph_from_per_poll_regression_with_steps_left_out():
    obs, mem, t = [compile_(1.0)], 2000 * MB, 20.0
    obs.append(sample(t, mem))
    for i in range(60):  # 2 recordings per poll at 0.5 MB each, plus noise-free
        t += 0.1
        obs += [record(t), record(t)]
        mem += 1 * MB
        if i == 30:
            mem += 500 * MB  # a one-poll step (allocator segment): not the graphs' cost
        obs.append(sample(t + 0.01, mem))
    obs.append(sample(t + 70, mem))  # no compile claimed the step within a minute
    s = run(obs)
    assert s.records == 120
    assert s.memory.mb_per_graph == pytest.approx(0.5, rel=1e-6)
    assert s.memory.regression.confidence == pytest.approx(1.0)
    causes = [f.cause for f in s.findings]
    assert "cudagraph_per_shape" in causes
    # the 500 MB step came at no compile: it is growth nothing explains
    assert "memory_growth_unexplained" in causes
    assert s.unexplained_bytes() == pytest.approx(500 * MB)


def test_a_step_during_a_compile_is_the_compiles():
    # the compile event arrives when the compile ends, after the memory step it caused
    obs = [compile_(1.0), sample(20.0, 1000 * MB), record(20.5), sample(21.0, 1000 * MB),
           sample(25.0, 1600 * MB), compile_(26.0, "0/1", seconds=3.0), sample(26.5, 1600 * MB)]
    s = run(obs)
    assert s.memory.compile_jump_bytes == 600 * MB and s.unexplained_bytes() == 0
    assert not s.findings


def test_a_step_no_compile_claims_becomes_unexplained_after_a_while():
    obs = [compile_(1.0), sample(20.0, 1000 * MB), record(20.5), sample(21.0, 1000 * MB),
           sample(25.0, 1600 * MB), sample(80.0, 1600 * MB)]
    s = run(obs)
    assert not s.findings  # 55 s: a compile may still claim it
    s = fold(s, [sample(90.0, 1600 * MB)], CFG)
    assert s.findings[0].cause == "memory_growth_unexplained" and s.findings[0].t == 90.0


def test_a_zero_threshold_waits_for_a_memory_reading():
    """correlate.unexplained_bytes: 0 (the config allows it): an agent's events before any
    memory reading are no unexplained growth (they raised TypeError), a step after is."""
    cfg = dataclasses.replace(CFG, unexplained_bytes=0)
    s = run([events.Heartbeat(t=1.0, pid=7, seq=1, uptime_s=1.0, queue_depth=0, errors=0)], cfg)
    assert not s.findings
    s = fold(s, [compile_(2.0), sample(20.0, 1000 * MB), sample(25.0, 1600 * MB),
                 sample(90.0, 1600 * MB)], cfg)
    assert [f.cause for f in s.findings] == ["memory_growth_unexplained"]


def test_falls_back_to_device_memory_without_per_process_numbers():
    obs = [Sample(t=1.0, devices=(DeviceSample("GPU-a", 10 * MB, 100 * MB),),
                  processes=(ProcessSample(7, True, 1, {"GPU-a": None}),))]
    s = run(obs)
    assert s.memory.source == "device" and s.memory.bytes == 10 * MB


def test_agent_reported_limit_hit_is_the_fallback():
    obs = [events.Hello(t=0.0, pid=7, torch="2.11", agent="x", devices=[], config={
        "recompile_limit": 3}, capabilities={}, watched=[], argv=""),
        events.RecompileLimit(t=5.0, pid=7, function="forward", limit=3, reason="size",
                              compile_id="0/3")]
    s = run(obs)
    (f,) = s.findings
    assert f.cause == "recompile_limit_eager_fallback" and f.detail["source"] == "agent"
    assert f.as_dict()["cause"] == f.cause and f.detail["last_reason"] == "size"
    assert s.compiles.limit == 3 and s.compiles.limit_hits == 1


def new_shape(t, n):
    return events.NewShape(t=t, pid=7, name="m", shape=[[1, n]], seconds=0.06, distinct=n)


def test_limit_inferred_only_when_new_shapes_stop_compiling():
    cfg = CorrelateConfig(default_recompile_limit=3, storm_recompiles=99)
    obs = [compile_(1.0), compile_(2.0, "0/1"), compile_(3.0, "0/2"),  # 3 compiles: the limit
           new_shape(3.5, 1), new_shape(3.6, 2)]
    s = run(obs, cfg)
    assert not s.findings  # two new shapes: not yet
    s = fold(s, [new_shape(3.7, 3)], cfg)
    (f,) = s.findings
    assert f.cause == "recompile_limit_eager_fallback" and f.detail["source"] == "inferred"


def test_compiling_past_the_assumed_limit_cancels_the_inference():
    cfg = CorrelateConfig(default_recompile_limit=2, storm_recompiles=99)
    s = run([compile_(1.0), compile_(2.0, "0/1"), compile_(3.0, "0/2"),
             new_shape(4, 1), new_shape(5, 2), new_shape(6, 3)], cfg)
    assert not s.findings and s.compiles.limit_t is None


def test_recompile_storm_comes_and_goes():
    cfg = CorrelateConfig(storm_recompiles=3, storm_window_s=10)
    s = run([compile_(0.0)] + [compile_(float(i), f"0/{i}") for i in (1, 2, 3)], cfg)
    assert [f.cause for f in s.findings] == ["recompile_storm"]
    s = fold(s, [sample(30.0, 1 * MB)], cfg)
    assert "recompile_storm" not in s.active


def test_an_active_cause_says_its_numbers_now_and_its_finding_the_first():
    """"recompile_storm: 4 recompiles within 5 min" while the counts said 7, and "256 MiB of
    332 MiB growth" while the server grew ~700 MiB more: the texts kept their first numbers."""
    cfg = CorrelateConfig(storm_recompiles=4, storm_window_s=300, unexplained_bytes=200 * MB)
    storm = run([compile_(0.0)] + [compile_(float(i), f"0/{i}") for i in (1, 2, 3, 4)], cfg)
    assert storm.active["recompile_storm"].detail["recompiles_in_window"] == 4
    storm = fold(storm, [compile_(float(i), f"0/{i}") for i in (5, 6, 7)]
                 + [sample(9.0, 1000 * MB)], cfg)
    assert storm.active["recompile_storm"].detail["recompiles_in_window"] == 7 == \
        storm.compiles.recompiles
    leak = run([compile_(1.0), sample(20.0, 1000 * MB), sample(25.0, 1600 * MB),
                sample(90.0, 1600 * MB)], cfg)
    assert leak.active["memory_growth_unexplained"].detail["growth_mb"] == 600.0
    leak = fold(leak, [sample(100.0 + i, 1600 * MB + i * 100 * MB) for i in range(8)]
                + [sample(200.0, 2300 * MB)], cfg)
    assert leak.active["memory_growth_unexplained"].detail == {"unexplained_mb": 1300.0,
                                                               "growth_mb": 1300.0}
    # the findings (logged once, when found) keep what they said then
    assert storm.findings[0].detail["recompiles_in_window"] == 4
    assert leak.findings[0].detail["growth_mb"] == 600.0


def test_steady_latency_excludes_stalls():
    calls = events.Calls(t=10.0, pid=7, name="m", calls=101, seconds=5.1, stall_calls=1,
                         stall_seconds=5.0, distinct_shapes=2, window_s=2.0)
    s = run([calls])
    assert s.calls.steady_ms() == pytest.approx(1.0) and s.calls.requests == 101


def _in(pid, e):
    return dataclasses.replace(e, pid=pid)


def test_workers_compiling_the_same_frame_are_not_a_storm_or_a_limit():
    # 4 workers, each the normal compile + one recompile of frame 0: 8 attempts at frame 0 in
    # all, 2 per process; counted across pids they were a storm and an inferred fallback
    cfg = CorrelateConfig(default_recompile_limit=3, storm_recompiles=3, storm_window_s=60)
    obs = []
    for pid in (11, 12, 13, 14):
        obs += [_in(pid, compile_(1.0 + pid)), _in(pid, compile_(1.5 + pid, "0/1"))]
    obs += [_in(11, new_shape(30.0 + i, i + 1)) for i in range(5)]
    s = run(obs, cfg)
    assert s.compiles.recompiles == 4 and s.compiles.compiles == 4
    assert not s.findings and s.compiles.limit_t is None
    # one process recompiling 3 times is a storm, whatever the others do
    s = fold(s, [_in(12, compile_(40.0 + i, f"0/{i + 2}")) for i in range(2)], cfg)
    assert [f.cause for f in s.findings] == ["recompile_storm"]
    assert s.findings[0].detail["recompiles_in_window"] == 3


def test_distinct_shapes_are_unique_across_workers():
    ns = [_in(pid, new_shape(1.0 + i, n)) for i, (pid, n) in
          enumerate([(11, 1), (12, 1), (11, 2), (12, 2), (12, 3)])]
    # sizes [1,1], [1,2], [1,3] in both workers: 3 distinct, not 5
    s = run(ns)
    assert s.shapes.distinct == 3
    # a worker whose own count is ahead (its earlier new_shape events were dropped) is a floor
    s = fold(s, [events.NewShape(t=9.0, pid=13, name="m", shape=[[1, 9]], seconds=0.1,
                                 distinct=7)], CFG)
    assert s.shapes.distinct == 7


def test_agent_losses_are_counted_from_the_reports_totals_so_a_lost_report_is_not_lost():
    """Issue 28, item 8: a drop report lost on the way (the queue was full) is counted by the
    next one, whose `total` covers it; totals are per process and reason."""
    def dropped(t, pid, reason, count, total):
        return events.Dropped(t=t, pid=pid, reason=reason, count=count, total=total)

    s = run([dropped(1.0, 7, "queue_full", 10, 10),
             # (total 25, count 15: never arrived)
             dropped(3.0, 7, "queue_full", 5, 30),
             dropped(3.0, 8, "queue_full", 4, 4), dropped(3.5, 7, "socket", 2, 2),
             dropped(4.0, 7, "queue_full", 0, 30)])  # a repeat of a total adds nothing
    assert s.losses.total == 36


def test_a_heartbeat_tells_every_loss_even_once_the_drop_reports_stopped():
    """The last drop reports were lost (or dropped by an overloaded sidecar) and nothing is
    dropped any more, so no report comes again: every heartbeat carries the agent's whole
    count (`lost`), and a process's part is the larger of that and its reports' sum."""
    def beat(t, pid, lost):
        return events.Heartbeat(t=t, pid=pid, seq=1, uptime_s=t, queue_depth=0, errors=0,
                                lost=lost)

    s = run([events.Dropped(t=1.0, pid=7, reason="queue_full", count=10, total=10),
             beat(2.0, 7, 150),            # 140 more lost, told by no report that arrived
             events.Dropped(t=3.0, pid=7, reason="socket", count=60, total=60),  # 10 + 60
             beat(3.0, 8, 5),
             beat(4.0, 7, None),           # an older agent's heartbeat: no count
             beat(5.0, 7, 170)])
    assert s.losses.total == 170 + 5
