"""The host model and who belongs to which server (pure): a host has GPUs and servers; a
server is a group of processes reloaded together, with its own correlation state, forecast and
policy state.

A server is configured (the sample says which pids a `server.unit` or `server.pidfile` owns) or
announced by its agents (`hello.server`; older agents: one server, "default"). Which server a
process belongs to is decided here, on the kernel's word where it matters (the uid and ppid
the receiver reads): a reload signals or drains every process of a server, and anyone may send
a hello naming one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from torch_watchdog import events
from torch_watchdog.sidecar.core import correlate, policy
from torch_watchdog.sidecar.core.forecast import Forecast
from torch_watchdog.sidecar.core.results import Reload

DEFAULT_SERVER = "default"   # agents that name no server (older ones), recorded traces
AGENT_SILENT_S = 30.0        # a dead pid not heard from for this long is forgotten


@dataclass(frozen=True)
class ReloadUnderWay:
    """The `reload` alert while a reload is carried out."""
    method: str
    seconds_to_oom: Optional[float]
    cause: str

    def detail(self) -> dict[str, Any]:
        return {"outcome": "in progress", "method": self.method,
                "seconds_to_oom": self.seconds_to_oom, "cause": self.cause}


@dataclass(frozen=True)
class ReloadEnded:
    """The `reload` alert once a reload's outcome is known (shown for one poll), and the
    `reload_failed` alert's detail."""
    outcome: str
    seconds: float
    cause: Optional[str]   # None: an outcome for a reload this sidecar did not carry out

    def detail(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reload_seconds": round(self.seconds, 3),
                "done": True, "cause": self.cause}


@dataclass(frozen=True)
class ReloadFailure:
    """The last reload did not bring the server back: alerted until a new process of it says
    hello (one not among `old_pids`)."""
    ended: ReloadEnded
    old_pids: frozenset[int]


@dataclass
class Server:
    name: str
    state: correlate.State = field(default_factory=correlate.State)
    policy: policy.PolicyState = field(default_factory=policy.PolicyState)
    # pid -> last heard (observation time)
    pids: dict[int, float] = field(default_factory=dict)
    gpus: set[str] = field(default_factory=set)    # UUIDs: agents' devices, NVML's lists
    forecast: Forecast = field(default_factory=lambda: Forecast(None, None))
    pending: Optional[Reload] = None        # decided: carried out next poll if it holds
    reloading: Optional[Reload] = None      # carried out: waiting for its outcome
    reload_alert: Union[ReloadUnderWay, ReloadEnded, None] = None  # the `reload` alert
    # alert cause -> detail, as of the last poll
    firing: dict[str, dict[str, Any]] = field(default_factory=dict)
    parents: set[int] = field(default_factory=set)  # its processes' parents (a supervisor)
    uid: Optional[int] = None   # its processes' uid (the kernel's, from the first hello)
    reload_failed: Optional[ReloadFailure] = None
    findings_shown: int = 0     # its state's findings already in a poll's result
    # the reload under way's new process said hello: the state is its own since then
    renewed: bool = False
    argv: Optional[str] = None  # its latest hello's command line (its label's program)
    label: Optional[str] = None  # its metrics' and alerts' `server` (core/labels.py)

    @property
    def busy(self) -> bool:
        return self.pending is not None or self.reloading is not None


@dataclass
class Host:
    servers: dict[str, Server] = field(default_factory=dict)  # name -> Server
    owner: dict[int, str] = field(default_factory=dict)       # pid -> server name
    alive: dict[int, bool] = field(default_factory=dict)      # pid -> alive, from the last sample
    now: Optional[float] = None                    # the last sample's time: the sidecar's clock
    configured: dict[int, str] = field(default_factory=dict)  # pid -> server name, from the config
    # (t, server or None): past reload decisions
    history: list[tuple[float, Optional[str]]] = field(default_factory=list)
    skewed_events: int = 0                         # event times outside the allowed clock skew
    # pid -> last heard: every agent's process, believed or not (its liveness only)
    agents: dict[int, float] = field(default_factory=dict)
    record_unreadable: Optional[str] = None        # why the reload record is not trusted
    # focus() while there is no server
    _placeholder: Optional[Server] = field(default=None, repr=False, compare=False)

    def server(self, name: str) -> Server:
        s = self.servers.get(name)
        if s is None:
            s = self.servers[name] = Server(name)
            s.policy.reloads = sorted(t for t, who in self.history if who in (None, name))
        return s

    def focus(self) -> Server:
        """The server nearest to OOM (the one a single-server view shows), among those with a
        process if any has one (a server that is gone is not the page's subject); before any
        server is known, an empty one that is not kept (a server exists only with a
        process)."""
        if not self.servers:
            return self.placeholder()
        live = [s for s in self.servers.values() if s.pids] or list(self.servers.values())
        return min(live, key=lambda s: (s.forecast.seconds, s.name != DEFAULT_SERVER, s.name))

    def placeholder(self) -> Server:
        """An empty server, not kept among the servers: the views' subject while there is no
        server (one, kept: not a new Server each idle poll)."""
        if self._placeholder is None:
            self._placeholder = Server(DEFAULT_SERVER)
        return self._placeholder

    def pids(self) -> set[int]:
        return set(self.owner)

    def agents_alive(self) -> bool:
        """An agent is up while one of the processes that sent events is alive (a pid not yet
        read in a sample counts as alive): after a reload or a crash it drops at the next poll,
        not 30 s later."""
        return any(self.alive.get(pid) is not False for pid in self.agents)


def owner_of(host: Host, e: events.Event) -> str:
    """A configured server owns its pids; else the server the agent named in its hello (never
    a configured one: its processes are found by the config alone); else its master's (a
    forked worker); else the default. A process joins a server only if it could signal that
    server's processes anyway (`may_join`): else its hello's name, for its uid alone."""
    if e.pid in host.configured:
        return host.configured[e.pid]
    if isinstance(e, events.Hello):
        if isinstance(e.server, str) and e.server and e.server not in host.configured.values():
            name = e.server
        elif e.ppid in host.owner:
            name = host.owner[e.ppid]
        else:
            name = host.owner.get(e.pid, DEFAULT_SERVER)
        return name if may_join(host, host.servers.get(name), e) else f"{name}@uid:{e.uid}"
    return host.owner.get(e.pid, DEFAULT_SERVER)


def may_join(host: Host, server: Optional[Server], e: events.Hello) -> bool:
    """Whether the sender of hello `e` may be one of `server`'s processes, on the kernel's word
    (the receiver's uid and ppid): the same uid as the server's, root, or a child of one of
    its processes (a root master's workers under another user). Why: a reload (signal, or a
    drain over the control channel) goes to every process of a server, and a hello naming a
    server is anyone's to send; a process of another user naming it, then growing, had that
    user's server drained. A process that could signal the server itself gains nothing; a
    server whose processes are all gone takes its next start's (another user's, too)."""
    if server is None or server.uid is None or e.uid is None or e.uid in (0, server.uid):
        return True
    return e.ppid in server.pids or not server.pids or all_gone(host, server)


def adopt(host: Host, e: events.Hello, name: str) -> None:
    """A hello naming a server not seen before may be one already known under another name:
    - a pid heard before its hello went to the default server: that state is its start;
    - a server restarted by the same supervisor (its parent, not init) whose processes are all
      gone: a process-group or job name (`pgid:N`, `dist:<addr>:<port>`) changes with each
      start, and a new name must not reset the reload history (the cooldown and the hourly
      maximum are the server's). Only a name of the same kind and GPU set (`pgid:N/cuda:2` for
      `pgid:M/cuda:2`): a replica that starts where another one died is not that one."""
    if name in host.servers:
        return
    old = host.servers.get(DEFAULT_SERVER)
    if old is not None and name != DEFAULT_SERVER and set(old.pids) == {e.pid}:
        rename(host, old, name)
        return
    if not isinstance(e.ppid, int) or e.ppid <= 1:
        return
    kind = events.per_start(name)
    if kind is None:
        return
    for other in list(host.servers.values()):
        if e.ppid in other.parents and (not other.pids or all_gone(host, other)) \
                and events.per_start(other.name) == kind:
            rename(host, other, name)
            return


def rename(host: Host, server: Server, name: str) -> None:
    del host.servers[server.name]
    for pid, owner in host.owner.items():
        if owner == server.name:
            host.owner[pid] = name
    server.name = name
    host.servers[name] = server


def all_gone(host: Host, server: Server) -> bool:
    """Every pid the server had is dead in the last sample (and there was one)."""
    return bool(server.pids) and all(host.alive.get(pid) is False for pid in server.pids)


def claim(host: Host, server: Server, pid: int, t: float) -> None:
    """`pid` is one of `server`'s processes from now on (heard at `t`): a pid it may be
    reloaded through, and one server's only."""
    before = host.owner.get(pid)
    if before not in (None, server.name) and before in host.servers:
        # heard before its hello (the default server), or named anew: left in the other,
        # that server's own policy could reload it (a phantom server)
        host.servers[before].pids.pop(pid, None)
    server.pids[pid] = t
    host.owner[pid] = server.name


def place_configured(host: Host, configured: dict[str, tuple[int, ...]], t: float) -> None:
    """The configured servers' pids, as a sample found them (name -> pids): theirs alone."""
    host.configured = {pid: name for name, pids in configured.items() for pid in pids} \
        if configured else {}
    for pid, name in host.configured.items():
        if host.owner.get(pid) not in (None, name):  # announced before the config found it
            host.servers[host.owner[pid]].pids.pop(pid, None)
        host.owner[pid] = name
        host.server(name).pids.setdefault(pid, t)


def forget_silent(host: Host, now: float) -> None:
    """Dead pids not heard from for AGENT_SILENT_S leave the host."""
    for pid, heard in list(host.agents.items()):
        if now - heard > AGENT_SILENT_S and host.alive.get(pid) is False:
            del host.agents[pid]
            if pid not in host.owner:
                host.alive.pop(pid, None)
    for server in host.servers.values():
        for pid, heard in list(server.pids.items()):
            if now - heard > AGENT_SILENT_S and host.alive.get(pid) is False:
                del server.pids[pid]
                host.owner.pop(pid, None)
                host.alive.pop(pid, None)
