"""Agent settings: install() arguments override TORCH_WATCHDOG_* environment variables.

A bad environment value never stops the server: it is reported (logger `torch_watchdog.agent`,
and the `hello` event's config) and the default is used. A bad explicit argument is a
programming error and raises ValueError from install().
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from torch_watchdog.agent.identity import check_name
from torch_watchdog.agent.settings import MAX_SHAPES, STALL_S
from torch_watchdog.events import DEFAULT_SOCKET

BUDGET_MODES = ("auto", "capture_sizes", "eager")


@dataclass(frozen=True)
class AgentConfig:
    enabled: bool = True
    socket_path: Optional[str] = DEFAULT_SOCKET   # "" or None: no socket
    # the server (group of processes reloaded together) this process belongs to, in every
    # hello; None: the systemd service, else "pgid:<process group>" (identity.py)
    server: Optional[str] = None
    event_log: Optional[str] = None               # JSON-lines post-mortem record; "{pid}" in
                                                  # it is replaced by each process's pid
    event_log_max_bytes: int = 64 * 1024 * 1024   # then rotated once to <event_log>.1
    queue_size: int = 10_000                      # events held while the sender catches up
    tick_s: float = 0.1                           # sender thread wake-up period
    heartbeat_s: float = 2.0
    hello_every_s: float = 30.0                   # re-sent this often; at once to a sidecar
                                                  # that restarted (emitter.py)
    reconnect_s: float = 1.0                      # retry period for a dead socket / log
    stall_threshold_s: float = STALL_S            # a call at least this slow is a stall
    max_shapes: int = MAX_SHAPES                  # distinct shapes remembered per watched callable
    graph_budget: int = 0                         # 0: off; else stop new cudagraph sizes after N
    graph_budget_mode: str = "auto"               # auto | capture_sizes (torch>=2.9) | eager
    recompile_guard_after: int = 0                # 0: off; else eager_on_recompile after N
    oom_observer: bool = True
    debug: bool = False                           # agent errors to stderr
    # cooperative drain (drain.py): the sidecar's control socket; None: <socket_path>.ctl
    control: bool = True
    control_path: Optional[str] = None
    control_uid: int = 0                          # the sidecar's uid, trusted besides root and
                                                  # this process's own
    drain_exit_code: int = 75                     # EX_TEMPFAIL: RestartForceExitStatus=75
    restart_file: Optional[str] = "/run/torch-watchdog/restart-requested"
    # warm restart (warm.py): torch.compiler cache artifacts, one bundle per (name, torch, GPU).
    # Opt-in: the bundle and the job id it sets (PGO state kept from an earlier run) change how
    # the server compiles; with it off the agent leaves compiles exactly as they were
    warm: bool = False
    warm_dir: Optional[str] = "/var/cache/torch-watchdog"
    warm_name: Optional[str] = None               # None: the server's name, else argv[0]
    warm_save_quiet_s: float = 10.0               # saved once calls ran this long compile-free


_ENV = {
    "enabled": "TORCH_WATCHDOG_ENABLED",
    "socket_path": "TORCH_WATCHDOG_SOCKET",
    "server": "TORCH_WATCHDOG_SERVER",
    "event_log": "TORCH_WATCHDOG_EVENT_LOG",
    "event_log_max_bytes": "TORCH_WATCHDOG_EVENT_LOG_MAX_BYTES",
    "queue_size": "TORCH_WATCHDOG_QUEUE_SIZE",
    "heartbeat_s": "TORCH_WATCHDOG_HEARTBEAT_S",
    "stall_threshold_s": "TORCH_WATCHDOG_STALL_S",
    "max_shapes": "TORCH_WATCHDOG_MAX_SHAPES",
    "graph_budget": "TORCH_WATCHDOG_GRAPH_BUDGET",
    "graph_budget_mode": "TORCH_WATCHDOG_GRAPH_BUDGET_MODE",
    "recompile_guard_after": "TORCH_WATCHDOG_RECOMPILE_GUARD_AFTER",
    "oom_observer": "TORCH_WATCHDOG_OOM_OBSERVER",
    "debug": "TORCH_WATCHDOG_DEBUG",
    "control": "TORCH_WATCHDOG_CONTROL",
    "control_path": "TORCH_WATCHDOG_CONTROL_PATH",
    "control_uid": "TORCH_WATCHDOG_CONTROL_UID",
    "drain_exit_code": "TORCH_WATCHDOG_DRAIN_EXIT_CODE",
    "restart_file": "TORCH_WATCHDOG_RESTART_FILE",
    "warm": "TORCH_WATCHDOG_WARM",
    "warm_dir": "TORCH_WATCHDOG_WARM_DIR",
    "warm_name": "TORCH_WATCHDOG_WARM_NAME",
    "warm_save_quiet_s": "TORCH_WATCHDOG_WARM_SAVE_QUIET_S",
}
ENV_VARS = tuple(_ENV.values())
_TYPES = {f.name: f.type for f in dataclasses.fields(AgentConfig)}


def parse_value(name: str, raw: Any) -> Any:
    """Convert and check one setting; raises ValueError with the reason."""
    kind = _TYPES[name]
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if kind == "Optional[str]":
        given = None if raw is None or raw == "" else str(raw)
        named = name in ("server", "warm_name")
        return check_name(given) if named and given is not None else given
    if kind == "str":
        if raw not in BUDGET_MODES:
            raise ValueError(f"{name}: expected one of {BUDGET_MODES}, got {raw!r}")
        return raw
    try:
        value = int(raw) if kind == "int" else float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {raw!r}") from None
    if isinstance(raw, bool) or value < 0 or value != value:
        raise ValueError(f"{name}: expected a number >= 0, got {raw!r}")
    if name in ("queue_size", "max_shapes", "tick_s", "heartbeat_s") and value == 0:
        raise ValueError(f"{name}: must be > 0")
    if name == "drain_exit_code" and value > 255:
        raise ValueError(f"{name}: an exit status is 0..255, got {raw!r}")
    return value


def resolve(args: Mapping[str, Any], environ: Mapping[str, str] = os.environ
            ) -> tuple[AgentConfig, list[str]]:
    """Config from explicit args over environment over defaults, plus the env problems found."""
    unknown = set(args) - set(_TYPES)
    if unknown:
        raise ValueError(f"unknown agent setting(s): {sorted(unknown)}")
    values, problems = {}, []
    for name, var in _ENV.items():
        if var in environ:
            try:
                values[name] = parse_value(name, environ[var])
            except ValueError as e:
                problems.append(f"{var}: {e} (using the default)")
    for name, raw in args.items():
        values[name] = parse_value(name, raw)  # explicit arguments fail loudly
    return AgentConfig(**values), problems
