"""Requests an operator makes by hand (`torch-watchdog unfreeze SERVER`): a file per request in
`<state_dir>/requests/`, which only the sidecar's user (root under systemd) may write to; the
loop takes them at each poll (one listdir) and removes them. No socket and no port: who may
ask is who may write to the sidecar's state directory."""
from __future__ import annotations

import json
import os
import stat
import time
from typing import Optional

from torch_watchdog.sidecar.core.observations import OPERATOR_REQUESTS, OperatorRequest

MAX_REQUESTS = 64          # taken per poll at most (a flood of files cannot stall the loop)
MAX_BYTES = 4096


def requests_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "requests")


def write_request(state_dir: str, server: str, request: str) -> str:
    """The CLI's end: the request's file (written whole, then renamed into place). Raises
    OSError (no such directory, no permission) with the path in its message."""
    if request not in OPERATOR_REQUESTS:
        raise ValueError(f"request must be one of {OPERATOR_REQUESTS}")
    where = requests_dir(state_dir)
    os.makedirs(where, mode=0o700, exist_ok=True)
    name = f"{request}-{time.time_ns()}-{os.getpid()}.json"
    tmp = os.path.join(where, "." + name)
    with open(tmp, "w") as fh:
        json.dump({"server": server, "request": request, "t": time.time()}, fh)
    os.replace(tmp, os.path.join(where, name))
    return os.path.join(where, name)


def take_requests(state_dir: str, now: float) -> tuple[list[OperatorRequest], list[str]]:
    """The sidecar's end: the requests waiting (each file removed once read), and what was
    wrong with the others (removed too: a bad file is said once, not every poll)."""
    where = requests_dir(state_dir)
    try:
        names = sorted(n for n in os.listdir(where) if not n.startswith("."))[:MAX_REQUESTS]
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [f"{where}: {e.strerror or e}"]
    got, bad = [], []
    for name in names:
        path = os.path.join(where, name)
        problem = None
        request = _read(path)
        if isinstance(request, str):
            problem = request
        else:
            got.append(OperatorRequest(now, *request))
        try:
            os.unlink(path)
        except OSError as e:
            problem = problem or f"cannot remove it: {e.strerror or e}"
        if problem:
            bad.append(f"{path}: {problem}")
    return got, bad


def _read(path: str) -> "tuple[str, str] | str":
    """(server, request), or what is wrong with the file."""
    try:   # no link followed, no FIFO waited on, a regular file only, bounded
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return e.strerror or str(e)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        return f"over {MAX_BYTES} bytes"
    try:
        d = json.loads(raw)
    except ValueError:
        return "not JSON"
    server: Optional[object] = d.get("server") if isinstance(d, dict) else None
    request = d.get("request") if isinstance(d, dict) else None
    if not isinstance(server, str) or not server or request not in OPERATOR_REQUESTS:
        return f"not a request (a server's name and one of {', '.join(OPERATOR_REQUESTS)})"
    return server, str(request)
