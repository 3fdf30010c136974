"""policy.remedy (issue 52): freeze graph growth, fall back to a reload when the freeze does
not take, reload a leak; the freeze's fold from the agents' answers; what it shows."""
import pytest

from tests.rules import cases, ids
from torch_watchdog import events
from torch_watchdog.sidecar.config import PolicyConfig
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.correlate.compiles import Compiles
from torch_watchdog.sidecar.core.correlate.freeze import Freeze, advice
from torch_watchdog.sidecar.core.forecast import Forecast
from torch_watchdog.sidecar.core.policy import (FREEZE_ANSWER_S, FROZEN_GROWTH_BYTES,
                                                PolicyState, decide, remedy)
from torch_watchdog.sidecar.core.results import ActionKind
from torch_watchdog.sidecar.present.status import freeze_summary

MiB = 1 << 20
LEVEL = 1000 * MiB


def mitigation(t, action, detail="312 sizes recorded; new sizes now run without CUDA graphs "
               "(cudagraph_capture_sizes)", pid=7):
    return events.Mitigation(t=t, pid=pid, name="freeze", action=action, detail=detail)


def graphs(level=LEVEL, seconds=30.0):
    """A forecast the recordings explain (cause cudagraph_per_shape)."""
    return Forecast(budget_bytes=2000 * MiB, level_bytes=level, seconds_linear=seconds,
                    trend_explained=True)


def leak(level=LEVEL, seconds=30.0):
    return Forecast(budget_bytes=2000 * MiB, level_bytes=level, seconds_linear=seconds)


def freeze(asked=None, answer=None, grown_to=None):
    """A freeze asked at `asked` with memory LEVEL; `answer`: (t, action) from the agent."""
    f = Freeze()
    if asked is not None:
        f.ask(asked, LEVEL, {})
    if answer is not None:
        f.on_mitigation(mitigation(*answer))
    return f


# (id, remedy, forecast, freeze, now, expected)
ROWS = [
    ("remedy-reload-graph-growth", "reload", graphs(), freeze(), 100, "reload"),
    ("graph-growth-freezes-first", "freeze_then_reload", graphs(), freeze(), 100, "freeze"),
    ("leak-goes-straight-to-a-reload", "freeze_then_reload", leak(), freeze(), 100, "reload"),
    ("remedy-freeze-leak-is-only-alerted", "freeze", leak(), freeze(), 100, "alert"),
    ("asked-answer-awaited", "freeze_then_reload", graphs(), freeze(100), 100 + 1, "frozen"),
    ("asked-no-answer-in-time", "freeze_then_reload", graphs(), freeze(100),
     100 + FREEZE_ANSWER_S, "reload"),
    ("agent-said-unavailable", "freeze_then_reload", graphs(),
     freeze(100, (100.2, "unavailable")), 100.5, "reload"),
    ("unavailable-remedy-freeze-alerts", "freeze", graphs(),
     freeze(100, (100.2, "unavailable")), 100.5, "alert"),
    ("engaged-and-flat-holds", "freeze_then_reload", graphs(),
     freeze(100, (100.2, "engaged")), 400, "frozen"),
    ("engaged-grown-within-one-tolerance", "freeze_then_reload",
     graphs(LEVEL + FROZEN_GROWTH_BYTES), freeze(100, (100.2, "engaged")), 130, "frozen"),
    ("engaged-but-still-growing-reloads", "freeze_then_reload",
     graphs(LEVEL + FROZEN_GROWTH_BYTES + MiB), freeze(100, (100.2, "engaged")), 130, "reload"),
    ("leak-after-the-freeze-reloads", "freeze_then_reload",
     leak(LEVEL + 2 * FROZEN_GROWTH_BYTES), freeze(100, (100.2, "engaged")), 130, "reload"),
    ("still-growing-remedy-freeze-alerts", "freeze",
     graphs(LEVEL + 2 * FROZEN_GROWTH_BYTES), freeze(100, (100.2, "engaged")), 130, "alert"),
    ("unfrozen-by-hand-is-reloaded", "freeze_then_reload", graphs(),
     freeze(100, (100.2, "released")), 130, "reload"),
]


@pytest.mark.parametrize("chosen, fc, f, now, expected", cases(ROWS), ids=ids(ROWS))
def test_what_the_reload_condition_does(chosen, fc, f, now, expected):
    state = State(first_t=0.0, now=now, freeze=f)
    assert remedy(state, fc, PolicyConfig(remedy=chosen)) == expected


def test_a_freeze_is_decided_once_then_holds_the_reload_while_it_takes():
    cfg = PolicyConfig(remedy="freeze_then_reload", hold_polls=2, warmup_s=0, alert_lead_s=600)
    state = State(first_t=0.0, compiles=Compiles(first_t=0.0))
    ps, kinds = PolicyState(), []
    for t in range(100, 110):
        state.now = float(t)
        for v in decide(state, graphs(), ps, cfg):
            kinds.append((t, v.kind))
            if v.kind is ActionKind.FREEZE:  # the step asks; the agent answers at once
                state.freeze.ask(v.t, LEVEL, {})
                state.freeze.on_mitigation(mitigation(t + 0.1, "engaged"))
    assert [k for k in kinds if k[1] is not ActionKind.ALERT] == [(101, ActionKind.FREEZE)]
    assert ps.held is not None and ps.held.reason == "frozen" and not ps.reloads
    state.now = 110.0   # the memory grows on: the freeze did not stop it
    got = decide(state, graphs(LEVEL + 2 * FROZEN_GROWTH_BYTES), ps, cfg) + \
        decide(state, graphs(LEVEL + 2 * FROZEN_GROWTH_BYTES), ps, cfg)
    assert ActionKind.RELOAD in [v.kind for v in got]


def test_the_freeze_follows_each_agents_answer():
    f = freeze(100)
    f.on_mitigation(mitigation(100.1, "engaged", pid=7))
    f.on_mitigation(mitigation(100.2, "engaged", "already stopped at 40 sizes (capture_sizes)",
                               pid=8))
    view = f.view()
    assert view["frozen"] and view["processes"] == 2 and view["since"] == 100.1
    assert view["sizes_kept"] == 312
    f.on_mitigation(mitigation(200, "released", pid=7))
    assert f.frozen  # pid 8 still is
    f.on_mitigation(mitigation(201, "released", pid=8))
    assert not f.frozen and f.released_t == 201
    f.on_mitigation(events.Mitigation(t=1, pid=7, name="padding", action="engaged", detail=""))
    assert f.released_t == 201


def test_the_advice_names_buckets_over_the_sizes_seen():
    keys = {"lm": {((1, n),) for n in range(16, 1025, 4)}, "tiny": {((1, 3),)}}
    got = advice(keys)
    assert got["model"] == "lm" and got["dimension"] == 1 and got["sizes_seen"] == 253
    assert len(got["buckets"]) == 8 and got["buckets"][-1] == 1024
    assert advice({}) is None and advice({"m": {"not a shape"}}) is None
    assert advice({"m": {((1, 4),), ((1, 4, 2),)}}) is None  # ranks differ


def test_the_status_line_says_what_a_frozen_server_runs_and_what_ends_it():
    f = freeze(100, (100.2, "engaged"))
    f.advice = {"model": "lm", "dimension": 1, "buckets": [64, 128, 256, 512],
                "sizes_seen": 300}
    text = freeze_summary(f.view())
    assert "recording frozen at 312 sizes since" in text
    assert "new sizes run without CUDA graphs" in text
    assert "lm's dimension 1 to 4 lengths (64, 128, 256, 512)" in text
    assert "did not take: no agent answered" in freeze_summary(freeze(100).view())
    assert freeze_summary(None) is None
    assert freeze_summary(freeze(100, (101, "released")).view()) is None


def test_a_reload_after_a_freeze_that_did_not_take_ends_the_freeze_and_its_alert():
    import dataclasses

    from tests.unit.test_step import CFG, GB, MB, POLICY, A, Host2, hello
    from torch_watchdog.sidecar.actions import alerts
    from torch_watchdog.sidecar.config import CorrelateConfig
    from torch_watchdog.sidecar.core.observations import ReloadOutcome

    cfg = dataclasses.replace(CFG, policy=dataclasses.replace(POLICY, remedy="freeze_then_reload"),
                              correlate=CorrelateConfig(min_records=5))
    h = Host2(cfg)
    for _ in range(10):
        h.poll()
    key = 0
    while not h.of("freeze") and h.t < 3000:   # a graph a poll, 20 MB each
        key += 1
        h.feed(events.CudagraphRecord(t=h.t, pid=101, phase="record", compile_id="0/1",
                                      key=[key], shape=None, seconds=0.01))
        h.poll(grow_a=20 * MB)
    (asked,) = h.of("freeze")
    assert asked.server == "replica-a" and asked.pids == (101,) and not h.of("reload")
    h.feed(mitigation(h.t + 0.1, "engaged", pid=101))
    h.poll()
    a = h.host.servers["replica-a"]
    built = alerts.build(a.firing, {}, {}, {"server": "replica-a"})
    (frozen,) = [v for k, v in built.items() if dict(k)["cause"] == "graphs_frozen"]
    assert frozen["labels"]["alertname"] == "TorchCompileGraphsFrozen"
    assert frozen["labels"]["severity"] == "warning"
    assert "recording frozen at 312 sizes" in frozen["annotations"]["description"]
    assert "unfreeze" in frozen["annotations"]["fix"]
    while not h.of("execute") and h.t < 3000:   # it grows on: the freeze did not stop it
        h.poll(grow_a=20 * MB)
    (decided,) = h.of("reload")
    assert decided.detail["level_bytes"] > asked.detail["level_bytes"] + FROZEN_GROWTH_BYTES
    h.feed(ReloadOutcome(True, "restarted", 3.0).at(h.t, "replica-a"))
    h.feed(hello(h.t, 111, "replica-a", [A]))     # the new process: recording as any
    h.mine[101] = 2 * GB
    h.poll()
    assert "graphs_frozen" not in a.firing and a.state.freeze.view() is None


def test_torch_2_15s_own_rerecord_limit_is_shown_not_taken_for_a_freeze():
    f = Freeze()
    f.on_limit(events.CudagraphWarning(t=1, pid=7, message="...", distinct_sizes=None,
                                       rerecord_limit=16, graph="0/1 inference"))
    f.on_limit(events.CudagraphWarning(t=1, pid=7, message="observed 9 distinct sizes",
                                       distinct_sizes=9))
    view = f.view()
    assert view["rerecord_limited"] == {"0/1 inference": 16} and not f.frozen
    assert freeze_summary(view) == ("torch stopped recording 1 graph(s) at "
                                    "cudagraph_dynamic_shape_rerecord_limit=16: their new "
                                    "sizes run without CUDA graphs")
    state = State(first_t=0.0, now=10.0, freeze=f)
    assert remedy(state, graphs(), PolicyConfig(remedy="freeze_then_reload")) == "freeze"


def test_a_freeze_from_before_a_sidecar_restart_is_adopted_not_asked_again():
    """The sidecar restarted beside a frozen server: the agent restates its freeze to the new
    one, which shows it, holds the reload while the memory stays flat, and reloads if it grows
    on; it does not ask for another freeze."""
    import dataclasses

    from tests.unit.test_step import CFG, MB, POLICY, Host2
    from torch_watchdog.sidecar.config import CorrelateConfig

    cfg = dataclasses.replace(CFG, policy=dataclasses.replace(POLICY, remedy="freeze_then_reload"),
                              correlate=CorrelateConfig(min_records=5))
    h = Host2(cfg)
    h.feed(mitigation(h.t, "engaged", "still stopped at 40 sizes (capture_sizes), as an "
                      "earlier sidecar asked", pid=101))
    for _ in range(20):
        h.poll()
    a = h.host.servers["replica-a"]
    assert a.firing["graphs_frozen"]["sizes_kept"] == 40 and a.state.freeze.level_bytes
    key = 0
    while not h.of("reload") and h.t < 3000:   # graphs and memory grow on: it did not hold
        key += 1
        h.feed(events.CudagraphRecord(t=h.t, pid=101, phase="record", compile_id="0/1",
                                      key=[key], shape=None, seconds=0.01))
        h.poll(grow_a=20 * MB)
    assert h.of("reload") and not h.of("freeze")
