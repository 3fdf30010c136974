"""The demo's timeline: readable lines from the server's, the agent's and the sidecar's reports,
and the facts the demo's exit code rests on (pure: no process, no clock)."""
import datetime

import pytest

from torch_watchdog.demo import timeline
from torch_watchdog.demo.timeline import Timeline, line_time, progress_text

T0 = 1_800_000_000.0
PID, PID2 = 1234, 1301


def iso(t: float) -> str:
    """How structlog's TimeStamper(fmt="iso", utc=True) writes a time."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat() \
        .replace("+00:00", "Z")


def recompile(t: float, attempt: int, actual: int, seconds: float = 1.1) -> dict:
    return {"v": 1, "kind": "recompile", "t": t, "pid": PID, "compile_id": f"0/{attempt}",
            "function": "forward (server.py:92)", "seconds": seconds,
            "reason": f"0/{attempt - 1}: tensor 'ids' size mismatch at index 1. expected 40, "
                      f"actual {actual}"}


def calls(t: float, n: int, seconds: float, stall_calls: int = 0, stall_seconds: float = 0.0,
          window_s: float = 1.0, pid: int = PID) -> dict:
    return {"v": 1, "kind": "calls", "t": t, "pid": pid, "name": "lm", "calls": n,
            "seconds": seconds, "stall_calls": stall_calls, "stall_seconds": stall_seconds,
            "distinct_shapes": 3, "window_s": window_s}


def test_a_line_is_time_from_the_start_source_and_text():
    tl = Timeline(T0)
    assert tl.line(T0 + 3.14, "server", "pid 1 started") == "+  3.1s server   pid 1 started"
    assert tl.line(T0 + 123.45, "sidecar", "x") == "+123.5s sidecar  x"
    assert tl.line(T0 - 5, "agent", "early") == "+  0.0s agent    early"  # clocks disagree
    assert line_time("+ 60.3s sidecar  RELOAD") == 60.3 and line_time("junk") == 0.0


def test_a_recompile_shows_its_number_function_reason_and_time():
    tl = Timeline(T0)
    (line,) = tl.agent(recompile(T0 + 9.8, 2, 97))
    assert line == ("+  9.8s agent    recompile #2 of forward: tensor 'ids' size mismatch at "
                    "index 1. expected 40, actual 97 (1.1 s)")
    assert tl.facts.recompiles == 1
    (fast,) = tl.agent({**recompile(T0 + 10, 3, 60), "seconds": 0.157})
    assert fast.endswith("(157 ms)")


def test_a_compile_without_reason_is_not_counted_as_explained():
    tl = Timeline(T0)
    (line,) = tl.agent({**recompile(T0, 1, 50), "reason": None})
    assert "no reason reported" in line and tl.facts.recompiles == 0


def test_the_limit_is_shown_then_the_fallback_cost_once_enough_calls_ran_after_it():
    tl = Timeline(T0)
    assert tl.agent(calls(T0 + 1, 10, 0.015)) == []          # 1.5 ms per call, compiled
    assert tl.agent(calls(T0 + 2, 11, 3.015, 1, 3.0)) == []  # a recompile stall: left out
    (limit,) = tl.agent({"v": 1, "kind": "recompile_limit", "t": T0 + 2.5, "pid": PID,
                         "function": "forward (server.py:92)", "limit": 4,
                         "reason": "0/3: …", "compile_id": "0/4"})
    assert "RECOMPILE LIMIT 4 hit in forward" in limit and "eager" in limit
    # true to what the server's log shows: torch's warning, no error (never "silently")
    assert "no error, only torch's `hit config.recompile_limit` warning" in limit
    assert "silent" not in limit
    assert tl.facts.limit_hit
    assert tl.agent(calls(T0 + 3, 10, 0.03)) == []           # began before the limit: neither
    assert tl.agent(calls(T0 + 4, 20, 0.06)) == []           # 20 calls after: not enough yet
    (cost,) = tl.agent(calls(T0 + 5, 10, 0.03))
    assert cost.startswith("+  5.0s agent    eager fallback: 1.50 ms per call while compiled, "
                           "3.00 ms after the limit (2.0x slower; mean of 30 calls")
    assert tl.facts.slowdown == pytest.approx((1.5, 3.0))
    assert tl.agent(calls(T0 + 6, 10, 0.03)) == []           # said once


def test_a_fallback_that_is_not_slower_is_said_so():
    tl = Timeline(T0)
    tl.agent(calls(T0 + 1, 10, 0.026))
    tl.agent({"v": 1, "kind": "recompile_limit", "t": T0 + 1.5, "pid": PID, "function": None,
              "limit": 4, "reason": None, "compile_id": None})
    (line,) = tl.agent(calls(T0 + 3, 40, 0.098))
    assert "(0.9x: no slower here;" in line


def test_new_shape_stalls_are_shown_up_to_a_limit_then_counted():
    tl = Timeline(T0)
    stall = {"v": 1, "kind": "stall", "t": T0 + 8, "pid": PID, "name": "lm",
             "shape": [[1, 168]], "seconds": 3.04, "new_shape": True, "cause": "recompile"}
    (first,) = tl.agent(stall)
    assert first == "+  8.0s agent    stall 3.0 s on new shape [1, 168]: cause recompile"
    shown = [tl.agent(stall) for _ in range(timeline.STALLS_SHOWN + 3)]
    assert sum(map(len, shown)) == timeline.STALLS_SHOWN - 1
    assert "counted on the status page" in shown[timeline.STALLS_SHOWN - 2][0]


def test_the_agent_hello_is_shown_once_per_process_and_heartbeats_never():
    tl = Timeline(T0)
    hello = {"v": 1, "kind": "hello", "t": T0 + 2, "pid": PID, "torch": "2.13.0",
             "agent": "0.1.0", "devices": [], "config": {"recompile_limit": 4},
             "capabilities": {}, "watched": [], "argv": ""}
    (line,) = tl.agent(hello)
    assert "pid 1234: hooks installed (torch 2.13.0, recompile_limit 4)" in line
    assert tl.agent(hello) == []
    assert tl.agent({"v": 1, "kind": "heartbeat", "t": T0, "pid": PID, "seq": 1,
                     "uptime_s": 1.0, "queue_depth": 0, "errors": 0}) == []


def test_sidecar_findings_actions_and_the_reload_become_lines_and_facts():
    tl = Timeline(T0)
    finding = {"event": "finding", "level": "warning", "timestamp": iso(T0 + 24.2),
               "cause": "recompile_limit_eager_fallback", "t": T0 + 24.2, "source": "agent",
               "function": "forward (server.py:92)", "limit": 4, "steady_ms_before": 1.46}
    (found,) = tl.sidecar(finding)
    assert found.startswith("+ 24.2s sidecar  FOUND recompile_limit_eager_fallback: recompile "
                            "limit 4 reached in forward")
    assert found.endswith("; 1.46 ms per call until then") and tl.facts.fallback_found
    # an alert for a cause repeats the FOUND line: not shown
    assert tl.sidecar({"event": "action", "action": "alert", "reason": "recompile_storm",
                       "timestamp": iso(T0 + 24.3)}) == []
    (decided,) = tl.sidecar({"event": "action", "action": "reload", "reason": "oom_forecast",
                             "timestamp": iso(T0 + 60.3), "seconds_to_oom": 8.0,
                             "level_bytes": 700 << 20, "budget_bytes": 800 << 20,
                             "dry_run": False})
    assert decided == ("+ 60.3s sidecar  RELOAD decided: forecast OOM in 8 s: server at "
                       "700 MiB of its 800 MiB budget")
    (reloading,) = tl.sidecar({"event": "reloading the server", "method": "signal",
                               "pids": [PID], "timestamp": iso(T0 + 60.4)})
    assert "SIGTERM to pid 1234" in reloading
    assert tl.facts.sigterm_t == pytest.approx(T0 + 60.4, abs=1e-3)
    (done,) = tl.sidecar({"event": "reload finished", "ok": True, "seconds": 1.2,
                          "detail": "exited after SIGTERM", "timestamp": iso(T0 + 62.0)})
    assert done == "+ 62.0s sidecar  reload done: exited after SIGTERM (1.2 s)"
    assert tl.facts.reload_ok and tl.facts.reload_decided


def test_sidecar_noise_is_hidden_and_errors_are_shown():
    tl = Timeline(T0)
    assert tl.sidecar({"event": "poll", "level": "info", "timestamp": iso(T0)}) == []
    (err,) = tl.sidecar({"event": "cannot write the sample log", "level": "error",
                         "timestamp": iso(T0 + 1), "path": "/x"})
    assert "ERROR cannot write the sample log" in err and "/x" in err


def test_the_storm_and_unexplained_growth_findings_explain_themselves():
    tl = Timeline(T0)
    (storm,) = tl.sidecar({"event": "finding", "cause": "recompile_storm",
                           "timestamp": iso(T0 + 21), "recompiles_in_window": 3,
                           "window_s": 120.0, "compile_seconds": 9.2})
    assert "FOUND recompile_storm: 3 recompiles within 2 min, 9.2 s compiling" in storm
    (growth,) = tl.sidecar({"event": "finding", "cause": "memory_growth_unexplained",
                            "timestamp": iso(T0 + 50), "unexplained_mb": 268.0,
                            "growth_mb": 268.0})
    assert "the stand-in is no CUDA graph the agent could report" in growth


def test_serving_again_is_a_new_pid_serving_after_the_sidecars_sigterm():
    tl = Timeline(T0)
    start = {"ev": "start", "t": T0 + 3.1, "pid": PID, "device": "CPU", "torch": "2.13.0",
             "standin_mb": 4, "standin_where": "RSS", "model": "1-layer transformer",
             "compile": "torch.compile(dynamic=False)"}
    (line,) = tl.server(start)
    assert "pid 1234 started: 1-layer transformer, torch.compile(dynamic=False) on CPU" in line
    assert "STAND-IN: it keeps 4 MB of RSS per distinct length" in line
    (first,) = tl.server({"ev": "serving", "t": T0 + 8, "pid": PID, "first_s": 5.1,
                          "served": 1})
    assert "pid 1234 serving (first request took 5.1 s" in first
    assert tl.facts.again_pid is None
    tl.sidecar({"event": "reloading the server", "method": "signal", "pids": [PID],
                "timestamp": iso(T0 + 62.0)})
    (again,) = tl.server({"ev": "serving", "t": T0 + 66.5, "pid": PID2, "first_s": 1.5,
                          "served": 1})
    assert again == ("+ 66.5s server   pid 1301 serving again (4.5 s after SIGTERM; first "
                     "request took 1.5 s)")
    assert tl.server({"ev": "progress", "t": T0 + 68, "pid": PID2, "served": 14}) == []
    assert tl.facts.again_pid == PID2 and tl.facts.served_again == 14


def test_facts_name_every_missing_step():
    f = timeline.Facts()
    assert len(f.missing()) == 4
    f.recompiles, f.limit_hit, f.reload_ok, f.served_again = 3, True, True, 5
    assert f.missing() == []
    f.reload_ok, f.reload_detail = False, "no server process to signal"
    assert f.missing() == ["the sidecar did not reload the server (no server process to "
                           "signal)"]


def test_progress_shows_counts_memory_as_the_sidecar_measures_it_and_its_forecast():
    p = {"ev": "progress", "pid": PID, "served": 1, "distinct": 1, "rss_bytes": 400 << 20,
         "standin_bytes": 4 << 20}
    assert progress_text(p, None) == ("pid 1234: 1 request, 1 distinct length, RSS 400 MiB "
                                      "(stand-in 4 MiB)")
    status = {"memory": {"source": "process", "level_bytes": 1 << 30},
              "forecast_summary": "OOM in ~21 s (linear trend); budget 1.2 GiB"}
    assert progress_text({**p, "served": 1500, "distinct": 61}, status) == (
        "pid 1234: 1,500 requests, 61 distinct lengths, GPU memory (NVML) 1 GiB (stand-in "
        "4 MiB) | sidecar: OOM in ~21 s (linear trend); budget 1.2 GiB")


def test_helpers():
    assert timeline.short_reason("0/3: tensor 'ids' size mismatch") == \
        "tensor 'ids' size mismatch"
    assert timeline.short_reason("guard failed: x") == "guard failed: x"
    assert timeline.function_name("forward (server.py:92)") == "forward"
    assert timeline.parse_time("2027-01-15T08:00:00.500000Z") == pytest.approx(
        datetime.datetime(2027, 1, 15, 8, 0, 0, 500000, datetime.timezone.utc).timestamp())
    assert timeline.parse_time("yesterday") is None and timeline.parse_time(None) is None
