"""What to do about the folded state and its forecast (pure): alert, reload, or nothing.

Guard rails, as earlyoom and systemd-oomd keep them: the reload condition must hold for
`hold_polls` consecutive polls; during the server's warm-up, for an OOM forecast before its
end plus the lead; a cooldown between reloads; at most `max_reloads_per_hour`, then alert
only. The executor re-checks right before acting.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch_watchdog.sidecar.config.schema import PolicyConfig
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.forecast import Forecast
from torch_watchdog.sidecar.core.results import ActionKind, Held, Verdict


REARM_S = 60.0
# remedy freeze: an agent answers a freeze from its own thread within a poll
# (tests/integration/test_agent_process.py: the "engaged" event back in under 0.5 s); none in
# this long is a freeze that did not take (no control connection, an old agent)
FREEZE_ANSWER_S = 5.0
# growth past the memory at the freeze that says it did not stop the growth: a new size run
# without a graph still takes its activations from the caching allocator (segments of 2 MiB
# and 20 MiB up, a new largest size a few of them): a frozen 12-layer transformer grew 38 MiB
# in 29 s over 1,566 new lengths (benchmarks/results/freeze.md, H100)
FROZEN_GROWTH_BYTES = 64 << 20


@dataclass
class PolicyState:
    alerted: set[str] = field(default_factory=set)  # causes already alerted
    forecast_alerted: bool = False
    holding: int = 0                              # consecutive polls with the reload condition
    reloads: list[float] = field(default_factory=list)  # times of reload decisions
    suppressed_alerted: bool = False
    not_before: float = 0.0                       # no reload decision before (a refused one's
                                                  # retry time)
    clear_since: Optional[float] = None           # the forecast well clear since
    held: Optional[Held] = None                   # the reload held back now, and why


def warming_up(state: State, cfg: PolicyConfig) -> bool:
    """From the server's first compile, else its agent's first hello, else the first time its
    processes were seen: a sidecar started before the server must not take the server's
    start-up (importing torch, loading weights) for runaway growth."""
    start = warmup_start(state)
    return start is None or state.now < start + cfg.warmup_s


def warmup_start(state: State) -> Optional[float]:
    if state.compiles.first_t is not None:
        return state.compiles.first_t
    return state.first_hello_t if state.first_hello_t is not None else state.first_t


def reload_lead(state: State, cfg: PolicyConfig) -> float:
    """How near a forecast OOM decides a reload: `reload_lead_s`, and during warm-up that
    plus what is left of it. The warm-up's one-off steps (weights, a compile's workspace) are
    not growth to the forecast; growth that climbs through the warm-up is, and waiting for its
    end would leave less than the lead (an OOM 40 s after the first compile was reloaded at
    the end of a 30 s warm-up, 9 s before it)."""
    if not warming_up(state, cfg):
        return cfg.reload_lead_s
    start = warmup_start(state)
    assert start is not None  # warming_up() is True without a start only before any sample
    return cfg.reload_lead_s + max(0.0, start + cfg.warmup_s - state.now)


def rearm_s(state: State) -> float:
    """How long the forecast stays well clear before its alert resolves: REARM_S, or half the
    horizon the trend reads the growth over while it reads one, where longer. Growth read over
    an hour clears the forecast for minutes and comes back (a staircase's next step late, a
    burst's idle gap, a shape space called saturated between new sizes): one growth, one
    alert. Growth that stops leaves no reading: REARM_S then."""
    reading = state.memory.reading
    return REARM_S if reading is None else max(REARM_S, reading.horizon / 2)


def well_clear(seconds: float, lead_s: float) -> bool:
    """A forecast far enough past a lead that it no longer calls for what the lead decides:
    twice the lead (a forecast wobbling around the lead must not cancel each decision, nor
    re-arm an alert each poll)."""
    return seconds > 2 * lead_s


def remedy(state: State, fc: Forecast, cfg: PolicyConfig) -> str:
    """What the reload condition does now (`policy.remedy`): "reload"; "freeze" (ask the
    server's agents to stop recording new sizes); "frozen" (asked: it took, or its answer is
    awaited; hold); "alert" (remedy freeze: no reload, say so). A freeze that did not take
    (an agent said it cannot, no answer in FREEZE_ANSWER_S, the memory still grew by
    FROZEN_GROWTH_BYTES) falls back to a reload; growth the recordings do not explain is
    reloaded at once; a server unfrozen by hand is reloaded as with remedy reload."""
    f = state.freeze
    if cfg.remedy == "reload" or f.released_t is not None:
        return "reload"
    fallback = "reload" if cfg.remedy == "freeze_then_reload" else "alert"
    if f.asked_t is None:
        return "freeze" if fc.cause == "cudagraph_per_shape" else fallback
    if not f.frozen:
        waiting = f.unavailable is None and state.now - f.asked_t < FREEZE_ANSWER_S
        return "frozen" if waiting else fallback
    if f.level_bytes is None:   # frozen before this sidecar: its level is read next poll
        return "frozen"
    grown = (fc.level_bytes or 0) - f.level_bytes
    return fallback if grown > FROZEN_GROWTH_BYTES else "frozen"


def decide(state: State, fc: Forecast, ps: PolicyState, cfg: PolicyConfig,
           allow_reload: bool = True,
           held_by: Optional[tuple[str, Optional[float], dict[str, Any]]] = None,
           ) -> list[Verdict]:
    """`allow_reload` False: another reload is under way (this server's, or the host-wide
    cap's); the condition keeps being held, and the decision comes once it is allowed.
    `held_by`: why it is not allowed, as `hold()` takes it (None: this server's own reload
    is under way, which holds nothing back). `ps.held` says, each poll, why a reload the
    forecast calls for is not decided (None: none is called for, or it is decided)."""
    now, actions = state.now, list[Verdict]()
    for finding in state.findings:
        if finding.cause not in ps.alerted:
            ps.alerted.add(finding.cause)
            actions.append(Verdict(now, ActionKind.ALERT, finding.cause, dict(finding.detail)))
    seconds = fc.seconds_earliest  # the trend's next step as soon as steps have come
    if seconds <= cfg.alert_lead_s and not ps.forecast_alerted:
        ps.forecast_alerted = True
        actions.append(Verdict(now, ActionKind.ALERT, "oom_forecast", _why(fc)))
    elif well_clear(seconds, cfg.alert_lead_s):
        # hysteresis: re-arm only once well clear, and for a while (a forecast that comes and
        # goes between polls is one alert)
        if ps.clear_since is None:
            ps.clear_since = now
        if now - ps.clear_since >= rearm_s(state):
            ps.forecast_alerted = False
    if not well_clear(seconds, cfg.alert_lead_s):
        ps.clear_since = None
    ps.holding = ps.holding + 1 if seconds <= reload_lead(state, cfg) else 0
    if ps.holding < cfg.hold_polls or not allow_reload:
        ps.held = _held_before_deciding(ps, now, cfg, allow_reload, held_by,
                                        not well_clear(seconds, reload_lead(state, cfg)))
        return actions
    todo = remedy(state, fc, cfg)
    if todo != "reload":
        return actions + _remedied(todo, state, fc, ps, cfg)
    ps.held = _held_back(ps, now, cfg)
    if ps.held is not None:
        if ps.held.reason == "hourly_maximum" and not ps.suppressed_alerted:
            ps.suppressed_alerted = True
            actions.append(Verdict(now, ActionKind.ALERT, "reload_suppressed",
                                   {"reloads_last_hour": ps.held.detail["reloads_last_hour"],
                                    **_why(fc)}))
        return actions
    ps.reloads.append(now)
    ps.holding, ps.suppressed_alerted, ps.held = 0, False, None
    actions.append(Verdict(now, ActionKind.RELOAD, "oom_forecast", _why(fc), dry_run=cfg.dry_run))
    return actions


def _remedied(todo: str, state: State, fc: Forecast, ps: PolicyState, cfg: PolicyConfig,
              ) -> list[Verdict]:
    """The reload condition held, and the remedy is not a reload (`remedy()`): a freeze
    asked, or the reload held while frozen, or (remedy freeze) said once not to be done."""
    now = state.now
    if todo == "freeze":
        ps.holding, ps.held = 0, None
        return [Verdict(now, ActionKind.FREEZE, "oom_forecast", _why(fc), dry_run=cfg.dry_run)]
    ps.held = hold(ps, now, "frozen" if todo == "frozen" else "remedy_freeze", None,
                   {"freeze": state.freeze.view()})
    if todo == "alert" and not ps.suppressed_alerted:  # said once, as the hourly maximum
        ps.suppressed_alerted = True
        return [Verdict(now, ActionKind.ALERT, "reload_suppressed",
                        {"remedy": cfg.remedy, **_why(fc)})]
    return []


def _held_before_deciding(ps: PolicyState, now: float, cfg: PolicyConfig, allow_reload: bool,
                          held_by: Optional[tuple[str, Optional[float], dict[str, Any]]],
                          near: bool) -> Optional[Held]:
    """The hold while the policy does not get as far as deciding: none when this server's
    own reload is under way, or no reload is called for and the forecast is well clear
    (`near` False: over twice the lead, as a decision is cancelled) or the hold's end has
    passed; the step's reason once the condition held `hold_polls` polls; while it is
    confirmed again, the hold already said. A forecast wobbling around the lead (a server
    growing in steps) is one hold, not one a poll, in the log and on the page."""
    if not allow_reload and held_by is None:
        return None
    if ps.holding == 0:
        kept = ps.held
        return kept if near and kept is not None and (kept.until is None or
                                                      now < kept.until) else None
    if held_by is not None and ps.holding >= cfg.hold_polls:
        return hold(ps, now, *held_by)
    return ps.held


def _held_back(ps: PolicyState, now: float, cfg: PolicyConfig) -> Optional[Held]:
    """Why the policy itself does not decide a reload now: a refused one's retry time, the
    cooldown, the hourly maximum; None: it decides one."""
    if now < ps.not_before:  # a refused reload (a PodDisruptionBudget) is asked again then
        return hold(ps, now, "precondition", ps.not_before, {"precondition": "refused"})
    if ps.reloads and now - ps.reloads[-1] < cfg.cooldown_s:
        return hold(ps, now, "cooldown", ps.reloads[-1] + cfg.cooldown_s,
                    {"last_reload_t": ps.reloads[-1], "cooldown_s": cfg.cooldown_s})
    recent = [t for t in ps.reloads if t > now - 3600]
    if len(recent) >= cfg.max_reloads_per_hour:
        # until the oldest of the hour's reloads leaves it (none allowed: no end)
        return hold(ps, now, "hourly_maximum", recent[0] + 3600 if recent else None,
                    {"reloads_last_hour": len(recent),
                     "max_reloads_per_hour": cfg.max_reloads_per_hour})
    return None


def hold(ps: PolicyState, now: float, reason: str, until: Optional[float],
         detail: dict[str, Any]) -> Held:
    """A hold for `reason`, since when it began (the same reason poll after poll is one hold:
    the log says it once, the page since when)."""
    since = ps.held.since if ps.held is not None and ps.held.reason == reason else now
    return Held(reason, since, until, detail)


def forget_reload(ps: PolicyState, t: float) -> None:
    """A decision taken at `t` was cancelled before anything was done: it starts no cooldown
    and does not count toward the hourly maximum."""
    ps.reloads = [x for x in ps.reloads if x != t]


def _why(fc: Forecast) -> dict[str, Any]:
    d = fc.as_dict()
    return {k: d[k] for k in ("seconds_to_oom", "seconds_to_oom_earliest", "seconds_to_oom_linear",
                              "seconds_to_oom_discovery", "plateau_bytes", "budget_bytes",
                              "level_bytes")}
