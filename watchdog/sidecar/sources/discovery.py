"""Which processes the sidecar watches: configured servers' pids, and each pid's start time.

A configured server's pids are its systemd unit's cgroup (else its MainPID), or its pidfile's
pid, with their children; systemctl and /proc walks are not free, so they are looked up every
UNIT_LOOKUP_S (every NEW_AGENT_LOOKUP_S while agents they do not hold say hello). A pid's
start time is read once, when it is first seen: a reload signals a pid only while it is still
that process (no pid reuse).
"""
from __future__ import annotations

import time
from typing import Optional

from torch_watchdog.procfs import process_start_time
from torch_watchdog.sidecar import config as config_mod
from torch_watchdog.sidecar.sources.process import children_of, read_pidfile, unit_main_pid, \
    unit_pids

UNIT_LOOKUP_S = 5.0
# ... and at most this often when an agent the lookup does not place said hello: the new
# process a restart brings is found at once, not taken for another server for up to 5 s
NEW_AGENT_LOOKUP_S = 1.0


class Discovery:
    def __init__(self, cfg: config_mod.Config):
        self.cfg = cfg
        # (unit, pidfile) -> (when looked up, pids)
        self._looked_up: dict[tuple[Optional[str], Optional[str]],
                              tuple[float, tuple[int, ...]]] = {}
        self.started: dict[int, Optional[float]] = {}  # pid -> its start time when first seen

    def configured_pids(self, unplaced: bool = False) -> dict[str, tuple[int, ...]]:
        """Each configured server's pids (servers without a live process left out);
        `unplaced`: an agent outside them said hello (looked up again sooner)."""
        out: dict[str, tuple[int, ...]] = {}
        every_s = NEW_AGENT_LOOKUP_S if unplaced else UNIT_LOOKUP_S
        for name, unit, pidfile in config_mod.server_sources(self.cfg):
            key = (unit, pidfile)
            checked, pids = self._looked_up.get(key, (-1e18, ()))
            if time.monotonic() - checked >= every_s:
                pids = _lookup(unit, pidfile)
                self._looked_up[key] = (time.monotonic(), pids)
            if pids and name is not None:  # a valid config names every server
                out[name] = pids
        return out

    def note_start_times(self, pids: set[int]) -> None:
        """Each pid's start time, read when it is first seen, forgotten when the pid is."""
        for pid in pids - self.started.keys():
            self.started[pid] = process_start_time(pid)
        if len(self.started) > 2 * len(pids) + 64:
            self.started = {p: v for p, v in self.started.items() if p in pids}

    def expected_start(self, pids: tuple[int, ...]) -> dict[int, float]:
        """The start times seen of `pids`: a pid started since is another process."""
        return {p: t for p in pids if (t := self.started.get(p)) is not None}

    def unit_of(self, server: Optional[str]) -> Optional[str]:
        return self.configured_unit(server) or self.cfg.server.unit

    def configured_unit(self, server: Optional[str]) -> Optional[str]:
        """The unit of a server configured by its unit; None for any other server."""
        return next((unit for name, unit, _ in config_mod.server_sources(self.cfg)
                     if name == server and unit), None)


def _lookup(unit: Optional[str], pidfile: Optional[str]) -> tuple[int, ...]:
    group = unit_pids(unit) if unit else None
    if group is not None:
        return group
    main = unit_main_pid(unit) if unit else read_pidfile(pidfile) if pidfile else None
    return tuple(sorted({main, *children_of(main)})) if main else ()
