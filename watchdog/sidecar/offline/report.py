"""`torch-watchdog report`: a self-contained HTML post-mortem of recorded event logs and traces.

The agent's event log, the sidecar's sample log and recorded traces (any mix) run through the
very pipeline `replay` runs (fold → forecast → decide, `replay.run`); `build_report` turns what
it saw into numbers (pure), `report_html.render_html` into one self-contained HTML page, and
`write_report` does the reading and writing.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

from torch_watchdog import events
from torch_watchdog.sidecar.offline.buckets import advise, size_counts, varying_dimension
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.present.history import Thinned, higher
from torch_watchdog.sidecar.present.plot import human_duration
from torch_watchdog.sidecar.offline.replay import run
from torch_watchdog.sidecar.offline.report_html import render_html
from torch_watchdog.sidecar.sources.samples import Sample
from torch_watchdog.sidecar.offline.traces import Reader, TraceAdapter, read_all

BUCKET_CHOICES = (4, 8, 16, 32)
GOOD_PADDING = 0.10      # the advisor recommends the fewest buckets padding at most this much
MAX_POINTS = 2000        # memory points kept for the chart (peaks kept when thinning)
EPOCH_T = 1e9            # agent logs use epoch seconds (> 2001); recorded traces count from 0
USAGE_HINT = ("pass the agent's event log (TORCH_WATCHDOG_EVENT_LOG), the sidecar's sample log "
              "(sample_log in watchdog.yaml) or a recorded trace (.jsonl or .jsonl.gz)")
MARK_KINDS = {"compile", "recompile", "recompile_limit", "oom"}  # events drawn as they are
CAUSE_TEXT = {
    "cudagraph_per_shape": "memory grows with each CUDA graph recorded for a new input size",
    "recompile_storm": "Dynamo recompiles again and again (a guard fails on new input sizes)",
    "recompile_limit_eager_fallback": "the recompile limit was hit: new input sizes now run "
                                      "eager, silently slower",
    "memory_growth_unexplained": "memory grew more than recordings and compiles explain",
}


class ReportError(Exception):
    """Input the report cannot use; the message says what to do next (exit code 2)."""


@dataclass(frozen=True)
class Request:
    """One request's input shape, from a recorded trace (`req` line): for the shape histogram,
    not for the pipeline (which sees the NewShape/Stall/Calls the agent would have sent)."""
    t: float
    shape: tuple


class _RequestAdapter(TraceAdapter):
    def _on_req(self, line: dict, t: float) -> list:
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

    def add(self, t: float, v: float) -> None:
        self.first = v if self.first is None else self.first
        self.peak = v if self.peak is None else max(self.peak, v)
        self.thinned.add((t, v))

    @property
    def points(self) -> tuple:
        return self.thinned.view()


class _Collector:
    """What the report needs beyond the pipeline's outcome, gathered while it runs."""

    def __init__(self) -> None:
        self.series: dict[str, _Series] = {}
        self.marks: list[tuple[float, str]] = []
        self.requests: Counter = Counter()     # shape -> requests (recorded traces)
        self.new_shapes: Counter = Counter()   # shape -> 1 (agent's new_shape events)
        self.graph_sizes: Counter = Counter()  # CUDA-graph shape or key -> 1 (agent, warm-up)
        self.spans: dict[bool, list[float]] = {}  # epoch time base? -> [first t, last t]
        self.agent_limit = False

    def rel(self, t: float) -> float:
        """Seconds from the first observation of t's time base: agent logs count epoch
        seconds, recorded traces from their process's start; each starts at 0."""
        return round(t - self.spans[t >= EPOCH_T][0], 3)

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

    def observe(self, obs: Any, state: Any, decided: list) -> None:
        if isinstance(obs, Sample):
            if state.mem_source is not None:
                self.series.setdefault(state.mem_source, _Series()).add(obs.t, state.mem_bytes)
        elif isinstance(obs, events.CudagraphRecord):
            if obs.phase == "record":
                self.marks.append((obs.t, "record"))
            elif obs.shape or obs.key:  # warm-up: the first call of a new size
                self.graph_sizes[tuple(map(tuple, obs.shape or [obs.key]))] = 1
        elif isinstance(obs, events.NewShape):
            self.new_shapes[tuple(tuple(dims) for dims in obs.shape)] = 1
        elif obs.kind in MARK_KINDS:
            self.agent_limit |= obs.kind == "recompile_limit"
            self.marks.append((obs.t, obs.kind))
        self.marks.extend((a.t, "reload") for a in decided if a.action == "reload")


def build_report(observations: Iterable[Any], config: Config, files: Iterable[str] = (),
                 follow_config: bool = True) -> dict[str, Any]:
    """Run the pipeline over `observations` (events, Samples, Requests, in time order) and
    return the report's numbers. Times in the result are seconds from the first observation.
    With `follow_config`, the configs the live sidecar recorded in its sample log apply."""
    col = _Collector()
    r = run(col.pipeline_input(observations), config, observe=col.observe,
            follow_config=follow_config)
    if r.observations == 0:
        raise ReportError("no events, samples or trace lines could be used")
    config = r.config
    outcome = r.outcome(config)
    est, state = outcome["estimates"], r.state
    # the meter that covered the run (the server's own memory, while it lived), not the last
    # one (a crashed server's process is gone: the device's memory is all that is left)
    source = max(col.series, key=lambda k: col.series[k].thinned.added, default=None)
    series = col.series.get(source) if source else None
    marks = list(col.marks)
    for f in state.findings:  # a limit inferred from a recorded trace has no event of its own
        if f.cause == "recompile_limit_eager_fallback" and not col.agent_limit:
            marks.append((f.detail.get("reached_at", f.t), "recompile_limit"))
    return {
        "input": {"files": list(files), "observations": r.observations,
                  "mixed_time_bases": len(col.spans) > 1},
        "summary": {**_summary(col.span, state, est, series), "recompile_limit":
                    _limit(state.findings), "memory_source": source},
        "chart": _chart(series, marks, col.rel,
                        _budget(source, est, config, series.peak if series else None)),
        "shapes": _shapes(col, est.get("mb_per_graph")),
        "causes": [{**f.as_dict(), "t": col.rel(f.t), "explanation":
                    CAUSE_TEXT.get(f.cause, "")} for f in state.findings],
        "actions": [{**a.as_dict(), "t": col.rel(a.t)} for a in r.actions],
        "estimates": est,
    }


def _summary(span: float, state: Any, est: dict, series: Optional[_Series]) -> dict[str, Any]:
    keys = ("recordings", "compiles", "recompiles", "recompile_limit_hits", "distinct_shapes",
            "requests", "stalls", "stall_seconds", "ooms", "mb_per_graph",
            "mb_per_graph_confidence", "seconds_to_oom", "will_oom", "plateau_bytes",
            "budget_bytes", "memory_source")
    return {"span_s": round(span, 3),
            "memory_start_bytes": series.first if series else None,
            "memory_peak_bytes": series.peak if series else None,
            "memory_end_bytes": state.mem_bytes,
            **{k: est.get(k) for k in keys}}


def _limit(findings: list) -> Optional[str]:
    """Whether the recompile limit was hit: "yes" (the agent said so), "yes (inferred)"."""
    for f in findings:
        if f.cause == "recompile_limit_eager_fallback":
            return "yes" if f.detail.get("source") == "agent" else "yes (inferred)"
    return None


def _budget(source: Optional[str], est: dict, config: Config,
            peak: Optional[float]) -> Optional[float]:
    """The forecast's budget for the chart: when it is on the meter shown, or when the server's
    own memory came near it (a server alone on its GPU; else the line would flatten the chart)."""
    budget = est.get("budget_bytes")
    per_process = config.forecast.process_budget_bytes is not None
    same = (source == "process" and per_process) or (source == "device" and not per_process)
    near = budget is not None and peak is not None and peak >= budget / 2
    return budget if same or near else None


def _chart(series: Optional[_Series], marks: list, rel: Callable[[float], float],
           budget: Optional[float]) -> dict[str, Any]:
    points = [[rel(t), v] for t, v in series.points] if series else []
    shown = sorted((rel(t), k) for t, k in marks)
    outside = 0
    if points:  # the time axis is the samples': events far outside them are not drawn
        lo, hi = points[0][0], points[-1][0]
        margin = 0.05 * (hi - lo) + 1.0
        kept = [m for m in shown if lo - margin <= m[0] <= hi + margin]
        outside, shown = len(shown) - len(kept), kept
    return {"points": points, "zoom": _zoom_range(points),
            "marks": [list(m) for m in shown], "marks_outside": outside,
            "mark_counts": dict(Counter(k for _, k in shown)), "budget_bytes": budget}


def _zoom_range(points: list) -> Optional[dict]:
    """Where a zoomed chart should start: after the last one-poll step of more than half the
    peak (weights, a ballast), when the growth since then is under a fifth of the peak and
    would be a flat line on the full chart."""
    if len(points) < 3:
        return None
    peak = max(v for _, v in points)
    steps = [i for i in range(1, len(points)) if points[i][1] - points[i - 1][1] > peak / 2]
    start = steps[-1] if steps else 0
    base = min(v for _, v in points[start:])
    return {"from_t": points[start][0], "baseline_bytes": base} \
        if 0 < peak - base < peak / 5 else None


def _shapes(col: _Collector, mb_per_graph: Optional[float]) -> dict[str, Any]:
    """Sizes along the varying dimension: per request (traces) else per distinct shape."""
    basis, shapes = next(((b, s) for b, s in (("requests", col.requests), ("distinct shapes",
                          col.new_shapes), ("CUDA-graph sizes", col.graph_sizes)) if s),
                         ("distinct shapes", Counter()))
    flat: Counter = Counter()
    for shape, n in shapes.items():  # one shape per tensor argument: their dims, in order
        flat[tuple(d for dims in shape for d in dims)] += n
    rank = Counter(len(s) for s in flat).most_common(1)[0][0] if flat else None
    same = [s for s in flat if len(s) == rank]
    dim = varying_dimension(same)
    counts: Counter = Counter()
    if dim is not None:
        counts = size_counts(chain.from_iterable(repeat(s, flat[s]) for s in same), dim)
    per_graph = None if mb_per_graph is None else mb_per_graph * 1e6
    rows = [{"max_buckets": k, **advise(counts, k, per_graph).as_dict()}
            for k in BUCKET_CHOICES] if counts else []
    return {"basis": basis, "dimension": dim, "rank": rank, "distinct": len(flat),
            "total": sum(flat.values()), "counts": sorted(counts.items()),
            "advisor": rows, "recommended": recommended(rows)}


def recommended(rows: list) -> Optional[dict]:
    """The fewest buckets whose padding stays under GOOD_PADDING, else the most."""
    good = [row for row in rows if row["padding_ratio"] <= GOOD_PADDING]
    return (good or rows[-1:] or [None])[0]


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
        numbers = {**report, "chart": {k: v for k, v in report["chart"].items()
                                       if k not in ("points", "marks")}}
        json.dump(numbers, stdout, indent=1)
        stdout.write("\n")
    s = report["summary"]
    print(f"wrote {out} in {time.perf_counter() - started:.1f} s: "
          f"{human_duration(s['span_s'])}, "
          f"{s['recordings']} recordings, {len(report['causes'])} cause(s), "
          f"{len(report['actions'])} action(s)", file=sys.stderr if as_json else stdout)
    return 0
