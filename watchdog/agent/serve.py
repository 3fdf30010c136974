"""Inside a Ray Serve replica: the server's name from Serve's replica context, and a reload that
Serve carries out itself.

Name. A replica is a Ray actor process; the agent in it names its server
`serve:<application>/<deployment>/<rank>` from `ray.serve.get_replica_context()`. The rank is
Serve's number for a replica's slot in its deployment (0 to num_replicas - 1): a replica that
Serve replaces takes the slot's rank again, so the name, its metrics and its alerts stay the
same over restarts. Serve may hand a starting replica a spare rank while the replica it
replaces is still stopping, and renumber it once that one is gone: the agent follows (its
next tick sees the new rank and says hello under the new name). An explicit name
(`install(server=...)`, `TORCH_WATCHDOG_SERVER`) overrides all of this.

Reload. With `reload.method: agent` the sidecar asks the growing replica's agent to drain.
Wired into Serve's health check (`check_health()` below, or the `WatchdogReplica` mixin), the
drain hands the replica to Serve: new calls are not refused, `ready()` turns False and the
health check fails from then on, so Serve's controller marks the replica unhealthy, routes new
requests to the other replicas, lets the calls in hand finish (`graceful_shutdown_timeout_s`),
calls the deployment's `__del__` (`stopping()`: the agent reports "drained" and flushes its
events) and starts a replacement. The process is stopped by Serve, not by the agent. A replica
whose health check never reached the agent drains the usual way (agent/drain.py: calls refused,
exit 75), which Serve sees as a dead replica.

Importing this module does not import ray or torch: the context is read from the modules the
replica has already loaded.
"""
from __future__ import annotations

import sys
import threading
import time

from torch_watchdog.agent import drain
from torch_watchdog.agent.identity import replica_name

__all__ = ["replica_name", "check_health", "stopping", "WatchdogReplica", "ReplicaDraining"]

STOPPING_WAIT_S = 5.0  # how long __del__ waits for the agent's reply and flush


class ReplicaDraining(RuntimeError):
    """Raised by `check_health()` once the sidecar asked this replica to drain: Serve's
    controller then replaces the replica."""


class _Handover:
    """drain.handover for Ray Serve: the drain waits for Serve to stop the replica."""

    name = "Ray Serve"

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def wait_stopped(self, deadline: float) -> bool:
        """Until the deployment's __del__ ran (Serve's graceful shutdown: its requests
        finished), or `deadline` (time.monotonic())."""
        return self.stopped.wait(max(0.0, deadline - time.monotonic()))


_handover = _Handover()


def check_health() -> None:
    """Call first thing in the deployment's `check_health` (the mixin does): raises
    ReplicaDraining once the sidecar asked this replica to drain. Its first call also tells
    the agent that Serve health-checks this replica, so that a drain lets Serve replace it."""
    if drain.handover is None:
        drain.handover = _handover
    if not drain.ready():
        raise ReplicaDraining("torch-watchdog: the sidecar asked this replica to drain for a "
                              "reload; Serve replaces it")


def stopping(timeout_s: float = STOPPING_WAIT_S) -> None:
    """Call from the deployment's `__del__` (the mixin does): Serve is stopping this replica,
    its requests done. During a drain: the agent reports "drained" to the sidecar and flushes
    its events before Serve kills the process. Otherwise (a scale-down, a redeploy): the
    agent's queued events are flushed. Never raises; waits `timeout_s` at most."""
    try:
        # the package, loaded before any of its modules (an import here would be a cycle)
        agent = sys.modules["torch_watchdog.agent"]
        current = agent.current()
        if current is None or replica_name() is None:
            return
        thread = current.drainer.thread
        if thread is None:
            agent.uninstall()
            return
        _handover.stopped.set()
        thread.join(timeout_s)
    except Exception:
        pass


class WatchdogReplica:
    """Mixin for a Serve deployment class: `class Model(WatchdogReplica): ...`. Its
    `check_health` fails once the sidecar asked for a drain; its `__del__` tells the agent
    Serve is stopping the replica. A class with its own `check_health` or `__del__` calls
    `super()`'s, or this module's `check_health()` and `stopping()`, first."""

    def check_health(self) -> None:
        check_health()

    def __del__(self) -> None:
        stopping()
