"""Sidecar configuration: YAML → frozen dataclasses. Unknown keys and bad values are errors,
all listed at once (`ConfigError.problems`); every key has a default, documented with its unit
in config/watchdog.yaml."""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from torch_watchdog.events import DEFAULT_SOCKET

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """How the watched inference server is found (any that is set is used)."""
    unit: Optional[str] = None            # systemd unit whose MainPID is the server
    pidfile: Optional[str] = None
    trust_agent_pids: bool = True         # PIDs announced by the agent's hello are watched


@dataclass(frozen=True)
class AgentSocketConfig:
    socket_path: str = DEFAULT_SOCKET
    allowed_uids: Optional[list[int]] = None   # None: any local uid may send events
    socket_mode: int = 0o660


@dataclass(frozen=True)
class CorrelateConfig:
    jump_bytes: int = 16 * MiB            # one poll's growth above this is an allocator/compile
                                          # step, kept out of the per-graph regression
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
    window_s: float = 60.0                # recent window for rates and the linear trend
    headroom_bytes: int = 128 * MiB       # budget = device total - headroom (FACTS #9 run:
                                          # the crash came with 3 MB free)
    process_budget_bytes: Optional[int] = None  # or a fixed budget for the server's memory


@dataclass(frozen=True)
class PolicyConfig:
    reload_lead_s: float = 60.0           # reload when the forecast OOM is nearer than this
    alert_lead_s: float = 1800.0          # alert (forecast) when nearer than this
    hold_polls: int = 3                   # the reload condition must hold this many polls
    warmup_s: float = 30.0                # after the server's first compile: no reload
    cooldown_s: float = 600.0             # between reloads
    max_reloads_per_hour: int = 3         # then alert only (per server)
    max_concurrent_reloads: int = 1       # servers reloading at once on this host (replicas
                                          # must not all restart together)
    dry_run: bool = False


@dataclass(frozen=True)
class ReloadConfig:
    method: str = "none"                  # none | signal | systemd | http | command
    unit: Optional[str] = None            # systemd: the unit to restart (default: server.unit)
    url: Optional[str] = None             # http: POSTed to drain and reload the server
    command: Optional[list[str]] = None   # command: argv to run
    grace_s: float = 30.0                 # signal: SIGKILL this long after SIGTERM
    timeout_s: float = 120.0              # systemd, http, command: the longest a reload may take


@dataclass(frozen=True)
class AlertsConfig:
    urls: list[str] = field(default_factory=list)  # Alertmanager base URLs (an HA pair: both)
    resend_s: float = 60.0                # firing alerts re-sent this often; endsAt = 4 x this
    resolved_retention_s: float = 900.0   # resolved alerts re-sent for this long
    timeout_s: float = 5.0                # per POST
    service: str = "inference"            # label `service` on every alert
    instance: Optional[str] = None        # label `instance`; None: this host's name


@dataclass(frozen=True)
class Config:
    poll_interval_s: float = 0.1
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 9464
    state_dir: str = "/var/lib/torch-watchdog"
    sample_log: Optional[str] = None      # every poll and agent event, for replay after an incident
    sample_log_max_bytes: int = 256 * MiB # then rotated once to <sample_log>.1
    server: ServerConfig = field(default_factory=ServerConfig)
    agent: AgentSocketConfig = field(default_factory=AgentSocketConfig)
    correlate: CorrelateConfig = field(default_factory=CorrelateConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    reload: ReloadConfig = field(default_factory=ReloadConfig)


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def from_mapping(data: Any) -> Config:
    """Build a Config from parsed YAML; raises ConfigError listing every problem."""
    problems: list[str] = []
    config = _build(Config, data, "", problems)
    problems += semantic_problems(config)
    if problems:
        raise ConfigError(problems)
    return config


def check(path: str) -> tuple[Optional[Config], list[str]]:
    """(config, []) for a good file, (None, problems) for a bad one; never raises for a bad file
    (missing, unreadable, not YAML, not a mapping, bad values) — for check-config and SIGHUP."""
    try:
        return load(path), []
    except ConfigError as e:
        return None, list(e.problems)


def load(path: str) -> Config:
    import yaml  # the sidecar's dependency; replay with defaults needs no YAML

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text: {e.reason} at byte {e.start}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    return from_mapping(data)


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    if data is None:  # an empty file, or a section whose keys are all commented out
        return cls()
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "config"
        problems.append(f"{where}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(set(data) - names, key=str):
        problems.append(f"{prefix}{key}: unknown key")
    values = {}
    for name in names & set(data):
        hint, raw = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw, f"{prefix}{name}.", problems)
            continue
        value, problem = _check(_COERCE.get(prefix + name, _same)(raw), hint)
        if problem:
            problems.append(f"{prefix}{name}: {problem}")
        else:
            values[name] = value
    return cls(**values)


def _check(raw: Any, hint: Any) -> tuple[Any, Optional[str]]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        if raw is None:
            return None, None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        if not isinstance(raw, list) or not all(type(x) is args[0] for x in raw):
            return None, f"expected a list of {args[0].__name__}, got {raw!r}"
        return list(raw), None
    if hint is bool:
        return (raw, None) if isinstance(raw, bool) else (None, f"expected true/false, got {raw!r}")
    if hint is str:
        return (raw, None) if isinstance(raw, str) and raw else (None, f"expected text, got {raw!r}")
    if hint in (int, float):
        return _check_number(raw, hint)
    return None, f"unsupported type {hint}"


def _check_number(raw: Any, hint: type) -> tuple[Any, Optional[str]]:
    """A finite number >= 0; an int field takes 2.0 as 2 but not 1.5."""
    try:
        value = hint(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
    except (OverflowError, ValueError):  # int(inf), int(nan), an int too large for a float
        value = None
    if value is None or (not math.isfinite(value) if hint is float else value != raw):
        return None, f"expected {'an integer' if hint is int else 'a number'}, got {raw!r}"
    if value < 0:
        return None, f"must be >= 0, got {raw!r}"
    return value, None


# --- values given as text that mean a number -------------------------------------------------

def _same(raw: Any) -> Any:
    return raw


def _octal_mode(raw: Any) -> Any:
    """A file mode may be written as text, read as octal like chmod: "0660", "0o660", "660".
    (Unquoted 0660 is already an int, 432, to YAML 1.1; unquoted 0o660 is text to PyYAML.)"""
    if not isinstance(raw, str):
        return raw
    digits = raw.strip().lower()
    digits = digits[2:] if digits.startswith("0o") else digits
    if digits and all(c in "01234567" for c in digits):
        return int(digits, 8)
    return raw  # left as text: the type check reports it


_COERCE = {"agent.socket_mode": _octal_mode}


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
    ("poll_interval_s", lambda v: 0 < v <= 60, "must be > 0 and <= 60 seconds"),
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
    ("policy.hold_polls", _at_least_one, "must be >= 1"),
    ("policy.max_concurrent_reloads", _at_least_one, "must be >= 1"),
    ("correlate.max_clock_skew_s", _positive, "must be > 0 seconds"),
    ("policy.max_reloads_per_hour", _not_negative, "must be >= 0"),
)


def semantic_problems(config: Config) -> list[str]:
    """Problems with well-typed values: ranges, absolute paths, keys that exclude each other."""
    problems = []
    for key, ok, what in _RULES:
        value = _lookup(config, key)
        if not ok(value):
            shown = oct(value) if key == "agent.socket_mode" else repr(value)
            problems.append(f"{key}: {what}, got {shown}")
    if config.server.unit is not None and config.server.pidfile is not None:
        problems.append("server: set only one of server.unit and server.pidfile")
    return problems + _reload_problems(config)


RELOAD_METHODS = ("none", "signal", "systemd", "http", "command")


def _reload_problems(config: Config) -> list[str]:
    r = config.reload
    if r.method not in RELOAD_METHODS:
        return [f"reload.method: one of {', '.join(RELOAD_METHODS)}, got {r.method!r}"]
    needs = {"systemd": (r.unit or config.server.unit, "reload.unit (or server.unit)"),
             "http": (r.url, "reload.url"), "command": (r.command, "reload.command")}
    if r.method in needs and not needs[r.method][0]:
        return [f"reload.method {r.method} needs {needs[r.method][1]}"]
    return []


def _lookup(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
