"""The host view (issue 40): three servers on one host, one growing, one in a recompile storm,
one idle. Every surface lists each server with its own numbers, a drill-down shows one server
and never another's, a stopped server reads down at once, and a reload held back says why and
until when, on the page, in `status` and in /metrics."""
from __future__ import annotations

import re

from prometheus_client import generate_latest

from torch_watchdog import events
from torch_watchdog.sidecar.core.observations import DeviceSample, ProcessSample, Sample
from torch_watchdog.sidecar.core.results import Alert, Reload
from torch_watchdog.sidecar.present.history import History
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.publisher import Publisher, _with_processes
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.status import build_status, format_terminal
from torch_watchdog.sidecar.present.units import fmt_bytes

GIB = 1 << 30
T = 1_700_000_000.0
PIDS = {"growing": 11, "storm": 22, "idle": 33}
BUDGET = 20 * GIB
COOLDOWN = {"reason": "cooldown", "since_t": T + 5, "until_t": T + 600,
            "last_reload_t": T, "cooldown_s": 600.0}


def server(name: str, k: int, up: bool = True, held=None) -> dict:
    memory = {"growing": (5 + k) * GIB, "storm": 3 * GIB, "idle": 1 * GIB}[name]
    estimates = {"memory_bytes": memory, "memory_source": "process",
                 "recordings": 10 * k if name == "growing" else 0,
                 "compiles": 1, "recompiles": 2 * k if name == "storm" else 0,
                 "distinct_shapes": 10 * k if name == "growing" else 3, "requests": 100}
    seconds = 90.0 if name == "growing" else None
    return {"estimates": estimates,
            "forecast": {"seconds_to_oom": seconds, "seconds_to_oom_linear": seconds,
                         "budget_bytes": BUDGET, "level_bytes": memory},
            "active_causes": {"growing": ("cudagraph_per_shape",),
                              "storm": ("recompile_storm",), "idle": ()}[name],
            "pids": [PIDS[name]], "gpus": [f"GPU-{name}"],
            "held": held if name == "growing" else None,
            "gpu_bytes": {f"GPU-{name}": memory}, "rss_bytes": GIB, "up": up}


FIRING = {"growing": {"cudagraph_per_shape": {"recordings": 90, "mb_per_graph": 100.0}},
          "storm": {"recompile_storm": {"recompiles_in_window": 18, "window_s": 60.0}},
          "idle": {}}


def three_servers(polls: int = 10, held=None, idle_up: bool = True, idle_listed: bool = True):
    """A History fed `polls` polls of the three servers, each with its own events."""
    h = History()
    devices = tuple(DeviceSample(f"GPU-{n}", 0, 80 * GIB, 80 * GIB) for n in PIDS)
    for k in range(polls):
        t = T + k
        last = k == polls - 1
        servers = {n: server(n, k, up=idle_up or n != "idle" or not last,
                             held=held if last else None)
                   for n in PIDS if idle_listed or n != "idle" or not last}
        snap = Snapshot(t=t, devices=devices, servers=servers, focus="growing",
                        estimates=servers["growing"]["estimates"],
                        forecast=servers["growing"]["forecast"],
                        server_gpu_bytes={f"GPU-{n}": v["gpu_bytes"][f"GPU-{n}"]
                                          for n, v in servers.items()},
                        actions_total={"alert": 2, "reload": 1})
        observed = [events.CudagraphRecord(t=t, pid=11, phase="record", compile_id="0/0",
                                           key=[k], shape=[[1, k]], seconds=0.01),
                    events.Recompile(t=t, pid=22, compile_id=f"0/{k}", function="f",
                                     seconds=0.5, reason="size mismatch"),
                    events.Recompile(t=t + 0.5, pid=22, compile_id=f"1/{k}", function="f",
                                     seconds=0.5, reason="size mismatch")]
        actions = []
        if k == 2:
            actions.append(Alert(t, "recompile_storm", {}, "storm", (22,), ()))
        if k == 3:
            actions.append(Reload(t, "oom_forecast", {"seconds_to_oom": 90.0}, "growing",
                                  (11,), (), cause="cudagraph_per_shape", dry_run=False,
                                  not_done=None))
        h.update(snap, observed, actions)
    focus = [{"cause": "cudagraph_per_shape", "t": T + 1, "recordings": 90,
              "mb_per_graph": 100.0}]
    return h.view(snap, focus, {"polls": polls, "reload_method": "signal"}, FIRING)


def test_every_server_has_its_row_with_its_own_numbers():
    status = build_status(three_servers(), T + 10)
    rows = {r["server"]: r for r in status["servers"]}
    assert list(rows) == ["growing", "idle", "storm"]
    assert {n: r["state"] for n, r in rows.items()} == dict.fromkeys(rows, "up")
    assert rows["growing"]["memory_bytes"] == 14 * GIB and rows["idle"]["memory_bytes"] == GIB
    assert rows["growing"]["budget_bytes"] == BUDGET
    assert rows["growing"]["seconds_to_oom"] == 90.0 and rows["idle"]["seconds_to_oom"] is None
    assert rows["storm"]["active_causes"] == ["recompile_storm"]
    assert rows["idle"]["active_causes"] == [] and rows["idle"]["last_action"] is None
    assert rows["storm"]["last_action"]["summary"] == "alert recompile_storm"
    assert rows["growing"]["last_action"]["action"] == "reload"


def test_a_drill_down_shows_its_server_and_never_another_s():
    view = three_servers()
    storm = build_status(view, T + 10, "storm")
    assert storm["detail"] == {"server": "storm", "chosen": True, "asked": None}
    # its own memory (3 GiB each poll), not the three summed (the chart once showed 919 MiB
    # = 592 + 327)
    assert {b for _, b in storm["history"]["points"]} == {3 * GIB}
    assert storm["memory"]["level_bytes"] == 3 * GIB
    assert {k for _, k in storm["history"]["marks"]} == {"recompile"}  # not growing's records
    assert storm["history"]["marks_total"] == {"recompile": 20}
    assert storm["graphs"]["recompiles"] == 18 and storm["graphs"]["recordings"] == 0
    assert [c["cause"] for c in storm["causes"]] == ["recompile_storm"]
    assert storm["forecast"]["seconds_to_oom"] is None
    assert [a["server"] for a in storm["actions"]] == ["storm"]
    assert [d["uuid"] for d in storm["memory"]["devices"]] == ["GPU-storm"]
    growing = build_status(view, T + 10, "growing")
    assert {k for _, k in growing["history"]["marks"]} == {"record", "reload"}
    assert growing["history"]["points"][-1][1] == 14 * GIB
    page = render_page(storm, T + 10)
    assert "Server storm" in page and "storm: server process GPU memory (NVML) over time" in page
    assert 'class="mark mark-record"' not in page and 'class="mark mark-recompile"' in page
    assert 'data-server="growing"' not in page  # no host table in a drill-down


def test_the_host_view_details_the_server_nearest_to_oom_and_links_the_others():
    status = build_status(three_servers(), T + 10)
    assert status["detail"] == {"server": "growing", "chosen": False, "asked": None}
    assert status["memory"]["level_bytes"] == 14 * GIB  # growing's, not 14 + 3 + 1
    assert status["host_causes"] == 2
    page = render_page(status, T + 10)
    assert page.count('<tr class="server server-up"') == 3
    assert 'href="?server=storm"' in page and 'href="?server=idle"' in page
    assert "Server growing" in page and "nearest to OOM" in page


def test_no_active_cause_only_when_no_server_has_one():
    idle = build_status(three_servers(), T + 10, "idle")
    assert idle["causes"] == []
    page = render_page(idle, T + 10)
    assert "no active cause" not in page
    assert "none on this server; on other servers:" in page and "recompile_storm" in page
    text = format_terminal(idle, "http://x", T + 10)
    assert "causes   none on this server; 2 on others (their rows above)" in text


def test_a_stopped_server_reads_down_at_once_then_stopped():
    down = build_status(three_servers(idle_up=False), T + 10)
    rows = {r["server"]: r for r in down["servers"]}
    assert rows["idle"]["state"] == "down" and rows["storm"]["state"] == "up"
    assert 'class="server server-down"' in render_page(down, T + 10)
    (line,) = [x for x in format_terminal(down, "http://x", T + 10).splitlines()
               if x[9:].startswith("idle ")]
    # its last reading is no process's memory now
    assert "DOWN" in line and "1 GiB" not in line and "- of 20 GiB" in line
    gone = build_status(three_servers(idle_listed=False), T + 10)
    rows = {r["server"]: r for r in gone["servers"]}
    assert rows["idle"]["state"] == "stopped" and rows["idle"]["pids"] == []
    assert "idle     STOPPED" in format_terminal(gone, "http://x", T + 10)


def test_the_process_source_s_exit_is_the_server_s_state():
    views = {n: {k: v for k, v in server(n, 1).items()
                 if k not in ("gpu_bytes", "rss_bytes", "up")} for n in PIDS}
    sample = Sample(t=T, processes=(ProcessSample(11, True, GIB, {"GPU-growing": 2 * GIB}),
                                    ProcessSample(22, True, 2 * GIB, {}),
                                    ProcessSample(33, False, None, {})))
    out = _with_processes(views, sample)
    assert [out[n]["up"] for n in ("growing", "storm", "idle")] == [True, True, False]
    assert out["growing"]["gpu_bytes"] == {"GPU-growing": 2 * GIB}
    assert out["storm"]["rss_bytes"] == 2 * GIB and out["idle"]["rss_bytes"] is None


def test_a_reload_held_back_says_why_and_until_when_everywhere():
    status = build_status(three_servers(held=COOLDOWN), T + 10)
    row = next(r for r in status["servers"] if r["server"] == "growing")
    when = re.escape  # the clock is local time: compared as the page writes it
    summary = row["held"]["summary"]
    assert summary.startswith("cooldown until ") and "(9 min 50 s left)" in summary
    assert "policy.cooldown_s 10 min after the reload at" in summary
    page = render_page(status, T + 10)
    assert 'data-reason="cooldown"' in page and when(summary) and summary in page
    text = format_terminal(status, "http://x", T + 10)
    assert f"reload   held back: {summary}" in text
    assert f"reload held back: {summary}" in text  # under its row in the table
    collector = SnapshotCollector()
    collector.update(three_servers(held=COOLDOWN).snapshot)
    metrics = generate_latest(make_registry(collector)).decode()
    assert ('torch_watchdog_reload_held_until_timestamp_seconds{reason="cooldown",'
            'server="growing"} 1.7000006e+09') in metrics
    assert metrics.count("torch_watchdog_reload_held_until_timestamp_seconds{") == 1


def test_a_hold_is_logged_once_when_it_starts_and_once_when_it_ends():
    class Log:
        def __init__(self):
            self.lines = []

        def warning(self, msg, **kw):
            self.lines.append((msg, kw))

        info = warning

    from torch_watchdog.sidecar.config import Config
    from torch_watchdog.sidecar.core.results import PollResult

    log = Log()
    publisher = Publisher(Config(), log)
    empty = PollResult.before_any()

    def poll(held):
        views = {"growing": {**server("growing", 1), "held": held}}
        return PollResult(firing={}, host_firing={}, views=views, focus="growing",
                          focus_view=empty.focus_view, focus_causes=[], agents_alive=True,
                          skewed_events=0, agent_events_lost=0)

    for held in (None, COOLDOWN, COOLDOWN, COOLDOWN, None, None):
        publisher.log_findings(poll(held))
    assert [(m, kw.get("reason"), kw.get("until_t")) for m, kw in log.lines] == [
        ("reload held back", "cooldown", T + 600), ("reload no longer held back", "cooldown",
                                                    None)]


def test_a_gone_server_s_action_counts_leave_metrics_after_the_rules_longest_window():
    """`pgid:N` names change with each start: a restart's counts kept for good grew one series
    per start. Kept an hour after the server's last poll (TorchCompileReloadLoop's
    `increase(...[1h])` still reads them), then dropped; a live server's stay."""
    from torch_watchdog.sidecar.config import Config
    from torch_watchdog.sidecar.core.results import PollResult, Restart
    from torch_watchdog.sidecar.present.publisher import ACTIONS_KEPT_S

    class Log:
        def warning(self, *a, **kw):
            pass
        info = exception = warning

    publisher = Publisher(Config(), Log())
    empty = PollResult.before_any()

    def poll(t, names):
        views = {n: {**server("idle", 1), "label": n} for n in names}
        result = PollResult(firing={}, host_firing={}, views=views, focus=names[0],
                            focus_view=empty.focus_view, focus_causes=[], agents_alive=True,
                            skewed_events=0, agent_events_lost=0)
        publisher.snapshot(Sample(t=t), result, {})
        text = generate_latest(publisher.registry).decode()
        return set(re.findall(r'torch_watchdog_actions_total\{[^}]*server="([^"]+)"', text))

    def restart(name):
        publisher.count(Restart(T, "server_restarted", {}, name, (), ()))

    restart("pgid:7")
    assert poll(T, ["pgid:7", "llm"]) == {"pgid:7"}
    assert poll(T + ACTIONS_KEPT_S - 1, ["llm"]) == {"pgid:7"}  # gone, still counted
    assert poll(T + ACTIONS_KEPT_S + 2, ["llm"]) == set()
    restart("llm")
    for t in (T + 2 * ACTIONS_KEPT_S, T + 4 * ACTIONS_KEPT_S):
        assert poll(t, ["llm"]) == {"llm"}  # a live server's counts stay


def test_one_number_per_fact_in_the_page_and_status():
    """The same budget read 21.9 GiB in `status` and 22 GiB on the page."""
    status = build_status(three_servers(), T + 10, "growing")
    page, text = render_page(status, T + 10), format_terminal(status, "http://x", T + 10)
    budget = fmt_bytes(BUDGET)
    assert budget == "20 GiB"
    for surface in (page, text):
        assert f"14 GiB of {budget}" in surface or f"budget {budget}" in surface
        assert "OOM in ~1 min 30 s" in surface


def test_a_server_not_on_this_host_is_said_and_the_nearest_to_oom_shown():
    status = build_status(three_servers(), T + 10, "nope")
    assert status["detail"] == {"server": "growing", "chosen": False, "asked": "nope"}
    assert "no server nope here" in render_page(status, T + 10)
    assert "detail   no server nope here" in format_terminal(status, "http://x", T + 10)


def test_a_server_whose_name_changes_with_each_start_shows_its_metrics_label():
    view = three_servers()
    view.snapshot.servers["growing"]["label"] = "app.py/cuda:0"
    status = build_status(view, T + 10)
    rows = {r["server"]: r for r in status["servers"]}
    assert rows["growing"]["label"] == "app.py/cuda:0" and rows["idle"]["label"] == "idle"
    text = format_terminal(status, "http://x", T + 10)
    assert "growing (app.py/cuda:0)" in text and "idle (" not in text
    page = render_page(status, T + 10)
    assert "metrics: app.py/cuda:0" in page and "metrics: idle" not in page


def test_once_every_server_has_stopped_the_views_wait_and_name_them():
    """The README's path: the only server stops; its row stays, marked stopped, and `status`
    says there is no server now and that it waits (not a table of stopped rows alone)."""
    h = History()
    for k in range(3):
        v = server("idle", k)
        h.update(Snapshot(t=T + k, devices=(), servers={"idle": v}, focus="idle",
                          estimates=v["estimates"], forecast=v["forecast"],
                          server_gpu_bytes={}, actions_total={}), [], [])
    gone = Snapshot(t=T + 3, devices=(), servers={}, focus=None, estimates={}, forecast={},
                    server_gpu_bytes={}, actions_total={}, stopped=("idle",))
    h.update(gone, [], [])
    status = build_status(h.view(gone, [], {"polls": 4, "reload_method": "signal"}, {}), T + 4)
    assert [(r["server"], r["state"]) for r in status["servers"]] == [("idle", "stopped")]
    text = format_terminal(status, "http://x", T + 4)
    assert "waiting  no server now: idle stopped" in text, text
    assert "no server now" in render_page(status, T + 4)
