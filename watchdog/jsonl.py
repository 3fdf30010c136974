"""An append-only JSON-lines file that never raises: the agent's event log, the sidecar's
sample log. And the reading side, for the offline commands (`events`, `replay`, `report`):
a file that cannot be read as JSON lines (missing, a directory, empty, binary, a truncated or
corrupt gzip) is one `InputError` naming the file and what is wrong. Stdlib only (both sides
use it)."""
from __future__ import annotations

import gzip
import os
import stat
import time
import zlib
from typing import IO, Iterator, Optional

GZIP_MAGIC = b"\x1f\x8b"
SNIFF_BYTES = 64 * 1024  # the head looked at to tell text from binary
# a head with more undecodable bytes than this share is binary, not a log with a few bad bytes
# (random bytes: about half are not UTF-8; a real log: none)
BINARY_SHARE = 0.01


class InputError(OSError):
    """A file that cannot be read as JSON lines. `str()` is one line for the user:
    "<path>: <what is wrong>". An OSError, so callers that catch read errors catch it."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def problem(path: str) -> Optional[str]:
    """What makes `path` unusable as a JSON-lines input, found from its head (None: read it).
    A gzip file is recognised by its first bytes, whatever its name."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as e:  # ENOTDIR (a parent is a file), EACCES, ELOOP, ENAMETOOLONG
        return f"cannot read: {e.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size == 0:
        return "empty file"
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
        gz = head[:2] == GZIP_MAGIC
        if gz:
            with gzip.open(path, "rb") as fh:
                head = fh.read(SNIFF_BYTES)
    except OSError as e:
        return _gzip_problem(e, 0) if gz else f"cannot read: {e.strerror or e}"
    except (EOFError, zlib.error) as e:
        return _gzip_problem(e, 0)
    if not head:
        return "empty file (gzip-compressed nothing)"
    text = head.decode("utf-8", errors="replace")
    if "\0" in text or text.count("\ufffd") > BINARY_SHARE * len(text):
        named = " (and not gzip-compressed, although named .gz)" if (
            path.endswith(".gz") and not gz) else ""
        return f"binary data, not JSON lines{named}"
    return None


def _gzip_problem(e: BaseException, lines: int) -> str:
    after = f" after line {lines:,}," if lines else ""
    if isinstance(e, EOFError):
        return (f"truncated gzip file: it ends{after} before gzip's end-of-stream marker "
                "(`gzip -dc` recovers the lines before the cut)")
    return f"corrupt gzip data{after} ({e})"


def open_lines(path: str) -> IO[str]:
    """A `.jsonl` or `.jsonl.gz` file opened for reading text lines (bad bytes replaced);
    gzip is recognised by its first bytes."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == GZIP_MAGIC
    opener = gzip.open if gz else open
    return opener(path, "rt", encoding="utf-8", errors="replace")


def read_lines(path: str) -> Iterator[str]:
    """The lines of a `.jsonl` or `.jsonl.gz` file; any reason it cannot be read, found before
    the first line (`problem`) or part-way (a truncated gzip), raises one InputError."""
    what = problem(path)
    if what is not None:
        raise InputError(path, what)
    n = 0
    try:
        with open_lines(path) as fh:
            for line in fh:
                n += 1
                yield line
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise InputError(path, _gzip_problem(e, n)) from None
    except OSError as e:
        raise InputError(path, f"cannot read after line {n:,}: {e.strerror or e}") from None


class JsonLines:
    """Append-only JSON lines, rotated once to `<path>.1` past `max_bytes`. A write that fails
    (read-only path, full disk) returns False and the file is retried after `reconnect_s`."""

    def __init__(self, path: str, reconnect_s: float, max_bytes: int):
        self.path = path
        self._reconnect_s = reconnect_s
        self._max_bytes = max_bytes
        self._file: Optional[IO[bytes]] = None
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
        assert self._file is not None  # rotated only while open
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
