"""Carrying out the step's reload actions: the durable record first, then the executor's thread.

A decision goes to `<state_dir>/reloads.json` before anything is done, its execution is marked
when it starts, and its outcome when it ends; one reload runs per server, on a thread, so the
loop keeps polling. Finished reloads come back as observations for the step.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterable, Optional

from torch_watchdog import events
from torch_watchdog.sidecar.actions import control, executors
from torch_watchdog.sidecar.actions.hellos import Hellos
from torch_watchdog.sidecar.actions.record import CANCELLED, ReloadLog
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.observations import ReloadOutcome
from torch_watchdog.sidecar.core.results import Action, Cancel, Execute, Reload, ReloadAction
from torch_watchdog.sidecar.sources.discovery import Discovery


class Reloads:
    def __init__(self, cfg: Config, log: Any, discovery: Discovery, now: float):
        self.cfg, self.log, self.discovery = cfg, log, discovery
        self.record = ReloadLog(os.path.join(cfg.state_dir, "reloads.json"), now=now,
                                       max_per_hour=cfg.policy.max_reloads_per_hour)
        self.control: Optional[control.ControlServer] = None  # reload.method agent
        # the agents' hellos, for a reload's thread: masters and workers, and the
        # replacements it waits for
        self.hellos = Hellos()
        # when a reload was decided, by the machine's clock (a pid started later is another)
        self._decided_wall: dict[str, float] = {}
        self._running: dict[str, tuple[Reloader, Execute]] = {}

    def decisions(self) -> list[tuple[float, Optional[str]]]:
        """Past decisions (time, server), for the step's cooldowns across restarts."""
        return self.record.decisions()

    def carry_out(self, action: Action) -> None:
        """A reload decision is recorded (with why it will not be carried out, if so), a
        cancelled one too; an execution starts; other actions are not the reloads'."""
        if isinstance(action, Reload):
            self._decided_wall[action.server] = time.time()
            self._write(action.t, None, action)
            if action.not_done is not None:
                self._write(action.t, ReloadOutcome(False, f"not carried out: "
                                                           f"{action.not_done}"), action)
        elif isinstance(action, Cancel):
            self._write(action.decided_t, ReloadOutcome(False, CANCELLED), action)
        elif isinstance(action, Execute):
            try:
                self._execute(action)
            except Exception as e:  # a bug before the reload's thread: an outcome all the same
                self.log.exception("reload not started", server=action.server, error=repr(e))
                failed = ReloadOutcome(False, f"not carried out: {type(e).__name__}: {e}", 0.0)
                reloader = Reloader(lambda _pids: failed)
                self._running[action.server] = (reloader, action)
                reloader.start(set())

    def _execute(self, action: Execute) -> None:
        run = executors.executor(self.cfg.reload, self.discovery.unit_of(action.server),
                              decided_t=self._decided_wall.pop(action.server, None),
                              expected_start=self.discovery.expected_start(action.pids),
                              hellos=self.hellos, control=self.control,
                              own_unit=self.discovery.configured_unit(action.server))
        if run is None:
            return
        self.record.executing(action.decided_t, action.server)
        self.log.warning("reloading the server", server=action.server,
                         method=self.cfg.reload.method, pids=list(action.pids))
        reloader = Reloader(run)
        self._running[action.server] = (reloader, action)
        reloader.start(set(action.pids))

    def outcomes(self, now: float, received: Iterable[Any] = ()) -> list[ReloadOutcome]:
        """Reloads that finished since the last poll, as observations for the step; the
        hellos and answered calls among `received` go to the reloads' threads first."""
        if received:
            self.hellos.add(e for e in received if isinstance(e, (events.Hello, events.Calls)))
        out = []
        for server, (reloader, action) in list(self._running.items()):
            result = reloader.poll()
            if result is None:
                continue
            del self._running[server]
            self._write(action.decided_t, result, action)
            (self.log.warning if result.ok else self.log.error)(
                "reload finished", server=server, ok=result.ok, detail=result.detail,
                seconds=result.seconds)
            out.append(result.at(now, server))
        return out

    def _write(self, t: float, outcome: Optional[ReloadOutcome], action: ReloadAction) -> None:
        self.record.record(t, outcome, action.cause, action.server)
        if self.record.error:
            self.log.error("cannot write the reload record", error=self.record.error)


class Reloader:
    """Runs one reload at a time on a thread; `poll()` returns the finished outcome once."""

    def __init__(self, run: Callable[[set[int]], ReloadOutcome]):
        self._run = run
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[ReloadOutcome] = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, pids: set[int]) -> None:
        def work() -> None:
            try:
                self._result = self._run(set(pids))
            except Exception as e:  # an executor bug must not kill the sidecar
                self._result = ReloadOutcome(False, f"{type(e).__name__}: {e}", 0.0)

        self._result = None
        self._thread = threading.Thread(target=work, name="torch-watchdog-reload", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[ReloadOutcome]:
        if self._thread is None or self._thread.is_alive():
            return None
        self._thread, result = None, self._result
        return result
