"""history.py: the status page's bounded memory series, marks and actions."""
from __future__ import annotations

import dataclasses

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.present.history import History, Thinned, memory_level
from torch_watchdog.sidecar.core.results import Alert, Reload
from torch_watchdog.sidecar.core.observations import DeviceSample
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.status import build_status

GIB = 1 << 30


def snap(t: float, **kw) -> Snapshot:
    return Snapshot(t=t, **kw)


def test_thinned_stays_bounded_and_covers_the_whole_run():
    th = Thinned(100, lambda a, b: a)
    for i in range(360_000):  # ten hours at the default 0.1 s poll
        th.add(i)
        assert len(th.items) < 100
    view = th.view()
    assert 50 <= len(view) <= 100
    assert view[0] == 0 and view[-1] == 359_999        # the start and "now" are both there
    gaps = [b - a for a, b in zip(view, view[1:-1])]
    assert max(gaps) == min(gaps)                       # evenly spread, no hole in the story
    assert th.added == 360_000


def test_points_keep_the_peaks_when_thinned():
    h = History(max_points=64)
    for i in range(10_000):
        level = 50 * GIB if i == 4321 else GIB + i  # a one-poll spike, e.g. just before an OOM
        h.update(snap(float(i), server_rss_bytes=level), [], [])
    points = h.view(snap(9999.0)).points
    assert len(points) <= 64
    assert max(b for _, b in points) == 50 * GIB
    assert [t for t, _ in points] == sorted(t for t, _ in points)
    assert points[-1] == (9999.0, GIB + 9999)


@pytest.mark.parametrize("kw, expected", [
    ({"server_gpu_bytes": {"GPU-a": 3 * GIB, "GPU-b": GIB}, "server_rss_bytes": 5},
     (4 * GIB, "process")),
    # NVML will not say for one GPU (MIG, containers): the devices' used memory instead
    ({"server_gpu_bytes": {"GPU-a": 3 * GIB, "GPU-b": None},
      "devices": (DeviceSample("GPU-a", 7 * GIB, 80 * GIB),
                  DeviceSample("GPU-b", 2 * GIB, 80 * GIB))}, (9 * GIB, "device")),
    ({"server_rss_bytes": 2 * GIB}, (2 * GIB, "rss")),       # host-memory mode
    ({}, (None, None)),
])
def test_memory_level_prefers_the_server_process_then_device_then_rss(kw, expected):
    assert memory_level(snap(1.0, **kw)) == expected


def test_unknown_memory_adds_no_point():
    h = History()
    h.update(snap(1.0), [], [])
    h.update(snap(2.0, server_rss_bytes=GIB), [], [])
    view = h.view(snap(2.0))
    assert view.points == ((2.0, GIB),) and view.memory_source == "rss"
    assert view.first_t == 1.0


def test_polls_without_a_reading_break_the_line():
    """A reload's gap (no process of the server's for 25 s): the page drew a diagonal across
    it. The first point after the gap starts a new stretch; no break before any point."""
    h = History()
    h.update(snap(1.0), [], [])
    for t in (2.0, 3.0):
        h.update(snap(t, server_rss_bytes=GIB), [], [])
    for t in (4.0, 29.0):
        h.update(snap(t), [], [])
    h.update(snap(30.0, server_rss_bytes=2 * GIB), [], [])
    view = h.view(snap(30.0, servers={"llm": {"pids": [7]}}, focus="llm"))
    assert view.breaks == (30.0,)
    page = render_page(build_status(view, 30.0), 30.0)
    assert page.count('class="memory-line"') == 2


def _record(t: float, phase: str = "record") -> events.CudagraphRecord:
    return events.CudagraphRecord(t=t, pid=1, phase=phase, compile_id="0/1", key=[int(t)],
                                  shape=None, seconds=0.01)


def test_marks_from_agent_events_warmups_and_samples_left_out():
    h = History()
    obs = [_record(1.0, "warmup"), _record(2.0),
           events.Compile(t=0.5, pid=1, compile_id="0/0", function="f", seconds=3.0),
           events.Recompile(t=3.0, pid=1, compile_id="0/1", function="f", seconds=2.0,
                            reason="size mismatch"),
           events.RecompileLimit(t=4.0, pid=1, function="f", limit=8, reason="r",
                                 compile_id="0/8"),
           events.Oom(t=5.0, pid=1, source="exception", device=0, requested_bytes=1,
                      limit_bytes=None, free_bytes=None, message="m"),
           events.Heartbeat(t=5.5, pid=1, seq=1, uptime_s=1.0, queue_depth=0, errors=0)]
    h.update(snap(6.0), obs, [])
    assert h.view(snap(6.0)).marks == ((0.5, "compile"), (2.0, "record"), (3.0, "recompile"),
                                       (4.0, "recompile_limit"), (5.0, "oom"))


def test_thousands_of_recordings_never_push_out_the_one_reload():
    h = History(max_marks=50)
    h.act(100.0, "reload", "oom_forecast", {"dry_run": False})
    for i in range(20_000):
        h.observe([_record(float(i))])
    view = h.view(snap(20_000.0))
    kinds = [k for _, k in view.marks]
    assert kinds.count("reload") == 1 and kinds.count("record") <= 50
    assert view.marks_total == {"reload": 1, "record": 20_000}
    assert [t for t, _ in view.marks] == sorted(t for t, _ in view.marks)


def test_actions_keep_the_last_twenty_with_reload_outcomes():
    h = History()
    for i in range(30):
        h.update(snap(float(i)), [], [Alert(float(i), f"cause{i}", {"n": i}, "a", (), ())])
    h.act(31.0, "reload_not_done", "oom_forecast", {"outcome": "not carried out: dry run"})
    actions = h.view(snap(31.0)).actions
    assert len(actions) == 20
    assert actions[0]["reason"] == "cause11"
    assert actions[-1] == {"t": 31.0, "action": "reload_not_done", "reason": "oom_forecast",
                           "detail": {"outcome": "not carried out: dry run"},
                           "server": None, "pids": []}
    # a reload outcome is an action, not a new mark (the decision was marked)
    assert h.view(snap(31.0)).marks == ()


def test_a_published_view_does_not_change_with_later_ticks():
    h = History()
    detail = {"recordings": 20}
    h.update(snap(1.0, server_rss_bytes=GIB), [_record(1.0)],
             [Reload(1.0, "oom_forecast", {}, "a", (), (), cause="oom_forecast", dry_run=True,
                     not_done=None)])
    view = h.view(snap(1.0), [{"cause": "cudagraph_per_shape", "t": 1.0, **detail}],
                  {"polls": 1})
    before = dataclasses.replace(view)
    h.update(snap(2.0, server_rss_bytes=2 * GIB), [_record(2.0)],
             [Alert(2.0, "x", {}, "a", (), ())])
    detail["recordings"] = 99
    assert view == before
    assert view.points == ((1.0, GIB),) and len(view.actions) == 1
    assert view.causes[0]["recordings"] == 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.points = ()  # type: ignore[misc]


def test_a_server_gone_for_the_retention_leaves_the_page_and_its_pids_with_it():
    """A churn soak listed 106 stopped servers after all had exited, and the page's memory
    and cost grew with every server the host ever ran."""
    from torch_watchdog.sidecar.core.lifecycle import RETAIN_S

    h = History()
    view = {"estimates": {"memory_bytes": 5, "memory_source": "process"}, "pids": [101]}
    for i in range(200):  # 200 short-lived servers, one after the other
        h.update(Snapshot(t=1000.0 + i, servers={f"s{i}": dict(view, pids=[1000 + i])}), [], [])
    assert len(h.series) == 200 and h.owner == {1199: "s199"}
    h.update(Snapshot(t=1198.0 + RETAIN_S + 0.5, servers={}), [], [])
    assert list(h.series) == ["s199"]
    h.update(Snapshot(t=1200.0 + RETAIN_S + 0.5, servers={}), [], [])
    assert h.series == {} and h.owner == {}
