"""Recorded inputs → the pipeline's observations (agent events and samples), for replay.

Reads `.jsonl` and `.jsonl.gz`, line by line, of three kinds:
- the agent's event log (schema v1, lines with `"v"`), decoded strictly;
- the sidecar's own sample log (`"kind": "sample"` lines, with the agent events it received,
  a `"kind": "config"` line at start and after each SIGHUP, and the reload history at start);
- the recorded-trace format of tests/fixtures/README.md (`start`, `req`,
  `compile_start`/`compile_end`, `nvml`, `crash`, …): translated into what the agent and the
  sidecar's sources would have
  produced (NewShape/Stall/Calls from `req`, Compile/Recompile/CudagraphRecord from the
  callbacks, a Sample from `nvml`), so replay runs the very same fold as the live daemon.
Several files are merged by time. Bad lines are counted, never fatal; a file that cannot be
read, or of which no line can be used, is (InputError, naming the file).
"""
from __future__ import annotations

import collections
import heapq
import itertools
import json
import math
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from torch_watchdog import events
from torch_watchdog.jsonl import InputError, read_lines
from torch_watchdog.sidecar.config import from_mapping
from torch_watchdog.sidecar.core.observations import (ConfigChange, DeviceSample,
                                                      OperatorRequest, ProcessSample,
                                                      RecordUnreadable, ReloadHistory,
                                                      ReloadOutcome, Sample, ServersKnown)
from torch_watchdog.sidecar.offline.sample_log import history_from_dict, known_from_dict, \
    outcome_from_dict, request_from_dict, sample_from_dict, unreadable_from_dict

Observation = Union[events.Event, Sample, ConfigChange, ReloadOutcome, RecordUnreadable,
                    ReloadHistory, ServersKnown, OperatorRequest]
TRACE_PID = 1
TRACE_GPU = "GPU-recorded-trace"
CALLS_WINDOW_S = 2.0  # like the agent's default heartbeat
STALL_S = 0.05        # the agent's default stall threshold


class TraceAdapter:
    """Turns recorded-trace lines into the observations a live sidecar would have seen."""

    def __init__(self, stall_s: float = STALL_S):
        self.stall_s = stall_s
        self.seen: set[Any] = set()
        self.started: dict[tuple[str, str], float] = {}
        self.window = [0, 0.0, 0, 0.0]  # calls, seconds, stall calls, stall seconds
        self.window_start: Optional[float] = None
        self.compiling_since: Optional[float] = None

    def feed(self, line: dict[str, Any]) -> list[Observation]:
        kind, t = line.get("kind"), _time(line)
        handler = getattr(self, f"_on_{kind}", None)
        return handler(line, t) if handler else []

    def _on_start(self, line: dict[str, Any], t: float) -> list[Observation]:
        return [events.Hello(t=t, pid=TRACE_PID, torch=str(line.get("torch", "")), agent="trace",
                             devices=[TRACE_GPU], config={}, capabilities={}, watched=["trace"],
                             argv=str(line.get("scenario", "")))]

    def _on_compile_start(self, line: dict[str, Any], t: float) -> list[Observation]:
        self.started[(line.get("trigger", ""), line.get("id", ""))] = t
        if "DYNAMO" in line.get("trigger", ""):
            self.compiling_since = t
        return []

    def _on_compile_end(self, line: dict[str, Any], t: float) -> list[Observation]:
        trigger, cid = line.get("trigger", ""), str(line.get("id", ""))
        start = self.started.pop((trigger, cid), None)
        seconds = None if start is None else t - start
        if "CUDAGRAPH_RECORDING" in trigger:
            return [events.CudagraphRecord(t=t, pid=TRACE_PID, phase="record", compile_id=cid,
                                           key=None, shape=None, seconds=seconds)]
        self.compiling_since = None
        attempt = cid.rsplit("/", 1)[-1]
        if attempt.isdigit() and int(attempt) > 0:
            return [events.Recompile(t=t, pid=TRACE_PID, compile_id=cid, function=None,
                                     seconds=seconds, reason=None)]
        return [events.Compile(t=t, pid=TRACE_PID, compile_id=cid, function=None, seconds=seconds)]

    def _on_req(self, line: dict[str, Any], t: float) -> list[Observation]:
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
        calls = events.Calls(t=t, pid=TRACE_PID, name="trace", calls=int(w[0]), seconds=w[1],
                             stall_calls=int(w[2]), stall_seconds=w[3],
                             distinct_shapes=len(self.seen),
                             window_s=t - self.window_start)
        self.window, self.window_start = [0, 0.0, 0, 0.0], t
        return [calls]

    def _on_nvml(self, line: dict[str, Any], t: float) -> list[Observation]:
        used, total = int(line["used"]), int(line["total"])
        proc = line.get("proc")
        process = ProcessSample(pid=TRACE_PID, alive=True,
                                gpu_bytes={TRACE_GPU: None if proc is None else int(proc)})
        query = line.get("query_us")
        return [Sample(t=t, devices=(DeviceSample(TRACE_GPU, used, total, total - used),),
                       processes=(process,), query_s=None if query is None else query / 1e6)]

    def _on_crash(self, line: dict[str, Any], t: float) -> list[Observation]:
        # what watch() reports when the CUDA error leaves the model call: the crash on a GPU
        # bypasses the allocator, so its OOM observer never fires (h200-oom300)
        return [events.Oom(t=t, pid=TRACE_PID, source="exception", device=None,
                           requested_bytes=None, limit_bytes=None, free_bytes=None,
                           message=events.clip(str(line.get("error", "")), 500))]


class Reader:
    """One file's observations, in file order; `bad_lines` counts what could not be used.
    A file that cannot be read (`jsonl.read_lines`), or none of whose lines can be used,
    raises InputError naming it: a wrong file is said so, not replayed as an empty one."""

    def __init__(self, path: str):
        self.path = path
        self.bad_lines = 0
        self.used_lines = 0      # lines that were events, samples, configs or trace lines
        self.first_bad: Optional[tuple[int, str]] = None  # (line number, what is wrong)
        self.ignored: set[Any] = set()  # recorded-trace kinds replay has no use for ("ballast")
        self.adapter = TraceAdapter()
        self.sidecar = False      # a sidecar's sample log: its events are what it was sent
        self.said_hello: set[int] = set()

    def __iter__(self) -> Iterator[Observation]:
        lines = 0
        for lineno, line in enumerate(read_lines(self.path), 1):
            if line.strip():
                lines += 1
                yield from self._parse(line, lineno)
        if self.used_lines == 0:
            raise InputError(self.path, self._nothing_usable(lines))

    def _nothing_usable(self, lines: int) -> str:
        if lines == 0:
            return "no lines, only blank space"
        if self.first_bad is not None:
            lineno, why = self.first_bad
            return (f"nothing usable: {self.bad_lines:,} unreadable line(s), none an agent "
                    f"event, a sidecar sample or a recorded-trace line (line {lineno}: {why})")
        return f"nothing usable: only trace lines of kind(s) {sorted(self.ignored)}"

    # over the complexity bound: one branch per line kind, in the order tried
    def _parse(self, line: str, lineno: int = 0) -> list[Observation]:  # noqa: C901
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            return self._bad(lineno, "not JSON")
        if not isinstance(obj, dict):
            return self._bad(lineno, f"a JSON {type(obj).__name__}, not an object")
        try:
            if "v" in obj:
                out: list[Observation] = self._event(events.from_dict(obj))
            elif obj.get("kind") == "sample":  # the sidecar's own log
                out = [sample_from_dict(obj)]
            elif obj.get("kind") == "reload_outcome":  # ... the reloads' outcomes
                out = [outcome_from_dict(obj)]
            elif obj.get("kind") == "record_unreadable":  # ... a record found untrustworthy
                out = [unreadable_from_dict(obj)]
            elif obj.get("kind") == "reload_history":  # ... the reloads before its start
                out = [history_from_dict(obj)]
            elif obj.get("kind") == "servers_known":  # ... the servers known at its start
                out = [known_from_dict(obj)]
            elif obj.get("kind") == "operator_request":  # ... what an operator asked
                out = [request_from_dict(obj)]
            elif obj.get("kind") == "config":  # ... and its config
                out = [ConfigChange(_time(obj), from_mapping(obj["config"], recorded=True))]
            elif "t" in obj:
                _time(obj)
                if not hasattr(self.adapter, f"_on_{obj.get('kind')}"):
                    self.ignored.add(str(obj.get("kind")))
                    return []
                out = self.adapter.feed(obj)
            else:
                return self._bad(lineno, "a JSON object without `v` (event) or `t` (trace)")
        except events.EventDecodeError as e:
            return self._bad(lineno, str(e))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return self._bad(lineno, f"bad {obj.get('kind')!s:.40} line ({type(e).__name__}: "
                                     f"{e!s:.80})")
        if "v" not in obj and "kind" in obj and obj["kind"] in SIDECAR_KINDS:
            self.sidecar = True
        self.used_lines += 1
        return out

    def _event(self, event: events.Event) -> list[Observation]:
        """An agent's event log read alone (rotated, or cut) may start without its hello: the
        pid is then the one agent the file is from, said so, as the live sidecar heard it from
        the hello the file lacks. A sidecar's sample log is replayed as it was received."""
        if isinstance(event, events.Hello) or self.sidecar:
            self.said_hello.add(event.pid)
            return [event]
        if event.pid in self.said_hello:
            return [event]
        self.said_hello.add(event.pid)
        return [events.Hello(t=event.t, pid=event.pid, torch="", agent="event log without a hello",
                             devices=[], config={}, capabilities={}, watched=[], argv=""), event]

    def _bad(self, lineno: int, why: str) -> list[Observation]:
        self.bad_lines += 1
        if self.first_bad is None:
            self.first_bad = (lineno, why)
        return []


def _time(obj: dict[str, Any]) -> float:
    """A line's `t`: a finite number of seconds, never a bool."""
    t = obj["t"]
    if type(t) not in (int, float) or not math.isfinite(t):
        raise ValueError(f"t is {t!r:.40}, not a number of seconds")
    return float(t)


SIDECAR_KINDS = frozenset({"sample", "reload_outcome", "record_unreadable", "reload_history",
                           "servers_known", "operator_request", "config"})
PROGRESS_S = 5.0  # a long read says how far it got this often
DUPLICATE_S = 1.0  # files are nearly ordered: an event's twin in another file is this close


def merged(readers: Iterable[Reader]) -> Iterator[tuple[Observation, int]]:
    """All files' observations in time order (each file is already nearly ordered), each with
    the index of its file."""
    tagged = [zip(reader, itertools.repeat(i)) for i, reader in enumerate(readers)]
    return heapq.merge(*tagged, key=lambda pair: pair[0].t)


def read_all(readers: Sequence[Reader], progress: Optional[Callable[[str], None]] = None,
             label: str = "read",
             clock: Callable[[], float] = time.monotonic) -> Iterator[Observation]:
    """`merged(readers)`, with a line to `progress` every PROGRESS_S (a 10-hour sample log
    takes the better part of a minute). An agent event that another file holds too (the
    sidecar's sample log keeps every event it received; the agent's own log has them all) is
    taken once: the same event is the same line, at the same time."""
    last, n = clock(), 0
    seen: dict[bytes, int] = {}                       # an event's line -> the file it came from
    recent: collections.deque[tuple[float, bytes]] = collections.deque()
    for obs, source in merged(readers):
        n += 1
        if progress is not None and n % 4096 == 0 and clock() - last >= PROGRESS_S:
            last = clock()
            progress(f"{label}: {n:,} records read, {sum(r.bad_lines for r in readers)} bad "
                     "lines so far")
        if len(readers) > 1 and isinstance(obs, events.Event):
            while recent and recent[0][0] < obs.t - DUPLICATE_S:
                seen.pop(recent.popleft()[1], None)
            key = events.encode(obs)
            first = seen.get(key)
            if first is None:
                seen[key] = source
                recent.append((obs.t, key))
            elif first != source:
                continue
        yield obs
