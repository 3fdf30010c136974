"""One sidecar per state_dir: an flock on `<state_dir>/sidecar.lock`, taken before the sidecar
changes any file (a `--dev` run's sample log renamed, the sample log opened, the socket's stale
file replaced), so a second one started beside it exits having changed nothing."""
from __future__ import annotations

import errno
import fcntl
import os

LOCK_NAME = "sidecar.lock"


def lock_path(state_dir: str) -> str:
    return os.path.join(state_dir, LOCK_NAME)


def take_lock(state_dir: str) -> int:
    """The lock's descriptor (held until closed, or the process exits; not inherited by the
    sidecar's children); OSError with whose it is when another sidecar holds it. The file's
    one write, the holder's pid, is made once the lock is held."""
    os.makedirs(state_dir, mode=0o750, exist_ok=True)
    path = lock_path(state_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise OSError(errno.EBUSY, f"another sidecar (pid {holder or 'unknown'}) is running "
                                   f"with this state_dir; stop it first, or give this one "
                                   f"a state_dir of its own", path) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        os.close(fd)
        raise
    return fd
