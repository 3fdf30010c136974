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
from typing import Any, Optional

from torch_watchdog import events
from torch_watchdog.sidecar.core import correlate, policy
from torch_watchdog.sidecar.core.forecast import Forecast
from torch_watchdog.sidecar.core.lifecycle import IDLE, RETAIN_S, Life, Phase, ReloadState

DEFAULT_SERVER = "default"   # agents that name no server (older ones), recorded traces
AGENT_SILENT_S = 30.0        # a dead pid not heard from for this long is forgotten
# what is held of events from pids no hello or config placed yet: a second of a busy agent's
# events each (1,000 events/s), and more agents than a host runs
HELD_EVENTS = 1000
HELD_PIDS = 256


@dataclass
class Server:
    name: str
    state: correlate.State = field(default_factory=correlate.State)
    policy: policy.PolicyState = field(default_factory=policy.PolicyState)
    # pid -> last heard (observation time): the processes it may be reloaded through
    pids: dict[int, float] = field(default_factory=dict)
    gpus: set[str] = field(default_factory=set)    # UUIDs: agents' devices, NVML's lists
    forecast: Forecast = field(default_factory=lambda: Forecast(None, None))
    reload: ReloadState = IDLE                     # its reload's phase (core/lifecycle.py)
    life: Life = Life.ANNOUNCED                    # announced, up, down (core/lifecycle.py)
    down_since: Optional[float] = None             # down since (a sample's time)
    # alert cause -> detail, as of the last poll
    firing: dict[str, dict[str, Any]] = field(default_factory=dict)
    parents: set[int] = field(default_factory=set)  # its processes' parents (a supervisor)
    uid: Optional[int] = None   # its processes' uid (the kernel's, from the first hello)
    findings_shown: int = 0     # its state's findings already in a poll's result
    argv: Optional[str] = None  # its latest hello's command line (its label's program)
    label: Optional[str] = None  # its metrics' and alerts' `server` (core/labels.py)

    @property
    def busy(self) -> bool:
        return self.reload.busy


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
    # pid -> the server its hello named, believed or not (`trust_agent_pids`): its events
    # are that server's
    named: dict[int, str] = field(default_factory=dict)
    # pid -> its events heard before any hello or the config placed it: held, not folded into
    # a server, until one does (a sidecar restarted beside running servers hears their
    # events before their next hello); at most HELD_PIDS pids, HELD_EVENTS events each
    unplaced: dict[int, list[events.Event]] = field(default_factory=dict)
    unplaced_dropped: int = 0                      # held events dropped past those bounds
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
        live = [s for s in self.servers.values() if s.pids and s.life is not Life.DOWN] or \
            list(self.servers.values())
        return min(live, key=nearest_to_oom)

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


def nearest_to_oom(s: Server) -> tuple[float, int, float, bool, str]:
    """The order of "nearest to OOM": the sooner forecast, then more active causes, then the
    larger share of its budget (a server at 44 % with no forecast was shown over one with two
    active causes, by name)."""
    fc = s.forecast
    share = fc.level_bytes / fc.budget_bytes if fc.level_bytes and fc.budget_bytes else 0.0
    return (fc.seconds, -len(s.firing), -share, s.name != DEFAULT_SERVER, s.name)


def adopt(host: Host, e: events.Hello, name: str) -> None:
    """A hello naming a server not seen before may be one already known under another name:
    a server restarted by the same supervisor (its parent, not init) whose processes are all
    gone: a process-group or job name (`pgid:N`, `dist:<addr>:<port>`) changes with each
    start, and a new name must not reset the reload history (the cooldown and the hourly
    maximum are the server's). Only a name of the same kind and GPU set (`pgid:N/cuda:2` for
    `pgid:M/cuda:2`): a replica that starts where another one died is not that one."""
    if name in host.servers or not isinstance(e.ppid, int) or e.ppid <= 1:
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
    for places in (host.owner, host.named):
        for pid, owner in places.items():
            if owner == server.name:
                places[pid] = name
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


def hold(host: Host, e: events.Event) -> None:
    """An event from a pid no hello or config placed: held for that pid (bounded), not folded
    into any server."""
    held = host.unplaced.get(e.pid)
    if held is None:
        if len(host.unplaced) >= HELD_PIDS:
            host.unplaced_dropped += 1
            return
        held = host.unplaced[e.pid] = []
    elif len(held) >= HELD_EVENTS:
        del held[0]  # the oldest go first: the newest say most about the process now
        host.unplaced_dropped += 1
    held.append(e)


def release(host: Host, pid: int) -> list[events.Event]:
    """The events held for `pid`, now placed, oldest first."""
    return host.unplaced.pop(pid, [])


def alive(host: Host, server: Server) -> Optional[bool]:
    """Whether a process of the server is alive (a pid not yet read counts as alive); None
    where it has had none since it was announced."""
    members = [*server.pids, *(p for p, n in host.named.items() if n == server.name)]
    if not members:
        return None if server.life is Life.ANNOUNCED else False
    return any(host.alive.get(pid) is not False for pid in members)


def forget_silent(host: Host, now: float) -> None:
    """Dead pids not heard from for AGENT_SILENT_S leave the host."""
    for pid, heard in list(host.agents.items()):
        if now - heard > AGENT_SILENT_S and host.alive.get(pid) is False:
            del host.agents[pid]
            host.unplaced.pop(pid, None)
            host.named.pop(pid, None)
            if pid not in host.owner:
                host.alive.pop(pid, None)
    for server in host.servers.values():
        for pid, heard in list(server.pids.items()):
            if now - heard > AGENT_SILENT_S and host.alive.get(pid) is False:
                del server.pids[pid]
                host.owner.pop(pid, None)
                host.alive.pop(pid, None)


def forget_stopped(host: Host, now: float) -> list[str]:
    """Servers down for RETAIN_S with no reload of theirs under way or failed leave the host
    (their reload decisions stay in `host.history`); the names forgotten."""
    gone = [name for name, s in host.servers.items()
            if s.life is Life.DOWN and s.down_since is not None
            and now - s.down_since >= RETAIN_S and s.reload.phase is Phase.IDLE]
    for name in gone:
        server = host.servers.pop(name)
        for pid in server.pids:
            host.owner.pop(pid, None)
        for pid in [p for p, n in host.named.items() if n == name]:
            del host.named[pid]
    return gone
