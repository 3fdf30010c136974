"""One pure step for the whole host: every decision the sidecar makes, for every server.

`step(host, observation, cfg) -> StepResult` (core/results.py: typed actions, and after a
sample what fires). Observations are the agents' events, the sources' samples (one per poll:
the sidecar's clock), the outcomes of reloads, and at start the reload history; the daemon
feeds them in the order it writes them to the sample log, and `replay` feeds that log to the
same step, so a replay decides what the live sidecar decided, at the same times, on the same
targets.

The host model and which server a process belongs to: core/host.py. Each server has its own
correlation state, forecast (the nearest time to OOM over its GPUs, each against that GPU's own
budget) and policy state. A reload targets only the server forecast to OOM, and
`policy.max_concurrent_reloads` keeps replicas from restarting together.

Decided here, not in the daemon: the re-check of a reload decision one poll later (carry it out,
or cancel it when the forecast is well clear), the reset after a reload or a restart, and the
alerts that fire.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from torch_watchdog import events
from torch_watchdog.sidecar.config.schema import Config, ForecastConfig, server_budgets
from torch_watchdog.sidecar.core import correlate, labels, policy
from torch_watchdog.sidecar.core.forecast import Forecast, forecast
from torch_watchdog.sidecar.core import lifecycle
from torch_watchdog.sidecar.core.host import (DEFAULT_SERVER, Host, Server, adopt, alive,
                                              all_gone, claim, forget_silent, forget_stopped,
                                              hold, owner_of, place_configured, release)
from torch_watchdog.sidecar.core.lifecycle import (Back, Decide, Life, Outcome, Phase, Renew,
                                                   ReloadEnded, ReloadUnderWay, Shown,
                                                   advance)
from torch_watchdog.sidecar.core.observations import (KnownServer, OperatorRequest,
                                                      ProcessSample, RecordUnreadable,
                                                      ReloadHistory, ReloadOutcome, Sample,
                                                      ServersKnown)
from torch_watchdog.sidecar.core.results import (Action, ActionKind, Alert, Cancel, Execute,
                                                 Freeze, Held, PollResult, Reload,
                                                 ReloadFailed, ReloadNotDone, ReloadOk,
                                                 Restart, ServerView, StepResult, Unfreeze)

CARRIED_OUT = (Phase.EXECUTING, Phase.RENEWED)
FROZEN_HOLDS = ("frozen", "remedy_freeze")   # the remedy holds a reload: not the method's
Observation = Union[events.Event, Sample, ReloadOutcome, RecordUnreadable, ReloadHistory,
                    ServersKnown, OperatorRequest]
__all__ = ["DEFAULT_SERVER", "Host", "Observation", "Server", "estimates", "server_view", "step"]


def step(host: Host, obs: Observation, cfg: Config) -> StepResult:
    if isinstance(obs, events.Event):  # the common observation: thousands a second
        return StepResult(_on_event(host, obs, cfg))
    if isinstance(obs, Sample):
        actions = _on_sample(host, obs, cfg)
        return StepResult(actions, _poll_result(host, cfg))
    if isinstance(obs, ReloadOutcome):
        return StepResult(_on_outcome(host, obs))
    if isinstance(obs, ReloadHistory):
        _on_history(host, obs)
        return StepResult()
    if isinstance(obs, ServersKnown):
        _on_known(host, obs, cfg)
        return StepResult()
    if isinstance(obs, OperatorRequest):
        return StepResult(_on_request(host, obs))
    host.record_unreadable = obs.detail  # fails closed: no reload for an hour, and an alert
    return StepResult()


def _on_history(host: Host, h: ReloadHistory) -> None:
    """Reload decisions before this sidecar started: cooldowns and the hourly maximum survive
    a restart (a decision of no server counts for every one)."""
    host.history.extend(h.decisions)
    for name, server in host.servers.items():
        server.policy.reloads = sorted([*server.policy.reloads,
                                        *(t for t, who in h.decisions if who in (None, name))])


def _on_known(host: Host, k: ServersKnown, cfg: Config) -> None:
    """The servers a sidecar before this one knew, their processes checked to be the same:
    placed as their hellos placed them then (claimed where agents' pids are trusted)."""
    for known in k.servers:
        server = host.server(known.name)
        for pid in known.pids:
            if pid in host.configured or pid in host.named:
                continue  # the config, or a hello already heard, says where it is now
            host.named[pid] = known.name
            host.agents.setdefault(pid, k.t)  # read for its liveness from the first poll
            if cfg.server.trust_agent_pids:
                claim(host, server, pid, k.t)
        server.uid = server.uid if server.uid is not None else known.uid
        server.parents.update(known.parents)
        server.gpus.update(known.gpus)
        server.argv = server.argv or known.argv


def _on_request(host: Host, r: OperatorRequest) -> list[Action]:
    """`torch-watchdog unfreeze SERVER`: its agents are asked to record again, and this
    process of it is not frozen again (a reload or restart gives it a new state)."""
    server = host.servers.get(r.server)
    if server is None:
        return []
    freeze = server.state.freeze
    was = freeze.view()
    freeze.released_t = r.t
    return [Unfreeze(r.t, "by_hand", {"freeze": was}, *_target(server))]


def known_servers(host: Host) -> tuple[KnownServer, ...]:
    """The servers the agents placed, as the next sidecar needs them: each live server's
    processes (not the config's: it finds those itself) and what its hellos said."""
    members: dict[str, list[int]] = {}
    for pid, name in host.named.items():
        if pid not in host.configured and host.alive.get(pid) is not False:
            members.setdefault(name, []).append(pid)
    out = []
    for name, pids in sorted(members.items()):
        server = host.servers.get(name)
        if server is not None:
            out.append(KnownServer(name, tuple(sorted(pids)), server.uid,
                                   tuple(sorted(server.parents)), tuple(sorted(server.gpus)),
                                   server.argv))
    return tuple(out)


# -- events -------------------------------------------------------------------------------
def _on_event(host: Host, e: events.Event, cfg: Config) -> list[Action]:
    now = host.now
    if now is not None and abs(e.t - now) > cfg.correlate.max_clock_skew_s:
        # one forged or broken clock must not move the state's clock: every real sample
        # would fall out of the forecast's window (a +1e9 s event switched the forecast off)
        host.skewed_events += 1
        e = dataclasses.replace(e, t=now)
    pid = e.pid
    host.agents[pid] = e.t
    actions: list[Action] = []
    if isinstance(e, events.Hello):
        server = _on_hello(host, e, actions)
    else:  # the common path: the owner is known
        name = host.configured.get(pid) or host.owner.get(pid) or host.named.get(pid)
        if name is None:  # no hello or config placed it yet: nothing is decided about it
            hold(host, e)
            return actions
        server = host.servers.get(name) or host.server(name)
    # a configured server's pids are its unit's or pidfile's (and their children) alone: an
    # agent naming it cannot add a pid it would be reloaded (signalled) through
    if pid in host.configured or (cfg.server.trust_agent_pids and
                                  server.name not in host.configured.values()):
        claim(host, server, pid, e.t)
    for held in release(host, pid):  # heard before its hello: the server's, in order
        correlate.apply(server.state, held, cfg.correlate)
    correlate.apply(server.state, e, cfg.correlate)
    if host.now is None:  # an agent log without samples: its causes are still alerted
        correlate.evaluate_causes(server.state, cfg.correlate)
        actions += _decide(host, server, cfg, allow_reload=False)
    return actions


def _on_hello(host: Host, e: events.Hello, actions: list[Action]) -> Server:
    name = owner_of(host, e)
    adopt(host, e, name)
    server = host.server(name)
    host.named[e.pid] = name
    if e.pid not in server.pids and server.reload.phase in CARRIED_OUT:
        if server.reload.phase is Phase.EXECUTING:
            # the reload's new process, back before the reload's outcome: its compiles and
            # recordings are the new state's first; the old pids stay until the outcome
            _renew(server)
            server.reload = advance(server.reload, Renew())
    elif e.pid not in server.pids and (server.life is Life.DOWN or all_gone(host, server)):
        # the server died and came back (a crash, systemd's Restart=, its name reused): a new
        # process, a new baseline; folding it into the old state calls its model load
        # "unexplained growth", and a name reused merged two processes' counts
        actions.append(Restart(e.t, "server_restarted",
                               {"old_pids": sorted(server.pids), "new_pid": e.pid},
                               *_target(server)))
        _reset(host, server)
    server.gpus.update(e.devices)
    if isinstance(e.argv, str) and e.argv:
        server.argv = e.argv
    if server.uid is None or server.uid == 0 or len(server.pids) == 0:
        server.uid = e.uid
    server.reload = advance(server.reload, Back(e.pid))  # a failed reload's server is back
    if isinstance(e.ppid, int):
        server.parents.add(e.ppid)
    return server


# -- samples ------------------------------------------------------------------------------
def _on_sample(host: Host, s: Sample, cfg: Config) -> list[Action]:
    host.now = s.t if host.now is None else max(host.now, s.t)
    host.alive.update({p.pid: p.alive for p in s.processes})
    place_configured(host, s.configured, s.t)
    for pid in host.unplaced.keys() & host.configured.keys():  # the config placed them
        server = host.server(host.configured[pid])
        for held in release(host, pid):
            correlate.apply(server.state, held, cfg.correlate)
    if False in host.alive.values():  # only the dead are forgotten
        forget_silent(host, s.t)
    actions: list[Action] = []
    servers = list(host.servers.values())
    busy = sum(o.busy for o in servers)
    for server in servers:
        was = server.busy
        _live(host, server, s.t)
        if server.life is Life.DOWN:
            actions += _poll_down(server, s.t, cfg)
        else:
            actions += _poll_server(host, server, s, cfg, busy - was)
        busy += server.busy - was
    forget_stopped(host, s.t)
    _trim_history(host, s.t, cfg)
    return actions


def _live(host: Host, server: Server, t: float) -> None:
    """The server's life after this sample (core/lifecycle.py): down since when."""
    server.life = lifecycle.life_after(server.life, alive(host, server))
    if server.life is not Life.DOWN:
        server.down_since = None
    elif server.down_since is None:
        server.down_since = t


def forecast_config(cfg: Config, name: str) -> ForecastConfig:
    """The forecast's config for one server: its own budget where `servers[]` gives it one,
    else the host's (`forecast.process_budget_bytes`, or the device's)."""
    budget = server_budgets(cfg).get(name)
    if budget is None or budget == cfg.forecast.process_budget_bytes:
        return cfg.forecast
    return dataclasses.replace(cfg.forecast, process_budget_bytes=budget)


def _poll_server(host: Host, server: Server, s: Sample, cfg: Config,
                 others_busy: int) -> list[Action]:
    correlate.apply(server.state, _view(server, s), cfg.correlate, cfg.gpu.attribution)
    correlate.evaluate_causes(server.state, cfg.correlate)
    server.forecast = forecast(server.state, forecast_config(cfg, server.name),
                               cfg.correlate.min_records)
    frozen = server.state.freeze
    if frozen.frozen and frozen.level_bytes is None:  # frozen before this sidecar started
        frozen.level_bytes = server.forecast.level_bytes
    actions = _recheck(server, s.t, cfg)
    held_by = _held_by(host, server, cfg, others_busy)
    actions += _decide(host, server, cfg, allow_reload=held_by is None, held_by=held_by)
    server.firing = _firing(server)
    server.reload = advance(server.reload, Shown())
    return actions


def _poll_down(server: Server, t: float, cfg: Config) -> list[Action]:
    """A server whose processes are all gone: no forecast and no cause of it fires (nothing
    of it is left to run out of memory); a decision not yet carried out is cancelled; its
    reload's alerts go on until their outcome is shown (a drained server is down until its
    new process says hello). Nothing of it is folded: a poll's cost follows the live
    servers."""
    server.forecast = Forecast(None, None)
    server.policy.held = None
    actions = _recheck(server, t, cfg)
    server.firing = lifecycle.alerts(server.reload)
    server.reload = advance(server.reload, Shown())
    return actions


def _trim_history(host: Host, now: float, cfg: Config) -> None:
    """Reload decisions older than any cooldown or the hourly maximum reads: they decide
    nothing (an unbounded list over weeks of uptime)."""
    keep = now - max(3600.0, cfg.policy.cooldown_s)
    if host.history and host.history[0][0] < keep:
        host.history = [d for d in host.history if d[0] >= keep]
        for server in host.servers.values():
            server.policy.reloads = [t for t in server.policy.reloads if t >= keep]


def _held_by(host: Host, server: Server, cfg: Config, others_busy: int,
             ) -> Optional[tuple[str, Optional[float], dict[str, Any]]]:
    """Why this server may not be reloaded now, whatever its forecast (policy.hold's terms);
    None: it may. A server whose processes are all forgotten has nothing to reload; growth on
    a GPU it shares, with no per-process numbers to pin it on this server, is alerted, not
    reloaded."""
    if not server.pids:
        return "precondition", None, {"precondition": "no_process"}
    if others_busy >= cfg.policy.max_concurrent_reloads:
        return "concurrency_cap", None, {"reloads_under_way": others_busy,
                                         "max_concurrent_reloads":
                                         cfg.policy.max_concurrent_reloads}
    if not _attributable(host, server):
        return "precondition", None, {"precondition": "shared_gpu"}
    return None


def _attributable(host: Host, server: Server) -> bool:
    """Its memory is its own processes' (NVML per process), or no other server shares its
    GPUs: only then can a forecast OOM be pinned on it."""
    if server.state.memory.source != "device":
        return True
    mine = set(server.state.memory.gpus)
    return not any(mine & set(o.state.memory.gpus) for o in host.servers.values()
                   if o is not server)


def _view(server: Server, s: Sample) -> Sample:
    """The sample as this server sees it: its processes, and its GPUs (every GPU when none of
    the agents' devices or NVML's per-process lists name one: a device-level meter)."""
    pids, gpus = server.pids, server.gpus
    procs = tuple([p for p in s.processes if p.pid in pids])
    if server.state.pool_slack:
        procs = tuple(_without_slack(p, server.state.pool_slack, s.t) for p in procs)
    for p in procs:
        for u, b in p.gpu_bytes.items():
            if b and u not in gpus:
                gpus.add(u)
    devices = tuple([d for d in s.devices if d.uuid in gpus]) or s.devices
    return dataclasses.replace(s, processes=procs, devices=devices)


POOL_SLACK_S = 10.0   # a pool's slack is believed this long after its heartbeat (5 of them)


def _without_slack(p: ProcessSample, slack: dict[int, tuple[float, int]], t: float,
                   ) -> ProcessSample:
    """The process's GPU memory less its primed graph pool's bytes not yet in use (torch
    2.15's cudagraph_initial_mempool_allocation_gb: NVML counts the whole block at once),
    taken from its largest GPU: what the graphs use grows, as NVML would show it unprimed."""
    got = slack.get(p.pid)
    if got is None or t - got[0] > POOL_SLACK_S or not p.gpu_bytes or got[1] <= 0:
        return p
    gpu = max(p.gpu_bytes, key=lambda u: p.gpu_bytes[u] or 0)
    left = dict(p.gpu_bytes)
    left[gpu] = max(0, (left[gpu] or 0) - got[1])
    return dataclasses.replace(p, gpu_bytes=left)


def _recheck(server: Server, t: float, cfg: Config) -> list[Action]:
    """Last poll's decision, right before acting: carried out, or cancelled when the forecast
    is well clear (policy.well_clear) because the server's memory fell (it let go of memory,
    a process exited): a growth rate read from the last seconds pauses with the traffic,
    which is no reason to cancel. A cancelled decision starts no cooldown."""
    decision = server.reload.decision
    if server.reload.phase is not Phase.DECIDED or decision is None:
        return []
    fc, before = server.forecast, decision.detail.get("level_bytes")
    fell = fc.level_bytes is None or before is None or fc.level_bytes < before
    if policy.well_clear(fc.seconds_earliest, cfg.policy.reload_lead_s) and fell:
        policy.forget_reload(server.policy, decision.t)
        server.reload = advance(server.reload, lifecycle.Cancel())
        return [Cancel(t, decision.reason, decision.detail, decision.server, decision.pids,
                       decision.gpus, decision.cause, decision.dry_run, decided_t=decision.t)]
    server.reload = advance(server.reload, lifecycle.Execute(ReloadUnderWay(
        cfg.reload.method, server.forecast.as_dict()["seconds_to_oom"], decision.cause)))
    return [Execute(t, decision.reason, decision.detail, decision.server, decision.pids,
                    decision.gpus, decision.cause, decision.dry_run, decided_t=decision.t)]


def _decide(host: Host, server: Server, cfg: Config, allow_reload: bool,
            held_by: Optional[tuple[str, Optional[float], dict[str, Any]]] = None,
            ) -> list[Action]:
    fc = server.forecast
    if server.busy:  # one decision at a time per server: its own reload holds nothing back
        allow_reload, held_by = False, None
    out: list[Action] = []
    before = server.policy.held
    verdicts = policy.decide(server.state, fc, server.policy, cfg.policy, allow_reload, held_by)
    held = server.policy.held
    if _not_done(cfg.policy.dry_run, cfg) is not None and (
            held is not None and held.reason not in FROZEN_HOLDS or any(
            v.kind is ActionKind.RELOAD for v in verdicts)):
        # decided or not, none is carried out: the reason a user needs first (a cooldown
        # after a dry-run decision is no reason of its own)
        reason = "dry_run" if cfg.policy.dry_run else "method_none"
        since = before.since if before is not None and before.reason == reason else \
            server.state.now
        server.policy.held = Held(reason, since)
    for v in verdicts:
        if v.kind is ActionKind.FREEZE:
            server.state.freeze.ask(v.t, fc.level_bytes, server.state.shapes.keys)
            out.append(Freeze(v.t, v.reason, {**v.detail, "cause": fc.cause},
                              *_target(server), dry_run=v.dry_run))
            continue
        if v.kind is not ActionKind.RELOAD:
            out.append(Alert(v.t, v.reason, v.detail, *_target(server)))
            continue
        decision = Reload(v.t, v.reason, v.detail, *_target(server),
                          cause=fc.cause or "oom_forecast", dry_run=v.dry_run,
                          not_done=_not_done(v.dry_run, cfg))
        host.history.append((decision.t, server.name))
        if decision.not_done is None:
            server.reload = advance(server.reload, Decide(decision))
        out.append(decision)
    return out


def _not_done(dry_run: bool, cfg: Config) -> Optional[str]:
    """Why a reload decision will not be carried out; None: it will be (next poll, if it
    still holds)."""
    if dry_run:
        return "dry run"
    if cfg.reload.method == "none":
        return "reload.method is none"
    return None


def _target(server: Server) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """An action's target: the server, its pids and its GPUs."""
    return (server.name, tuple(sorted(server.pids)),
            tuple(sorted(server.state.memory.gpus or server.gpus)))


def _firing(server: Server) -> dict[str, dict[str, Any]]:
    """The alerts that fire for this server now: its active causes, the OOM forecast (with the
    policy's hysteresis), and its reload's (core/lifecycle.py: from its start until one poll
    after its outcome; a failed one until the server is back)."""
    state = server.state
    if not (state.active or server.policy.forecast_alerted or state.padding.models or
            server.reload.phase is not Phase.IDLE or state.freeze.engaged):
        return {}  # the common case: nothing fires
    firing = {cause: dict(f.detail) for cause, f in state.active.items()}
    if server.policy.forecast_alerted:
        firing["oom_forecast"] = dict(server.forecast.as_dict())
    refused = server.state.padding.refused()
    if refused:  # the agent's padding turned itself off: until the server's process changes
        firing["padding_refused"] = {"models": refused}
    if state.freeze.frozen:  # new sizes run without CUDA graphs: until unfrozen or reloaded
        firing["graphs_frozen"] = state.freeze.view() or {}
    firing.update(lifecycle.alerts(server.reload))
    return firing


# -- reload outcomes ----------------------------------------------------------------------
def _on_outcome(host: Host, o: ReloadOutcome) -> list[Action]:
    server = host.server(o.server)
    r = server.reload
    decision = r.decision if r.phase in CARRIED_OUT else None
    renewed = r.phase is Phase.RENEWED
    ended = ReloadEnded(o.detail, o.seconds, decision.cause if decision else None)
    # carried out but not back (no new hello in time): reload_failed, alerted until it is back
    kind = ReloadOk if o.ok else ReloadFailed if o.failed else ReloadNotDone
    action = kind(o.t, "oom_forecast", ended.detail(), *_target(server))
    if not o.ok and o.retry_after_s is not None and decision is not None:
        # refused for now (a PodDisruptionBudget): no cooldown, not counted; asked again
        policy.forget_reload(server.policy, decision.t)
        server.policy.not_before = o.t + o.retry_after_s
    old = set(decision.pids) if decision else set(server.pids)
    server.reload = advance(r, Outcome(ended, o.failed, frozenset(old)))
    if o.ok:  # the old processes are gone: the new ones start a fresh state (from the first
        # new hello where it came first), keeping the replacements heard during the reload
        fresh = {pid: t for pid, t in server.pids.items() if pid not in old}
        if renewed:
            for pid in old:
                server.pids.pop(pid, None)
                host.owner.pop(pid, None)
        else:
            _reset(host, server)
        server.pids.update(fresh)
        host.owner.update(dict.fromkeys(fresh, server.name))
    return [action]


def _reset(host: Host, server: Server) -> None:
    """A new server process: a new correlation state and alerts that can fire again; its
    reload history (cooldown, hourly maximum) stays."""
    for pid in server.pids:
        host.owner.pop(pid, None)
        if host.named.get(pid) == server.name:
            del host.named[pid]
    server.pids = {}
    server.life, server.down_since = Life.ANNOUNCED, None
    _renew(server)


def _renew(server: Server) -> None:
    """A new correlation state, alerts that can fire again, no decision pending; the pids and
    the reload history (cooldown, hourly maximum) stay."""
    server.state = correlate.State()
    server.findings_shown = 0
    server.policy = policy.PolicyState(reloads=server.policy.reloads)
    server.forecast = Forecast(None, None)
    if server.reload.phase is Phase.DECIDED:
        server.reload = lifecycle.IDLE


def estimates(server: Server, cfg: Config) -> dict[str, Any]:
    """The server's numbers and its forecast in one mapping, as replay and the report show."""
    return {**server.state.estimates(cfg.correlate), **server.forecast.as_dict()}


def _poll_result(host: Host, cfg: Config) -> PollResult:
    """What fires and what every server shows, after a sample."""
    labels.relabel(host)
    focus = host.focus()
    # a server whose processes are all gone leaves the page (its state and reload history
    # stay, for its next start); once every one has, the page waits for a server again
    # the servers shown, alerted and exported are one set: those with processes, and those
    # down whose reload's alerts still fire (a drained server until its new process is back)
    shown = {name: s for name, s in host.servers.items()
             if s.pids and s.life is not Life.DOWN or s.life is Life.DOWN and s.firing}
    stopped: tuple[str, ...] = ()
    if host.servers and focus.name not in shown:
        stopped, focus = tuple(sorted(host.servers)), host.placeholder()
    views = {name: server_view(s, cfg) for name, s in shown.items()}
    known = host.servers.get(focus.name) is focus
    unreadable = host.record_unreadable
    return PollResult(
        firing={name: s.firing for name, s in shown.items()}, views=views,
        host_firing={"reload_record_unreadable": {"detail": unreadable}} if unreadable else {},
        focus=focus.name if known else None,
        focus_view=views[focus.name] if known else server_view(focus, cfg),
        focus_causes=[f.as_dict() for f in focus.state.active.values()],
        agents_alive=host.agents_alive(), skewed_events=host.skewed_events,
        agent_events_lost=sum(s.state.losses.total for s in host.servers.values()),
        stopped=stopped, new_findings=_new_findings(host),
        pids_to_read=frozenset(host.agents).union(host.owner)
        if cfg.server.trust_agent_pids else frozenset(host.agents),
        placed_pids=frozenset(host.configured), known=known_servers(host))


def _new_findings(host: Host) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Every server's findings since the last poll's result, as shown."""
    out = []
    for name, server in host.servers.items():
        findings = server.state.findings
        if len(findings) > server.findings_shown:
            out += [(name, f.as_dict()) for f in findings[server.findings_shown:]]
            server.findings_shown = len(findings)
    return tuple(out)


def server_view(server: Server, cfg: Config) -> ServerView:
    state = server.state
    return {"estimates": state.estimates(cfg.correlate), "forecast": server.forecast.as_dict(),
            "active_causes": tuple(state.active), "pids": sorted(server.pids),
            "label": server.label or server.name,
            "gpus": sorted(state.memory.gpus or server.gpus),
            "held": None if server.policy.held is None else server.policy.held.as_dict(),
            "freeze": state.freeze.view()}
