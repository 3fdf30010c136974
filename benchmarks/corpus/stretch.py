"""Stretch a recorded sample log's growth phase K times: the same growth at a production pace.

    python benchmarks/corpus/stretch.py IN.jsonl.gz OUT.jsonl.gz --k 60 --start T0 --end T1
    python benchmarks/corpus/stretch.py --scenario leak-medium --k 60 OUT.jsonl.gz

(the second form takes the window from tests/fixtures/corpus/labels.json: from the scenario's
growth to its OOM, or to its end when it has none, and prints the moved labels).

What a stretched log is: the recorded run, with every moment of the window [start, end] moved
K times further from `start`, and everything after `end` moved by the window's (K - 1) x its
length. Times map by

    f(t) = t                          t <  start
    f(t) = start + K (t - start)      start <= t <= end
    f(t) = t + (K - 1)(end - start)   t >  end

so every growth step comes K times further apart, and a label's time (the OOM, the end) maps
by the same f. What runs at its own pace in a real server is kept at that pace:

- the sidecar's polls: between two recorded polls i and i+1 (gap g, mapped K g apart) the
  stretched log polls every g, each a copy of poll i (the memory holds its level until the
  next poll saw it change): K times as many polls, at the recorded cadence and jitter, and the
  same levels, each held K times as long;
- the agents' heartbeats and periodic hellos (per process): copied the same way, at the gap to
  that process's next one (its heartbeat `seq` renumbered, `uptime_s` counted in the stretched
  time); the last one before a process died is repeated at its previous gap until the
  process's last event;
- a `calls` event (requests counted over a window): its window is mapped too (`window_s`
  becomes f(t) - f(t - window_s)), its counts kept: K times fewer requests a second, so a new
  shape per request comes as often per request as recorded;
- every other observation (a new shape, a recording, a compile, the OOM, a config change)
  keeps its fields and moves to f(t).

Outside the window a poll's next is one gap away in the map too, so it gets no copy: K = 1
gives the recorded log back, observation for observation.

Exact and bounded: f is monotone, so recorded observations keep their order (the file's order,
which is the order the live sidecar stepped them in); a copy goes between the recorded ones
by its time. A copy of observation i needs the time of its stream's next one, which comes at
most one period later (2 s for heartbeats, 30 s for hellos): the input is read LOOKAHEAD_S
ahead, copies are made lazily (one pending progression per stream), so memory holds the
recorded observations of LOOKAHEAD_S, whatever K and however long the output. A periodic
stream silent for longer than LOOKAHEAD_S is a pause (the process gone), not repeated across.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import heapq
import itertools
import json
import os
import sys
from typing import Any, Iterable, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from torch_watchdog import events  # noqa: E402
from torch_watchdog.sidecar.offline import sample_log  # noqa: E402
from torch_watchdog.sidecar.core.observations import ConfigChange, Sample  # noqa: E402

CORPUS = os.path.join(ROOT, "tests", "fixtures", "corpus")
LOOKAHEAD_S = 45.0   # > the slowest periodic stream's period (the agent's hello, 30 s)
PERIODIC = (events.Heartbeat, events.Hello)


class TimeMap:
    """f above: `start` and `end` in the log's own seconds, `k` >= 1."""

    def __init__(self, start: float, end: float, k: float):
        if k < 1 or end < start:
            raise ValueError(f"need k >= 1 and start <= end (k={k}, {start}..{end})")
        self.start, self.end, self.k = start, end, k
        self.shift = (k - 1) * (end - start)

    def __call__(self, t: float) -> float:
        if t < self.start or self.k == 1:   # (start + (t - start) is not always t in floats)
            return t
        if t <= self.end:
            return self.start + self.k * (t - self.start)
        return t + self.shift


def _stream(obs: Any) -> Optional[tuple[Any, ...]]:
    """Which periodic stream an observation belongs to (None: a one-off)."""
    if isinstance(obs, Sample):
        return ("sample",)
    if isinstance(obs, PERIODIC):
        return (obs.kind, obs.pid)
    return None


class _Entry:
    __slots__ = ("obs", "stream", "next_t", "resolved", "gap")

    def __init__(self, obs: Any, stream: Optional[tuple[Any, ...]]):
        self.obs, self.stream = obs, stream
        self.next_t: Optional[float] = None
        self.resolved = stream is None
        self.gap: Optional[float] = None    # the stream's previous gap (for its last one)


class Stretcher:
    """The stretched observations of a recorded run, lazily (see the module's docstring)."""

    def __init__(self, f: TimeMap, lookahead_s: float = LOOKAHEAD_S):
        self.f, self.lookahead_s = f, lookahead_s
        self.copies: list[tuple[float, int, Any, float, float, float]] = []  # a heap
        self.order = itertools.count()
        self.extra_beats: dict[int, int] = {}  # pid -> heartbeats added so far (its seq)
        self.heard: dict[int, float] = {}      # pid -> the last time any event of it came
        self.added = 0                         # copies made

    def run(self, observations: Iterable[Any]) -> Iterator[Any]:
        buf: collections.deque[_Entry] = collections.deque()
        last: dict[tuple[Any, ...], _Entry] = {}     # stream -> its newest entry
        gaps: dict[tuple[Any, ...], float] = {}      # stream -> its newest gap
        for obs in observations:
            pid = getattr(obs, "pid", None)
            if isinstance(obs, events.Event) and isinstance(pid, int):
                self.heard[pid] = max(self.heard.get(pid, obs.t), obs.t)
            entry = _Entry(obs, _stream(obs))
            if entry.stream is not None:
                before = last.get(entry.stream)
                if before is not None and not before.resolved:
                    before.next_t, before.resolved = obs.t, True
                    gaps[entry.stream] = obs.t - before.obs.t
                entry.gap = gaps.get(entry.stream)
                last[entry.stream] = entry
            buf.append(entry)
            while buf and (buf[0].resolved or buf[0].obs.t < obs.t - self.lookahead_s):
                buf[0].resolved = True
                yield from self._emit(buf.popleft())
        while buf:
            yield from self._emit(buf.popleft())
        yield from self._copies_before(float("inf"))

    def _emit(self, e: _Entry) -> Iterator[Any]:
        obs, f = e.obs, self.f
        at = f(obs.t)
        yield from self._copies_before(at)
        yield self._retimed(obs, at, copy=False)
        if e.stream is None:
            return
        if e.next_t is not None:
            gap, until = e.next_t - obs.t, f(e.next_t) - 0.5 * (e.next_t - obs.t)
        elif e.gap is not None and isinstance(obs, PERIODIC) and obs.pid in self.heard:
            # its last: the next was due a gap later; repeated while its process lived
            gap = e.gap
            until = min(f(obs.t + gap) - 0.5 * gap, f(self.heard[obs.pid]))
        else:
            return
        if gap > 0 and at + gap < until:
            heapq.heappush(self.copies, (at + gap, next(self.order), obs, at, gap, until))

    def _copies_before(self, t: float) -> Iterator[Any]:
        copies = self.copies
        while copies and copies[0][0] < t:
            tau, _, obs, at, gap, until = heapq.heappop(copies)
            self.added += 1
            yield self._retimed(obs, tau, copy=True)
            if tau + gap < until:
                heapq.heappush(copies, (tau + gap, next(self.order), obs, at, gap, until))

    def _retimed(self, obs: Any, t: float, copy: bool) -> Any:
        """`obs` at stretched time `t`: the recorded one moved, or a `copy` of it."""
        if self.f.k == 1:
            return obs
        if isinstance(obs, events.Heartbeat):
            extra = self.extra_beats.get(obs.pid, 0) + copy
            self.extra_beats[obs.pid] = extra
            if obs.t == t and not extra:
                return obs
            born = self.f(obs.t - obs.uptime_s)
            return dataclasses.replace(obs, t=t, seq=obs.seq + extra, uptime_s=t - born)
        if isinstance(obs, events.Calls) and obs.t > self.f.start and \
                obs.t - obs.window_s < self.f.end:   # a window that overlaps the stretch
            return dataclasses.replace(obs, t=t, window_s=t - self.f(obs.t - obs.window_s))
        if obs.t == t:
            return obs
        if isinstance(obs, Sample):
            # a poll: hundreds of thousands of them at x360. A plain copy of its fields, not
            # dataclasses.replace (which runs __init__ again: a tenth of a x60 replay's time)
            moved = object.__new__(Sample)
            moved.__dict__.update(obs.__dict__, t=t)
            return moved
        return dataclasses.replace(obs, t=t)


def stretch(observations: Iterable[Any], start: float, end: float, k: float,
            lookahead_s: float = LOOKAHEAD_S) -> Iterator[Any]:
    """The observations of a recorded run (traces.Reader's, in file order) with [start, end]
    stretched `k` times."""
    return Stretcher(TimeMap(start, end, k), lookahead_s).run(observations)


def window(label: dict[str, Any]) -> tuple[float, float]:
    """A corpus label's growth phase: from its servers' first growth to the last OOM (else
    to the last end)."""
    servers = label["servers"].values()
    start = min(s["growth_t"] for s in servers)
    ooms = [s["oom_t"] for s in servers if s["oom_t"] is not None]
    return start, max(ooms) if ooms else max(s["end_t"] for s in servers)


def stretched_label(label: dict[str, Any], k: float) -> dict[str, Any]:
    """The label of the stretched log: its times moved by the same map."""
    f = TimeMap(*window(label), k)
    servers = {}
    for pid, s in label["servers"].items():
        moved = dict(s)
        for key in ("compiled_t", "growth_t", "oom_t", "end_t"):
            if s[key] is not None:
                moved[key] = f(s[key])
        if s["growth_visible_s"]:
            moved["growth_visible_s"] = round(moved["oom_t"] - moved["growth_t"], 1)
        servers[pid] = moved
    return {**label, "servers": servers}


def encode(obs: Any) -> bytes:
    """One sample-log line."""
    if isinstance(obs, ConfigChange):
        return json.dumps(sample_log.config_to_dict(obs.t, obs.config),
                          separators=(",", ":")).encode()
    return sample_log.encode([obs])


def main() -> int:
    from torch_watchdog.sidecar.offline.traces import Reader

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="IN OUT, or OUT with --scenario")
    p.add_argument("--k", type=float, required=True)
    p.add_argument("--start", type=float)
    p.add_argument("--end", type=float)
    p.add_argument("--scenario", help="a corpus file's name (labels.json): its growth phase")
    a = p.parse_args()
    if a.scenario:
        with open(os.path.join(CORPUS, "labels.json")) as fh:
            label = json.load(fh)[a.scenario]
        src, (out,) = os.path.join(CORPUS, label["file"]), a.paths
        start, end = window(label)
        print(json.dumps(stretched_label(label, a.k), indent=1))
    else:
        if a.start is None or a.end is None:
            p.error("--start and --end, or --scenario")
        (src, out), start, end = a.paths, a.start, a.end
    opener = gzip.open if out.endswith(".gz") else open
    with opener(out, "wb") as fh:
        for obs in stretch(Reader(src), start, end, a.k):
            fh.write(encode(obs) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
