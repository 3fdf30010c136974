"""Which server this process belongs to: the name put in every `hello` (`server`).

A server is a group of processes reloaded together: 8 replicas are 8 servers; a tensor-parallel
server on 8 GPUs, or a gunicorn master and its forked workers, is one. The sidecar groups
processes by it. In order:
1. `install(server=...)` / `TORCH_WATCHDOG_SERVER` (checked by `check_name`);
2. the systemd service the process runs in, from /proc/self/cgroup (`foo.service`): what
   `systemctl restart` reloads, shared by every process of the unit;
3. `pgid:<process group>`: a master and the workers it forks share it (neither gunicorn nor
   multiprocessing moves workers to a new group).
A forked child keeps its master's name (it is resolved once, at install). Stdlib only.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

MAX_NAME_CHARS = 255  # systemd's own bound for a unit name (UNIT_NAME_MAX - 1)
CGROUP_FILE = "/proc/self/cgroup"


def check_name(name: str) -> str:
    """An explicit server name, or ValueError with the reason: 1 to 255 printable characters
    (a label in metrics and alerts, and a field of a 64 KiB datagram)."""
    if not isinstance(name, str):
        raise ValueError(f"server: expected a string, got {type(name).__name__}")
    if not name.strip():
        raise ValueError(f"server: expected a name, got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"server: at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if not name.isprintable() or name != name.strip():
        raise ValueError(f"server: expected printable characters without surrounding blanks, "
                         f"got {name!r:.80}")
    return name


def unit_from_path(path: str) -> Optional[str]:
    """The systemd service owning a cgroup path, or None.

    The innermost unit decides: `/system.slice/foo.service/worker` (a delegated sub-group) is
    foo.service; `/user.slice/user-1000.slice/user@1000.service/app.slice/x.service` is x.service
    (a user unit, not the user manager around it); a `.scope` (a login session, a container, a
    terminal tab) is no service even inside user@1000.service; slices and other folders
    (kubepods, docker/<id>) name no unit."""
    for part in reversed([p for p in path.strip().split("/") if p]):
        if part.endswith(".service") and len(part) > len(".service"):
            return part
        if part.endswith(".scope"):
            return None
    return None


def unit_from_cgroup(text: str) -> Optional[str]:
    """The systemd service named in /proc/<pid>/cgroup's content, or None.

    Lines are `id:controllers:path`. cgroup v1 and hybrid hosts have systemd's own tree on the
    `name=systemd` line (on hybrid hosts the `0::` line may be unused, every process at `/`);
    cgroup v2 has only `0::`."""
    v1 = v2 = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if "name=systemd" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and controllers == "":
            v2 = path
    path = v1 if v1 is not None else v2
    return None if path is None else unit_from_path(path)


def _read_cgroup() -> str:
    with open(CGROUP_FILE, encoding="utf-8", errors="replace") as fh:
        return fh.read(64 * 1024)


def server_name(explicit: Optional[str] = None, *,
                read_cgroup: Callable[[], str] = _read_cgroup,
                getpgid: Callable[[int], int] = os.getpgid) -> str:
    """The explicit name, else the systemd service, else `pgid:<process group>`. Never raises
    for the automatic part (no /proc, an odd cgroup file: the process group)."""
    if explicit:
        return explicit
    try:
        unit = unit_from_cgroup(read_cgroup())
        if unit is not None:
            return check_name(unit)
    except (OSError, ValueError):
        pass
    try:
        return f"pgid:{getpgid(0)}"
    except OSError:
        return f"pid:{os.getpid()}"
