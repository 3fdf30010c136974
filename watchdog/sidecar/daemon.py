"""The sidecar's loop: read the sources, feed the step, carry out its actions, publish.

Every decision is the pure step's (core/step.py). Each poll the loop reads the sources, writes
each observation to the sample log in the order it feeds them to the step (so a replay of the
log decides what the loop decided), hands the step's actions to the reloads and the alerts, and
the result to the publisher.

Signal handlers only queue the signal (and wake the loop through a pipe); the loop dispatches
`handle_<name>()`. One exit path, `halt()`. Failures are tiered: fatal at start (config, socket,
metrics port: a clear message and exit code 2 or 1); at run time a failing source is degraded
(`source_up` = 0, reading None), never a crash of the loop.
"""
from __future__ import annotations

import collections
import os
import select
import signal
import time
import traceback
from operator import attrgetter
from typing import Any, Callable, Optional, TypeVar

from torch_watchdog.procfs import process_start_time
from torch_watchdog.sidecar import config as config_mod
from torch_watchdog.sidecar.offline import sample_log
from torch_watchdog.sidecar.actions import control, requests
from torch_watchdog.sidecar.actions.alerting import Alerting
from torch_watchdog.sidecar.actions.known import KnownServers
from torch_watchdog.sidecar.actions.reloading import Reloads
from torch_watchdog.sidecar.actions.systemd import Notifier
from torch_watchdog.sidecar.core import step
from torch_watchdog.sidecar.core.step import Observation
from torch_watchdog.sidecar.core.observations import RecordUnreadable, ReloadHistory, Sample
from torch_watchdog.sidecar.core.results import (Action, ActionKind, Freeze, PollResult,
                                                 ServerView, Unfreeze)
from torch_watchdog.sidecar.sources.discovery import Discovery
from torch_watchdog.sidecar.sources.intake import BATCH_S, Intake
from torch_watchdog.sidecar.present.metrics import serve, stop
from torch_watchdog.sidecar.present.publisher import Publisher
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.sources.nvml import NvmlSource
from torch_watchdog.sidecar.sources.process import ProcessReader, PssMeter
from torch_watchdog.sidecar.sources.receiver import Receiver

_PID = attrgetter("pid")
_T = TypeVar("_T")


class Daemon:
    def __init__(self, cfg: config_mod.Config, config_path: Optional[str], log: Any, *,
                 nvml: Optional[NvmlSource] = None, clock: Callable[[], float] = time.time,
                 notifier: Optional[Notifier] = None, serve_metrics: bool = True):
        self.cfg, self.config_path, self.log = cfg, config_path, log
        self.clock = clock
        self.nvml = nvml or NvmlSource()
        self.processes = ProcessReader()          # keeps /proc files open from poll to poll
        self.pss = PssMeter()
        self.notifier = notifier or Notifier()
        self.intake = Intake(cfg.poll_interval_s)
        self.discovery = Discovery(cfg)
        self.reloads = Reloads(cfg, log, self.discovery, now=clock())
        self.alerting = Alerting(cfg.alerts, on_failure=self._alert_failed)
        self.publisher = Publisher(cfg, log)
        self.sample_log = (sample_log.Writer(cfg.sample_log, cfg.sample_log_max_bytes, log)
                           if cfg.sample_log else None)
        self.host = step.Host()  # every server's state: the step's alone, read by no one here
        # cooldowns survive a restart: stepped now, written to the sample log at start
        self._history = ReloadHistory(clock(), tuple(self.reloads.decisions()))
        step.step(self.host, self._history, cfg)
        # so do the servers' processes (each checked to be the same process)
        self.known = KnownServers(os.path.join(cfg.state_dir, "servers.json"),
                                  process_start_time)
        self._known = self.known.read(clock())
        if self._known is not None:
            step.step(self.host, self._known, cfg)
        self._poll = PollResult.before_any()  # the last poll's result: the pids to read next
        self._configure(cfg)
        self.serve_metrics = serve_metrics
        self.http: Optional[tuple[Any, Any]] = None
        self.signals: collections.deque[Any] = collections.deque()
        self.running = False
        self.ticks = 0
        self.poll_errors: collections.Counter[str] = collections.Counter()  # by stage
        self._wake_r, self._wake_w = os.pipe()

    @property
    def registry(self) -> Any:
        return self.publisher.registry

    @property
    def status(self) -> Any:
        return self.publisher.status

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the socket and the metrics port; raises OSError with a clear message."""
        agent = self.cfg.agent
        uids = set(agent.allowed_uids) if agent.allowed_uids is not None else None
        self.intake.receiver = Receiver(agent.socket_path, uids, agent.socket_mode)
        if self.cfg.reload.method == "agent" or self.cfg.policy.remedy != "reload":
            # a drain, or a freeze (policy.remedy), goes to the agents over it
            self.reloads.control = control.ControlServer(
                control.path_for(self.cfg), self.cfg.reload.control_mode, uids)
        if self.serve_metrics:
            self.http = serve(self.cfg.metrics_address, self.cfg.metrics_port, self.registry,
                              lambda: self.publisher.status)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._queue_signal)
        os.set_blocking(self._wake_w, False)
        self.alerting.start()
        self.running = True
        if self.sample_log is not None:
            self.sample_log.config(self.clock(), self.cfg)
            self.sample_log.observations([self._history, *filter(None, [self._known])])
        if self.known.error:
            self.log.warning("servers file not used; the agents' hellos place their servers",
                             detail=self.known.error)
        elif self._known is not None:
            self.log.info("servers resumed", servers={
                k.name: list(k.pids) for k in self._known.servers})
        record = self.reloads.record
        if record.unreadable:  # fails closed: no reload for an hour, said loudly
            self.log.error("reload record unreadable", detail=record.unreadable)
            unreadable = RecordUnreadable(self.clock(), record.unreadable)
            if self.sample_log is not None:
                self.sample_log.observations([unreadable])
            step.step(self.host, unreadable, self.cfg)
        for repair in record.repairs:
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
                self._guarded("poll", self.tick)  # each stage guards itself; this, the rest
                next_poll = max(next_poll + self.cfg.poll_interval_s, now)  # sees a streak
            self._wait(next_poll - time.monotonic())
        return self.halt()

    def _wait(self, timeout: float) -> None:
        """Until the next poll: wake at once for a signal and, after a busy poll, take agent
        datagrams as they come (the kernel queues only ~11 per socket)."""
        deadline = time.monotonic() + max(0.0, timeout)
        intake = self.intake
        watch: list[Any] = [self._wake_r]  # file descriptors and objects with fileno()
        if intake.watching:
            watch.append(intake.receiver)
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(watch, [], [], left)
            # nothing came in the wait's last stretch: the poll need not ask the socket again
            intake.quiet = not ready and len(watch) > 1
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 512)
                except BlockingIOError:
                    pass
                return
            if intake.receiver in ready:
                if not intake.take():  # this poll's share is used up: wait for the next
                    watch = [self._wake_r]
                    continue
                # let datagrams gather rather than waking per event
                time.sleep(min(BATCH_S, max(0.0, deadline - time.monotonic())))

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
        self._configure(cfg)
        if self.sample_log is not None:
            self.sample_log.config(self.clock(), cfg)
        self.log.info("config reloaded", needs_restart_to_apply=restart_needed)

    def _configure(self, cfg: config_mod.Config) -> None:
        """The config in force from now on, for every part of the loop that reads it."""
        self.cfg = self.discovery.cfg = self.reloads.cfg = self.publisher.cfg = cfg
        self.intake.poll_interval_s = cfg.poll_interval_s
        # a reading older than ~2 polls (at most 1 s) is late: down, never forecast on; a read
        # waits for a fresh one at most half a poll (NVML's p99 is 20-100 ms on a busy host:
        # docs/architecture.md)
        self.nvml.deadline_s = min(1.0, 2 * cfg.poll_interval_s)
        self.nvml.wait_s = min(0.05, cfg.poll_interval_s / 2)

    def halt(self) -> int:
        """The one exit path."""
        self.notifier.stopping()
        if self.intake.receiver is not None:
            self.intake.receiver.close()
        if self.reloads.control is not None:
            self.reloads.control.close()
        self.nvml.close()
        self.processes.close()
        self.alerting.stop()
        if self.sample_log is not None:
            self.sample_log.close()
        if self.http is not None and self.http[0] is not None:
            stop(*self.http)
        self.log.info("stopped", ticks=self.ticks)
        return 0

    # -- one poll ---------------------------------------------------------------------------
    def tick(self) -> Optional[Snapshot]:
        """One poll: what the sources and the agents say, what the step decides on it, what
        is carried out, and what is shown. Each stage has its own error boundary (`_guarded`):
        a bug in one is logged with its traceback, counted by stage, and the next poll goes
        on; systemd's watchdog is pinged only after a poll whose sample the step decided on.
        None: this poll did not get as far as a snapshot."""
        started = time.perf_counter()
        now = self.clock()
        observed = self._guarded("observe", self._observe, now)
        if observed is None:
            return None
        sample, observations = observed
        decided, poll = self._decide(observations)
        if poll is None:  # the page stays at the last poll that decided: stale, if it lasts
            for action in decided:  # what the poll's events decided is still carried out
                self._guarded("act", self._act, action)
            return None
        self._guarded("act", self._carry_out, now, decided, poll)
        shown = self._guarded("show", self._show, sample, observations, decided, poll,
                              time.perf_counter() - started)
        self.notifier.watchdog()  # only after a poll that decided
        return shown

    def _guarded(self, stage: str, fn: Callable[..., _T], *args: Any) -> Optional[_T]:
        """`fn(*args)`, or None where it raised: logged with its traceback as text, counted
        in `poll_errors[stage]`."""
        try:
            return fn(*args)
        except Exception as e:  # a bug must not stop the watching
            self._failed(stage, e)
            return None

    def _failed(self, stage: str, e: BaseException) -> None:
        self.poll_errors[stage] += 1
        self.log.error("poll failed", stage=stage, error=repr(e),
                       traceback="".join(traceback.format_exception(e)))

    def _observe(self, now: float) -> tuple[Sample, list[Observation]]:
        """This poll's observations, in the order the step sees them (the agents' events, the
        reloads' outcomes, the sample last), written to the sample log first: what the step
        sees is what replay sees."""
        received = self.intake.for_poll()
        outcomes = self.reloads.outcomes(now, received)
        asked, bad = requests.take_requests(self.cfg.state_dir, now)
        for problem in bad:
            self.log.warning("request not taken", detail=problem)
        sample = self._sample(now, received)
        observations: list[Observation] = [*received, *outcomes, *asked, sample]
        if self.sample_log is not None:
            self.sample_log.observations(observations)
        return sample, observations

    def _decide(self, observations: list[Observation],
                ) -> tuple[list[Action], Optional[PollResult]]:
        """Each observation stepped on its own: one that breaks the step is skipped (logged,
        counted), the others still decide. The poll's result comes from the sample's step,
        last; None where that one failed."""
        decided: list[Action] = []
        poll = None
        for obs in observations:
            try:
                result = step.step(self.host, obs, self.cfg)
            except Exception as e:
                self._failed("decide", e)
                continue
            decided += result.actions
            poll = result.poll if isinstance(obs, Sample) else poll
        if poll is not None:
            self._poll = poll  # the pids to read next
        return decided, poll

    def _carry_out(self, now: float, decided: list[Action], poll: PollResult) -> None:
        for action in decided:  # one failing action leaves the others to be carried out
            self._guarded("act", self._act, action)
        self._guarded("act", self.publisher.log_findings, poll)
        self._guarded("act", self._save_known, poll)
        self.alerting.dispatch(now, poll)

    def _save_known(self, poll: PollResult) -> None:
        failed = self.known.error
        started = self.discovery.started
        if not self.known.save(poll.known, lambda pid: started.get(pid) or
                               process_start_time(pid)) and failed is None:
            self.log.warning("servers file not written; retried", detail=self.known.error)

    def _show(self, sample: Sample, observations: list[Observation], decided: list[Action],
              poll: PollResult, poll_s: float) -> Snapshot:
        snapshot = self.publisher.snapshot(sample, poll, self._counts(poll_s))
        self.ticks += 1
        self.publisher.publish(snapshot, observations, decided, poll, self.ticks)
        if self.ticks % 50 == 1:
            self.notifier.status(_status_line(poll.focus or "no server yet", poll.focus_view))
        return snapshot

    def _sample(self, now: float, received: list[Any]) -> Sample:
        """Every source, read for the pids the step may ask about."""
        heard = set(map(_PID, received))
        placed = self._poll.placed_pids
        configured = self.discovery.configured_pids(unplaced=any(
            e.kind == "hello" and e.pid not in placed for e in received))
        # the configured servers', those the last poll asked for, and those heard just now
        # (read for their liveness; believed to be a server's only as the step decides)
        pids = {p for ps in configured.values() for p in ps} | self._poll.pids_to_read | heard
        self.discovery.note_start_times(pids)
        reading = self.nvml.read(pids)
        processes = self.processes.read(pids, reading.process_gpu_bytes)
        if not reading.devices:  # host-memory mode: PSS, so workers' shared pages count once
            processes = self.pss.apply(processes)
        host_total, host_available = self.processes.host_memory()
        return Sample(t=now, devices=reading.devices, processes=processes, nvml_up=reading.up,
                      nvml_down=dict(reading.down), nvml_error=reading.error,
                      query_s=reading.query_s, host_total_bytes=host_total,
                      host_available_bytes=host_available, configured=configured)

    def _act(self, action: Action) -> None:
        """Carry out what the step decided; decisions and outcomes go to reloads.json first."""
        kind = action.kind
        self.publisher.count(action)
        log = (self.log.info if kind in (ActionKind.RESTART, ActionKind.RELOAD_OK) else
               self.log.error if kind is ActionKind.RELOAD_FAILED else self.log.warning)
        log("action", **action.as_dict())
        if isinstance(action, (Freeze, Unfreeze)):
            self._tell(action)
            return
        self.reloads.carry_out(action)

    def _tell(self, action: "Freeze | Unfreeze") -> None:
        """A freeze or an unfreeze to the server's agents over the control channel; each
        agent answers with a `freeze` mitigation event (the step's fallback covers none)."""
        kind = action.kind.value
        if isinstance(action, Freeze) and action.dry_run:
            return
        ctl = self.reloads.control
        if ctl is None:
            self.log.error(f"{kind} not sent: the control socket is not open",
                           server=action.server)
            return
        told, refused = ctl.tell(set(action.pids), kind, action.t)
        (self.log.info if told else self.log.error)(
            f"{kind} sent", server=action.server, pids=told, refused=refused,
            not_connected=sorted(set(action.pids) - set(told)))

    def _counts(self, poll_s: float) -> dict[str, Any]:
        """The loop's and its sources' counters, as the snapshot names them."""
        receiver, intake, sent = self.intake.receiver, self.intake, self.alerting.counts()
        return dict(
            poll_seconds=poll_s, events_received_total=intake.accepted,
            source_errors_total={("nvml", reason): n for reason, n in self.nvml.errors.items()},
            reload_record_unreadable=self.reloads.record.unreadable is not None,
            events_dropped_total={**(receiver.dropped if receiver else {}),
                                  "backlog": intake.backlog_dropped},
            alerts_sent_total=sent["sent"], alert_posts_failed_total=sent["failed"],
            alerts_dropped_total=sent["dropped"], poll_errors_total=dict(self.poll_errors))

    def _alert_failed(self, url: str, error: str) -> None:
        self.log.warning("alertmanager unreachable; will retry", url=url, error=error)


def _status_line(name: str, view: ServerView) -> str:
    seconds, est = view["forecast"]["seconds_to_oom"], view["estimates"]
    eta = "no OOM forecast" if seconds is None else f"OOM in ~{seconds:.0f} s"
    return (f"{name}: {est['recordings']} graphs, {est['recompiles']} recompiles, "
            f"{len(view['active_causes'])} active causes, {eta}")
