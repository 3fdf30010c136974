"""Atomic, durable file replacement, shared by the agent (warm bundles) and the sidecar
(`reloads.json`): a crash or power loss leaves the old file or the new one, never a torn one."""
from __future__ import annotations

import os
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
