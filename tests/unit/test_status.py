"""status.py: the status dict (/status.json), its summaries, and the terminal view."""
from __future__ import annotations

import json
import math

import pytest

from tests.conftest import free_port
from torch_watchdog import cli
from torch_watchdog.sidecar.present.history import History
from torch_watchdog.sidecar.core.results import Alert, Reload
from torch_watchdog.sidecar.core.observations import DeviceSample
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.status import (build_status, cause_summary, chart_budget,
                                                   fmt_bytes, fmt_duration, format_terminal)

GIB = 1 << 30
T = 1_700_000_000.0
ESTIMATES = {"recordings": 1983, "warmups": 1990, "distinct_shapes": 1990, "requests": 50_000,
             "compiles": 1, "recompiles": 2, "compile_seconds": 14.5, "recompile_limit_hits": 0,
             "graph_breaks": 0, "stalls": 7, "stall_seconds": 1.2, "ooms": 0,
             "mb_per_graph": 0.47, "mb_per_graph_confidence": 0.93, "memory_bytes": 5 * GIB,
             "unexplained_bytes": 0}
FORECAST = {"seconds_to_oom": 2400.0, "seconds_to_oom_linear": 5000.0,
            "seconds_to_oom_discovery": 2400.0, "plateau_bytes": 90 * GIB, "will_oom": True,
            "budget_bytes": 79 * GIB, "level_bytes": 13 * GIB, "shape_space_estimate": 2043.0,
            "growth_bytes_per_s": 1e6}


def a_view(**snap_kw):
    kw = dict(t=T, devices=(DeviceSample("GPU-a", 13 * GIB, 80 * GIB, 67 * GIB),),
              server_gpu_bytes={"GPU-a": 5 * GIB}, server_rss_bytes=3 * GIB, server_alive=True,
              estimates=ESTIMATES, forecast=FORECAST, active_causes=("cudagraph_per_shape",),
              actions_total={"alert": 1, "reload": 1, "reload_not_done": 1},
              sources_up={"nvml": True, "process": True, "agent": True},
              events_received_total=12_345, events_dropped_total={"malformed": 2},
              agent_events_lost_total=3)
    kw.update(snap_kw)
    snap = Snapshot(**kw)
    h = History()
    h.update(Snapshot(t=T - 60, server_gpu_bytes={"GPU-a": 4 * GIB}), [], [])
    h.update(snap, [], [Alert(T - 30, "cudagraph_per_shape", {}, "default", (), ()),
                        Reload(T - 10, "oom_forecast", {"seconds_to_oom": 55.0}, "default", (),
                               (), cause="oom_forecast", dry_run=True, not_done=None)])
    h.act(T - 9, "reload_not_done", "oom_forecast", {"outcome": "not carried out: dry run"})
    causes = [{"cause": "cudagraph_per_shape", "t": T - 30, "recordings": 20,
               "distinct_shapes": 21, "mb_per_graph": 0.5, "confidence": 0.9, "mb_so_far": 10.0}]
    return h.view(snap, causes, {"version": "9.9", "polls": 600, "reload_method": "none"})


def test_status_has_every_section_and_is_strict_json():
    status = build_status(a_view(), T + 2)
    assert set(status) == {"t", "age_s", "sidecar", "memory", "graphs", "causes", "forecast",
                           "forecast_summary", "actions", "actions_total", "sources",
                           "source_errors", "events", "history", "servers", "scope",
                           "padding", "stopped", "detail", "host_causes"}
    assert status["age_s"] == 2.0
    assert status["memory"]["source"] == "process" and status["memory"]["level_bytes"] == 5 * GIB
    assert status["memory"]["devices"] == [{"uuid": "GPU-a", "used_bytes": 13 * GIB,
                                            "total_bytes": 80 * GIB, "free_bytes": 67 * GIB}]
    assert status["memory"]["server"] == {"alive": True, "gpu_bytes": {"GPU-a": 5 * GIB},
                                          "rss_bytes": 3 * GIB}
    assert status["graphs"]["recordings"] == 1983 and "memory_bytes" not in status["graphs"]
    assert status["sidecar"] == {"version": "9.9", "polls": 600, "reload_method": "none",
                                 "watching_since_t": T - 60}
    assert status["history"]["points"] == [[T - 60, 4 * GIB], [T, 5 * GIB]]
    assert status["history"]["marks"] == [[T - 10, "reload"]]
    assert status["events"] == {"received_total": 12_345, "dropped_total": {"malformed": 2},
                                "agent_lost_total": 3}
    json.dumps(status, allow_nan=False)


def test_actions_newest_first_with_a_readable_summary():
    actions = build_status(a_view(), T)["actions"]
    assert [a["action"] for a in actions] == ["reload_not_done", "reload", "alert"]
    assert [a["summary"] for a in actions] == [
        "reload not done: not carried out: dry run",
        "reload decided (oom_forecast, OOM in ~55 s) — dry run",
        "alert cudagraph_per_shape"]


def test_cause_summary_uses_current_numbers_not_those_at_detection():
    cause = build_status(a_view(), T)["causes"][0]
    assert cause["cause"] == "cudagraph_per_shape" and cause["since_t"] == T - 30
    assert cause["summary"] == ("1,983 CUDA graphs for 1,990 distinct shapes, 459 KiB each, "
                                "889 MiB so far")  # kept in MB (0.47), shown in MiB
    assert cause["detail"]["recordings"] == 20  # the finding itself is kept as it was


@pytest.mark.parametrize("cause, detail, expected", [
    ("recompile_storm", {"recompiles_in_window": 6, "window_s": 300.0},
     "6 recompiles within 5 min, 14.6 s compiling so far"),
    ("recompile_limit_eager_fallback", {"source": "agent", "function": "forward", "limit": 8},
     "recompile limit 8 reached in forward (reported by the agent): new shapes run eager"),
    ("memory_growth_unexplained", {"unexplained_mb": 412.3, "growth_mb": 900.0},
     "393 MiB of 858 MiB growth explained by no recording or compile"),
])
def test_cause_summaries(cause, detail, expected):
    assert cause_summary(cause, detail, {"compile_seconds": 14.6}) == expected


def test_infinities_become_null():
    view = a_view(forecast={**FORECAST, "growth_bytes_per_s": math.inf,
                            "plateau_bytes": math.nan})
    status = build_status(view, T)
    assert status["forecast"]["growth_bytes_per_s"] is None
    assert status["forecast"]["plateau_bytes"] is None
    json.dumps(status, allow_nan=False)


def test_before_the_first_poll():
    status = build_status(None, T)
    assert status["t"] is None and status["causes"] == [] and status["history"]["points"] == []
    assert "no poll yet" in format_terminal(status, "http://x", T)


def test_chart_budget_is_moved_to_the_plotted_series():
    status = build_status(a_view(), T)
    # the device may use 79 GiB; others use 13 - 5 = 8 GiB of it: the server may reach 71
    assert chart_budget(status) == 71 * GIB
    status["memory"]["level_bytes"] = None
    assert chart_budget(status) == 79 * GIB


def test_terminal_summary_lines_are_aligned():
    text = format_terminal(build_status(a_view(), T), "http://127.0.0.1:9464", T + 1)
    lines = text.splitlines()
    heads = [line[:9] for line in lines]
    assert [h.strip() for h in heads if h.strip()] == [
        "sidecar", "server", "device", "graphs", "causes", "forecast", "sources", "actions"]
    assert all(line[8] == " " for line in lines)
    assert "last poll 1 s ago" in lines[0]
    assert "5 GiB (server process GPU memory (NVML)), RSS 3 GiB, up" in text
    assert "GPU-a: 13 GiB used of 80 GiB" in text
    assert "1,983 recorded, 1,990 distinct shapes, 1 compile, 2 recompiles, 459 KiB/graph" in text
    assert "causes   cudagraph_per_shape: 1,983 CUDA graphs" in text
    assert ("forecast OOM in ~40 min (discovery model); plateau 90 GiB, above the budget: it "
            "will run out; budget 79 GiB") in text
    assert "sources  agent up, nvml up, process up" in text
    assert "reload not done: not carried out: dry run" in lines[-3]


@pytest.mark.parametrize("n, text", [(None, "?"), (512, "512 B"), (3 * GIB, "3 GiB"),
                                     (1536 << 20, "1.5 GiB"), (5 << 20, "5 MiB")])
def test_fmt_bytes(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("s, text", [(None, "?"), (5.25, "5.25 s"), (45, "45 s"),
                                     (65, "1 min 5 s"), (2400, "40 min"),
                                     (5400, "1 h 30 min"), (3 * 86400, "3 d")])
def test_fmt_duration(s, text):
    assert fmt_duration(s) == text


def test_status_command_says_when_no_sidecar_answers(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["status", "--url", url]) == 1
    err = capsys.readouterr().err
    assert f"no sidecar is running at {url}" in err and "torch-watchdog sidecar" in err


def test_status_command_takes_the_port_from_the_config(tmp_path, capsys):
    port = free_port()
    cfg = tmp_path / "w.yaml"
    cfg.write_text(f"metrics_port: {port}\nmetrics_address: 0.0.0.0\n")
    assert cli.main(["status", "--config", str(cfg)]) == 1
    assert f"no sidecar is running at http://127.0.0.1:{port}" in capsys.readouterr().err
    cfg.write_text("metrics_port: nope\n")
    assert cli.main(["status", "--config", str(cfg)]) == 2
    assert "metrics_port" in capsys.readouterr().err


@pytest.mark.parametrize("action, text", [
    ({"action": "alert", "reason": "oom_forecast", "detail": {"seconds_to_oom": 1500.0}},
     "alert oom_forecast, OOM in ~25 min"),
    ({"action": "alert", "reason": "recompile_storm", "detail": {"seconds_to_oom": 1500.0}},
     "alert recompile_storm"),
    ({"action": "reload", "reason": "oom_forecast", "detail": {"seconds_to_oom": 42.0}},
     "reload decided (oom_forecast, OOM in ~42 s)"),
    ({"action": "reload", "reason": "oom_forecast", "cause": "memory_growth_unexplained",
      "detail": {"seconds_to_oom": 42.0}},
     "reload decided (memory_growth_unexplained, OOM in ~42 s)"),
    ({"action": "execute", "reason": "oom_forecast", "cause": "cudagraph_per_shape"},
     "execute cudagraph_per_shape"),
    ({"action": "reload_ok", "reason": "oom_forecast",
      "detail": {"outcome": "SIGTERM sent; the server exited", "reload_seconds": 3.25}},
     "reload done: SIGTERM sent; the server exited (3.25 s)"),
])
def test_action_summaries(action, text):
    from torch_watchdog.sidecar.present.status import action_summary
    assert action_summary(action) == text
