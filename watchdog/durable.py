"""Atomic, durable file replacement, shared by the agent (warm bundles) and the sidecar
(`reloads.json`): a crash or power loss leaves the old file or the new one, never a torn one;
and the check of a file read from a directory others may write."""
from __future__ import annotations

import os
import stat
import tempfile


def write_atomic(path: str, data: bytes, prefix: str = ".tmp.", dir_mode: int = 0o777) -> None:
    """Write `data` to a temporary file beside `path` (named `prefix...`), fsync it, rename it
    over `path`, then fsync the directory so the rename itself survives. Raises OSError; the
    temporary file never stays behind."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=dir_mode, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Untrusted(ValueError):
    """A file that is there but not to be believed (its type or owner)."""


def open_trusted(path: str) -> tuple[int, os.stat_result]:
    """Open for reading a plain file of this uid or root, in a directory others may write:
    never through a link, never blocking on a FIFO, its type and owner checked on the open
    descriptor. Raises OSError (it cannot be opened; ELOOP: a link) or Untrusted (why)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted("not a plain file")
        if st.st_uid not in (0, os.geteuid()):
            raise Untrusted(f"owned by uid {st.st_uid}, not root or this uid {os.geteuid()}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st
