"""Recorded inputs → the pipeline's observations (agent events and samples), for replay.

Reads `.jsonl` and `.jsonl.gz`, line by line, of three kinds:
- the agent's event log (schema v1, lines with `"v"`), decoded strictly;
- the sidecar's own sample log (`"kind": "sample"` lines, with the agent events it received,
  and a `"kind": "config"` line at start and after each SIGHUP);
- the recorded-trace format of FACTS.md (`start`, `req`, `compile_start`/`compile_end`,
  `nvml`, `crash`, …): translated into what the agent and the sidecar's sources would have
  produced (NewShape/Stall/Calls from `req`, Compile/Recompile/CudagraphRecord from the
  callbacks, a Sample from `nvml`), so replay runs the very same fold as the live daemon.
Several files are merged by time. Bad lines are counted, never fatal.
"""
from __future__ import annotations

import heapq
import json
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from torch_watchdog import events
from torch_watchdog.jsonl import open_lines
from torch_watchdog.sidecar.config import from_mapping
from torch_watchdog.sidecar.sources.samples import ConfigChange, DeviceSample, ProcessSample, \
    ReloadOutcome, Sample, outcome_from_dict, sample_from_dict

Observation = Union[events.Event, Sample, ConfigChange, ReloadOutcome]
TRACE_PID = 1
TRACE_GPU = "GPU-recorded-trace"
CALLS_WINDOW_S = 2.0  # like the agent's default heartbeat
STALL_S = 0.05        # the agent's default stall threshold


class TraceAdapter:
    """Turns recorded-trace lines into the observations a live sidecar would have seen."""

    def __init__(self, stall_s: float = STALL_S):
        self.stall_s = stall_s
        self.seen: set = set()
        self.started: dict[tuple[str, str], float] = {}
        self.window = [0, 0.0, 0, 0.0]  # calls, seconds, stall calls, stall seconds
        self.window_start: Optional[float] = None
        self.compiling_since: Optional[float] = None

    def feed(self, line: dict[str, Any]) -> list[Observation]:
        kind, t = line.get("kind"), float(line["t"])
        handler = getattr(self, f"_on_{kind}", None)
        return handler(line, t) if handler else []

    def _on_start(self, line: dict, t: float) -> list[Observation]:
        return [events.Hello(t=t, pid=TRACE_PID, torch=str(line.get("torch", "")), agent="trace",
                             devices=[TRACE_GPU], config={}, capabilities={}, watched=["trace"],
                             argv=str(line.get("scenario", "")))]

    def _on_compile_start(self, line: dict, t: float) -> list[Observation]:
        self.started[(line.get("trigger", ""), line.get("id", ""))] = t
        if "DYNAMO" in line.get("trigger", ""):
            self.compiling_since = t
        return []

    def _on_compile_end(self, line: dict, t: float) -> list[Observation]:
        trigger, cid = line.get("trigger", ""), str(line.get("id", ""))
        start = self.started.pop((trigger, cid), None)
        seconds = None if start is None else t - start
        if "CUDAGRAPH_RECORDING" in trigger:
            return [events.CudagraphRecord(t=t, pid=TRACE_PID, phase="record", compile_id=cid,
                                           key=None, shape=None, seconds=seconds)]
        self.compiling_since = None
        attempt = cid.rsplit("/", 1)[-1]
        common = dict(t=t, pid=TRACE_PID, compile_id=cid, function=None, seconds=seconds)
        if attempt.isdigit() and int(attempt) > 0:
            return [events.Recompile(reason=None, **common)]
        return [events.Compile(**common)]

    def _on_req(self, line: dict, t: float) -> list[Observation]:
        if not isinstance(line["shape"], list):
            raise ValueError("req shape is not a list")
        sizes = [int(v) for v in line["shape"]]
        shape, seconds, key = [sizes], float(line["ms"]) / 1e3, tuple(sizes)
        out: list[Observation] = []
        new = key not in self.seen
        if new:
            self.seen.add(key)
            out.append(events.NewShape(t=t, pid=TRACE_PID, name="trace", shape=shape,
                                       seconds=seconds, distinct=len(self.seen)))
        stalled = seconds >= self.stall_s
        if stalled:
            cause = "compile" if self.compiling_since is not None else None
            out.append(events.Stall(t=t, pid=TRACE_PID, name="trace", shape=shape,
                                    seconds=seconds, new_shape=new, cause=cause))
        out.extend(self._count_call(t, seconds, stalled))
        return out

    def _count_call(self, t: float, seconds: float, stalled: bool) -> list[Observation]:
        if self.window_start is None:
            self.window_start = t - seconds
        w = self.window
        w[0] += 1
        w[1] += seconds
        w[2] += stalled
        w[3] += seconds if stalled else 0.0
        if t - self.window_start < CALLS_WINDOW_S:
            return []
        calls = events.Calls(t=t, pid=TRACE_PID, name="trace", calls=w[0], seconds=w[1],
                             stall_calls=w[2], stall_seconds=w[3], distinct_shapes=len(self.seen),
                             window_s=t - self.window_start)
        self.window, self.window_start = [0, 0.0, 0, 0.0], t
        return [calls]

    def _on_nvml(self, line: dict, t: float) -> list[Observation]:
        used, total = int(line["used"]), int(line["total"])
        proc = line.get("proc")
        process = ProcessSample(pid=TRACE_PID, alive=True,
                                gpu_bytes={TRACE_GPU: None if proc is None else int(proc)})
        query = line.get("query_us")
        return [Sample(t=t, devices=(DeviceSample(TRACE_GPU, used, total, total - used),),
                       processes=(process,), query_s=None if query is None else query / 1e6)]

    def _on_crash(self, line: dict, t: float) -> list[Observation]:
        # what watch() reports when the CUDA error leaves the model call (FACTS #9)
        return [events.Oom(t=t, pid=TRACE_PID, source="exception", device=None,
                           requested_bytes=None, limit_bytes=None, free_bytes=None,
                           message=events.clip(str(line.get("error", "")), 500))]


class Reader:
    """One file's observations, in file order; `bad_lines` counts what could not be used."""

    def __init__(self, path: str):
        self.path = path
        self.bad_lines = 0
        self.adapter = TraceAdapter()

    def __iter__(self) -> Iterator[Observation]:
        with open_lines(self.path) as fh:
            for line in fh:
                if line.strip():
                    yield from self._parse(line)

    def _parse(self, line: str) -> list[Observation]:
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and "v" in obj:
                return [events.from_dict(obj)]
            if isinstance(obj, dict) and obj.get("kind") == "sample":  # the sidecar's own log
                return [sample_from_dict(obj)]
            if isinstance(obj, dict) and obj.get("kind") == "reload_outcome":  # ... outcomes
                return [outcome_from_dict(obj)]
            if isinstance(obj, dict) and obj.get("kind") == "config":  # ... and its config
                return [ConfigChange(float(obj["t"]), from_mapping(obj["config"]))]
            if isinstance(obj, dict) and isinstance(obj.get("t"), (int, float)):
                return self.adapter.feed(obj)
        except (ValueError, KeyError, TypeError, events.EventDecodeError):
            pass
        self.bad_lines += 1
        return []


PROGRESS_S = 5.0  # a long read says how far it got this often


def merged(readers: Iterable[Reader]) -> Iterator[Observation]:
    """All files' observations in time order (each file is already nearly ordered)."""
    return heapq.merge(*readers, key=lambda o: o.t)


def read_all(readers: list, progress: Optional[Callable[[str], None]] = None, label: str = "read",
             clock: Callable[[], float] = time.monotonic) -> Iterator[Observation]:
    """`merged(readers)`, with a line to `progress` every PROGRESS_S (a 10-hour sample log
    takes the better part of a minute)."""
    last, n = clock(), 0
    for obs in merged(readers):
        n += 1
        if progress is not None and n % 4096 == 0 and clock() - last >= PROGRESS_S:
            last = clock()
            progress(f"{label}: {n:,} records read, {sum(r.bad_lines for r in readers)} bad "
                     "lines so far")
        yield obs
