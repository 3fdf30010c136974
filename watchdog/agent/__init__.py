"""The in-process agent: `install()`, `watch()`, `uninstall()`.

    import torch_watchdog.agent.auto   # one import: install() from TORCH_WATCHDOG_* variables

or, in code, `torch_watchdog.agent.install(event_log="/var/log/srv/events.jsonl")` and
`model = torch_watchdog.agent.watch(torch.compile(model, mode="reduce-overhead"), name="llm")`.

Importing this module does not import torch. After install() nothing the agent does raises
into the server, blocks it or prints to its stderr (set debug=True to see agent errors).

Fork (gunicorn --preload, a multiprocessing pool with fork): installed before the fork, the
agent goes on in each child as that child's own agent (`_after_fork_in_child`, registered with
os.register_at_fork at import): a fresh emitter and sender thread, fresh locks, counters from
zero, and a hello with the child's pid, `ppid` (its master) and the master's `server`.
Per-process state owned elsewhere is reset by callables appended to `_AFTER_FORK` (forks.py).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Optional

from torch_watchdog import __version__, events
from torch_watchdog.agent import drain, identity, imports, pools, settings
from torch_watchdog.agent.config import AgentConfig, resolve
from torch_watchdog.agent.drain import Draining, on_drain, ready
from torch_watchdog.agent.forks import _AFTER_FORK
from torch_watchdog.agent.wrapper import watched
from torch_watchdog.agent.wrapper import Watched, watch

__all__ = ["install", "uninstall", "watch", "current", "ready", "on_drain", "Draining", "Agent",
           "AgentConfig", "Watched"]

log = logging.getLogger("torch_watchdog.agent")
_lock = threading.RLock()
_agent: Optional["Agent"] = None
_atexit_registered = False


class Agent:
    """One per process: hooks, mitigations and the emitter's thread, which also runs `tick()`."""

    def __init__(self, config: AgentConfig, problems: list[str]):
        from torch_watchdog.agent.emitter import Emitter
        from torch_watchdog.agent.hooks import TorchHooks
        from torch_watchdog.agent.mitigation import GraphBudget, RecompileGuard

        import torch

        self.config = config
        self._torch = torch
        self.problems = problems
        self.server = identity.server_name(config.server)
        self.errors = 0
        self.started = time.monotonic()
        self._seq = 0
        self._next_heartbeat = self._next_hello = 0.0
        self._calls_at = self.started
        self._devices: list[str] = []
        # the launcher's: what this process imported by its first answer (agent/imports.py)
        self._imports_file = os.environ.get(imports.ENV) or None
        self.emitter = Emitter(config.socket_path, config.event_log, queue_size=config.queue_size,
                               tick_s=config.tick_s, reconnect_s=config.reconnect_s,
                               log_max_bytes=config.event_log_max_bytes, on_tick=self.tick,
                               on_error=self.on_error, drop_report_s=config.heartbeat_s,
                               on_receiver_change=self._hello_again, on_link=self._on_link)
        emit = self.emitter.emit
        self.budget = GraphBudget(torch, config.graph_budget, config.graph_budget_mode, emit)
        self.guard = RecompileGuard(torch, config.recompile_guard_after, emit)
        self.warm = self._warm(torch)
        self.hooks = TorchHooks(torch, self._compile_emit if self.warm else emit, self.on_error,
                                on_recompile=self.guard.note_recompile,
                                on_cudagraph_key=self.budget.note_key,
                                watched_names=lambda: sorted({w.name for w in list(watched)}))
        self.torch_version = str(torch.__version__)
        control = config.control_path or drain.default_path(config.socket_path)
        self.control = (drain.ControlClient(control, {0, os.geteuid(), config.control_uid},
                                            self.drain, self.on_error, config.reconnect_s,
                                            self.freeze)
                        if config.control and control else None)
        self.drainer = drain.Drainer(self, uninstall)

    def _on_link(self, up: bool) -> None:
        """One line when no sidecar listens at the socket (events go nowhere until one does),
        one when one first takes them."""
        path = self.config.socket_path
        if up:
            log.info("torch-watchdog agent: connected to the sidecar at %s", path)
        else:
            log.warning("torch-watchdog agent: no sidecar listens at %s: events are not sent "
                        "until one does (start `torch-watchdog sidecar`, or set "
                        "TORCH_WATCHDOG_SOCKET to the socket it listens on); retried every "
                        "%g s", path, self.config.reconnect_s)

    def _warm(self, torch: Any) -> Any:
        from torch_watchdog.agent.warm import Warm

        cfg = self.config
        if not (cfg.warm and cfg.warm_dir and Warm.supported(torch)):
            return None
        name = cfg.warm_name or identity.warm_name(self.server, cfg.server, sys.argv[0])
        return Warm(torch, cfg.warm_dir, name, self.emitter.emit, cfg.warm_save_quiet_s)

    def _compile_emit(self, event: events.Event) -> None:
        """The hooks' events (compiles, recordings: rare): what the warm bundle waits for."""
        if event.kind in ("compile", "recompile", "cudagraph_record"):
            self.warm.note_compile()
        self.emitter.emit(event)

    def drain(self, grace_s: float) -> None:
        """The sidecar asked (control channel): drain and exit (drain.Drainer)."""
        if self.drainer.start(grace_s):
            log.warning("torch-watchdog agent: the sidecar asked this process to drain "
                        "(grace %.0f s); exiting with %d once done", grace_s,
                        self.config.drain_exit_code)

    def freeze(self, on: bool) -> None:
        """The sidecar asked (control channel): stop recording CUDA graphs for new sizes, or
        record them again (mitigation.GraphBudget.freeze)."""
        if on:
            self.budget.freeze()
            log.warning("torch-watchdog agent: the sidecar froze CUDA-graph recording at %d "
                        "sizes: new sizes run without CUDA graphs", len(self.budget.keys))
        else:
            self.budget.unfreeze()

    def start(self) -> None:
        if self.config.restart_file:
            drain.clear_stale_restart_file(self.config.restart_file)
        if self.warm is not None:  # before the hooks and the first compile
            try:
                self.warm.set_job_id()
                self.warm.load()
            except Exception as e:
                self.on_error(e)
        self.hooks.install()
        settings.configure(emit=self.emitter.emit, emit_later=self.emitter.emit_later,
                           max_shapes=self.config.max_shapes,
                           stall_ns=int(self.config.stall_threshold_s * 1e9))
        self.emitter.emit(self.hello())
        self._next_hello = time.monotonic() + self.config.hello_every_s
        self.emitter.start()

    def stop(self) -> None:
        settings.reset()
        self.hooks.uninstall()
        self.budget.release()
        self.guard.release()
        self._emit_calls()
        self.emitter.stop(last=self._heartbeat)
        if self.control is not None:
            self.control.close()

    def after_fork(self) -> None:
        """In a forked child (at-fork hook): this agent becomes the child's. Plain assignments
        and, for the hello, reads of torch's compile config; no CUDA call (a child of a CUDA
        parent must not touch CUDA; torch marks it a bad fork, so the OOM observer and GPU
        UUIDs come only from a child that initialises CUDA itself, which tick() picks up). The
        child's hello is queued first, before its sender thread starts: a worker that exits at
        once still says who it is."""
        now = time.monotonic()
        self.errors = self._seq = 0
        self.started = self._calls_at = now
        self._next_heartbeat = 0.0
        self._next_hello = now + self.config.hello_every_s
        self._devices = []
        self.hooks.pid = os.getpid()  # the hooks' events name the child, not the master
        for w in list(watched):
            w.take_window()  # calls made before the fork are the master's to report
        if self.control is not None:
            self.control.after_fork()
        self.drainer = drain.Drainer(self, uninstall)
        running = self.emitter.after_fork()
        self.emitter.emit(self.hello())
        if running:
            self.emitter.start(hand_back=True)

    def on_error(self, exc: BaseException) -> None:
        self.errors += 1
        if self.config.debug:
            print("torch-watchdog agent error (ignored):", file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)

    def tick(self) -> None:
        """Every `tick_s` on the sender thread: heal hooks, mitigations, heartbeat, hello."""
        self.hooks.heal()
        self.guard.tick()
        if self.control is not None:
            self.control.poll()
        if self.warm is not None and self.warm.due():
            self.warm.save_in_background(self.on_error)
        now = time.monotonic()
        if self.config.server is None and self._renamed():
            self._next_hello = now  # the sidecar learns the new name at once
        devices = self._devices or self.hooks.devices()  # known once CUDA is up
        if now >= self._next_hello or devices != self._devices:
            self._devices = devices
            self._next_hello = now + self.config.hello_every_s
            self.emitter.emit(self.hello())
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_s
            self.emitter.emit(self._heartbeat())
            self._emit_calls()

    def _hello_again(self) -> None:
        """On the sender thread, when the emitter sees a new sidecar at the socket path (it
        restarted, or came up after this process): it learns who this process is now, not up
        to hello_every_s later; the period runs on from this hello."""
        self._next_hello = time.monotonic() + self.config.hello_every_s
        self.emitter.emit(self.hello())
        self.budget.restate()

    def _renamed(self) -> bool:
        """A Ray Serve replica's name follows the rank Serve gives it (agent/serve.py): given after
        the agent started, or changed when Serve renumbers its replicas."""
        name = identity.replica_name()
        if name is None or name == self.server:
            return False
        self.server = name
        return True

    def _heartbeat(self) -> events.Heartbeat:
        """The next heartbeat: every tick's `heartbeat_s`, and the last one at stop()."""
        self._seq += 1
        reserved, active = pools.primed_pool_bytes(self._torch)
        return events.Heartbeat(
            t=time.time(), pid=os.getpid(), seq=self._seq,
            uptime_s=time.monotonic() - self.started, queue_depth=self.emitter.depth(),
            errors=self.errors, lost=self.emitter.lost(), pool_reserved_bytes=reserved,
            pool_active_bytes=active)

    def _emit_calls(self) -> None:
        now = time.monotonic()
        window, self._calls_at = now - self._calls_at, now
        for w in list(watched):
            calls, total_ns, stall_calls, stall_ns, distinct = w.take_window()
            if calls and self._imports_file is not None:
                why, self._imports_file = imports.record(self._imports_file), None
                if why is not None:
                    log.info("torch-watchdog agent: the standby's preload list not written: "
                             "%s", why)
            if calls:
                self.emitter.emit(events.Calls(
                    t=time.time(), pid=os.getpid(), name=w.name, calls=calls,
                    seconds=total_ns / 1e9, stall_calls=stall_calls,
                    stall_seconds=stall_ns / 1e9, distinct_shapes=distinct, window_s=window))
        padding = sys.modules.get("torch_watchdog.agent.pad")  # imported by watch(pad=...)
        if padding is not None:
            padding.emit_stats(self.emitter.emit)

    def hello(self) -> events.Hello:
        config: dict[str, events.Scalar] = {}
        try:
            config = self.hooks.compile_config()
        except Exception as e:
            self.on_error(e)
        for i, problem in enumerate(self.problems):
            config[f"agent_config_problem_{i}"] = events.clip(problem, 300)
        return events.Hello(
            t=time.time(), pid=os.getpid(), torch=self.torch_version, agent=__version__,
            devices=list(self._devices), config=config, capabilities=dict(self.hooks.capabilities),
            watched=sorted({w.name for w in list(watched)})[:100],
            argv=events.clip(" ".join(sys.argv), 300) or "", server=self.server,
            ppid=os.getppid())


def install(**settings: Any) -> Optional[Agent]:
    """Start the agent (idempotent, thread-safe). Returns it, or None if disabled or failed.

    Settings are AgentConfig fields; each overrides its TORCH_WATCHDOG_* variable. A bad
    explicit setting raises ValueError; any failure to start is logged and returns None.
    """
    global _agent, _atexit_registered
    with _lock:
        if _agent is not None:
            return _agent
        config, problems = resolve(settings)
        for problem in problems:
            log.warning("torch-watchdog agent: %s", problem)
        if not config.enabled:
            return None
        agent = None
        try:
            agent = Agent(config, problems)
            agent.start()
        except Exception as e:  # never take the server down for the watchdog's sake
            log.warning("torch-watchdog agent not started: %s: %s", type(e).__name__, e)
            if agent is not None:
                try:
                    agent.stop()
                except Exception:
                    pass
            return None
        _agent = agent
        if not _atexit_registered:
            atexit.register(uninstall)  # flush what is queued when the server exits normally
            _atexit_registered = True
        return agent


def uninstall() -> None:
    """Remove every hook, flush queued events, stop the thread. Idempotent."""
    global _agent
    with _lock:
        agent, _agent = _agent, None
        if agent is not None:
            try:
                agent.stop()
            except Exception as e:
                log.warning("torch-watchdog agent: error while stopping: %s", e)


def current() -> Optional[Agent]:
    return _agent


def _after_fork_in_child() -> None:
    """os.register_at_fork(after_in_child=...): runs in every forked child, inside os.fork(),
    before the child's own code. Never raises, never waits on an inherited lock."""
    global _lock
    try:
        _lock = threading.RLock()  # held by another thread at fork time: held forever here
        agent = _agent
        failed = []
        for reset in list(_AFTER_FORK):
            try:
                reset()
            except Exception as e:
                failed.append(e)
        if agent is None:
            return
        agent.after_fork()
        for error in failed:
            agent.on_error(error)  # counted in the child's heartbeat; printed only with debug
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:  # run after multiprocessing clears the child's finalizers
            mp_util.register_after_fork(agent, _flush_at_multiprocessing_exit)
    except BaseException:  # an at-fork hook's error would go to the server's stderr
        pass


def _flush_at_multiprocessing_exit(agent: Agent) -> None:
    """A multiprocessing child (a Pool worker) leaves through os._exit(), skipping atexit: its
    last events would be lost. multiprocessing's own exit finalizers do run: flush from one."""
    import multiprocessing.util

    multiprocessing.util.Finalize(None, uninstall, exitpriority=0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
