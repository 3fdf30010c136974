"""`<state_dir>/reloads.json`: every reload decision and how it ended, across sidecar restarts.

Each decision is written *before* it is carried out, and marked when its execution starts
(`ReloadLog.executing`), so a sidecar that restarts mid-reload does not reload again (the
cooldown and the hourly maximum count it), while a decision it never got to carry out does not
hold the next reload back for a whole cooldown. The record is the guard rail's memory, so a
record that cannot be trusted fails closed: a file that cannot be read or has the wrong shape
is reported (`ReloadLog.unreadable`) and the hourly maximum counts as reached for an hour from
the sidecar's start.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

from torch_watchdog import durable
from torch_watchdog.sidecar.core.observations import ReloadOutcome

CANCELLED = "cancelled: the forecast cleared"


NOT_CARRIED_OUT = "not carried out: the sidecar stopped before acting"


OUTCOME_UNKNOWN = "outcome unknown: the sidecar stopped while acting"


FUTURE_SLACK_S = 60.0       # a decision time further ahead of the clock than this is clamped


MAX_FILE_BYTES = 1 << 20    # 100 entries are ~20 KiB; a bigger file is not ours


TEMP_PREFIX = ".reloads."     # a write in progress: <state_dir>/.reloads.XXXXXXXX


BLOCK_ENTRIES = 100         # stand-ins when the caller does not say its max_reloads_per_hour


class ReloadLog:
    """`reloads.json` in the state directory: every reload decision and how it ended.

    Read at start (`now`: the sidecar's clock then). What is found there:
    - missing: a new record;
    - unreadable or of the wrong shape (not JSON, not {"reloads": [...]}, an entry whose `t`
      is not a finite number, `server` not a string or null, `ok` not true/false/null, a
      directory, no permission): `unreadable` and `error` say why, and `decisions()` adds
      `max_per_hour` decisions at `now` for every server, so no reload happens for an hour
      from the start (or until the file is removed and the sidecar restarted). The bad file
      is kept, renamed `<path>.unreadable`, when a later decision is written;
    - a decision time more than 60 s ahead of `now`: clamped to `now` (a clock set back, or
      a hand edit, would otherwise block reloads for good), reported in `repairs`;
    - a decision with no outcome (ok null): the sidecar stopped before the outcome. Not
      marked `executing`: it stopped between deciding and acting; the decision is marked
      `NOT_CARRIED_OUT` and counts for neither the cooldown nor the hourly maximum (it did
      nothing, and the server grows on). Marked `executing`: the server may have been
      signalled or restarted; marked `OUTCOME_UNKNOWN`, it still counts. Both are reported
      in `repairs`.
    Repairs are written back at once.
    """

    def __init__(self, path: str, now: Optional[float] = None,
                 max_per_hour: Optional[int] = None):
        self.path = path
        self.started = time.time() if now is None else now
        self.error: Optional[str] = None         # the last read or write failure
        self.unreadable: Optional[str] = None    # why the record found at start is not used
        self.repairs: list[str] = []             # what was changed in it at start
        self._blocks = BLOCK_ENTRIES if max_per_hour is None else max(max_per_hour, 0)
        self.entries: list[dict[str, Any]] = []
        self._remove_torn_writes()
        try:
            self.entries = self._read()
        except _Unreadable as e:
            self.unreadable = self.error = (
                f"{self.path}: {e}; reloads are suspended for an hour (until "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started + 3600))}"
                f") — remove the file and restart the sidecar to lift this")
            return
        self._repair()

    # -- reading ------------------------------------------------------------------------------
    def _remove_torn_writes(self) -> None:
        """A sidecar killed between the temporary file's creation and its rename leaves it
        behind (the record itself is whole): one per kill, so remove them at start."""
        directory = os.path.dirname(self.path) or "."
        try:
            names = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
        except OSError:
            return
        for name in names:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass

    def _read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _Unreadable(f"cannot read it ({e.strerror or e})") from e
        if len(raw) > MAX_FILE_BYTES:
            raise _Unreadable(f"over {MAX_FILE_BYTES} bytes")
        if not raw.strip():
            raise _Unreadable("empty (a reload record is never written empty)")
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError is one
            raise _Unreadable(f"not JSON ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("reloads"), list):
            raise _Unreadable('not {"reloads": [...]}')
        entries: list[dict[str, Any]] = data["reloads"]
        for i, entry in enumerate(entries):
            why = _entry_problem(entry)
            if why:
                raise _Unreadable(f"reloads[{i}]: {why}")
        return entries

    def _repair(self) -> None:
        changed = False
        for e in self.entries:
            if e["t"] > self.started + FUTURE_SLACK_S:
                self.repairs.append(f"decision time {e['t']:.0f} is {e['t'] - self.started:.0f}"
                                    f" s in the future: clamped to now")
                e["t"] = self.started
                changed = True
            if e["ok"] is None and e["t"] <= self.started:
                if e.get("executing") is not None:
                    self.repairs.append(f"decision at {e['t']:.0f} (server {e.get('server')}): "
                                        f"the sidecar stopped while carrying it out: counted")
                    e.update(ok=False, detail=OUTCOME_UNKNOWN, seconds=0.0)
                else:
                    self.repairs.append(f"decision at {e['t']:.0f} (server {e.get('server')}) "
                                        f"was never carried out: not counted")
                    e.update(ok=False, detail=NOT_CARRIED_OUT, seconds=0.0)
                changed = True
        if changed:
            self._save()

    # -- what counts --------------------------------------------------------------------------
    def decisions(self) -> list[tuple[float, Optional[str]]]:
        """(when, which server) reloads were decided, for the cooldown and the hourly maximum
        (per server; entries older than servers count for every server); a decision cancelled
        at the re-check, never carried out, or refused for now (retry_after_s), did nothing
        and counts for neither. An
        unreadable record counts as the hourly maximum reached at start, for every server."""
        out = [(e["t"], e.get("server") if isinstance(e.get("server"), str) else None)
               for e in self.entries if e.get("detail") not in (CANCELLED, NOT_CARRIED_OUT)
               and e.get("retry_after_s") is None]  # refused for now: not a reload
        if self.unreadable is not None:
            out += [(self.started, None)] * self._blocks
        return out

    def times(self) -> list[float]:
        return [t for t, _ in self.decisions()]

    # -- writing ------------------------------------------------------------------------------
    def record(self, t: float, outcome: Optional[ReloadOutcome], reason: str,
               server: Optional[str] = None) -> None:
        entry = {"t": t, "reason": reason, "server": server,
                 **(_outcome_entry(outcome) if outcome else {"ok": None})}
        same = [i for i, e in enumerate(self.entries) if e["t"] == t and e.get("server") == server]
        if same:
            self.entries[same[-1]] = entry  # the outcome of the decision recorded before
        else:
            self.entries.append(entry)
        self.entries = self.entries[-100:]
        self._save()

    def executing(self, t: float, server: Optional[str] = None,
                  now: Optional[float] = None) -> None:
        """The decision taken at `t` is being carried out now: if the sidecar stops before
        its outcome, the next start still counts it (the server may be restarting)."""
        for e in reversed(self.entries):
            if e["t"] == t and e.get("server") == server and e["ok"] is None:
                e["executing"] = time.time() if now is None else now
                self._save()
                return

    def _save(self) -> None:
        try:
            if self.unreadable is not None and os.path.isfile(self.path):
                os.replace(self.path, self.path + ".unreadable")  # kept for the post-mortem
            self._write()
            self.error = None
        except OSError as e:  # kept in memory; the daemon logs it and goes on
            self.error = f"{self.path}: {e.strerror or e}"

    def _write(self) -> None:
        """Atomic and durable: a crash or power loss leaves the old file or the new one,
        never a truncated one (the rename is made durable by the directory's fsync)."""
        durable.write_atomic(self.path, json.dumps({"reloads": self.entries}, indent=1,
                                                   allow_nan=False).encode(),
                             prefix=TEMP_PREFIX)


class _Unreadable(Exception):
    pass


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _entry_problem(e: object) -> Optional[str]:
    """Why one entry of reloads.json is not one this module wrote, or None."""
    if not isinstance(e, dict):
        return f"not an object: {e!r:.40}"
    if not _finite(e.get("t")):
        return f"t must be a finite number, got {e.get('t')!r:.40}"
    if not isinstance(e.get("server"), (str, type(None))):
        return f"server must be a string or null, got {e.get('server')!r:.40}"
    if "ok" not in e or not isinstance(e["ok"], (bool, type(None))):
        return f"ok must be true, false or null, got {e.get('ok', '(missing)')!r:.40}"
    if not isinstance(e.get("detail"), (str, type(None))):
        return f"detail must be a string, got {e.get('detail')!r:.40}"
    return None


def _outcome_entry(o: ReloadOutcome) -> dict[str, Any]:
    """An outcome's fields in the record (its decision's time and server are the entry's)."""
    return {"ok": o.ok, "detail": o.detail, "seconds": o.seconds,
            "retry_after_s": o.retry_after_s, "failed": o.failed}
