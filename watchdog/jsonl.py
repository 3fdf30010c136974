"""An append-only JSON-lines file that never raises: the agent's event log, the sidecar's
sample log. Stdlib only (both sides use it)."""
from __future__ import annotations

import gzip
import os
import time
from typing import IO


def open_lines(path: str) -> IO[str]:
    """A `.jsonl` or `.jsonl.gz` file opened for reading text lines (bad bytes replaced)."""
    opener = gzip.open if path.endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8", errors="replace")


class JsonLines:
    """Append-only JSON lines, rotated once to `<path>.1` past `max_bytes`. A write that fails
    (read-only path, full disk) returns False and the file is retried after `reconnect_s`."""

    def __init__(self, path: str, reconnect_s: float, max_bytes: int):
        self.path = path
        self._reconnect_s = reconnect_s
        self._max_bytes = max_bytes
        self._file = None
        self._size = 0
        self._retry_at = 0.0

    def write(self, data: bytes) -> bool:
        now = time.monotonic()
        try:
            if self._file is None:
                if now < self._retry_at:
                    return False
                self._file = open(self.path, "ab", buffering=0)
                self._size = self._file.tell()
            if self._size + len(data) + 1 > self._max_bytes > 0:
                self._rotate()
            self._file.write(data + b"\n")
            self._size += len(data) + 1
            return True
        except OSError:
            self.close()
            self._retry_at = now + self._reconnect_s
            return False

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path + ".1")
        self._file = open(self.path, "ab", buffering=0)
        self._size = 0

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
