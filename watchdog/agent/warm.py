"""Warm restart: torch.compiler's cache artifacts ("Mega-Cache") kept across restarts.

One bundle per (name, torch version, GPU kind) in `warm_dir`:
`<name>--torch<version>--<gpu>.bundle`, a JSON header line (the key, the payload's size and
sha256) then the bytes of `torch.compiler.save_cache_artifacts()` (Inductor, AOTAutograd,
PGO and autotuning artifacts, recorded on cache hits as well as misses). Written atomically
(temporary file, fsync, rename, fsync of the directory): a crash leaves the old bundle or
the new one.

- `load()` at install, before the first compile: `load_cache_artifacts()` fills the local
  caches, so the compiles that follow are cache hits. A bundle for another torch or GPU, a
  corrupt one, one not owned by root or this uid (the payload is unpickled), or one torch
  refuses is skipped with one log line and a `warm` event: never a crash.
- `save()` once the server warmed up (compiles happened, then `warm_save_quiet_s` of calls
  without one: a crash later still finds a bundle) and before a planned exit (drain).
- `TORCH_COMPILE_JOB_ID` (torch.compiler.config.job_id) is set from the name when the user
  did not set it: automatic-dynamic PGO needs it in open-source torch to carry the dynamic
  dimensions it learnt across the restart.
Feature-detected: a torch without save/load_cache_artifacts gets none of this.
The GPU kind is read without initialising CUDA (a forking server's master must not): the
current device's name when CUDA is up, else /proc/driver/nvidia, else "cpu".
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Optional

from torch_watchdog import durable, events

log = logging.getLogger("torch_watchdog.agent")
FORMAT = "torch-watchdog-warm/1"
MAX_BUNDLE_BYTES = 4 << 30
MAX_HEADER_BYTES = 64 * 1024
SUFFIX = ".bundle"


def slug(text: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_.")[:limit] or "x"


def gpu_kind(torch: Any) -> str:
    try:
        if torch.cuda.is_initialized():
            name: str = torch.cuda.get_device_name(torch.cuda.current_device())
            return name
    except Exception:
        pass
    models = set()
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as fh:
                for line in fh:
                    if line.startswith("Model:"):
                        models.add(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return "+".join(sorted(models)) or "cpu"


def bundle_name(name: str, torch_version: str, gpu: str) -> str:
    return f"{slug(name)}--torch{slug(torch_version, 40)}--{slug(gpu, 60)}{SUFFIX}"


class Warm:
    """The bundle of one process; `emit` sends `warm` events."""

    def __init__(self, torch: Any, directory: str, name: str, emit: Callable[[events.Event], None],
                 quiet_s: float = 10.0):
        self.torch = torch
        self.dir = directory
        self.name = name
        self.emit = emit
        self.quiet_s = quiet_s
        self.version = str(torch.__version__)
        self.gpu = gpu_kind(torch)
        self.path = os.path.join(directory, bundle_name(name, self.version, self.gpu))
        self._lock = threading.Lock()
        self.compiles = 0          # compile-side events seen (hooks), and at the last save
        self._saved_at_compiles = 0
        self._last_compile = 0.0
        self._saving = False

    @staticmethod
    def supported(torch: Any) -> bool:
        c = getattr(torch, "compiler", None)
        return hasattr(c, "save_cache_artifacts") and hasattr(c, "load_cache_artifacts")

    def set_job_id(self) -> None:
        """TORCH_COMPILE_JOB_ID from the name, unless the user chose one (env or config)."""
        if os.environ.get("TORCH_COMPILE_JOB_ID") or os.environ.get("TORCH_COMPILE_STICKY_PGO_KEY"):
            return
        job = slug(self.name, 120)
        os.environ["TORCH_COMPILE_JOB_ID"] = job  # for processes it starts
        config = getattr(self.torch.compiler, "config", None)
        if config is not None and getattr(config, "job_id", "") is None:
            config.job_id = job  # read from the environment when torch was imported: too late

    # -- load --------------------------------------------------------------------------------
    def load(self) -> Optional[str]:
        """Load the matching bundle; returns a line saying what happened (also logged)."""
        started = time.monotonic()
        if not os.path.exists(self.path):
            others = [os.path.basename(p) for p in
                      glob.glob(os.path.join(glob.escape(self.dir),
                                             slug(self.name) + "--*" + SUFFIX))]
            why = (f"no bundle for torch {self.version} on {self.gpu}"
                   + (f" (skipped, made for another torch or GPU: {', '.join(sorted(others))})"
                      if others else ""))
            return self._note("missing", why, None, started)
        try:
            payload = self._read()
        except _Skip as e:
            return self._note("skipped", str(e), None, started, warn=True)
        try:
            info = self.torch.compiler.load_cache_artifacts(payload)
        except Exception as e:
            return self._note("skipped", f"torch refused it: {type(e).__name__}: {e}",
                              len(payload), started, warn=True)
        if info is None:
            return self._note("skipped", "torch could not read it (see its warning)",
                              len(payload), started, warn=True)
        return self._note("loaded", _describe(info), len(payload), started)

    def _read(self) -> bytes:
        """The payload of the bundle at `path`, once its file and header check out: a plain
        file (never through a link, never a FIFO or a device) of this uid or root, its header
        this process's, its size the header's; only then is the payload read."""
        try:
            fd, st = durable.open_trusted(self.path)
        except OSError as e:
            raise _Skip(f"cannot open it: {e.strerror or e} (a link is not followed)") from None
        except durable.Untrusted as e:
            raise _Skip(f"{e}: not loaded (it is unpickled)") from None
        with os.fdopen(fd, "rb") as fh:
            try:
                if st.st_size > MAX_BUNDLE_BYTES:
                    raise _Skip(f"{st.st_size} bytes, over {MAX_BUNDLE_BYTES}")
                line = fh.readline(MAX_HEADER_BYTES)
                header = self._header(line)
                size = st.st_size - len(line)
                if header.get("bytes") != size:
                    raise _Skip(f"corrupt: {size} bytes after a header that says "
                                f"{header.get('bytes')}")
                payload = fh.read(size + 1)
            except OSError as e:
                raise _Skip(f"cannot read it: {e.strerror or e}") from None
        if len(payload) != size or header.get("sha256") != hashlib.sha256(payload).hexdigest():
            raise _Skip(f"corrupt: {len(payload)} bytes whose checksum does not match the header"
                        f" ({header.get('bytes')} bytes)")
        return payload

    def _header(self, line: bytes) -> dict[str, Any]:
        try:
            header = json.loads(line)
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise ValueError("not a torch-watchdog bundle")
        except ValueError as e:
            raise _Skip(f"corrupt header ({e})") from None
        for key, mine in (("name", self.name), ("torch", self.version), ("gpu", self.gpu)):
            if header.get(key) != mine:
                raise _Skip(f"made for {key} {header.get(key)!r}, this is {mine!r}")
        return header

    # -- save --------------------------------------------------------------------------------
    def note_compile(self) -> None:
        """A compile, recompile or CUDA-graph recording happened (hooks' events)."""
        self.compiles += 1
        self._last_compile = time.monotonic()

    def due(self) -> bool:
        """Warmed up and not saved since: compiles happened, then `quiet_s` without one."""
        return (self.compiles > self._saved_at_compiles and not self._saving
                and time.monotonic() - self._last_compile >= self.quiet_s)

    def save_in_background(self, on_error: Callable[[BaseException], None]) -> None:
        """From the sender thread: serialising takes a while, the events must keep going."""
        self._saving = True

        def run() -> None:
            try:
                self.save("warm")
            except Exception as e:
                on_error(e)
            finally:
                self._saving = False

        threading.Thread(target=run, name="torch-watchdog-warm", daemon=True).start()

    def save(self, why: str) -> Optional[str]:
        """Write the bundle now; returns a problem, or None."""
        with self._lock:
            compiles, started = self.compiles, time.monotonic()
            try:
                got = self.torch.compiler.save_cache_artifacts()
            except Exception as e:  # a compile on another thread changed its lists: later
                self._note("skipped", f"save ({why}): {type(e).__name__}: {e}", None, started,
                           warn=True)
                return f"warm bundle not saved: {type(e).__name__}"
            self._saved_at_compiles = compiles
            if got is None:
                return None  # nothing compiled in this process: the bundle on disk stands
            payload, info = got
            header = {"format": FORMAT, "name": self.name, "torch": self.version,
                      "gpu": self.gpu, "bytes": len(payload),
                      "sha256": hashlib.sha256(payload).hexdigest(), "t": time.time(),
                      "pid": os.getpid(), "why": why, "python": sys.version.split()[0]}
            try:
                _write_atomic(self.path, json.dumps(header).encode() + b"\n", payload)
            except OSError as e:
                self._note("skipped", f"save ({why}): {e.strerror or e}", len(payload),
                           started, warn=True)
                return f"warm bundle not saved: {e.strerror or e}"
            self._note("saved", f"{why}: {_describe(info)}", len(payload), started)
            return None

    def _note(self, action: str, detail: str, size: Optional[int], started: float,
              warn: bool = False) -> str:
        line = f"torch-watchdog warm bundle {self.path}: {action}: {detail}"
        (log.warning if warn else log.info)(line)
        if action == "missing" and "skipped" not in detail:
            return line  # the usual first start: no event
        self.emit(events.Warm(t=time.time(), pid=os.getpid(), action=action, path=self.path,
                              bytes=size, seconds=time.monotonic() - started,
                              detail=events.clip(detail, 500)))
        return line


class _Skip(Exception):
    pass


def _describe(info: Any) -> str:
    """CacheInfo: artifact counts per kind (inductor, aot_autograd, pgo, ...)."""
    try:
        counts = {k: len(v) for k, v in dict(info.artifacts).items() if v}
        return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no artifacts"
    except Exception:
        return "artifacts"


def _write_atomic(path: str, header: bytes, payload: bytes) -> None:
    durable.write_atomic(path, header + payload, prefix=".warm.", dir_mode=0o700)
