"""What the offline tools (`replay`, `report`) see of a run: typed views of the step's state,
computed here, so that no one outside the core reads the host model (core/host.py) or a
server's correlation state.

`Follower` follows one host through a run, after each step: every server it had (under a key
that stays over its renames) and every process of each (a correlation state: a new one at each
reload or restart), with the counts each process had at its end. `outcome` is the host at the
end of a replay.
"""
from __future__ import annotations

from typing import Any, Optional

from torch_watchdog import events
from torch_watchdog.sidecar.config.schema import Config
from torch_watchdog.sidecar.core import correlate, policy
from torch_watchdog.sidecar.core.host import DEFAULT_SERVER, Host, Server, owner_of
from torch_watchdog.sidecar.core.results import (FindingView, HostOutcome, ProcessTotals,
                                                 ServerMoment, ServerReading)
from torch_watchdog.sidecar.core.step import estimates


class Follower:
    """Follows `host` (stepped by its owner) through a run. It keeps every server and every
    process state it gave a key to, so that a process's counts outlive its reload."""

    def __init__(self, host: Host):
        self._host = host
        self._servers: dict[int, Server] = {}             # key -> server
        self._processes: dict[int, correlate.State] = {}  # key -> a process's state

    def _key(self, server: Server) -> int:
        key = id(server)  # kept below: no other object gets its id during the run
        self._servers.setdefault(key, server)
        return key

    def _process(self, state: correlate.State) -> int:
        key = id(state)
        self._processes.setdefault(key, state)
        return key

    def servers(self) -> list[ServerMoment]:
        """Every server of the host now, in the host's order."""
        return [self._moment(s) for s in self._host.servers.values()]

    def _moment(self, s: Server) -> ServerMoment:
        return ServerMoment(self._key(s), s.name, self._process(s.state), frozenset(s.pids),
                            frozenset(s.state.memory.gpus or s.gpus))

    def readings(self, cfg: Config) -> list[ServerReading]:
        """Every server of the host after a sample, in the host's order."""
        alive = self._host.alive
        out = []
        for s in self._host.servers.values():
            state, fc = s.state, s.forecast
            warming = policy.warming_up(state, cfg.policy)
            lead = policy.reload_lead(state, cfg.policy) \
                if not warming or policy.warmup_start(state) is not None else None
            out.append(ServerReading(
                self._key(s), self._process(state), state.memory.source, state.memory.bytes,
                bool(s.pids), any(alive.get(pid) is not False for pid in s.pids), fc.seconds,
                fc.budget_bytes, fc.level_bytes, fc.as_dict(), warming, lead))
        return out

    def owner(self, e: events.Event) -> Optional[int]:
        """The key of the server event `e` went to (the step's own routing); None: none."""
        server = self._host.servers.get(owner_of(self._host, e))
        return None if server is None else self._key(server)

    def key_of(self, name: str) -> Optional[int]:
        """The key of the server called `name` now; None: no such server."""
        server = self._host.servers.get(name)
        return None if server is None else self._key(server)

    def name(self, key: int) -> str:
        """The server's name now (a server may be renamed)."""
        return self._servers[key].name

    def estimates(self, key: int, cfg: Config) -> dict[str, Any]:
        """The server's numbers and its forecast now (step.estimates)."""
        return estimates(self._servers[key], cfg)

    def placeholder(self) -> ServerMoment:
        """An empty server, not the host's: the subject of a run with none."""
        return self._moment(Server(DEFAULT_SERVER))

    def totals(self, process: int, cfg: Config) -> ProcessTotals:
        """A process's counts as they stood at its end (or now)."""
        st = self._processes[process]
        c, calls = st.compiles, st.calls
        return ProcessTotals(
            records=st.records, compiles=c.compiles, recompiles=c.recompiles,
            limit_hits=c.limit_hits, limit=c.limit, distinct_shapes=st.shapes.distinct,
            requests=calls.requests, stalls=calls.stalls, stall_seconds=calls.stall_seconds,
            ooms=st.ooms, memory_bytes=st.memory.bytes,
            findings=tuple(FindingView(f.t, f.cause, f.detail) for f in st.findings),
            estimates=st.estimates(cfg.correlate))


def outcome(host: Host, cfg: Config) -> HostOutcome:
    """The host at the end of a replay."""
    focus = host.focus()
    return HostOutcome(
        server=focus.name,
        estimates=estimates(focus, cfg) if host.now is not None
        else dict(focus.state.estimates(cfg.correlate)),
        servers={name: estimates(s, cfg) for name, s in sorted(host.servers.items())},
        findings=sorted(({**f.as_dict(), "server": s.name} for s in host.servers.values()
                         for f in s.state.findings), key=lambda f: f["t"]),
        last_t=host.now if host.now is not None else focus.state.now)
