"""`torch-watchdog report`: a self-contained HTML post-mortem of recorded event logs and traces.

The agent's event log, the sidecar's sample log and recorded traces (any mix) run through the
very step the daemon and `replay` run (core/step.py), with every server of the host in view:
each server's every process (a reload or a restart starts a new one), its memory, its budget
from when it applied, and the forecast in force when the sidecar decided. `build_report`
turns what it saw into numbers (pure), `report_html.render_html` into one self-contained HTML
page, and `write_report` does the reading and writing.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

from torch_watchdog import events
from torch_watchdog.buckets import advise, size_counts, varying_dimension
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.present.history import Thinned, higher
from torch_watchdog.sidecar.present.plot import human_duration
from torch_watchdog.sidecar.present.status import padding_rows
from torch_watchdog.sidecar.core import step
from torch_watchdog.sidecar.core.forecast import FOREVER
from torch_watchdog.sidecar.core.results import (Action, ActionKind, ProcessTotals, ServerMoment,
                                                 ServerReading)
from torch_watchdog.sidecar.core.views import Follower
from torch_watchdog.sidecar.offline.report_html import render_html
from torch_watchdog.sidecar.core.observations import ConfigChange, Sample
from torch_watchdog.sidecar.offline.traces import Reader, TraceAdapter, read_all

BUCKET_CHOICES = (4, 8, 16, 32)
GOOD_PADDING = 0.10      # the advisor recommends the fewest buckets padding at most this much
MAX_POINTS = 2000        # memory points kept for the chart (peaks kept when thinning)
EPOCH_T = 1e9            # agent logs use epoch seconds (> 2001); recorded traces count from 0
OFF_SCALE = 3.0          # a budget above 3x the server's peak is left off its chart
USAGE_HINT = ("pass the agent's event log (TORCH_WATCHDOG_EVENT_LOG), the sidecar's sample log "
              "(sample_log in watchdog.yaml) or a recorded trace (.jsonl or .jsonl.gz)")
MARK_KINDS = {"compile", "recompile", "recompile_limit", "oom"}  # events drawn as they are
CAUSE_TEXT = {
    "cudagraph_per_shape": "memory grows with each CUDA graph recorded for a new input size",
    "recompile_storm": "Dynamo recompiles again and again (a guard fails on new input sizes)",
    "recompile_limit_eager_fallback": "the recompile limit was hit: new input sizes now run "
                                      "eager (no error; torch logs one warning), slower",
    "memory_growth_unexplained": "memory grew more than recordings and compiles explain",
}

# a shape (per tensor argument, its dims) or a CUDA-graph key -> how often it was seen
ShapeCounts = Counter[tuple[Any, ...]]


class ReportError(Exception):
    """Input the report cannot use; the message says what to do next (exit code 2)."""


@dataclass(frozen=True)
class Request:
    """One request's input shape, from a recorded trace (`req` line): for the shape histogram,
    not for the pipeline (which sees the NewShape/Stall/Calls the agent would have sent)."""
    t: float
    shape: tuple[Any, ...]


class _RequestAdapter(TraceAdapter):
    def _on_req(self, line: dict[str, Any], t: float) -> list[Any]:
        out = super()._on_req(line, t)  # validates the line first
        return [Request(t, (tuple(int(v) for v in line["shape"]),)), *out]


class RequestReader(Reader):
    """A traces.Reader that also yields each recorded request's shape."""

    def __init__(self, path: str):
        super().__init__(path)
        self.adapter = _RequestAdapter()


class _Series:
    """(t, bytes) points over the whole run, thinned as the status page's (peaks kept)."""

    def __init__(self, limit: int = MAX_POINTS):
        self.thinned = Thinned(limit, higher)
        self.first: Optional[float] = None
        self.peak: Optional[float] = None
        self.breaks: list[float] = []   # a new process's first point: the line breaks there

    def add(self, t: float, v: float) -> None:
        self.first = v if self.first is None else self.first
        self.peak = v if self.peak is None else max(self.peak, v)
        self.thinned.add((t, v))

    @property
    def points(self) -> tuple[Any, ...]:
        return self.thinned.view()


class _Steps:
    """A value that changes now and then (the budget): (t, value) at each change only."""

    def __init__(self, limit: int = MAX_POINTS):
        self.thinned = Thinned(limit, lambda a, b: a)
        self.last: Optional[float] = None
        self.less_others = False  # other processes' memory was taken off the budget

    def add(self, t: float, v: float, others: float = 0.0) -> None:
        self.less_others = self.less_others or others > 2 ** 20
        # the budget line moves with other processes' memory: a change under 0.2 % is noise
        if self.last is None or abs(v - self.last) > max(2 ** 20, 0.002 * abs(v)):
            self.thinned.add((t, v))
            self.last = v

    @property
    def points(self) -> tuple[Any, ...]:
        return self.thinned.view()


class _ServerLog:
    """One server over the whole run. A reload or a restart gives it a new process and the
    step a new correlation state: every state it had is kept, so counts cover the whole run
    (the live sidecar's counters start again at each new process)."""

    def __init__(self, key: int):
        self.key = key                         # the server's (views.Follower's: over renames)
        self.states: list[tuple[float, int]] = []  # (first seen t, its process's key), in order
        self.state_pids: dict[int, set[int]] = {}  # a process's key -> the server's pids then
        self.series: dict[str, _Series] = {}   # meter -> the server's memory
        self.budget: dict[str, _Steps] = {}    # meter -> the budget on that meter's scale
        self.marks: list[tuple[float, str]] = []
        self.new_shapes: ShapeCounts = Counter()   # shape -> 1 (agent's new_shape events)
        self.graph_sizes: ShapeCounts = Counter()  # CUDA-graph shape or key -> 1 (warm-ups)
        self.nearest: Optional[tuple[float, dict[str, Any]]] = None  # (t, forecast) nearest to OOM
        self.seen: Optional[tuple[float, float]] = None    # first and last it was alive
        self.pids: set[Any] = set()
        self.gpus: set[Any] = set()
        self.agent_limit = False
        self.sampled: Optional[int] = None     # the process of the last point charted
        self.gap = False                       # samples skipped since (no process of its own)

    def track(self, t: float, s: ServerMoment) -> None:
        if not self.states or self.states[-1][1] != s.process:
            self.states.append((t, s.process))
        self.state_pids.setdefault(s.process, set()).update(s.pids)
        self.pids |= s.pids
        self.gpus |= s.gpus

    def saw(self, t: float) -> None:
        """A sample with a live process of the server's, or an event of its, at `t` seconds
        from the start of its time base."""
        self.seen = (self.seen or (t, t))[0], t

    def sample(self, t: float, r: ServerReading) -> None:
        if r.memory_source is None or r.memory_bytes is None or not r.has_pids or not r.alive:
            # no process of its own (after a reload, before the new one is known): the step
            # then folds every process's memory, which is not this server's; none alive: its
            # last reading is no longer its memory (the chart stops where it died)
            self.gap = self.sampled is not None
            return
        series = self.series.setdefault(r.memory_source, _Series())
        if self.gap or (self.sampled is not None and r.process != self.sampled):
            series.breaks.append(t)  # a new process (a reload, a restart): not one line
        self.gap, self.sampled = False, r.process
        series.add(t, r.memory_bytes)
        if r.budget_bytes is not None:
            # where the server's memory meets the budget with everything else as it is now
            # (the forecast's level may be the whole GPU's; the chart plots the server's own)
            other = 0 if r.level_bytes is None else r.level_bytes - r.memory_bytes
            self.budget.setdefault(r.memory_source, _Steps()).add(
                t, r.budget_bytes - other, other)
        # the nearest forecast the policy would have acted on: during a process's warm-up
        # only one due by its end plus the lead (a fresh process's start-up is not growth)
        if r.seconds != FOREVER and (self.nearest is None or r.seconds < self.nearest[1][
                "seconds_to_oom"]) and (not r.warming_up or (r.reload_lead is not None
                                                             and r.seconds <= r.reload_lead)):
            self.nearest = (t, dict(r.forecast))


class _Collector:
    """What the report needs beyond the pipeline's outcome, gathered while it runs."""

    def __init__(self) -> None:
        self.logs: dict[int, _ServerLog] = {}   # a server's key (views.Follower) -> its log
        self.requests: ShapeCounts = Counter()     # shape -> requests (recorded traces)
        self.spans: dict[bool, list[float]] = {}  # epoch time base? -> [first t, last t]

    def rel(self, t: float) -> float:
        """Seconds from the first observation of t's time base: agent logs count epoch
        seconds, recorded traces from their process's start; each starts at 0."""
        span = self.spans.get(t >= EPOCH_T)
        return round(t - span[0], 3) if span else round(t, 3)

    @property
    def span(self) -> float:
        return max((last - first for first, last in self.spans.values()), default=0.0)

    def pipeline_input(self, observations: Iterable[Any]) -> Iterator[Any]:
        for obs in observations:
            span = self.spans.setdefault(obs.t >= EPOCH_T, [obs.t, obs.t])
            span[1] = max(span[1], obs.t)
            if isinstance(obs, Request):
                self.requests[obs.shape] += 1
            else:
                yield obs

    def log(self, key: int) -> _ServerLog:
        log = self.logs.get(key)
        if log is None:
            log = self.logs[key] = _ServerLog(key)
        return log

    def observe(self, fol: Follower, obs: Any, decided: list[Action], config: Config) -> None:
        for moment in fol.servers():
            self.log(moment.key).track(obs.t, moment)
        if isinstance(obs, Sample):
            for reading in fol.readings(config):
                log = self.log(reading.key)
                log.sample(obs.t, reading)
                if reading.alive:
                    log.saw(self.rel(obs.t))
        elif isinstance(obs, events.Event):
            # the step's own routing: the server the event went to
            owner = fol.owner(obs)
            if owner is not None:
                self._event(self.log(owner), obs)
                self.log(owner).saw(self.rel(obs.t))
        for a in decided:
            marked = a.kind in (ActionKind.RELOAD, ActionKind.FREEZE)
            key = fol.key_of(a.server) if marked else None
            if key is not None:
                self.log(key).marks.append((a.t, a.kind.value))

    @staticmethod
    def _event(log: _ServerLog, obs: Any) -> None:
        if isinstance(obs, events.CudagraphRecord):
            if obs.phase == "record":
                log.marks.append((obs.t, "record"))
            elif obs.shape or obs.key:  # warm-up: the first call of a new size
                log.graph_sizes[tuple(tuple(d) for d in (obs.shape or [obs.key or []]))] = 1
        elif isinstance(obs, events.NewShape):
            log.new_shapes[tuple(tuple(dims) for dims in obs.shape)] = 1
        elif obs.kind in MARK_KINDS:
            log.agent_limit |= obs.kind == "recompile_limit"
            log.marks.append((obs.t, obs.kind))


def _run(col: _Collector, observations: Iterable[Any], config: Config,
         follow_config: bool) -> tuple[Follower, list[Action], int, Config]:
    """replay.run's loop (the very step the daemon runs), with the whole host in view after
    each observation (core/views.py): every server, every process of it. Returns the views'
    follower, the actions, the number of observations and the last config in force."""
    host = step.Host()  # the step's state: what the report sees of it, the follower gives
    fol, actions, n = Follower(host), [], 0
    for obs in col.pipeline_input(observations):
        n += 1
        if isinstance(obs, ConfigChange):
            if follow_config:
                config = obs.config
            continue
        decided = step.step(host, obs, config).actions
        actions.extend(decided)
        col.observe(fol, obs, decided, config)
    return fol, actions, n, config


def build_report(observations: Iterable[Any], config: Config, files: Iterable[str] = (),
                 follow_config: bool = True) -> dict[str, Any]:
    """Run the pipeline over `observations` (events, Samples, Requests, in time order) and
    return the report's numbers. Times in the result are seconds from the first observation.
    With `follow_config`, the configs the live sidecar recorded in its sample log apply."""
    col = _Collector()
    fol, actions, n, config = _run(col, observations, config, follow_config)
    if n == 0:
        raise ReportError("no events, samples or trace lines could be used")
    # a server that never had a process of its own (renamed by its restart: the new name
    # took its history) is not a server of the report
    logs = [log for log in col.logs.values() if log.states and log.pids]
    if not logs:  # samples of no server: nothing to attribute, still a page
        empty = fol.placeholder()
        logs = [_ServerLog(empty.key)]
        logs[0].track(0.0, empty)
    acts = [_relative({**a.as_dict(), "t": col.rel(a.t)}, col.rel) for a in actions]
    findings = sorted(((fol.name(log.key), f) for log in logs for _, p in log.states
                       for f in fol.totals(p, config).findings), key=lambda p: p[1].t)
    causes = [_relative({**f.as_dict(), "server": name, "t": col.rel(f.t),
                         "explanation": CAUSE_TEXT.get(f.cause, "")}, col.rel)
              for name, f in findings]
    servers = [_server_report(log, [a for a in acts if a["server"] == fol.name(log.key)],
                              [c for c in causes if c["server"] == fol.name(log.key)], col, fol,
                              config, requests=col.requests if len(logs) == 1 else Counter())
               for log in logs]
    servers.sort(key=lambda s: s["name"])
    focus = min(servers, key=_nearness)
    return {
        "input": {"files": list(files), "observations": n, "span_s": round(col.span, 3),
                  "mixed_time_bases": len(col.spans) > 1},
        "summary": focus["summary"], "chart": focus["chart"], "shapes": focus["shapes"],
        "causes": causes, "actions": acts, "estimates": focus["estimates"],
        "focus": focus["name"], "servers": servers,
    }


def _nearness(s: dict[str, Any]) -> tuple[Any, ...]:
    """The server a one-server view shows: the one reloaded, else the nearest to OOM."""
    fc = s["summary"]["forecast"]
    seconds = fc.get("seconds_to_oom")
    return (fc["basis"] != "reload decision", not s["summary"]["ooms"],
            math.inf if seconds is None else seconds, s["name"])


def _relative(d: dict[str, Any], rel: Callable[[float], float]) -> dict[str, Any]:
    """A finding's or an action's times as seconds from the start, like its `t`."""
    for key in ("decided_t", "reached_at"):
        if isinstance(d.get(key), (int, float)):
            d[key] = rel(d[key])
    return d


def _server_report(log: _ServerLog, acts: list[Any], causes: list[Any], col: _Collector,
                   fol: Follower, config: Config, requests: ShapeCounts) -> dict[str, Any]:
    # its processes: a state that never had a pid of its own (the gap between a reload and
    # the new process) measured no process of this server
    owned = [(t, p) for t, p in log.states if log.state_pids.get(p)] or log.states[:1]
    states = [fol.totals(p, config) for _, p in owned]
    last = states[-1]
    limit_hit, limit = _limit(states, config)
    per_graph = _best_per_graph(states)
    shapes = _shapes(requests, log, per_graph, limit if limit_hit else None)
    source = max(log.series, key=lambda k: log.series[k].thinned.added, default=None)
    series = log.series.get(source) if source else None
    marks = list(log.marks)
    for f in (f for st in states for f in st.findings):
        # a limit inferred from a recorded trace has no event of its own
        if f.cause == "recompile_limit_eager_fallback" and not log.agent_limit:
            marks.append((f.detail.get("reached_at", f.t), "recompile_limit"))
    budget = log.budget.get(source) if source else None
    chart = _chart(series, marks, col, budget)
    fc = _forecast_in_force(log, acts, fol.estimates(log.key, config), col.rel)
    def total(attr: str) -> Any:
        return sum(attrgetter(attr)(st) for st in states)

    shapes["now"] = now = compiled_now(total("records"), total("compiles")
                                       + total("recompiles"))
    if now["what"] == "CUDA graphs" and per_graph is not None:
        for row in shapes["advisor"]:  # the graphs recorded, less one per bucket
            row["memory_saved_bytes"] = round(max(0, now["count"] - row["graphs_after"])
                                              * per_graph[0] * 1e6)
    counted = shapes["basis"] in ("requests", "distinct shapes") and shapes["distinct"]
    summary = {
        # the server's own span (from its first to its last sample with a process of its
        # own), not the whole log's: a sample log holds the sidecar's time before and after
        "span_s": round(log.seen[1] - log.seen[0], 3) if log.seen else 0.0,
        "seen_from_s": log.seen[0] if log.seen else None,
        "memory_start_bytes": series.first if series else None,
        "memory_peak_bytes": series.peak if series else None,
        # the charted meter's last point (the last state may have switched meters)
        "memory_end_bytes": series.points[-1][1] if series else last.memory_bytes,
        "memory_source": source,
        "recordings": total("records"), "compiles": total("compiles"),
        "recompiles": total("recompiles"),
        "recompile_limit_hits": total("limit_hits"),
        # one source for each number: the shapes the histogram counts
        "distinct_shapes": shapes["distinct"] if counted else total("distinct_shapes"),
        "requests": shapes["total"] if shapes["basis"] == "requests" else total("requests"),
        "stalls": total("stalls"), "stall_seconds": round(total("stall_seconds"), 3),
        "ooms": total("ooms"), "processes": len(states),
        "first_oom_t": min((t for t, k in chart["marks"] if k == "oom"), default=None),
        "mb_per_graph": per_graph[0] if per_graph else None,
        "mb_per_graph_confidence": per_graph[1] if per_graph else None,
        "recompile_limit": limit, "recompile_limit_hit": limit_hit,
        "forecast": fc, **{k: fc.get(k) for k in ("seconds_to_oom", "will_oom",
                                                  "plateau_bytes", "budget_bytes")},
    }
    # the agent's padding per model, its latest word over the processes
    padding: dict[str, Any] = {}
    for st in states:
        padding.update(st.estimates["padding"])
    return {"name": fol.name(log.key), "pids": sorted(log.pids), "gpus": sorted(log.gpus),
            "summary": summary, "chart": chart, "shapes": shapes,
            "padding": padding_rows(padding),
            "estimates": fol.estimates(log.key, config),
            "processes": [{"from_t": col.rel(t), "pids": sorted(log.state_pids.get(p, ()))}
                          for t, p in owned]}


def _limit(states: list[ProcessTotals], config: Config) -> tuple[Optional[str], Optional[int]]:
    """Whether the recompile limit was hit ("agent": it said so; "inferred"), and the limit
    the server ran with: the one torch hit (the finding's), else its agent's hello's, else
    torch's default."""
    hit, hit_limit, hello = None, None, None
    for st in states:
        for f in st.findings:
            if f.cause == "recompile_limit_eager_fallback" and hit is None:
                hit = "agent" if f.detail.get("source") == "agent" else "inferred"
                hit_limit = f.detail.get("limit")
        hello = hello or st.limit
    limit = hit_limit or hello or config.correlate.default_recompile_limit
    return hit, limit


def _best_per_graph(states: list[ProcessTotals]) -> Optional[tuple[float, float]]:
    """MB per graph as measured in the run: of the server's processes, the most confident
    estimate (a reload's new process has too few recordings for its own)."""
    found = [(mb, confidence) for mb, confidence in
             ((st.estimates["mb_per_graph"], st.estimates["mb_per_graph_confidence"])
              for st in states) if mb is not None and confidence is not None]
    return max(found, key=lambda p: p[1], default=None)


FORECAST_TEXT_KEYS = ("seconds_to_oom", "seconds_to_oom_earliest", "seconds_to_oom_linear",
                      "seconds_to_oom_discovery", "seconds_to_oom_unexplained", "plateau_bytes",
                      "budget_bytes", "level_bytes", "will_oom", "driver", "cause")


def _forecast_in_force(log: _ServerLog, acts: list[Any], end: dict[str, Any],
                       rel: Callable[[float], float]) -> dict[str, Any]:
    """The forecast the sidecar acted on: at its reload decision, else at its oom_forecast
    alert, else the one at the end; with the nearest one seen during the run."""
    nearest = None if log.nearest is None else {"t": rel(log.nearest[0]), **log.nearest[1]}
    picks: tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...] = (
        ("reload decision", lambda a: a["action"] == "reload"),
        ("oom_forecast alert", lambda a: a["action"] == "alert" and a["reason"] == "oom_forecast"))
    for basis, pick in picks:
        a = next((a for a in acts if pick(a)), None)
        if a is not None:
            fc = {k: a.get(k) for k in FORECAST_TEXT_KEYS}
            if fc["will_oom"] is None and None not in (fc["plateau_bytes"], fc["budget_bytes"]):
                fc["will_oom"] = fc["plateau_bytes"] >= fc["budget_bytes"]
            return {"basis": basis, "t": a["t"], **fc, "nearest": nearest}
    return {"basis": "end", "t": None, **{k: end.get(k) for k in FORECAST_TEXT_KEYS},
            "nearest": nearest}


def _chart(series: Optional[_Series], marks: list[Any], col: _Collector,
           budget: Optional[_Steps]) -> dict[str, Any]:
    rel = col.rel
    points = [[rel(t), v] for t, v in series.points] if series else []
    shown = sorted((rel(t), k) for t, k in marks)
    outside = 0
    if points:  # the time axis is the samples': events far outside them are not drawn
        lo, hi = points[0][0], points[-1][0]
        margin = 0.05 * (hi - lo) + 1.0
        kept = [m for m in shown if lo - margin <= m[0] <= hi + margin]
        outside, shown = len(shown) - len(kept), kept
    steps = [[rel(t), v] for t, v in budget.points] if budget else []
    line, off = _on_scale(steps, series.peak if series else None)
    return {"points": points, "zoom": _zoom_range(points),
            "breaks": [rel(t) for t in series.breaks] if series else [],
            "marks": [list(m) for m in shown], "marks_outside": outside,
            "mark_counts": dict(Counter(k for _, k in shown)),
            "budget": line, "budget_off_scale": off,
            # the line is where this server's memory meets the budget: the budget itself, or
            # less what the other processes on its GPU hold (a number of its own)
            "budget_label": "budget less other processes" if budget and budget.less_others
            else "budget",
            "budget_bytes": line[-1][1] if line else None}


def _on_scale(steps: list[Any], peak: Optional[float]) -> tuple[list[Any], list[Any]]:
    """The budget's steps drawn on the chart, and those left off: a budget over OFF_SCALE x
    the server's peak would flatten its memory to a line along the axis (the demo's budget is
    the machine's RAM until warm-up; a server alone on a GPU stays near its budget)."""
    if peak is None or not steps:
        return [], steps
    first_on = next((i for i, (_, v) in enumerate(steps) if v <= OFF_SCALE * peak), None)
    if first_on is None:
        return [], steps
    return steps[first_on:], steps[:first_on]


def _zoom_range(points: list[Any]) -> Optional[dict[str, Any]]:
    """What a zoomed chart should show: the stretch around the peak between one-poll steps of
    more than half the peak (weights or a ballast before it, a reload or a crash after it),
    when the growth there is under a fifth of the peak and would be a flat line on the full
    chart."""
    if len(points) < 3:
        return None
    peak = max(v for _, v in points)
    top = next(i for i, (_, v) in enumerate(points) if v == peak)
    jump = [i for i in range(1, len(points)) if abs(points[i][1] - points[i - 1][1]) > peak / 2]
    start = max((i for i in jump if i <= top), default=0)
    end = min((i for i in jump if i > top), default=len(points))
    base = min(v for _, v in points[start:end])
    return {"from_t": points[start][0], "to_t": points[end - 1][0], "baseline_bytes": base} \
        if 0 < peak - base < peak / 5 else None


def _shapes(requests: ShapeCounts, log: _ServerLog, per_graph: Optional[tuple[Any, ...]],
            limit: Optional[int]) -> dict[str, Any]:
    """Sizes along the varying dimension: per request (traces) else per distinct shape. With
    `limit` (the server compiles per size, dynamic=False, and hit that recompile limit), no
    more buckets than the limit: one more would run eager like every size did."""
    basis, shapes = next(((b, s) for b, s in (("requests", requests), ("distinct shapes",
                          log.new_shapes), ("CUDA-graph sizes", log.graph_sizes)) if s),
                         ("distinct shapes", Counter()))
    flat: Counter[tuple[int, ...]] = Counter()
    for shape, n in shapes.items():  # one shape per tensor argument: their dims, in order
        flat[tuple(d for dims in shape for d in dims)] += n
    rank = Counter(len(s) for s in flat).most_common(1)[0][0] if flat else None
    same = [s for s in flat if len(s) == rank]
    dim = varying_dimension(same)
    counts: Counter[int] = Counter()
    if dim is not None:
        counts = size_counts(chain.from_iterable(repeat(s, flat[s]) for s in same), dim)
    bytes_per_graph = None if per_graph is None else per_graph[0] * 1e6
    choices = BUCKET_CHOICES if limit is None else \
        sorted({k for k in BUCKET_CHOICES if k < limit} | {limit})
    rows: list[dict[str, Any]] = []
    for k in choices if counts else ():
        row = {"max_buckets": k, **advise(counts, k, bytes_per_graph).as_dict()}
        # 3 sizes: every choice is the same 3 boundaries, shown once
        if not rows or row["boundaries"] != rows[-1]["boundaries"]:
            rows.append(row)
    return {"basis": basis, "dimension": dim, "rank": rank, "distinct": len(flat),
            "total": sum(flat.values()), "counts": sorted(counts.items()),
            "advisor": rows, "recommended": recommended(rows), "recompile_limit": limit,
            "mb_per_graph": None if per_graph is None else per_graph[0]}


def compiled_now(recordings: int, compiles: int) -> dict[str, Any]:
    """What the server built for its sizes in this log, which buckets would bound: CUDA graphs
    where it recorded any (one per size under reduce-overhead), else Dynamo compiles (one per
    size with dynamic=False; with automatic dynamic shapes, one graph serves every size and
    buckets save no compile)."""
    if recordings:
        return {"what": "CUDA graphs", "count": recordings}
    return {"what": "compiles", "count": compiles}


def recommended(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The fewest buckets whose padding stays under GOOD_PADDING, else the most."""
    good = [row for row in rows if row["padding_ratio"] <= GOOD_PADDING]
    return (good or rows[-1:])[0] if good or rows else None


# -- I/O ------------------------------------------------------------------------------------
def write_report(paths: list[str], out: str, config: Config,
                 progress: Optional[Callable[[str], None]] = None,
                 follow_config: bool = True) -> dict[str, Any]:
    """Read `paths`, write the HTML page to `out`, return the report's numbers."""
    for path in paths:
        if not os.path.isfile(path):
            raise ReportError(f"{path}: no such file; {USAGE_HINT}")
    readers = [RequestReader(p) for p in paths]
    try:
        report = build_report(read_all(readers, progress, "report"), config, paths,
                              follow_config)
    except ReportError as err:
        bad = sum(r.bad_lines for r in readers)
        raise ReportError(f"{err} ({bad} unreadable line(s)); {USAGE_HINT}") from None
    except (OSError, EOFError) as err:
        raise ReportError(f"cannot read the input: {err}") from None
    report["input"]["bad_lines"] = sum(r.bad_lines for r in readers)
    try:  # a whole page or none: never a half-written one over the previous report
        with open(out + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(render_html(report))
        os.replace(out + ".tmp", out)
    except OSError as err:
        raise ReportError(f"cannot write {out}: {err.strerror}; pick another -o path") from None
    return report


def numbers(report: dict[str, Any]) -> dict[str, Any]:
    """What `--json` prints: everything the page shows but the charts' points and marks."""
    def lean(chart: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in chart.items() if k not in ("points", "marks", "breaks")}
    return {**report, "chart": lean(report["chart"]),
            "servers": [{**s, "chart": lean(s["chart"])} for s in report["servers"]]}


def main(paths: list[str], out: str, cfg: Config, as_json: bool, stdout: TextIO,
         follow_config: bool = True) -> int:
    """The `report` subcommand. Exit codes: 0 written, 2 bad input (message on stderr)."""
    started = time.perf_counter()
    try:
        report = write_report(paths, out, cfg, lambda line: print(line, file=sys.stderr),
                              follow_config)
    except ReportError as err:
        print(f"torch-watchdog report: {err}", file=sys.stderr)
        return 2
    if as_json:
        json.dump(numbers(report), stdout, indent=1)
        stdout.write("\n")
    servers = len(report["servers"])
    print(f"wrote {out} in {time.perf_counter() - started:.1f} s: "
          f"{human_duration(report['input']['span_s'])}"
          + (f", {servers} servers" if servers > 1 else "") + ", "
          f"{sum(x['summary']['recordings'] for x in report['servers'])} recordings, "
          f"{len(report['causes'])} cause(s), {len(report['actions'])} action(s)",
          file=sys.stderr if as_json else stdout)
    return 0
