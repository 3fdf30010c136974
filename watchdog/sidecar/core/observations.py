"""What the sidecar observes, as plain values: the input of the pure step (core/step.py).

Sources (nvml.py, process.py) produce samples; the agents' events (watchdog/events.py) come
through the receiver; reload outcomes come back from the executors. Times are wall-clock
seconds (the same base as event `t`); byte counts are ints; `None` means "not available" (NVML
said so, or the source is down), never zero.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

@dataclass(frozen=True)
class DeviceSample:
    uuid: str                      # "GPU-…" (or "MIG-…"), the stable identity of a device
    used_bytes: int
    total_bytes: int
    free_bytes: Optional[int] = None


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    alive: bool
    rss_bytes: Optional[int] = None
    # per device UUID: this process's usedGpuMemory; None where NVML does not say (MIG, containers)
    gpu_bytes: dict[str, Optional[int]] = field(default_factory=dict)
    # host-memory mode: its proportional set size (shared pages split among their sharers, so
    # forked workers are not each counted with the master's pages); None where not read
    pss_bytes: Optional[int] = None
    # host-memory mode: the memory limit of its cgroup (memory.max, the lowest of its
    # ancestors'), None where there is none or it is not read
    mem_limit_bytes: Optional[int] = None

    @property
    def host_bytes(self) -> Optional[int]:
        return self.pss_bytes if self.pss_bytes is not None else self.rss_bytes

    @property
    def gpu_total(self) -> Optional[int]:
        values = [v for v in self.gpu_bytes.values() if v is not None]
        return sum(values) if values else None


@dataclass(frozen=True)
class Sample:
    """One poll of every source at time `t`."""
    t: float
    devices: tuple[DeviceSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    nvml_up: bool = True
    nvml_error: Optional[str] = None
    query_s: Optional[float] = None  # how long the NVML queries took (p99 up to ~100 ms)
    # host memory, for host-memory mode (no GPU: the server's PSS against its cgroup's limit)
    host_total_bytes: Optional[int] = None
    host_available_bytes: Optional[int] = None
    # configured servers (a systemd unit, a pidfile): name -> the pids that belong to it
    configured: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # device uuid -> why NVML did not read it at this poll (lost, vanished, late, ...): such a
    # device is absent from `devices`, and its last numbers are not carried over
    nvml_down: dict[str, str] = field(default_factory=dict)
    kind = "sample"  # class attribute, as every observation has: not a field


@dataclass(frozen=True)
class ConfigChange:
    """The config the live sidecar used from `t` on (written at start and after each good
    SIGHUP): a replay of its sample log follows it, and so decides as the daemon did."""
    t: float
    config: Any                    # config.Config
    kind = "config"


@dataclass(frozen=True)
class ReloadOutcome:
    """How a reload ended. An executor returns it; the daemon stamps it with when it learnt it
    and the server (`at`), writes it to the sample log and steps it, so a replay sees it at the
    same place."""
    ok: bool
    detail: str
    seconds: float = 0.0
    # not done, and not to be counted as a reload: ask again after this many seconds (an
    # eviction refused by the PodDisruptionBudget while another replica restarts)
    retry_after_s: Optional[float] = None
    failed: bool = False   # carried out, but the server did not come back (no hello in time)
    t: float = 0.0
    server: str = ""
    kind = "reload_outcome"

    def at(self, t: float, server: str) -> "ReloadOutcome":
        return dataclasses.replace(self, t=t, server=server)


@dataclass(frozen=True)
class ReloadHistory:
    """The reload decisions the reload record holds, at the sidecar's start: (time, server;
    None for a decision of no one server), so that cooldowns and the hourly maximum survive a
    restart, in replay too."""
    t: float
    decisions: tuple[tuple[float, Optional[str]], ...]
    kind = "reload_history"


@dataclass(frozen=True)
class KnownServer:
    """What a sidecar knew of one server: its processes (each checked, at the next sidecar's
    start, to be still the process it was: its start time) and what its hellos said."""
    name: str
    pids: tuple[int, ...]
    uid: Optional[int] = None
    parents: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()
    argv: Optional[str] = None


@dataclass(frozen=True)
class ServersKnown:
    """The servers a sidecar before this one knew (`<state_dir>/servers.json`), at this one's
    start, their processes checked alive and the same: they are placed at once, so their
    events fold into their own server from the first poll, not pooled (a restarted sidecar
    drained every server on the host through a `default` of the processes it had not yet
    heard a hello from)."""
    t: float
    servers: tuple[KnownServer, ...]
    kind = "servers_known"


OPERATOR_REQUESTS = ("unfreeze",)


@dataclass(frozen=True)
class OperatorRequest:
    """What an operator asked of one server by hand (`torch-watchdog unfreeze SERVER`: a
    request file in `<state_dir>/requests/`, actions/requests.py): "unfreeze"."""
    t: float
    server: str
    request: str
    kind = "operator_request"


@dataclass(frozen=True)
class RecordUnreadable:
    """The reload record found at the sidecar's start cannot be trusted: reloads are suspended
    for an hour (actions/record.py), and an alert says so while this sidecar runs."""
    t: float
    detail: str
    kind = "record_unreadable"
