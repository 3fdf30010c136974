"""A reload's phase and a server's life (core/lifecycle.py), and what the step does with them
between runs: a sidecar restarted beside running servers, a server that stops while its alerts
fire, a name reused, a server gone for good."""
from __future__ import annotations

import dataclasses

import pytest

from torch_watchdog import events
from tests.unit.test_step import A, B, CFG, GB, MB, calls, compile_event, hello, sample
from torch_watchdog.sidecar.config import Config, ForecastConfig
from torch_watchdog.sidecar.core import lifecycle
from torch_watchdog.sidecar.core.host import HELD_EVENTS, HELD_PIDS
from torch_watchdog.sidecar.core.lifecycle import (IDLE, RETAIN_S, Back, Cancel, Decide, Execute,
                                                   Life, Outcome, Phase, ReloadEnded,
                                                   ReloadUnderWay, Renew, Shown, advance)
from torch_watchdog.sidecar.core.observations import (KnownServer, ProcessSample, ReloadOutcome,
                                                      ServersKnown)
from torch_watchdog.sidecar.core.results import Reload
from torch_watchdog.sidecar.core.step import Host, step

DECISION = Reload(1.0, "oom_forecast", {}, "s", (101,), (A,), cause="oom_forecast",
                  dry_run=False, not_done=None)
UNDER_WAY = ReloadUnderWay("signal", 30.0, "oom_forecast")
ENDED = ReloadEnded("exited after SIGTERM", 1.0, "oom_forecast")
DECIDED = advance(IDLE, Decide(DECISION))
EXECUTING = advance(DECIDED, Execute(UNDER_WAY))
FAILED = advance(EXECUTING, Outcome(ENDED, True, frozenset({101})))


@pytest.mark.parametrize("before, transition, after", [
    (IDLE, Decide(DECISION), Phase.DECIDED),
    (DECIDED, Execute(UNDER_WAY), Phase.EXECUTING),
    (DECIDED, Cancel(), Phase.IDLE),
    (DECIDED, Outcome(ENDED, False, frozenset()), Phase.DECIDED),  # not carried out yet
    (DECIDED, Decide(DECISION), Phase.DECIDED),                    # one at a time
    (EXECUTING, Renew(), Phase.RENEWED),
    (EXECUTING, Decide(DECISION), Phase.EXECUTING),
    (EXECUTING, Cancel(), Phase.EXECUTING),                        # too late to cancel
    (EXECUTING, Outcome(ENDED, False, frozenset()), Phase.ENDED),
    (advance(EXECUTING, Renew()), Outcome(ENDED, False, frozenset()), Phase.ENDED),
    (EXECUTING, Outcome(ENDED, True, frozenset({101})), Phase.FAILED),
    (IDLE, Outcome(ENDED, False, frozenset()), Phase.ENDED),  # a reload of the last sidecar's
    (advance(EXECUTING, Outcome(ENDED, False, frozenset())), Shown(), Phase.IDLE),
    (FAILED, Shown(), Phase.FAILED),
    (FAILED, Back(101), Phase.FAILED),   # one of the processes the reload failed to replace
    (FAILED, Back(102), Phase.IDLE),     # a new process of it: back
    (IDLE, Back(7), Phase.IDLE),
])
def test_each_transition_from_each_phase(before, transition, after):
    assert advance(before, transition).phase is after


def test_a_reload_fires_from_its_execution_until_its_outcome_is_shown_once():
    assert lifecycle.alerts(DECIDED) == {}
    assert lifecycle.alerts(EXECUTING)["reload"]["outcome"] == "in progress"
    ended = advance(EXECUTING, Outcome(ENDED, False, frozenset()))
    assert lifecycle.alerts(ended)["reload"]["done"] is True
    assert lifecycle.alerts(advance(ended, Shown())) == {}
    # failed: `reload` once with its outcome, `reload_failed` until the server is back
    assert set(lifecycle.alerts(FAILED)) == {"reload", "reload_failed"}
    shown = advance(FAILED, Shown())
    assert set(lifecycle.alerts(shown)) == {"reload_failed"}
    assert lifecycle.alerts(advance(shown, Back(102))) == {}


# -- a sidecar restarted beside running servers ------------------------------------------------
BUDGET = Config(policy=CFG.policy, reload=CFG.reload,
                forecast=ForecastConfig(headroom_bytes=0, window_s=30,
                                        process_budget_bytes=400 * MB))


def flat_host(host: Host, t: float, polls: int, cfg: Config = BUDGET) -> list:
    """Two flat 262 MiB servers (101, 202) on one GPU each, polled `polls` times from `t`:
    together over the 400 MiB per-server budget, each well under it."""
    out = []
    for i in range(polls):
        s = sample(t + 0.25 * i, {A: (GB, 10 * GB), B: (GB, 10 * GB)},
                   {101: {A: 262 * MB}, 202: {B: 262 * MB}})
        out += step(host, s, cfg).actions
        for pid in (101, 202):
            out += step(host, calls(t + 0.25 * i, pid, 3, 1), cfg).actions
    return out


def test_a_restarted_sidecar_hearing_servers_before_their_hellos_reloads_none_of_them():
    """The reproduction of issue 50: a sidecar restarted beside two flat 262 MiB servers (400
    MiB budget) heard their events before their next hello; pooled into `default`, their sum
    read "OOM in 0 s" 0.6 s after the start and both were drained. Held for their pids, they
    are no server's until each hello places it."""
    host = Host()
    actions = flat_host(host, 1000.0, 40)
    assert [a for a in actions if a.kind in ("reload", "alert")] == []
    assert host.servers == {} and set(host.unplaced) == {101, 202}
    for pid, name, gpu in ((101, "llm-a", A), (202, "llm-b", B)):
        step(host, hello(1010.0, pid, name, [gpu]), BUDGET)
    actions = flat_host(host, 1010.25, 200)
    assert [a for a in actions if a.kind == "reload"] == []
    assert sorted(host.servers) == ["llm-a", "llm-b"]
    assert host.servers["llm-a"].state.calls.requests == 3 * 240  # held, then folded


def test_servers_known_to_the_last_sidecar_are_placed_at_once():
    host = Host()
    known = ServersKnown(999.0, (KnownServer("llm-a", (101,), 1000, (1,), (A,), "serve a"),
                                 KnownServer("llm-b", (202,), 1000, (1,), (B,), "serve b")))
    step(host, known, BUDGET)
    actions = flat_host(host, 1000.0, 200)
    assert [a for a in actions if a.kind == "reload"] == []
    assert host.owner == {101: "llm-a", 202: "llm-b"} and host.unplaced == {}
    assert host.servers["llm-a"].state.calls.requests == 3 * 200
    assert step(host, sample(1100.0, {A: (GB, 10 * GB), B: (GB, 10 * GB)},
                             {101: {A: 262 * MB}, 202: {B: 262 * MB}}),
                BUDGET).poll.known == known.servers


def test_a_hello_heard_first_wins_over_what_the_last_sidecar_knew():
    host = Host()
    step(host, hello(999.0, 101, "llm-new", [A]), CFG)
    step(host, ServersKnown(999.5, (KnownServer("llm-old", (101,)),)), CFG)
    assert host.owner[101] == "llm-new"


def test_held_events_are_bounded_per_pid_and_in_pids():
    host = Host()
    for i in range(HELD_EVENTS + 50):
        step(host, calls(1000.0 + i * 1e-3, 101, 1, 1), CFG)
    assert len(host.unplaced[101]) == HELD_EVENTS and host.unplaced_dropped == 50
    for pid in range(1000, 1000 + HELD_PIDS + 10):
        step(host, calls(1001.0, pid, 1, 1), CFG)
    assert len(host.unplaced) == HELD_PIDS and host.unplaced_dropped == 50 + 11  # 101 held


# -- a server that stops, and one gone for good ------------------------------------------------
def dead(s, *pids):
    return dataclasses.replace(s, processes=tuple(ProcessSample(p, False, None, {})
                                                  for p in pids))


def test_a_server_that_stops_while_its_alerts_fire_leaves_views_and_firing_together():
    """The loop froze for good on a KeyError: a server forgotten 30 s after it exited was still
    in `firing`, no longer in `views`. A dead server fires no cause and has no forecast."""
    host = Host()
    step(host, hello(1000.0, 101, "storm", [A]), CFG)
    for i in range(12):  # a recompile storm
        step(host, events.Recompile(t=1000.0 + i * 0.05, pid=101, compile_id=f"0/{i}",
                                    function="fwd", seconds=6.5, reason="size mismatch"), CFG)
    live = step(host, sample(1001.0, {A: (GB, 10 * GB)}, {101: {A: GB}}), CFG).poll
    assert live.firing["storm"] and set(live.firing) == set(live.views)
    for t in (1002.0, 1040.0, 1100.0):  # exited; forgotten once silent
        poll = step(host, dead(sample(t, {A: (GB, 10 * GB)}, {}), 101), CFG).poll
        assert set(poll.firing) == set(poll.views) == set()
    server = host.servers["storm"]
    assert server.life is Life.DOWN and server.forecast.seconds == float("inf")


def test_a_stopped_server_is_forgotten_after_the_retention_and_its_reloads_are_kept():
    host = Host()
    step(host, hello(1000.0, 101, "gone", [A]), CFG)
    host.history.append((1000.5, "gone"))
    step(host, sample(1001.0, {A: (GB, 10 * GB)}, {101: {A: GB}}), CFG)
    step(host, dead(sample(1002.0, {A: (GB, 10 * GB)}, {}), 101), CFG)
    step(host, dead(sample(1002.0 + RETAIN_S - 1, {A: (GB, 10 * GB)}, {}), 101), CFG)
    assert "gone" in host.servers
    step(host, dead(sample(1002.0 + RETAIN_S, {A: (GB, 10 * GB)}, {}), 101), CFG)
    assert host.servers == {} and host.owner == {} and host.named == {}
    assert host.history == [(1000.5, "gone")]  # its next start keeps the cooldown
    step(host, hello(1003.0 + RETAIN_S, 303, "gone", [A]), CFG)
    assert host.servers["gone"].policy.reloads == [1000.5]


@pytest.mark.parametrize("after_s", [8.0, 45.0, 300.0])
def test_a_name_reused_after_its_processes_are_gone_starts_afresh(after_s):
    """Reused 45 s after its process died (its pid forgotten at 30 s), the name merged the two
    processes' counts (27 compiles = 11 + 16); after 8 s it was a restart. Both are now."""
    host = Host()
    step(host, hello(1000.0, 101, "api", [A]), CFG)
    for i in range(11):
        step(host, dataclasses.replace(compile_event(1000.0, 101), compile_id=f"0/{i}"), CFG)
    step(host, sample(1001.0, {A: (GB, 10 * GB)}, {101: {A: GB}}), CFG)
    t = 1002.0
    while t < 1002.0 + after_s:
        step(host, dead(sample(t, {A: (GB, 10 * GB)}, {}), 101), CFG)
        t += 4.0
    actions = step(host, hello(t, 202, "api", [A]), CFG).actions
    assert [a.kind for a in actions] == ["restart"]
    for i in range(16):
        step(host, dataclasses.replace(compile_event(t, 202), compile_id=f"0/{i}"), CFG)
    assert host.servers["api"].state.compiles.compiles == 16


def test_a_drained_server_keeps_its_reload_alert_until_its_new_process_is_back():
    """Down between the drain's exit and the new process's hello: still in the views, its
    `reload` alert firing, not resolved and fired again."""
    host = Host()
    step(host, hello(1000.0, 101, "api", [A]), CFG)
    server = host.servers["api"]
    server.reload = advance(advance(IDLE, Decide(dataclasses.replace(
        DECISION, server="api"))), Execute(UNDER_WAY))
    poll = step(host, dead(sample(1001.0, {A: (GB, 10 * GB)}, {}), 101), CFG).poll
    assert poll.firing["api"]["reload"]["outcome"] == "in progress" and "api" in poll.views
    step(host, hello(1002.0, 202, "api", [A]), CFG)
    assert server.reload.phase is Phase.RENEWED
    step(host, ReloadOutcome(True, "exited", 2.0).at(1002.5, "api"), CFG)
    poll = step(host, sample(1003.0, {A: (GB, 10 * GB)}, {202: {A: GB}}), CFG).poll
    assert poll.firing["api"]["reload"]["done"] is True
    poll = step(host, sample(1003.5, {A: (GB, 10 * GB)}, {202: {A: GB}}), CFG).poll
    assert "reload" not in poll.firing["api"] and server.reload.phase is Phase.IDLE


def test_nearest_to_oom_is_the_forecast_then_active_causes_then_budget_share():
    """A server at 44 % of its budget, no forecast, no cause was shown (by name) over one
    with two active causes."""
    from torch_watchdog.sidecar.core.forecast import Forecast
    from torch_watchdog.sidecar.core.host import Host, Server

    def server(name, seconds=None, causes=(), level=0):
        s = Server(name, pids={len(name): 0.0}, life=Life.UP)
        s.forecast = Forecast(GB, level, seconds_linear=seconds if seconds is not None
                              else float("inf"))
        s.firing = {c: {} for c in causes}
        return s

    host = Host()
    for s in (server("a-idle", level=GB * 44 // 100),
              server("b-storm", causes=("recompile_storm", "recompile_limit_eager_fallback"),
                     level=GB // 10),
              server("c-quiet", level=GB // 10)):
        host.servers[s.name] = s
    assert host.focus().name == "b-storm"
    host.servers["b-storm"].firing = {}
    assert host.focus().name == "a-idle"  # the larger share of its budget
    host.servers["c-quiet"].forecast = Forecast(GB, GB // 10, seconds_linear=900.0)
    assert host.focus().name == "c-quiet"  # a forecast first
