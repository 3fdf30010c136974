"""What the sidecar's sources read, as plain values: the input of the pure pipeline.

Sources (nvml.py, process.py) produce these; correlate.fold() consumes them together with the
agent's events. Times are wall-clock seconds (same base as event `t`); byte counts are ints;
`None` means "not available" (NVML said so, or the source is down), never zero.
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
    query_s: Optional[float] = None  # how long the NVML queries took (FACTS #11: p99 ~100 ms)
    # host memory, for host-memory mode (no GPU: the server's RSS against the machine's RAM)
    host_total_bytes: Optional[int] = None
    host_available_bytes: Optional[int] = None
    # configured servers (a systemd unit, a pidfile): name -> the pids that belong to it
    servers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # device uuid -> why NVML did not read it at this poll (lost, vanished, late, ...): such a
    # device is absent from `devices`, and its last numbers are not carried over
    nvml_down: dict[str, str] = field(default_factory=dict)


def sample_to_dict(s: Sample) -> dict[str, Any]:
    """One line of the sidecar's sample log (read back by traces.py for replay)."""
    line = {"kind": "sample", "t": s.t, "nvml_up": s.nvml_up, "query_s": s.query_s,
            "devices": [{"uuid": d.uuid, "used": d.used_bytes, "total": d.total_bytes,
                         "free": d.free_bytes} for d in s.devices],
            "processes": [{"pid": p.pid, "alive": p.alive, "rss": p.rss_bytes,
                           "gpu": p.gpu_bytes, **({"pss": p.pss_bytes} if p.pss_bytes
                                                  is not None else {})}
                          for p in s.processes],
            "host_total": s.host_total_bytes, "host_available": s.host_available_bytes}
    if s.servers:
        line["servers"] = {k: list(v) for k, v in s.servers.items()}
    if s.nvml_down:  # only when some device is down: healthy lines stay as they were
        line["nvml_down"] = dict(s.nvml_down)
    return line


def sample_from_dict(d: dict[str, Any]) -> Sample:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    def opt_int(v: Any) -> Optional[int]:
        return None if v is None else int(v)

    return Sample(
        t=float(d["t"]), nvml_up=bool(d["nvml_up"]),
        query_s=None if d.get("query_s") is None else float(d["query_s"]),
        devices=tuple(DeviceSample(str(x["uuid"]), int(x["used"]), int(x["total"]),
                                   opt_int(x.get("free"))) for x in d["devices"]),
        processes=tuple(ProcessSample(int(x["pid"]), bool(x["alive"]), opt_int(x.get("rss")),
                                      {str(k): opt_int(v) for k, v in x["gpu"].items()},
                                      opt_int(x.get("pss")))
                        for x in d["processes"]),
        host_total_bytes=opt_int(d.get("host_total")),
        host_available_bytes=opt_int(d.get("host_available")),
        servers={str(k): tuple(int(p) for p in v) for k, v in (d.get("servers") or {}).items()},
        nvml_down={str(k): str(v) for k, v in (d.get("nvml_down") or {}).items()})


@dataclass(frozen=True)
class ConfigChange:
    """The config the live sidecar used from `t` on (written at start and after each good
    SIGHUP): a replay of its sample log follows it, and so decides as the daemon did."""
    t: float
    config: Any                    # config.Config
    kind = "config"


def config_to_dict(t: float, config: Any) -> dict[str, Any]:
    """A sample-log line; `config.from_mapping` reads the mapping back."""
    return {"kind": "config", "t": t, "config": dataclasses.asdict(config)}


@dataclass(frozen=True)
class ReloadOutcome:
    """How a reload that the step asked for ended: an observation, written to the sample log
    when the daemon learns it, so a replay sees it at the same place."""
    t: float
    server: str
    ok: bool
    detail: str
    seconds: float = 0.0
    retry_after_s: Optional[float] = None  # not done, not counted: decide again after this
    failed: bool = False   # carried out, but the server did not come back (no hello in time)
    kind = "reload_outcome"


def outcome_to_dict(o: ReloadOutcome) -> dict[str, Any]:
    line = {"kind": "reload_outcome", "t": o.t, "server": o.server, "ok": o.ok,
            "detail": o.detail, "seconds": o.seconds}
    if o.retry_after_s is not None:
        line["retry_after_s"] = o.retry_after_s
    if o.failed:  # only then: other lines stay as they were
        line["failed"] = True
    return line


def outcome_from_dict(d: dict[str, Any]) -> ReloadOutcome:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    if not isinstance(d["ok"], bool) or not isinstance(d.get("failed", False), bool):
        raise ValueError("ok and failed must be booleans")
    retry = d.get("retry_after_s")
    return ReloadOutcome(float(d["t"]), str(d["server"]), d["ok"], str(d["detail"]),
                         float(d.get("seconds", 0.0)), None if retry is None else float(retry),
                         d.get("failed", False))
