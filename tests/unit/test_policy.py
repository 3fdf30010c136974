"""decide(): table-driven guard rails with hand-made forecasts (no clock, no I/O)."""
import pytest

from torch_watchdog.sidecar.config import PolicyConfig
from torch_watchdog.sidecar.core.correlate import Finding, State
from torch_watchdog.sidecar.core.correlate.compiles import Compiles
from torch_watchdog.sidecar.core.forecast import FOREVER, Forecast
from torch_watchdog.sidecar.core.policy import PolicyState, decide

CFG = PolicyConfig(reload_lead_s=60, alert_lead_s=600, hold_polls=3, warmup_s=30,
                   cooldown_s=100, max_reloads_per_hour=2)


def fc(seconds):
    return Forecast(budget_bytes=100, level_bytes=50, seconds_linear=seconds)


def run(seconds_by_t, cfg=CFG, first_compile_t=0.0):
    state = State(first_t=0.0, compiles=Compiles(first_t=first_compile_t))
    ps, out = PolicyState(), []
    for t, seconds in seconds_by_t:
        state.now = t
        out += [(a.t, a.kind, a.reason) for a in decide(state, fc(seconds), ps, cfg)]
    return out


def reloads(actions):
    return [t for t, action, _ in actions if action == "reload"]


@pytest.mark.parametrize("case, series, expected_reloads", [
    ("holds 3 polls", [(40, 30), (41, 30), (42, 30)], [42]),
    ("a blip does not reload", [(40, 30), (41, 30), (42, 500), (43, 30)], []),
    # in warm-up (30 s from the compile at 0): an OOM before its end plus the lead
    ("in warm-up, an OOM before its end", [(10, 1), (11, 1), (12, 1), (20, 1)], [12]),
    ("in warm-up, one after its end plus the lead waits",
     [(10, 85), (11, 85), (12, 85), (13, 85), (20, 85), (21, 85), (22, 85)], []),
    ("in warm-up, an OOM due before its end plus the lead",
     [(t, 88 - t) for t in (20, 21, 22)], [22]),
    ("in warm-up, one due later waits for the lead", [(t, 95 - t) for t in range(20, 40)],
     [37]),
    ("after warm-up the lead alone", [(30, 65), (31, 65), (32, 65), (33, 59), (34, 59),
                                      (35, 59)], [35]),
    ("cooldown", [(40 + i, 1) for i in range(100)], [42]),
    ("again after cooldown", [(40 + i, 1) for i in range(110)], [42, 142]),
    ("flat: never", [(40 + i, FOREVER) for i in range(200)], []),
])
def test_reload_guard_rails(case, series, expected_reloads):
    assert reloads(run(series)) == expected_reloads


def test_max_per_hour_then_alert_only():
    cfg = PolicyConfig(reload_lead_s=60, hold_polls=1, warmup_s=0, cooldown_s=10,
                       max_reloads_per_hour=2)
    actions = run([(float(t), 1.0) for t in range(0, 100)], cfg)
    assert reloads(actions) == [0.0, 10.0]
    assert [a for a in actions if a[2] == "reload_suppressed"] == [(20.0, "alert",
                                                                    "reload_suppressed")]


def test_forecast_alert_once_with_hysteresis():
    # re-armed once well clear (over twice the alert lead) for a minute, not at one clear poll
    actions = run([(40, 500), (41, 400), (42, 5000), (43, 2000), (44, 300), (45, 5000),
                   (104, 5000), (105, 5000), (106, 300)])
    assert [t for t, a, r in actions if r == "oom_forecast" and a == "alert"] == [40, 106]


def test_a_forecast_alert_read_over_an_hour_rearms_after_half_of_it():
    """Growth read over an hour (the trend's horizon) clears the forecast for minutes between
    its steps: that is one growth, one alert. Once the trend reads no growth, a minute well
    clear re-arms it as before."""
    from torch_watchdog.sidecar.core import horizons

    state = State(first_t=0.0, compiles=Compiles(first_t=0.0))
    state.memory.reading = horizons.Reading(3600.0, 1e3, 0.9, 10, 1e6, 0.0, 300.0, 360.0)
    ps, fired = PolicyState(), []
    series = [(100, 500), (200, 5000), (1000, 5000), (1700, 5000), (1750, 400),
              (1800, 5000), (3700, 5000), (3710, 400)]
    for t, seconds in series:
        state.now = float(t)
        fired += [t for a in decide(state, fc(seconds), ps, CFG) if a.reason == "oom_forecast"]
    assert fired == [100, 3710]  # clear 1,500 s (under half the hour), then 1,900 s
    state.memory.reading = None   # the growth stopped: a minute clear re-arms
    for t, seconds in [(3800, 5000), (3861, 5000), (3862, 400)]:
        state.now = float(t)
        fired += [t for a in decide(state, fc(seconds), ps, CFG) if a.reason == "oom_forecast"]
    assert fired == [100, 3710, 3862]


def test_each_cause_is_alerted_once():
    state, ps = State(first_t=0.0, now=50.0), PolicyState()
    state.findings.append(Finding(45.0, "recompile_storm", {"recompiles_in_window": 5}))
    first = decide(state, fc(FOREVER), ps, CFG)
    again = decide(state, fc(FOREVER), ps, CFG)
    assert [(a.kind, a.reason) for a in first] == [("alert", "recompile_storm")]
    assert again == []


def test_dry_run_is_marked():
    cfg = PolicyConfig(hold_polls=1, warmup_s=0, dry_run=True)
    state, ps = State(first_t=0.0, now=5.0), PolicyState()
    (reload,) = [a for a in decide(state, fc(1.0), ps, cfg) if a.kind == "reload"]
    assert reload.dry_run is True


def test_a_cancelled_decision_starts_no_cooldown():
    """The daemon re-checks a decision one poll later; if the forecast cleared it cancels it
    and forgets it: the next time the condition holds, the policy decides again (a cancelled
    decision once blocked every reload for the cooldown's 10 minutes while the demo's server
    grew past its budget)."""
    from torch_watchdog.sidecar.core.policy import forget_reload

    state, ps = State(first_t=0.0, compiles=Compiles(first_t=0.0)), PolicyState()
    decided = []
    for t in range(40, 50):
        state.now = float(t)
        for a in decide(state, fc(1), ps, CFG):
            if a.kind == "reload":
                decided.append(t)
                if len(decided) == 1:
                    forget_reload(ps, a.t)  # cancelled at the re-check
    assert decided == [42, 45]


def test_warm_up_counts_from_the_first_hello_not_the_sidecars_start():
    # the sidecar saw the server's processes at t=0 (importing torch); its agent said hello at
    # t=50 and nothing compiled yet: in warm-up until t=80, where the lead is 60 s plus what
    # is left of it
    state = State(first_t=0.0, first_hello_t=50.0)
    ps, out = PolicyState(), []
    for t in range(55, 90):
        state.now = float(t)
        out += [a.t for a in decide(state, fc(130.0 - t), ps, CFG) if a.kind == "reload"]
    # an OOM due at 130, before the warm-up's end plus the lead (140): decided while warming
    # up, after 3 polls holding (counted from t=0, the warm-up was over and the lead alone
    # would have waited until t=70)
    assert out == [57.0]


def held_over(series, cfg=CFG, ps=None, held_by=None, allow_reload=True):
    """(t, held reason, since, until) after each poll."""
    state, ps = State(first_t=0.0, compiles=Compiles(first_t=0.0)), ps or PolicyState()
    out = []
    for t, seconds in series:
        state.now = t
        decide(state, fc(seconds), ps, cfg, allow_reload, held_by)
        h = ps.held
        out.append((t, None, None, None) if h is None else (t, h.reason, h.since, h.until))
    return out


def test_a_reload_held_by_the_cooldown_says_so_until_it_ends():
    """Issue 40: over budget for 6 minutes with no reload and no word of the cooldown."""
    series = [(t, 10) for t in range(40, 50)]
    out = held_over(series)
    assert out[2] == (42, None, None, None)  # decided at 42: nothing held back
    # once the condition held hold_polls polls again, held by the cooldown, until 42 + 100
    assert out[3:5] == [(43, None, None, None), (44, None, None, None)]
    assert out[5:] == [(t, "cooldown", 45, 142.0) for t in range(45, 50)]
    assert held_over([(40, 500), (41, 500)]) == [(40, None, None, None), (41, None, None, None)]


def test_the_hourly_maximum_holds_until_the_oldest_reload_leaves_the_hour():
    ps = PolicyState(reloads=[1000.0, 1200.0])
    (last,) = held_over([(1400, 10), (1401, 10), (1402, 10)], ps=ps)[-1:]
    assert last == (1402, "hourly_maximum", 1402, 4600.0)
    assert ps.held.detail == {"reloads_last_hour": 2, "max_reloads_per_hour": 2}


def test_a_refused_reload_holds_until_it_is_asked_again():
    ps = PolicyState(not_before=500.0)
    assert held_over([(t, 10) for t in (40, 41, 42)], ps=ps)[-1] == (42, "precondition", 42,
                                                                     500.0)
    assert ps.held.detail == {"precondition": "refused"}


def test_the_step_s_reason_holds_it_and_its_own_reload_holds_nothing():
    cap = ("concurrency_cap", None, {"reloads_under_way": 1, "max_concurrent_reloads": 1})
    out = held_over([(t, 10) for t in (40, 41, 42, 43)], held_by=cap, allow_reload=False)
    assert [o[1] for o in out] == [None, None, "concurrency_cap", "concurrency_cap"]
    assert out[-1][2] == 42  # one hold since it began, not a new one each poll
    assert held_over([(t, 10) for t in (40, 41, 42)], allow_reload=False)[-1][1] is None


def test_a_forecast_wobbling_around_the_lead_is_one_hold_until_well_clear():
    """A server growing in steps: its forecast crossed the lead back and forth, and the log
    said "reload held back" every other poll."""
    ps = PolicyState(reloads=[0.0])  # the cooldown runs until 100
    out = held_over([(40, 10), (41, 10), (42, 10), (43, 90), (44, 10), (45, 90)], ps=ps)
    assert [o[1] for o in out] == [None, None] + ["cooldown"] * 4
    assert {o[2] for o in out[2:]} == {42}
    assert held_over([(46, 500)], ps=ps)[-1][1] is None  # well clear (over twice the lead)
