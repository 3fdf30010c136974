"""Where the sidecar writes, checked on the host at check-config, start and SIGHUP: its state
directory and its sample log (stat and access, nothing is created)."""
from __future__ import annotations

import os
from typing import Optional

from torch_watchdog.sidecar.config.schema import Config


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
