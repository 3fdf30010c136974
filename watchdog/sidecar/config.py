"""Sidecar configuration: YAML → frozen dataclasses. Unknown keys and bad values are errors,
all listed at once (`ConfigError.problems`); every key has a default, documented with its unit
in config/watchdog.yaml."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
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
    """One more server on this host (a replica): its name, and how its processes are found."""
    name: Optional[str] = None            # default: the unit's name
    unit: Optional[str] = None            # systemd unit whose MainPID (and children) it is
    pidfile: Optional[str] = None


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
    window_s: float = 60.0                # recent window for rates and the linear trend
    headroom_bytes: int = 128 * MiB       # budget = device total - headroom (the H200 OOM
                                          # run, h200-oom300: the crash came with 3 MB free)
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


GPU_ATTRIBUTIONS = ("auto", "process", "device")


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


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def from_mapping(data: Any, recorded: bool = False) -> Config:
    """Build a Config from parsed YAML; raises ConfigError listing every problem.
    `recorded`: the config a live sidecar ran with (its sample log): only its types are
    checked, as a replay must decide as that sidecar did, even where today's rules differ."""
    if recorded:
        problems: list[str] = []
        config: Config = _build(Config, data, "", problems)
        if problems:
            raise ConfigError(problems)
        return config
    config, problems = _validate(data)
    if problems:
        raise ConfigError(problems)
    return config


def _validate(data: Any) -> tuple[Config, list[str]]:
    """The Config (a bad value replaced by its default) and every problem with `data`."""
    problems: list[str] = []
    config = _build(Config, data, "", problems)
    return config, problems + semantic_problems(config)


MAX_FILE_BYTES = 1 * MiB  # the shipped file, every key documented, is 7 KB
# Expanded YAML nodes: the shipped file has ~100. An alias (*name) is not copied by PyYAML but
# whatever walks the result (type checks, error messages) expands it: 9 levels of 10 aliases,
# 2 KB of text, are 10^9 nodes (the "billion laughs"). Counted before construction, in time
# linear in the text.
MAX_NODES = 10_000


def check(path: str, host: bool = True) -> tuple[Optional[Config], list[str]]:
    """(config, []) for a good file, (None, problems) for a bad one; never raises for a bad file
    (missing, unreadable, empty, too large, not YAML, not a mapping, bad values) — for
    check-config, the sidecar's start and SIGHUP (a bad file keeps the old config). With
    `host`, also whether this machine lets the sidecar write where the config says
    (`host_problems`); a command that only reads the config's values passes host=False.
    Every problem is listed at once; none repeats `path` (the caller names the file once)."""
    try:
        config, problems = _validate(_mapping(path))
    except ConfigError as e:
        return None, list(e.problems)
    if host:
        reported = {p.split(":", 1)[0] for p in problems}  # a bad value's default: not checked
        problems += [p for p in host_problems(config) if p.split(":", 1)[0] not in reported]
    return (None, problems) if problems else (config, [])


def load(path: str) -> Config:
    """Parse and validate the file at `path` (its values only); ConfigError lists every
    problem."""
    return from_mapping(_mapping(path))


def _mapping(path: str) -> dict[Any, Any]:
    """The file's top-level YAML mapping; ConfigError for anything else."""
    data = _parse_yaml(_read(path))
    if data is None:
        raise ConfigError(["empty config (no keys, only blank space or comments): write `{}` "
                           "to run with every default"])
    if not isinstance(data, dict):
        kinds: dict[type, str] = {list: "list", str: "line of text"}
        kind = kinds.get(type(data), type(data).__name__)
        raise ConfigError([f"not a watchdog config: a YAML {kind}, not a mapping of "
                           "keys (key: value)"])
    return data


def _read(path: str) -> str:
    try:
        if os.path.isdir(path):
            raise ConfigError(["is a directory, not a config file"])
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(["no such file"]) from None
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror or e}"]) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([f"larger than {MAX_FILE_BYTES // MiB} MiB: not a watchdog config "
                           "(the documented one is 7 KB)"])
    if data[:2] == b"\x1f\x8b":
        raise ConfigError(["gzip-compressed, not a YAML config"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text (byte {e.start}): not a YAML config"]) from None


def _parse_yaml(text: str) -> Any:
    """yaml.safe_load, refusing a document that expands to more than MAX_NODES nodes."""
    import yaml  # the sidecar's dependency; replay with defaults needs no YAML

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node)
        if nodes > MAX_NODES:
            raise ConfigError([f"refused: its aliases (*name) expand to more than {MAX_NODES:,} "
                               "values (a YAML alias bomb?); a watchdog config has ~100"])
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = "; ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError([f"not valid YAML{where}: {what}"]) from None
    except yaml.YAMLError as e:  # a reader error: a control character, for instance
        raise ConfigError([f"not valid YAML: {e}"]) from None
    except RecursionError:
        raise ConfigError(["not a watchdog config: nested too deeply"]) from None
    finally:
        loader.dispose()


def _expanded_nodes(root: Any) -> int:
    """How many nodes the YAML tree under `root` has once every alias is expanded (capped
    just past MAX_NODES); a recursive alias counts as too many."""
    import yaml

    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:  # &a [*a]: infinite once expanded
            return MAX_NODES + 1
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [x for pair in node.value for x in pair]
        else:
            children = []
        for child in children:
            total = min(total + size(child), MAX_NODES + 1)
        active.discard(key)
        memo[key] = total
        return total

    return size(root)


# --- where the sidecar writes: checked on the host at check-config, start and SIGHUP ---------

PSEUDO_FS = ("/proc", "/sys")  # kernel interfaces: nothing of ours may be written there


def host_problems(config: Config) -> list[str]:
    """Whether this host, as this user, lets the sidecar keep its state in `state_dir` and
    write `sample_log` (I/O: stat and access, nothing is created)."""
    problems = []
    what = _dir_problem(config.state_dir)
    if what:
        problems.append(f"state_dir: {what}")
    if config.sample_log is not None:
        what = _file_problem(config.sample_log)
        if what:
            problems.append(f"sample_log: {what}")
    return problems


def _pseudo(path: str) -> Optional[str]:
    real = os.path.realpath(path)
    for top in PSEUDO_FS:
        if real == top or real.startswith(top + "/"):
            return f"{path} is under {top}, a kernel interface, not a place for files"
    return None


def _who() -> str:
    return f"this user (uid {os.geteuid()})"


def _dir_problem(path: str) -> Optional[str]:
    """None when `path` is a writable directory, or can be created as one."""
    pseudo = _pseudo(path)
    if pseudo:
        return pseudo
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{path} is a directory not writable by {_who()}"
        return None
    if os.path.lexists(path):
        return f"{path} exists and is not a directory"
    parent = path
    while not os.path.lexists(parent):  # the nearest existing ancestor would hold it
        parent = os.path.dirname(parent.rstrip("/")) or "/"
    if not os.path.isdir(parent):
        return f"{path} cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} does not exist and cannot be created: {parent} is not writable by {_who()}"
    return None


def _file_problem(path: str) -> Optional[str]:
    """None when the file at `path` can be appended to, or created (its directory exists:
    the sidecar creates the log, not its directory)."""
    pseudo = _pseudo(path)
    if pseudo:
        return pseudo
    if os.path.isdir(path):
        return f"{path} is a directory, not a file"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{path} is not writable by {_who()}"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"its directory {directory} does not exist (the sidecar does not create it)"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"its directory {directory} is not writable by {_who()}"
    return None


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
        near = difflib.get_close_matches(str(key), sorted(names), n=1)
        hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
        problems.append(f"{prefix}{key}: unknown key{hint}")
    values = {}
    for name in names & set(data):
        hint, raw = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            # is_dataclass narrows to an instance or a class; a field's type is a class
            values[name] = _build(typing.cast(type, hint), raw, f"{prefix}{name}.", problems)
            continue
        item = (typing.get_args(hint) or (None,))[0]
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(item):
            if not isinstance(raw, list):
                problems.append(f"{prefix}{name}: expected a list, got {type(raw).__name__}")
                continue
            values[name] = [_build(typing.cast(type, item), x, f"{prefix}{name}[{i}].", problems)
                            for i, x in enumerate(raw)]
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
        return (raw, None) if isinstance(raw, str) and raw else \
            (None, f"expected text, got {raw!r}")
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


_COERCE = {"agent.socket_mode": _octal_mode, "reload.control_mode": _octal_mode}


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
    ("reload.timeout_s", _positive, "must be > 0 seconds"),   # 0: every reload times out
    ("gpu.attribution", lambda v: v in GPU_ATTRIBUTIONS, "one of " + ", ".join(GPU_ATTRIBUTIONS)),
    ("reload.hello_timeout_s", _not_negative, "must be >= 0 seconds (0: no check)"),
    ("reload.control_path", lambda v: v is None or os.path.isabs(v), "must be an absolute path"),
    ("reload.control_mode", lambda v: 0 <= v <= 0o777, "must be a file mode 0..0o777"),
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
    out += [(e.name or e.unit, e.unit, e.pidfile) for e in config.servers]
    return out


def _servers_problems(config: Config) -> list[str]:
    problems, names = [], []
    for i, e in enumerate(config.servers):
        where = f"servers[{i}]"
        if (e.unit is None) == (e.pidfile is None):
            problems.append(f"{where}: set exactly one of unit and pidfile")
        if e.name is None and e.unit is None:
            problems.append(f"{where}: a server found by its pidfile needs a name")
        if e.pidfile is not None and not os.path.isabs(e.pidfile):
            problems.append(f"{where}.pidfile: must be an absolute path, got {e.pidfile!r}")
    names = [name for name, _, _ in server_sources(config) if name]
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
