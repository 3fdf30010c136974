"""What the status page remembers of the run (pure, bounded): the memory series, event marks,
the last actions, and the frozen `StatusView` the loop publishes each tick.

A long run must fit: the series keeps at most `MAX_POINTS` points spread over the whole run
(when full, neighbours are merged pairwise, keeping the higher — peaks are what an OOM is
about — and from then on one point per 2, 4, 8 … polls is kept). At the default 0.1 s poll a
10-hour run (360,000 polls) ends at ~1,400 points. Marks are thinned the same way, per kind, so
thousands of recordings cannot push out the one reload.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from torch_watchdog.sidecar.core.lifecycle import RETAIN_S
from torch_watchdog.sidecar.core.results import Action, Reload
from torch_watchdog.sidecar.present.snapshot import Snapshot

MAX_POINTS = 2000
MAX_MARKS_PER_KIND = 1000
MAX_ACTIONS = 20
# observation kind -> mark kind (cudagraph_record only for phase "record": warm-ups cost nothing)
EVENT_MARKS = {"compile": "compile", "recompile": "recompile",
               "recompile_limit": "recompile_limit", "oom": "oom", "cudagraph_record": "record"}


class Thinned:
    """At most `cap` items covering everything ever added, at a uniform density: when full,
    each pair of neighbours becomes `pick(a, b)` and the stride (items added per item kept)
    doubles. `view()` ends with the newest item added, so "now" is always shown."""

    def __init__(self, cap: int, pick: Callable[[Any, Any], Any]):
        self.cap, self.pick = max(2, cap), pick
        self.items: list[Any] = []
        self.stride = 1
        self.added = 0
        self._bucket: Any = None    # the pick of the items added since the last kept one
        self._in_bucket = 0
        self._newest: Any = None

    def add(self, item: Any) -> None:
        self.added += 1
        self._newest = item
        self._bucket = item if self._in_bucket == 0 else self.pick(self._bucket, item)
        self._in_bucket += 1
        if self._in_bucket < self.stride:
            return
        self.items.append(self._bucket)
        self._bucket, self._in_bucket = None, 0
        if len(self.items) >= self.cap:
            odd = self.items[-1:] if len(self.items) % 2 else []
            self.items = [self.pick(a, b) for a, b in zip(self.items[0::2], self.items[1::2],
                                                                     strict=False)]
            self.items += odd
            self.stride *= 2

    def view(self) -> tuple[Any, ...]:
        pending = (self._newest,) if self._in_bucket else ()
        return tuple(self.items) + pending


def higher(a: tuple[float, int], b: tuple[float, int]) -> tuple[float, int]:
    """Of two (t, bytes) points, the higher: thinning keeps the peaks an OOM is about."""
    return b if b[1] > a[1] else a


def _first(a: Any, b: Any) -> Any:
    return a


def memory_level(snap: Snapshot) -> tuple[Optional[int], Optional[str]]:
    """The server's memory as the page plots it: its own GPU bytes where NVML says them for
    every GPU it uses, else the devices' used memory, else (no GPU) its RSS; as the forecast
    meters it (config gpu.attribution: "process" never plots the device, "device" always)."""
    gpu = [v for v in snap.server_gpu_bytes.values() if v is not None]
    if snap.gpu_attribution != "device" and gpu and len(gpu) == len(snap.server_gpu_bytes):
        return sum(gpu), "process"
    if snap.devices and snap.gpu_attribution == "process":
        return None, None
    if snap.devices:
        return sum(d.used_bytes for d in snap.devices), "device"
    if snap.server_rss_bytes is not None:
        return snap.server_rss_bytes, "rss"
    return None, None


@dataclass(frozen=True)
class SeriesView:
    """One server's own memory series and marks (never another server's): its drill-down."""
    points: tuple[Any, ...] = ()                 # (t, bytes), oldest first
    memory_source: Optional[str] = None          # the core's meter: "process" | "device" | "rss"
    marks: tuple[Any, ...] = ()                  # (t, kind), by time
    marks_total: dict[str, int] = field(default_factory=dict)
    breaks: tuple[float, ...] = ()
    first_t: Optional[float] = None              # the first poll it was listed
    last_t: Optional[float] = None               # the last poll it was listed (gone: stopped)
    causes: tuple[Any, ...] = ()                 # its active causes: {"cause", "t", **detail}


class Series:
    """One server's memory and marks, thinned like the host's."""

    def __init__(self, max_points: int, max_marks: int):
        self.points = Thinned(max_points, higher)
        self.max_marks = max_marks
        self.marks: dict[str, Thinned] = {}
        self.breaks: collections.deque[Any] = collections.deque(maxlen=max_marks)
        self.memory_source: Optional[str] = None
        self.first_t: Optional[float] = None
        self.last_t: Optional[float] = None
        self.cause_since: dict[str, float] = {}  # active cause -> the first poll it showed
        self.touched = -math.inf                 # its latest point or mark
        self._gap = False
        self._view: Optional[tuple[Any, ...]] = None

    def mark(self, t: float, kind: str) -> None:
        if kind not in self.marks:
            self.marks[kind] = Thinned(self.max_marks, _first)
        self.marks[kind].add((t, kind))
        self.touched = max(self.touched, t)
        self._view = None

    def level(self, t: float, level: Optional[int], source: Optional[str]) -> None:
        if self.first_t is None:
            self.first_t = t
        self.last_t = self.touched = t
        if level is None:
            self._gap = self.memory_source is not None
            return
        if self._gap:
            self.breaks.append(t)
            self._gap = False
        self.points.add((t, level))
        self.memory_source = source

    def view(self, causes: tuple[Any, ...]) -> SeriesView:
        if self._view is None:
            self._view = tuple(sorted(m for thinned in self.marks.values()
                                      for m in thinned.view()))
        return SeriesView(points=self.points.view(), memory_source=self.memory_source,
                          marks=self._view, marks_total={k: m.added for k, m in
                                                         self.marks.items()},
                          breaks=tuple(self.breaks), first_t=self.first_t, last_t=self.last_t,
                          causes=causes)


@dataclass(frozen=True)
class StatusView:
    """One tick as the status page sees it. Published by a single reference swap and never
    changed after (its dicts are fresh each tick): the HTTP thread reads it without a lock."""
    snapshot: Snapshot
    points: tuple[Any, ...] = ()                 # (t, bytes) of the memory series, oldest first
    memory_source: Optional[str] = None   # "process" | "device" | "rss"
    marks: tuple[Any, ...] = ()                  # (t, kind), by time
    actions: tuple[Any, ...] = ()                # the last MAX_ACTIONS actions, oldest first
    causes: tuple[Any, ...] = ()                 # active findings: {"cause", "t", **detail}
    first_t: Optional[float] = None    # the first tick
    # kind -> marks ever made (before thinning)
    marks_total: dict[str, int] = field(default_factory=dict)
    breaks: tuple[float, ...] = ()  # times the line starts again after polls with no reading
    info: dict[str, Any] = field(default_factory=dict)  # the sidecar itself (version, uptime …)
    # every server seen, listed now or gone: its own series, marks and causes
    servers: dict[str, SeriesView] = field(default_factory=dict)


class History:
    """Fed by the daemon once per tick (and on each reload outcome); pure, no clock."""

    def __init__(self, max_points: int = MAX_POINTS, max_marks: int = MAX_MARKS_PER_KIND,
                 max_actions: int = MAX_ACTIONS):
        self.points = Thinned(max_points, higher)
        self.max_marks = max_marks
        self.marks: dict[str, Thinned] = {}
        self.actions: collections.deque[Any] = collections.deque(maxlen=max_actions)
        self.memory_source: Optional[str] = None
        self.first_t: Optional[float] = None   # the first tick: "watching since"
        self._marks_view: Optional[tuple[Any, ...]] = None   # sorted, rebuilt only after a new mark
        # polls without a reading (no process of the server's: a reload's gap, a server that
        # stopped): the next point starts a new stretch, not a line across the gap
        self.breaks: collections.deque[Any] = collections.deque(maxlen=max_marks)
        self._gap = False
        self.max_points = max_points
        self.series: dict[str, Series] = {}      # server -> its own series
        self.owner: dict[int, str] = {}          # pid -> server, as last listed

    def mark(self, t: float, kind: str) -> None:
        if kind not in self.marks:
            self.marks[kind] = Thinned(self.max_marks, _first)
        self.marks[kind].add((t, kind))
        self._marks_view = None

    def observe(self, observations: Iterable[Any]) -> None:
        """Marks from the agent's events (other observations, the samples, are skipped), on
        the host's chart and on the chart of the server the sending process belongs to."""
        for obs in observations:  # every observation has a kind: one lookup each
            kind = EVENT_MARKS.get(obs.kind)
            if kind is None or (kind == "record" and obs.phase != "record"):
                continue
            self.mark(obs.t, kind)
            server = self.owner.get(obs.pid)
            if server is not None:
                self._series(server).mark(obs.t, kind)

    def _series(self, name: str) -> Series:
        series = self.series.get(name)
        if series is None:
            series = self.series[name] = Series(self.max_points, self.max_marks)
        return series

    def listed(self, t: float, servers: dict[str, dict[str, Any]]) -> None:
        """Each listed server's own memory (the core's meter of it), and whose pids are
        whose: a later event's mark goes on its server's chart."""
        owner: dict[int, str] = {}
        for name, v in servers.items():
            est = v.get("estimates") or {}
            self._series(name).level(t, est.get("memory_bytes"), est.get("memory_source"))
            owner.update(dict.fromkeys(v.get("pids") or (), name))
        self.owner = owner
        # a server stopped for as long as the step keeps it leaves the page too: the page's
        # memory and each view's cost follow the servers alive, not every one the host ran
        for name in [n for n, series in self.series.items() if t - series.touched > RETAIN_S]:
            del self.series[name]

    def act(self, t: float, action: str, reason: str, detail: Optional[dict[str, Any]] = None,
            server: Optional[str] = None, pids: Iterable[int] = ()) -> None:
        """An action (alert, reload decision) or a reload's outcome (`reload_ok`,
        `reload_not_done`), with the server and pids it targets; a reload decision is also
        marked on the time axis."""
        self.actions.append({"t": t, "action": action, "reason": reason,
                             "detail": dict(detail or {}), "server": server,
                             "pids": list(pids)})
        if action == "reload":
            self.mark(t, "reload")

    def update(self, snap: Snapshot, observations: Iterable[Any],
               actions: Iterable[Action]) -> None:
        """One tick: the memory level, the events' marks, the step's actions (`results.Action`)."""
        if self.first_t is None:
            self.first_t = snap.t
        level, source = memory_level(snap)
        if level is None:
            self._gap = self.memory_source is not None  # after a first point
        else:
            if self._gap:
                self.breaks.append(snap.t)
                self._gap = False
            self.points.add((snap.t, level))
            self.memory_source = source
        self.listed(snap.t, snap.servers)
        self.observe(observations)
        for a in actions:
            self.act(a.t, a.kind.value, a.reason, a.shown(), a.server, a.pids)
            if a.kind.value == "reload":
                self._series(a.server).mark(a.t, "reload")
            if isinstance(a, Reload) and a.not_done is not None:  # decided, not carried out
                self.act(a.t, "reload_not_done", a.reason,
                         {"outcome": f"not carried out: {a.not_done}"})

    def view(self, snap: Snapshot, causes: Iterable[dict[str, Any]] = (),
             info: Optional[dict[str, Any]] = None,
             firing: Optional[dict[str, dict[str, dict[str, Any]]]] = None) -> StatusView:
        """`causes`: the focus server's active findings; `firing`: every server's alerts
        (server -> cause -> detail), whose active causes each server's view lists."""
        focus_causes = tuple(dict(c) for c in causes)
        servers = {}
        for name, series in self.series.items():
            listed = snap.servers.get(name)
            active = tuple(listed.get("active_causes") or ()) if listed else ()
            series.cause_since = {c: series.cause_since.get(c, snap.t) for c in active}
            if name == snap.focus and focus_causes:
                mine = focus_causes
            else:
                fires = (firing or {}).get(name) or {}
                mine = tuple({**fires.get(c, {}), "cause": c, "t": series.cause_since[c]}
                             for c in active)
            servers[name] = series.view(mine)
        if self._marks_view is None:
            self._marks_view = tuple(sorted(m for thinned in self.marks.values()
                                            for m in thinned.view()))
        return StatusView(snapshot=snap, points=self.points.view(),
                          memory_source=self.memory_source, marks=self._marks_view,
                          first_t=self.first_t,
                          marks_total={k: m.added for k, m in self.marks.items()},
                          breaks=tuple(self.breaks),
                          actions=tuple(self.actions), causes=focus_causes,
                          info=dict(info or {}), servers=servers)
