"""The sidecar's loop: read the sources, feed the step, carry out its actions, publish.

Every decision is the pure step's (core/step.py); the loop reads sources, writes each
observation to the sample log in the order it feeds them to the step (so a replay of the log
decides what the loop decided), and carries out what the step asks: alerts, reloads.

Signal handlers only queue the signal (and wake the loop through a pipe); the loop dispatches
`handle_<name>()`. One exit path, `halt()`. Failures are tiered: fatal at start (config, socket,
metrics port: a clear message and exit code 2 or 1); at run time a failing source is degraded
(`source_up` = 0, reading None), never a crash of the loop.
"""
from __future__ import annotations

import collections
import json
import os
import select
import signal
import socket
import time
from operator import attrgetter
from typing import Any, Callable, Optional

from torch_watchdog import __version__, events
from torch_watchdog.jsonl import JsonLines
from torch_watchdog.sidecar.actions import alerts, control, reload
from torch_watchdog.sidecar.core import step
from torch_watchdog.sidecar.core.results import Action, ActionKind
from torch_watchdog.sidecar import config as config_mod
from torch_watchdog.sidecar.present.history import History, StatusView
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry, serve, stop
from torch_watchdog.sidecar.sources.nvml import NvmlSource
from torch_watchdog.sidecar.sources.process import ProcessReader, PssMeter, children_of, \
    read_pidfile, unit_main_pid, unit_pids
from torch_watchdog.sidecar.sources.receiver import Receiver
from torch_watchdog.sidecar.core.observations import ReloadOutcome, Sample
from torch_watchdog.sidecar import sample_log
from torch_watchdog.sidecar.sample_log import config_to_dict
from torch_watchdog.sidecar.present import snapshot as snapshot_mod
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.views import ServerViews
from torch_watchdog.sidecar.actions.systemd import Notifier

UNIT_LOOKUP_S = 5.0     # systemctl is asked for the unit's MainPID at most this often
_PID = attrgetter("pid")
MAX_PENDING = 100_000   # events held between polls; more are dropped and counted
# Intake per poll, so a flood cannot starve the loop (64 KB datagrams of packed events for
# 20 s ran it at 1.6 polls/s of 10 on main): at most this many events and this share of the
# poll interval reading them; the rest waits in the kernel's ~10-datagram queue, and the
# agents count what it cannot hold
INTAKE_EVENTS = 5_000
INTAKE_SHARE = 0.25
BATCH_S = 0.002         # after a read, let the socket fill this long before reading again
# The socket is read at each poll; between polls only after a poll that took at least this
# many datagrams (of the queue's ~11). One agent at 1,000 events/s sends ~1 datagram a poll:
# waking for it, and again BATCH_S later, was ~0.3 % of a core of the sidecar's ~2 %
# (benchmarks/sidecar_cost.py), a wake on this VM costing ~100 us of CPU. A burst that finds
# the queue full between two polls is parked by the agent and retried every 5 ms for 1 s
# (agent/emitter.py), and the poll that finds the queue that busy reads it promptly from then on
EAGER_DATAGRAMS = 3
PUBLISH_S = 1.0         # the status page's view is rebuilt at most this often (it refreshes
                        # every 5 s), or at once when the policy acts


class Daemon:
    def __init__(self, cfg: config_mod.Config, config_path: Optional[str], log: Any, *,
                 nvml: Optional[NvmlSource] = None, clock: Callable[[], float] = time.time,
                 notifier: Optional[Notifier] = None, serve_metrics: bool = True):
        self.cfg, self.config_path, self.log = cfg, config_path, log
        self.clock = clock
        self.nvml = nvml or NvmlSource()
        self._nvml_deadline()
        self.processes = ProcessReader()          # keeps /proc files open from poll to poll
        self.notifier = notifier or Notifier()
        self.host = step.Host()                   # every server's state: the step's alone
        self.collector = SnapshotCollector()
        self.registry = make_registry(self.collector)
        self.history = History()                   # the status page's series, marks, actions
        self.status: Optional[StatusView] = None   # published each tick, read by HTTP threads
        self.publish_failed = False
        self.published_t = -1e18
        self.serve_metrics = serve_metrics
        self.signals: collections.deque = collections.deque()
        self._configured: dict = {}   # (unit, pidfile) -> (when looked up, pids)
        self.actions_total: collections.Counter = collections.Counter()
        self.findings_logged: dict[str, int] = {}  # per server
        self.receiver: Optional[Receiver] = None
        self.control: Optional[control.ControlServer] = None  # reload.method agent
        self.pending: list = []
        self.sample_log = (JsonLines(cfg.sample_log, 5.0, cfg.sample_log_max_bytes)
                           if cfg.sample_log else None)
        self.book = alerts.AlertBook(cfg.alerts.resend_s, cfg.alerts.resolved_retention_s)
        self.reload_log = reload.ReloadLog(os.path.join(cfg.state_dir, "reloads.json"),
                                           now=self.clock(),
                                           max_per_hour=cfg.policy.max_reloads_per_hour)
        self.host.history = self.reload_log.decisions()  # cooldowns survive a restart
        self.pss = PssMeter()
        self.started: dict[int, Optional[float]] = {}  # pid -> its start time when first seen:
        # a reload signals a pid only while it is still that process (no pid reuse)
        self.decided_wall: dict[Optional[str], float] = {}  # when a reload was decided, by the
        # machine's clock (a reused pid started after it is never signalled)
        self.reloaders: dict[str, reload.Reloader] = {}   # per server, while one runs
        self.reloading: dict[str, Action] = {}
        self.hellos = reload.Hellos()   # the agents' hellos, for a reload's thread: masters
        # and workers, and the replacements it waits for
        self.sender = (alerts.AlertSender(cfg.alerts.urls, cfg.alerts.timeout_s,
                                          on_failure=self._alert_failed)
                       if cfg.alerts.urls else None)
        self.sample_log_failed = False
        self.backlog_dropped = 0
        self.accepted = 0                 # agent events taken into a poll
        self.intake_events, self.intake_seconds = 0, 0.0  # this poll's intake so far
        self.intake_from = 0  # receiver.datagrams at the last poll
        self.eager = False    # read datagrams as they come between polls (EAGER_DATAGRAMS)
        # the wait before this poll ended with the socket found empty: the poll need not ask
        # it again (an idle poll's recvmsg, cold after 100 ms asleep, was ~60 us of its ~500)
        self.quiet = False
        self._unknown: Optional[tuple] = None  # _unknown_focus's numbers, and for what
        self.views = ServerViews()  # each server's view, built again only when it changed
        self._focus_kept: Optional[tuple] = None  # (estimates, forecast, the two merged)
        self._procs_kept: Optional[tuple] = None  # (processes, what _snapshot made of them)
        self._actions_kept: Optional[dict] = None  # dict(actions_total), until an action
        self._alerts_kept: dict[str, tuple] = {}  # server -> (what alerts.build read, built)
        self.http = None
        self.running = False
        self.ticks = 0
        self._wake_r, self._wake_w = os.pipe()

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the socket and the metrics port; raises OSError with a clear message."""
        agent = self.cfg.agent
        self.receiver = Receiver(agent.socket_path, set(agent.allowed_uids)
                                 if agent.allowed_uids is not None else None, agent.socket_mode)
        if self.cfg.reload.method == "agent":
            self.control = control.ControlServer(
                control.path_for(self.cfg), self.cfg.reload.control_mode,
                set(agent.allowed_uids) if agent.allowed_uids is not None else None)
        if self.serve_metrics:
            self.http = serve(self.cfg.metrics_address, self.cfg.metrics_port, self.registry,
                              lambda: self.status)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._queue_signal)
        os.set_blocking(self._wake_w, False)
        if self.sender is not None:
            self.sender.start()
        self.running = True
        self._log_config()
        if self.reload_log.unreadable:  # fails closed: no reload for an hour, said loudly
            self.log.error("reload record unreadable", detail=self.reload_log.unreadable)
        for repair in self.reload_log.repairs:
            self.log.warning("reload record repaired", detail=repair)
        self.log.info("started", socket=agent.socket_path, metrics_port=self.cfg.metrics_port,
                      config=self.config_path, poll_interval_s=self.cfg.poll_interval_s)
        self.notifier.ready("watching")

    def _queue_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)  # nothing else here: the loop does the work
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def run(self) -> int:
        next_poll = time.monotonic()
        while self.running:
            self._dispatch_signals()
            if not self.running:
                break
            now = time.monotonic()
            if now >= next_poll:
                try:
                    self.tick()
                except Exception as e:  # a bug must not stop the watching; no WATCHDOG=1 for
                    self.log.exception("poll failed", error=repr(e))  # this poll, so systemd
                next_poll = max(next_poll + self.cfg.poll_interval_s, now)  # sees a streak
            self._wait(next_poll - time.monotonic())
        return self.halt()

    def _wait(self, timeout: float) -> None:
        """Until the next poll: wake at once for a signal, and, after a busy poll (`eager`),
        take agent datagrams as they come (the kernel queues only ~11 per socket) into
        `pending`."""
        deadline = time.monotonic() + max(0.0, timeout)
        watch = [self._wake_r] + ([self.receiver] if self.receiver is not None and self.eager
                                  else [])
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(watch, [], [], left)
            # nothing came in the wait's last stretch: the poll need not ask the socket again
            # (a datagram that lands in between is taken at the next wait, a poll later)
            self.quiet = not ready and len(watch) > 1
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 512)
                except BlockingIOError:
                    pass
                return
            if self.receiver in ready:
                if not self._intake():  # this poll's share is used up: wait for the next
                    watch = [self._wake_r]
                    continue
                # let datagrams gather rather than waking per event; a sender finding the
                # ~10-deep queue full parks its datagram and retries (agent/emitter.py). The
                # pause caps ingest near 5,000 events/s (benchmarks/sidecar_cost.py)
                time.sleep(min(BATCH_S, max(0.0, deadline - time.monotonic())))

    def _intake(self) -> bool:
        """Take datagrams within this poll's intake budget; False once it is used up."""
        left = INTAKE_EVENTS - self.intake_events
        if left <= 0 or self.intake_seconds >= INTAKE_SHARE * self.cfg.poll_interval_s:
            return False
        started = time.monotonic()
        deadline = started + INTAKE_SHARE * self.cfg.poll_interval_s - self.intake_seconds
        got = self.receiver.receive(left, deadline)
        self.intake_events += len(got)
        self.intake_seconds += time.monotonic() - started
        self._take(got)
        return True

    def _take(self, got: list) -> None:
        room = MAX_PENDING - len(self.pending)
        self.pending.extend(got[:room])
        self.accepted += min(room, len(got))
        self.backlog_dropped += max(0, len(got) - room)  # dropped, never counted received

    def _dispatch_signals(self) -> None:
        while self.signals:
            signum = self.signals.popleft()
            name = {signal.SIGHUP: "reload"}.get(signum, "stop")
            getattr(self, f"handle_{name}")(signum)

    def handle_stop(self, signum: int) -> None:
        self.log.info("stopping", signal=signal.Signals(signum).name)
        self.running = False

    def handle_reload(self, signum: int) -> None:
        if not self.config_path:
            return
        cfg, problems = config_mod.check(self.config_path)
        if cfg is None:
            self.log.error("config reload failed; keeping the old config", problems=problems)
            return
        restart_needed = [k for k in ("metrics_address", "metrics_port", "agent", "alerts",
                                      "reload", "state_dir", "sample_log",
                                      "sample_log_max_bytes")
                          if getattr(cfg, k) != getattr(self.cfg, k)]
        self.cfg = cfg
        self._nvml_deadline()
        self._log_config()
        self.log.info("config reloaded", needs_restart_to_apply=restart_needed)

    def _nvml_deadline(self) -> None:
        """A reading older than ~2 polls (at most 1 s) is late: down, never forecast on; a read
        waits for a fresh one at most half a poll (FACTS #11: p99 20-100 ms when busy)."""
        poll = self.cfg.poll_interval_s
        self.nvml.deadline_s = min(1.0, 2 * poll)
        self.nvml.wait_s = min(0.05, poll / 2)

    def halt(self) -> int:
        """The one exit path."""
        self.notifier.stopping()
        if self.receiver is not None:
            self.receiver.close()
        if self.control is not None:
            self.control.close()
        self.nvml.close()
        self.processes.close()
        if self.sender is not None:
            self.sender.stop()
        if self.sample_log is not None:
            self.sample_log.close()
        if self.http is not None and self.http[0] is not None:
            stop(*self.http)
        self.log.info("stopped", ticks=self.ticks)
        return 0

    # -- one poll -------------------------------------------------------------------------------
    def tick(self) -> Snapshot:
        started = time.perf_counter()
        now = self.clock()
        observations: list = self._receive()
        # the agent events' pids, mapped in C before the outcomes join them (a comprehension
        # with isinstance() per observation: 5.5 -> 3.8 us a poll of 100 events, hot)
        heard = set(map(_PID, observations))
        outcomes = self._outcomes(now, observations)
        observations += outcomes
        configured = self.configured_pids()
        pids = {p for ps in configured.values() for p in ps}
        if self.cfg.server.trust_agent_pids:  # the agents' own, also those heard just now
            pids |= self.host.pids() | heard
        pids |= heard | set(self.host.agents)  # read for their liveness; never believed by that
        self._note_start_times(pids)
        reading = self.nvml.read(pids)
        processes = self.processes.read(pids, reading.process_gpu_bytes)
        if not reading.devices:  # host-memory mode: PSS, so workers' shared pages count once
            processes = self.pss.apply(processes)
        host_total, host_available = self.processes.host_memory()
        sample = Sample(t=now, devices=reading.devices, processes=processes, nvml_up=reading.up,
                        nvml_down=dict(reading.down),
                        nvml_error=reading.error, query_s=reading.query_s,
                        host_total_bytes=host_total, host_available_bytes=host_available,
                        servers=configured)
        observations.append(sample)
        self._log_observations(observations)  # first: what the step sees is what replay sees
        cfg = self.cfg
        # the events first, as one batch (step.fold_events: what step() of each would do)
        events_n = len(observations) - len(outcomes) - 1
        decided: list[Action] = step.fold_events(self.host, observations[:events_n], cfg)
        for obs in observations[events_n:]:
            result = step.step(self.host, obs, cfg)
            decided += result.actions
        firing = result.firing or {}  # the sample's: the alerts are decided once a poll
        for action in decided:
            self._act(action)
        self._log_findings()
        focus = self.host.focus()
        servers = self._server_views()  # once a poll, for the alerts and the snapshot
        view = servers.get(focus.name)  # the focus's numbers: computed once, not twice a poll
        if view is not None and self.host.servers.get(focus.name) is focus:
            estimates, forecast = self._focus_numbers(view)
        else:
            estimates, forecast = self._unknown_focus(focus, cfg)
        self._alert(now, servers, firing)
        snapshot = self._snapshot(sample, estimates, focus, servers,
                                  time.perf_counter() - started, forecast)
        self.collector.update(snapshot)
        self.ticks += 1
        self._publish(snapshot, observations, decided, focus)
        self.notifier.watchdog()  # only after a completed tick
        if self.ticks % 50 == 1:
            self.notifier.status(_status_line(focus))
        return snapshot

    def _log_findings(self) -> None:
        for name, server in self.host.servers.items():
            findings = server.state.findings
            seen = self.findings_logged.get(name, 0)
            if seen > len(findings):  # a reset: a new state
                seen = 0
            for finding in findings[seen:]:
                self.log.warning("finding", server=name, **finding.as_dict())
            self.findings_logged[name] = len(findings)

    def _log_observations(self, observations: list) -> None:
        """One write per poll: the agent events received, reload outcomes, then the sample."""
        if self.sample_log is None:
            return
        if not self.sample_log.write(sample_log.encode(observations)) and \
                not self.sample_log_failed:
            self.sample_log_failed = True  # logged once; retried every few seconds
            self.log.error("cannot write the sample log", path=self.cfg.sample_log)

    def _log_config(self) -> None:
        """The config in force from now on, for a replay of the sample log."""
        if self.sample_log is not None:
            self.sample_log.write(json.dumps(config_to_dict(self.clock(), self.cfg),
                                             separators=(",", ":")).encode())

    def _receive(self) -> list:
        receiver = self.receiver
        if receiver is not None:
            if not self.quiet:
                self._intake()
            # a busy socket, or a poll's share used up: read it as datagrams come until a
            # poll takes fewer
            self.eager = receiver.datagrams - self.intake_from >= EAGER_DATAGRAMS or \
                self.intake_events >= INTAKE_EVENTS or \
                self.intake_seconds >= INTAKE_SHARE * self.cfg.poll_interval_s
            self.intake_from = receiver.datagrams
        self.quiet = False
        got, self.pending = self.pending, []
        self.intake_events, self.intake_seconds = 0, 0.0  # the next poll's budget
        return [event for event, _pid in got]

    def configured_pids(self) -> dict[str, tuple[int, ...]]:
        """Each configured server's pids: its unit's cgroup (else its MainPID), or its
        pidfile's pid, and their children (looked up every UNIT_LOOKUP_S: systemctl and /proc
        walks are not free)."""
        out = {}
        for name, unit, pidfile in config_mod.server_sources(self.cfg):
            key = (unit, pidfile)
            checked, pids = self._configured.get(key, (-1e18, ()))
            if time.monotonic() - checked >= UNIT_LOOKUP_S:
                group = unit_pids(unit) if unit else None
                main = None if group is not None else \
                    unit_main_pid(unit) if unit else read_pidfile(pidfile)
                pids = group if group is not None else \
                    tuple(sorted({main, *children_of(main)})) if main else ()
                self._configured[key] = (time.monotonic(), pids)
            if pids:
                out[name] = pids
        return out

    def _note_start_times(self, pids: set[int]) -> None:
        """Each pid's start time, read once when it is first seen (at its hello or in its
        unit), forgotten when the pid is."""
        for pid in pids - self.started.keys():
            self.started[pid] = reload.process_start_time(pid)
        if len(self.started) > 2 * len(pids) + 64:
            self.started = {p: v for p, v in self.started.items() if p in pids}

    def _unit_of(self, server: Optional[str]) -> Optional[str]:
        return next((unit for name, unit, _ in config_mod.server_sources(self.cfg)
                     if name == server and unit), self.cfg.server.unit)

    # -- actions ------------------------------------------------------------------------------
    def _act(self, action: Action) -> None:
        """Carry out what the step decided; decisions and outcomes go to reloads.json first."""
        kind = action.kind
        self.actions_total[kind.value] += 1
        self._actions_kept = None
        log = (self.log.info if kind in (ActionKind.RESTART, ActionKind.RELOAD_OK) else
               self.log.error if kind is ActionKind.RELOAD_FAILED else self.log.warning)
        log("action", **action.as_dict())
        if kind is ActionKind.RELOAD:
            self.decided_wall[action.server] = time.time()
            self._record(action.t, None, action)
            if action.not_done is not None:
                outcome = f"not carried out: {action.not_done}"
                self._record(action.t, ReloadOutcome(False, outcome), action)
                self.history.act(self.clock(), ActionKind.RELOAD_NOT_DONE.value, action.reason,
                                 {"outcome": outcome})
        elif kind is ActionKind.CANCEL:
            self._record(action.decided_t, ReloadOutcome(False, reload.CANCELLED), action)
        elif kind is ActionKind.EXECUTE:
            run = reload.executor(self.cfg.reload, self._unit_of(action.server),
                                  decided_t=self.decided_wall.pop(action.server, None),
                                  expected_start={p: self.started[p] for p in action.pids
                                                  if self.started.get(p) is not None},
                                  hellos=self.hellos, control=self.control)
            if run is None:
                return
            self.reload_log.executing(action.decided_t, action.server)
            self.log.warning("reloading the server", server=action.server,
                             method=self.cfg.reload.method, pids=list(action.pids))
            self.reloaders[action.server] = reload.Reloader(run)
            self.reloading[action.server] = action
            self.reloaders[action.server].start(set(action.pids))

    def _outcomes(self, now: float, received: list = ()) -> list[ReloadOutcome]:
        """Reloads that finished since the last poll, as observations for the step; the
        hellos `received` go to the reloads' threads first."""
        if received:
            self.hellos.add(e for e in received if isinstance(e, events.Hello))
        out = []
        for server, reloader in list(self.reloaders.items()):
            result = reloader.poll()
            if result is None:
                continue
            action = self.reloading.pop(server)
            del self.reloaders[server]
            self._record(action.decided_t, result, action)
            (self.log.warning if result.ok else self.log.error)(
                "reload finished", server=server, ok=result.ok, detail=result.detail,
                seconds=result.seconds)
            out.append(result.at(now, server))
        return out

    def _record(self, t: float, outcome: Optional[ReloadOutcome], action: Action) -> None:
        self.reload_log.record(t, outcome, action.cause or action.reason, action.server)
        if self.reload_log.error:
            self.log.error("cannot write the reload record", error=self.reload_log.error)

    def _server_views(self) -> dict[str, dict[str, Any]]:
        """Every server's view (present/views.py: made again only when it changed)."""
        return self.views.build(self.host.servers, self.cfg.correlate)

    def _focus_numbers(self, view: dict[str, Any]) -> tuple[dict, dict]:
        """The focus's estimates merged with its forecast, and its forecast: merged again only
        when its view's dicts change (shared, read only, like the views)."""
        kept = self._focus_kept
        if kept is None or kept[0] is not view["estimates"] or kept[1] is not view["forecast"]:
            kept = self._focus_kept = (view["estimates"], view["forecast"],
                                       {**view["estimates"], **view["forecast"]})
        return kept[2], kept[1]

    def _alert(self, now: float, servers: dict[str, dict[str, Any]],
               firing_of: dict[str, dict[str, dict[str, Any]]]) -> None:
        """Hand the alerts the step says fire, for every server, to the sender's thread."""
        if self.sender is None:
            return
        a = self.cfg.alerts
        base = {"service": a.service, "instance": a.instance or socket.gethostname()}
        firing: dict = {}
        kept = self._alerts_kept
        for name, fires in firing_of.items():
            if not fires:  # the common case: nothing of it fires (build() gives {})
                continue
            labels = {**base, "server": name}
            view = servers[name]
            uuid = view["forecast"]["gpu_uuid"] or (view["gpus"][0] if view["gpus"] else None)
            if uuid:
                labels["gpu_uuid"] = uuid
            # built again only when what build() reads changed: a still server keeps its
            # `firing` and its view's dicts (each alert's description is ~10 us of strings)
            was = kept.get(name)
            if was is None or was[0] is not fires or was[1] is not view["estimates"] \
                    or was[2] is not view["forecast"] or was[3] != labels:
                was = kept[name] = (fires, view["estimates"], view["forecast"], labels,
                                    alerts.build(fires, view["estimates"], view["forecast"],
                                                 labels))
            firing.update(was[4])
        if len(kept) > len(self.host.servers):  # servers come and go
            self._alerts_kept = {k: v for k, v in kept.items() if k in self.host.servers}
        if self.reload_log.unreadable:
            firing.update(alerts.build({"reload_record_unreadable": {
                "detail": self.reload_log.unreadable}}, {}, {}, base))
        self.book.update(firing, now)
        self.sender.submit(self.book.due(now))

    def _publish(self, snapshot: Snapshot, observations: list, decided: list,
                 focus: step.Server) -> None:
        """The status page's view of this tick: one reference swap, read by HTTP threads. A
        failure here only leaves the page a tick behind: the watching goes on."""
        cfg = self.cfg
        try:
            self.history.update(snapshot, observations, decided)
            if decided or snapshot.t - self.published_t >= PUBLISH_S or snapshot.t < \
                    self.published_t:
                info = {"version": __version__, "polls": self.ticks, "poll_interval_s":
                        cfg.poll_interval_s, "socket": cfg.agent.socket_path,
                        "reload_method": cfg.reload.method, "dry_run": cfg.policy.dry_run}
                causes = [f.as_dict() for f in focus.state.active.values()]
                self.status = self.history.view(snapshot, causes, info)
                self.published_t = snapshot.t
        except Exception as e:
            if not self.publish_failed:  # once: it would repeat every poll
                self.log.exception("status page not updated", error=repr(e))
            self.publish_failed = True

    def _alert_failed(self, url: str, error: str) -> None:
        self.log.warning("alertmanager unreachable; will retry", url=url, error=error)

    def _unknown_focus(self, focus: step.Server, cfg: config_mod.Config) -> tuple[dict, dict]:
        """step.estimates(focus) and its forecast, of a focus that is no known server (none
        yet): the host's one empty server, which nothing changes, so its numbers are computed
        once per config (an idle sidecar with no agent did it every poll: ~30 us of ~500)."""
        known = self._unknown
        if known is None or known[0] is not focus or known[1] is not cfg:
            known = self._unknown = (focus, cfg, step.estimates(focus, cfg),
                                     focus.forecast.as_dict())
        return known[2], known[3]  # shared, read only, like the views

    def _snapshot(self, sample: Sample, estimates: dict, focus: step.Server,
                  servers: dict[str, dict[str, Any]], poll_s: float,
                  forecast: Optional[dict] = None) -> Snapshot:
        processes = sample.processes
        kept = self._procs_kept
        if kept is None or kept[0] is not processes:  # the reader hands back the same tuple
            gpu: dict[str, Optional[int]] = {}      # when nothing changed: the same sums
            for p in processes:
                for uuid, used in p.gpu_bytes.items():
                    gpu[uuid] = None if used is None or gpu.get(uuid, 0) is None \
                        else gpu.get(uuid, 0) + used
            alive = [p for p in processes if p.alive]
            rss = [p.host_bytes for p in alive if p.host_bytes is not None]
            kept = self._procs_kept = (processes, gpu, sum(rss) if rss else None, bool(alive))
        _, gpu, rss_bytes, any_alive = kept
        if self._actions_kept is None:
            self._actions_kept = dict(self.actions_total)
        receiver = self.receiver
        return snapshot_mod.make(dict(  # Snapshot(...) at a ninth of the cost
            t=sample.t, devices=sample.devices, server_gpu_bytes=gpu,
            gpu_attribution=self.cfg.gpu.attribution,
            server_rss_bytes=rss_bytes,
            server_alive=any_alive if processes else None,
            estimates=estimates,
            forecast=focus.forecast.as_dict() if forecast is None else forecast,
            active_causes=tuple(focus.state.active), actions_total=self._actions_kept,
            servers=servers, focus=focus.name if focus.name in servers else None,
            sources_up={"nvml": sample.nvml_up, "process": any_alive,
                        "agent": self.host.agents_alive()},
            poll_seconds=poll_s, nvml_query_seconds=sample.query_s,
            events_received_total=self.accepted,
            events_skewed_total=self.host.skewed_events,
            source_errors_total={("nvml", reason): n for reason, n in self.nvml.errors.items()},
            reload_record_unreadable=self.reload_log.unreadable is not None,
            events_dropped_total={**(receiver.dropped if receiver else {}),
                                  "backlog": self.backlog_dropped},
            agent_events_lost_total=sum(v.state.agent_dropped
                                        for v in self.host.servers.values()),
            alerts_sent_total=dict(self.sender.sent) if self.sender else {},
            alert_posts_failed_total=dict(self.sender.failed) if self.sender else {},
            alerts_dropped_total=dict(self.sender.dropped) if self.sender else {}))


def _status_line(server: step.Server) -> str:
    seconds, state = server.forecast.seconds, server.state
    eta = "no OOM forecast" if seconds == float("inf") else f"OOM in ~{seconds:.0f} s"
    return (f"{server.name}: {state.records} graphs, {state.recompiles} recompiles, "
            f"{len(state.active)} active causes, {eta}")
