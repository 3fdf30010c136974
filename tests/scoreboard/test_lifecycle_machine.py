"""The lifecycle space, searched: a stateful property test (Hypothesis) over the pure step.

Random sequences of sidecar restarts (a new host fed what the last one persisted: the reload
history of reloads.json and the servers of servers.json, each pid checked alive), servers
starting, exiting, crashing and starting again under the same name, hellos late or never
re-sent after a restart, reloads carried out and ending, config reloads, memory flat or
growing per server. After every step the invariants a user relies on hold:
- no reload of a server whose own memory is flat and under its budget (two flat servers
  together over the per-server budget must not make one);
- no action on a process that no hello placed, nor one named for another server;
- the servers the views show are the servers the alerts fire for;
- cooldowns and the hourly maximum hold across restarts;
- a server whose processes are all gone has no forecast and no firing cause (its reload's
  alerts apart);
- no `default` server (every agent here names its server).
`LIFECYCLE_EXAMPLES` sets the number of sequences (CI: the default).
"""
from __future__ import annotations

import dataclasses
import math
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.unit.test_step import calls, compile_event, hello
from torch_watchdog.sidecar.config import Config, ForecastConfig, PolicyConfig, ReloadConfig
from torch_watchdog.sidecar.core.observations import (DeviceSample, KnownServer, ProcessSample,
                                                      ReloadHistory, ReloadOutcome, Sample,
                                                      ServersKnown)
from torch_watchdog.sidecar.core.step import Host, step

MB = 1 << 20
GB = 1 << 30
NAMES = ("llm-a", "llm-b", "llm-c")
GPU = {name: f"GPU-{name}" for name in NAMES}
BUDGET = 400 * MB
FLAT = 262 * MB        # two together are over the budget; one is well under it
GROWTH = 2 * MB        # a poll, for a growing server: its OOM comes within a minute
POLL_S = 0.5
COOLDOWN_S = 120.0
MAX_PER_HOUR = 2


def config(alert_lead_s: float) -> Config:
    return Config(policy=PolicyConfig(reload_lead_s=20, alert_lead_s=alert_lead_s,
                                      hold_polls=2, warmup_s=0, cooldown_s=COOLDOWN_S,
                                      max_reloads_per_hour=MAX_PER_HOUR),
                  forecast=ForecastConfig(headroom_bytes=0, window_s=30,
                                          process_budget_bytes=BUDGET),
                  reload=ReloadConfig(method="signal"))


CONFIGS = (config(60.0), config(120.0))


@dataclasses.dataclass
class Proc:
    pid: int
    name: str
    memory: int
    growing: bool
    alive: bool = True
    announced: bool = False   # its hello reached the current sidecar


class Lifecycles(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t, self.next_pid, self.cfg = 10_000.0, 100, CONFIGS[0]
        self.procs: dict[int, Proc] = {}
        self.host = Host()
        self.known: tuple[KnownServer, ...] = ()   # servers.json
        self.decisions: list[tuple[float, str]] = []  # reloads.json: decisions carried on
        self.executing: dict[str, tuple[int, ...]] = {}  # server -> pids being reloaded
        self.poll = None
        self.compiled: set[int] = set()

    # -- the world ------------------------------------------------------------------------
    def _feed(self, obs) -> list:
        result = step(self.host, obs, self.cfg)
        for a in result.actions:
            self._check_action(a)
        if result.poll is not None:
            self.poll = result.poll
            self.known = result.poll.known
        return result.actions

    def _check_action(self, a) -> None:
        if a.kind in ("reload", "execute"):
            mine = [p for p in self.procs.values() if p.pid in a.pids]
            assert mine and all(p.announced and p.name == a.server for p in mine), a
            assert any(p.growing or p.memory > BUDGET for p in mine), \
                f"reload of a flat server under its budget: {a}"
        if a.kind == "reload" and a.not_done is None:
            times = [t for t, s in self.decisions if s == a.server]
            assert not times or a.t - times[-1] >= COOLDOWN_S, ("cooldown", a, times)
            assert len([t for t in times if t > a.t - 3600]) < MAX_PER_HOUR, ("hourly", a)
            self.decisions.append((a.t, a.server))
        if a.kind == "cancel":
            self.decisions.remove((a.decided_t, a.server))
        if a.kind == "execute":
            self.executing[a.server] = a.pids
        assert a.server != "default", a

    def _start(self, name: str, growing: bool, announce: bool) -> Proc:
        self.next_pid += 1
        p = self.procs[self.next_pid] = Proc(self.next_pid, name,
                                             320 * MB if growing else FLAT, growing)
        if announce:
            self._hello(p)
        return p

    def _hello(self, p: Proc) -> None:
        first = not p.announced and p.pid not in self.compiled
        p.announced = True
        self._feed(hello(self.t, p.pid, p.name, [GPU[p.name]]))
        if first:  # a server compiles as it starts (its model's first call)
            self.compiled.add(p.pid)
            self._feed(compile_event(self.t, p.pid))

    def _sample(self) -> Sample:
        live = [p for p in self.procs.values() if p.alive]
        used = {g: GB + sum(p.memory for p in live if GPU[p.name] == g) for g in GPU.values()}
        return Sample(t=self.t, devices=tuple(DeviceSample(g, u, 80 * GB, 80 * GB - u)
                                              for g, u in used.items()),
                      processes=tuple(ProcessSample(p.pid, p.alive, GB if p.alive else None,
                                                    {GPU[p.name]: p.memory} if p.alive else {})
                                      for p in self.procs.values()))

    # -- rules ----------------------------------------------------------------------------
    @rule(name=st.sampled_from(NAMES), growing=st.booleans(), announce=st.booleans())
    def start_server(self, name, growing, announce):
        if not any(p.alive and p.name == name for p in self.procs.values()):
            self._start(name, growing, announce)

    @rule(name=st.sampled_from(NAMES), crash=st.booleans())
    def stop_server(self, name, crash):
        for p in self.procs.values():
            if p.name == name and p.alive:
                p.alive = False  # a crash or an exit: the sidecar sees the same

    @rule(name=st.sampled_from(NAMES), growing=st.booleans())
    def restart_server(self, name, growing):
        """systemd's Restart=: the old process dies, a new one says hello at once."""
        self.stop_server(name, True)
        self._start(name, growing, True)

    @rule()
    def late_hellos(self):
        for p in self.procs.values():
            if p.alive and not p.announced:
                self._hello(p)

    @rule(polls=st.integers(1, 40))
    def run(self, polls):
        for _ in range(polls):
            self.t += POLL_S
            for p in self.procs.values():
                if p.alive:
                    p.memory += GROWTH if p.growing else 0
                    self._feed(calls(self.t, p.pid, 3, 1))
            self._feed(self._sample())

    @precondition(lambda self: self.executing)
    @rule(ok=st.booleans())
    def reload_ends(self, ok):
        """A reload carried out: the old processes exit; a new one comes back (ok), or none."""
        server, pids = next(iter(self.executing.items()))
        del self.executing[server]
        growing = False
        for pid in pids:
            if pid in self.procs:
                growing |= self.procs[pid].growing
                self.procs[pid].alive = False
        if ok:
            self._start(server, False, True)
        self._feed(ReloadOutcome(ok, "exited" if ok else "not back", 2.0,
                                 failed=not ok).at(self.t, server))

    @rule(kill=st.booleans())
    def sidecar_restarts(self, kill):
        """SIGTERM or SIGKILL, then a new sidecar: it reads reloads.json and servers.json; the
        agents keep sending events and say hello again only when the `late_hellos` rule
        runs (a missed or late hello)."""
        self.host = Host()
        self.executing.clear()  # an outcome the old sidecar waited for is never heard
        self._feed(ReloadHistory(self.t, tuple(self.decisions)))
        alive = {p.pid for p in self.procs.values() if p.alive}
        known = tuple(k for s in self.known
                      if (k := dataclasses.replace(s, pids=tuple(p for p in s.pids
                                                                 if p in alive))).pids)
        if known:
            self._feed(ServersKnown(self.t, known))
        for p in self.procs.values():
            p.announced = p.announced and any(p.pid in k.pids for k in known)

    @rule(which=st.sampled_from(CONFIGS))
    def config_reload(self, which):
        self.cfg = which

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def views_are_what_fires(self):
        if self.poll is not None:
            assert set(self.poll.views) == set(self.poll.firing)
            assert "default" not in self.host.servers

    @invariant()
    def a_dead_server_has_no_forecast_and_no_cause(self):
        for name, server in self.host.servers.items():
            if any(p.alive and p.name == name for p in self.procs.values()):
                continue
            if server.life.value == "down":
                assert server.forecast.seconds == math.inf
                assert set(server.firing) <= {"reload", "reload_failed"}, server.firing


Lifecycles.TestCase.settings = settings(
    max_examples=int(os.environ.get("LIFECYCLE_EXAMPLES", "2000")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_lifecycles = Lifecycles.TestCase
