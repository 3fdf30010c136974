"""One tick's results, handed from the daemon loop to the metrics exporter (and status views).

The loop builds a new frozen Snapshot each tick and swaps a reference; a scrape reads whatever
reference it finds, so it never waits for the loop and never sees half an update.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Optional

from torch_watchdog.sidecar.core.observations import DeviceSample


class Processes(NamedTuple):
    """One server's processes as the poll read them (publisher.readings): None where none
    said."""
    up: Optional[bool]                     # one of them alive; None: none read
    rss_bytes: Optional[int]               # the live ones' resident set sizes, summed
    gpu_bytes: dict[str, Optional[int]]    # by gpu_uuid: the live ones' NVML usedGpuMemory


@dataclass(frozen=True)
class Snapshot:
    t: float                                       # wall-clock time of the tick
    devices: tuple[DeviceSample, ...] = ()
    server_gpu_bytes: dict[str, Optional[int]] = field(default_factory=dict)  # by gpu_uuid
    server_rss_bytes: Optional[int] = None
    server_alive: Optional[bool] = None
    estimates: dict[str, Any] = field(default_factory=dict)   # correlate.State.estimates()
    forecast: dict[str, Any] = field(default_factory=dict)    # forecast.Forecast.as_dict()
    active_causes: tuple[str, ...] = ()
    # every server: name -> {"estimates", "forecast", "active_causes", "pids", "gpus"}; the
    # fields above are the server nearest to OOM (the status page's focus)
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    focus: Optional[str] = None                    # the server the fields above are about
    stopped: tuple[str, ...] = ()                  # servers gone while none is left (PollResult)
    actions_total: dict[str, int] = field(default_factory=dict)   # by action ("alert", …)
    sources_up: dict[str, bool] = field(default_factory=dict)     # "nvml", "process", "agent"
    nvml_error: Optional[str] = None               # why NVML is down (no driver: no GPU here)
    poll_seconds: Optional[float] = None           # the last tick's duration
    nvml_query_seconds: Optional[float] = None
    events_received_total: int = 0
    events_skewed_total: int = 0                   # event times replaced by the sidecar's clock
    reload_record_unreadable: bool = False   # reloads.json could not be read: none for an hour
    source_errors_total: dict[tuple[str, str], int] = field(default_factory=dict)  # (source,
                                                                 # reason): NVML errors by class
    events_dropped_total: dict[str, int] = field(default_factory=dict)  # by receiver reason
    agent_events_lost_total: int = 0               # what agents reported in `dropped` events
    alerts_sent_total: dict[str, int] = field(default_factory=dict)         # by Alertmanager URL
    alert_posts_failed_total: dict[str, int] = field(default_factory=dict)  # (a few, configured)
    alerts_dropped_total: dict[str, int] = field(default_factory=dict)
    poll_errors_total: dict[str, int] = field(default_factory=dict)  # by stage of the poll
    gpu_attribution: str = "auto"                  # config gpu.attribution: whose memory
    # per server (by name, as `servers`): its processes, and its actions by kind
    processes: dict[str, Processes] = field(default_factory=dict)
    server_actions_total: dict[tuple[str, str], int] = field(default_factory=dict)  # (label,
                                                                                    # action)
    nvml_in_use: bool = True      # NVML listed a GPU, or is there and fails (publisher)


_FIELDS = frozenset(f.name for f in fields(Snapshot))
_new = object.__new__


def make(values: dict[str, Any]) -> Snapshot:
    """Snapshot(**values), the daemon's each poll. With every field given, the instance's dict
    is filled at once (a frozen dataclass's __init__ sets its fields one object.__setattr__ at
    a time). The same Snapshot, frozen alike; anything else (a field missing or unknown) goes
    through __init__."""
    if values.keys() != _FIELDS:
        return Snapshot(**values)
    snap = _new(Snapshot)
    snap.__dict__.update(values)
    return snap
