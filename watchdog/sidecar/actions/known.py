"""`<state_dir>/servers.json`: which server each process belongs to, across sidecar restarts.

Written when the servers' processes change (at most once a second), read at the next start:
a pid is believed again only while it is the same process (its start time, as written), so a
restarted sidecar places the processes of running servers at once, before their agents' next
hello, and a pid reused since is no one's. A file that is missing, unreadable or of the wrong
shape places nothing (the agents' hellos do, as on a first start) and is said in the log.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Optional

from torch_watchdog.durable import write_atomic
from torch_watchdog.sidecar.actions.identity import START_SLACK_S
from torch_watchdog.sidecar.core.observations import KnownServer, ServersKnown
from torch_watchdog.sidecar.offline.sample_log import known_from_dict

VERSION = 1
WRITE_EVERY_S = 1.0
MAX_BYTES = 4 << 20   # a file larger than any host's servers is not read
TEMP_PREFIX = ".servers."


class KnownServers:
    def __init__(self, path: str, start_time: Callable[[int], Optional[float]],
                 clock: Callable[[], float] = time.monotonic):
        self.path, self.start_time, self.clock = path, start_time, clock
        self.error: Optional[str] = None   # the last read or write failure
        self._written: Optional[tuple[KnownServer, ...]] = None
        self._written_at = -1e18

    def read(self, t: float) -> Optional[ServersKnown]:
        """The servers the last sidecar knew, each pid kept only while it is still the process
        it was; None where the file is missing or unusable (`error` says why)."""
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            self.error = f"{self.path}: {e.strerror or e}"
            return None
        try:
            if len(raw) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES} bytes")
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(f"not a version {VERSION} servers file")
            starts = {int(pid): float(start) for pid, start in data["starts"].items()}
            known = known_from_dict({"t": t, "servers": data["servers"]})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.error = f"{self.path}: {e}"
            return None
        servers = []
        for s in known.servers:
            pids = tuple(p for p in s.pids if self._same(p, starts.get(p)))
            if pids:
                servers.append(KnownServer(s.name, pids, s.uid, s.parents, s.gpus, s.argv))
        self._written = tuple(servers)  # as good as written: the file says as much
        return ServersKnown(t, tuple(servers))

    def _same(self, pid: int, start: Optional[float]) -> bool:
        now = self.start_time(pid)
        return start is not None and now is not None and abs(now - start) <= START_SLACK_S

    def save(self, servers: tuple[KnownServer, ...],
             starts: Callable[[int], Optional[float]]) -> bool:
        """Write the servers where they changed since the last write (at most every
        WRITE_EVERY_S); False where a write failed (`error`), retried at the next change."""
        now = self.clock()
        if servers == self._written or now - self._written_at < WRITE_EVERY_S:
            return True
        known = {pid: start for s in servers for pid in s.pids
                 if (start := starts(pid)) is not None}
        data = {"version": VERSION, "starts": {str(p): t for p, t in sorted(known.items())},
                "servers": [{"name": s.name, "pids": [p for p in s.pids if p in known],
                             "uid": s.uid, "parents": list(s.parents), "gpus": list(s.gpus),
                             "argv": s.argv} for s in servers]}
        self._written_at = now
        try:
            write_atomic(self.path, json.dumps(data, separators=(",", ":")).encode(),
                         prefix=TEMP_PREFIX)
        except OSError as e:
            self.error = f"{self.path}: {e.strerror or e}"
            return False
        self._written, self.error = servers, None
        return True
