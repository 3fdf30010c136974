"""The sidecar's configuration schema: every key as a frozen dataclass field with its type and
default (each documented with its unit in config/watchdog.yaml), and the rules its values
follow (`semantic_problems`). Reading a file into it: loading.py."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from torch_watchdog.events import DEFAULT_SOCKET

MiB = 1 << 20
MIN_POLL_S = 0.05


@dataclass(frozen=True)
class ServerConfig:
    """How the watched inference server is found (any that is set is used)."""
    unit: Optional[str] = None            # systemd unit whose MainPID is the server
    pidfile: Optional[str] = None
    trust_agent_pids: bool = True         # PIDs announced by the agent's hello are watched


@dataclass(frozen=True)
class ServerEntry:
    """One more server on this host (a replica): its name, and how its processes are found;
    or, with neither unit nor pidfile, a server its agents announce by `name`. Either may set
    its own budget."""
    name: Optional[str] = None            # default: the unit's name
    unit: Optional[str] = None            # systemd unit whose MainPID (and children) it is
    pidfile: Optional[str] = None
    budget_bytes: Optional[int] = None    # its memory's budget, for forecast.process_budget_bytes


@dataclass(frozen=True)
class AgentSocketConfig:
    socket_path: str = DEFAULT_SOCKET
    allowed_uids: Optional[list[int]] = None   # None: any local uid may send events
    socket_mode: int = 0o660


@dataclass(frozen=True)
class CorrelateConfig:
    jump_bytes: int = 16 * MiB            # one poll's growth above this is an allocator/compile
                                          # step: out of the per-graph regression, and of the
                                          # trend unless steps form a staircase
    min_records: int = 20                 # recordings before a MB/graph estimate is reported
    min_confidence: float = 0.5           # of the MB/graph estimate, to name the cause
    storm_recompiles: int = 4             # this many recompiles …
    storm_window_s: float = 300.0         # … within this window is a recompile storm
    default_recompile_limit: int = 8      # when the agent did not report torch's setting
    fallback_new_shapes: int = 3          # new shapes without a compile after the limit
    unexplained_bytes: int = 256 * MiB    # growth no recording or compile explains
    max_clock_skew_s: float = 300.0       # an event time further from the sidecar's clock is
                                          # counted and replaced by the sidecar's


@dataclass(frozen=True)
class ForecastConfig:
    window_s: float = 60.0                # recent window for the request rate, growth outside
                                          # recordings and graph growth's recent rate
    # deprecated and ignored: the forecast is to where allocation fails (core/forecast.py,
    # FAIL_FREE_BYTES) and the margin is policy.reload_lead_s. Kept so that configs and
    # sample logs that set it still load
    headroom_bytes: int = 128 * MiB
    process_budget_bytes: Optional[int] = None  # or a fixed budget for the server's memory
    # or a budget for each of its processes (a worker is killed alone: a cgroup per worker, a
    # host-memory server whose workers each have a limit)
    per_process_budget_bytes: Optional[int] = None


@dataclass(frozen=True)
class PolicyConfig:
    reload_lead_s: float = 60.0           # reload when the forecast OOM is nearer than this
    alert_lead_s: float = 1800.0          # alert (forecast) when nearer than this
    hold_polls: int = 3                   # the reload condition must hold this many polls
    warmup_s: float = 30.0                # after the server's first compile: a reload only
                                          # for an OOM due before its end plus the lead
    cooldown_s: float = 600.0             # between reloads
    max_reloads_per_hour: int = 3         # then alert only (per server)
    max_concurrent_reloads: int = 1       # servers reloading at once on this host (replicas
                                          # must not all restart together)
    dry_run: bool = False
    # what the reload condition does for growth the CUDA-graph recordings explain: reload |
    # freeze_then_reload (freeze recording over the control channel; reload if it does not
    # take) | freeze (never reload: freeze, and alert). A leak is reloaded (freeze: alerted).
    remedy: str = "reload"


@dataclass(frozen=True)
class ReloadConfig:
    method: str = "none"                  # none | signal | rolling | master-hup | systemd | http
                                          # | command | evict
    unit: Optional[str] = None            # systemd: the unit to restart (default: server.unit)
    url: Optional[str] = None             # http: POSTed to drain and reload the server
    command: Optional[list[str]] = None   # command: argv to run
    grace_s: float = 30.0                 # signal: SIGKILL this long after SIGTERM
    timeout_s: float = 120.0              # systemd, http, command, evict: the longest a reload
                                          # may take
    # after a reload, a new process of the server must say hello within this (rolling: each
    # replacement): else reload_failed. The hello comes at the agent's import, after torch's
    # and before the model's load (GPU seed scenario: back 19.1 s after SIGTERM); 0: no check
    hello_timeout_s: float = 120.0
    # agent: the control socket the agents connect to (None: <agent.socket_path>.ctl); grace_s
    # is the agent's bound on the calls in hand
    control_path: Optional[str] = None
    control_mode: int = 0o660


@dataclass(frozen=True)
class AlertsConfig:
    urls: list[str] = field(default_factory=list)  # Alertmanager base URLs (an HA pair: both)
    resend_s: float = 60.0                # firing alerts re-sent this often; endsAt = 4 x this
    resolved_retention_s: float = 900.0   # resolved alerts re-sent for this long
    timeout_s: float = 5.0                # per POST
    service: str = "inference"            # label `service` on every alert
    instance: Optional[str] = None        # label `instance`; None: this host's name
    # the `reload` alert fires at least this long from the reload's start (its outcome known in
    # about a second): over an Alertmanager route's group_wait, else it is never notified, and
    # over Prometheus' scrape + evaluation intervals, as it inhibits TorchCompileOomSoon
    reload_min_firing_s: float = 180.0


GPU_ATTRIBUTIONS = ("auto", "process", "device")
REMEDIES = ("reload", "freeze_then_reload", "freeze")


@dataclass(frozen=True)
class GpuConfig:
    # Whose memory the forecast watches. process: the server's own processes (NVML's
    # per-process list; a pod needs the node-level mode, hostPID, for its pids to match);
    # device: the used memory of the server's GPUs, whoever holds it (a pod that has its GPUs
    # to itself); auto: per process when NVML lists every server process, else device-level.
    attribution: str = "auto"


@dataclass(frozen=True)
class Config:
    poll_interval_s: float = 0.1
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 9464
    state_dir: str = "/var/lib/torch-watchdog"
    sample_log: Optional[str] = None      # every poll and agent event, for replay after an incident
    sample_log_max_bytes: int = 256 * MiB # then rotated once to <sample_log>.1
    server: ServerConfig = field(default_factory=ServerConfig)
    servers: list[ServerEntry] = field(default_factory=list)  # more servers: replicas
    agent: AgentSocketConfig = field(default_factory=AgentSocketConfig)
    correlate: CorrelateConfig = field(default_factory=CorrelateConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    reload: ReloadConfig = field(default_factory=ReloadConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)


# --- semantic checks, run after the type checks on the typed Config ----------------------------

def _positive(v: float) -> bool:
    return v > 0


def _at_least_one(v: int) -> bool:
    return v >= 1


def _not_negative(v: float) -> bool:
    return v >= 0


# (dotted key, rule, what is wrong when the rule fails). Values that failed the type check were
# replaced by their (valid) default, so each bad value is reported once.
_RULES: tuple[tuple[str, Any, str], ...] = (
    # a tiny value is a busy loop: at 0.001 s the daemon's fixed ~0.3 ms of work per poll
    # alone is a third of a core, plus NVML's 20-100 ms queries back to back
    ("poll_interval_s", lambda v: MIN_POLL_S <= v <= 60,
     f"must be >= {MIN_POLL_S} and <= 60 seconds"),
    # a tiny one rotates (an open and a rename) at every write, 10 times a second
    ("sample_log_max_bytes", lambda v: v >= MiB, f"must be >= {MiB} (1 MiB)"),
    ("metrics_address", lambda v: bool(v.strip()), "must not be empty"),
    ("metrics_port", lambda v: 1 <= v <= 65535, "must be a TCP port 1..65535"),
    ("state_dir", os.path.isabs, "must be an absolute path"),
    ("agent.socket_path", os.path.isabs, "must be an absolute path"),
    ("agent.socket_mode", lambda v: 0 <= v <= 0o777, "must be a file mode 0..0o777 (e.g. 0660)"),
    ("correlate.min_confidence", lambda v: 0 <= v <= 1, "must be within 0..1"),
    ("correlate.min_records", _at_least_one, "must be >= 1"),
    ("correlate.storm_recompiles", _at_least_one, "must be >= 1"),
    ("correlate.fallback_new_shapes", _at_least_one, "must be >= 1"),
    ("forecast.window_s", _positive, "must be > 0 seconds"),
    ("forecast.process_budget_bytes", lambda v: v is None or v > 0, "must be > 0 bytes or null"),
    ("forecast.per_process_budget_bytes", lambda v: v is None or v > 0,
     "must be > 0 bytes or null"),
    ("policy.hold_polls", _at_least_one, "must be >= 1"),
    ("policy.max_concurrent_reloads", _at_least_one, "must be >= 1"),
    ("correlate.max_clock_skew_s", _positive, "must be > 0 seconds"),
    ("policy.max_reloads_per_hour", _not_negative, "must be >= 0"),
    # a firing alert is re-sent when resend_s has passed, checked every poll: 0 would POST
    # every alert to every Alertmanager 10 times a second
    ("alerts.resend_s", lambda v: v >= 1, "must be >= 1 second"),
    ("alerts.timeout_s", _positive, "must be > 0 seconds"),   # 0: every POST fails at once
    ("alerts.reload_min_firing_s", _not_negative, "must be >= 0 seconds"),
    ("reload.timeout_s", _positive, "must be > 0 seconds"),   # 0: every reload times out
    ("gpu.attribution", lambda v: v in GPU_ATTRIBUTIONS, "one of " + ", ".join(GPU_ATTRIBUTIONS)),
    ("reload.hello_timeout_s", _not_negative, "must be >= 0 seconds (0: no check)"),
    ("reload.control_path", lambda v: v is None or os.path.isabs(v), "must be an absolute path"),
    ("reload.control_mode", lambda v: 0 <= v <= 0o777, "must be a file mode 0..0o777"),
    ("policy.remedy", lambda v: v in REMEDIES, "one of " + ", ".join(REMEDIES)),
)


def semantic_problems(config: Config) -> list[str]:
    """Problems with well-typed values: ranges, absolute paths, keys that exclude each other."""
    problems = []
    for key, ok, what in _RULES:
        value = _lookup(config, key)
        if not ok(value):
            shown = oct(value) if key.endswith("_mode") else repr(value)
            problems.append(f"{key}: {what}, got {shown}")
    if config.server.unit is not None and config.server.pidfile is not None:
        problems.append("server: set only one of server.unit and server.pidfile")
    if (config.reload.method in SIGNALLING and config.server.unit is None
            and config.server.pidfile is None and not config.servers
            and config.agent.allowed_uids is None):
        # the pids to signal then come only from the agents' hellos, on a socket any local
        # uid may write to (a 0660 socket narrows it to a group, not to the server)
        problems.append(f"reload.method: {config.reload.method}, with the pids from the agents "
                        "alone: any local process able to write to the socket could get processes "
                        "killed: set server.unit, server.pidfile, servers or "
                        "agent.allowed_uids")
    return problems + _servers_problems(config) + _reload_problems(config)


def server_sources(config: Config,
                   ) -> list[tuple[Optional[str], Optional[str], Optional[str]]]:
    """(name, unit, pidfile) of every configured server: `server` (named by its unit, else
    "default") and each of `servers`. A name is None only for a `servers` entry with neither
    name nor unit, which `_servers_problems` reports (a valid config has none)."""
    out: list[tuple[Optional[str], Optional[str], Optional[str]]] = []
    if config.server.unit or config.server.pidfile:
        out.append((config.server.unit or "default", config.server.unit, config.server.pidfile))
    out += [(e.name or e.unit, e.unit, e.pidfile) for e in config.servers
            if e.unit is not None or e.pidfile is not None]
    return out


def server_budgets(config: Config) -> dict[str, int]:
    """The servers given a budget of their own (`servers[].budget_bytes`), by name."""
    return {name: e.budget_bytes for e in config.servers
            if e.budget_bytes is not None and (name := e.name or e.unit) is not None}


def _servers_problems(config: Config) -> list[str]:
    problems, names = [], []
    for i, e in enumerate(config.servers):
        where = f"servers[{i}]"
        if e.unit is not None and e.pidfile is not None:
            problems.append(f"{where}: set one of unit and pidfile, not both")
        if e.unit is None and e.pidfile is None and (e.name is None or e.budget_bytes is None):
            problems.append(f"{where}: set one of unit and pidfile, or name and budget_bytes "
                            "(the budget of a server its agents announce by that name)")
        elif e.name is None and e.unit is None:
            problems.append(f"{where}: a server found by its pidfile needs a name")
        if e.budget_bytes is not None and e.budget_bytes <= 0:
            problems.append(f"{where}.budget_bytes: must be > 0 bytes or null, got "
                            f"{e.budget_bytes}")
        if e.pidfile is not None and not os.path.isabs(e.pidfile):
            problems.append(f"{where}.pidfile: must be an absolute path, got {e.pidfile!r}")
    names = [name for name, _, _ in server_sources(config) if name] + \
        [e.name for e in config.servers if e.unit is None and e.pidfile is None and e.name]
    if len(set(names)) != len(names):
        problems.append(f"servers: names must differ, got {names}")
    return problems


RELOAD_METHODS = ("none", "signal", "rolling", "master-hup", "systemd", "http", "command",
                  "evict", "agent")
SIGNALLING = ("signal", "rolling", "master-hup")   # the sidecar signals processes itself


def _reload_problems(config: Config) -> list[str]:
    r = config.reload
    if r.method not in RELOAD_METHODS:
        return [f"reload.method: one of {', '.join(RELOAD_METHODS)}, got {r.method!r}"]
    needs = {"systemd": (r.unit or config.server.unit or any(e.unit for e in config.servers),
                         "reload.unit (or server.unit, or units in servers)"),
             "http": (r.url, "reload.url"), "command": (r.command, "reload.command")}
    if r.method in needs and not needs[r.method][0]:
        return [f"reload.method {r.method} needs {needs[r.method][1]}"]
    if r.method in ("rolling", "master-hup") and r.hello_timeout_s <= 0:
        return [f"reload.method {r.method} waits for the new workers' hellos: "
                f"reload.hello_timeout_s must be > 0"]
    return []


def _lookup(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
