"""Fold agent events and source samples into one state, and name the causes of what is seen.

Deterministic and free of I/O: `apply(state, observation, cfg)` folds one observation into a
server's state, and `evaluate_causes(state, cfg)` names what it shows (the step calls both, for
the live daemon and for replay alike).

Causes (stable names, documented in the README):
The server's memory is its per-process GPU memory (NVML), else the device's used memory, else
(host-memory mode, no GPU) its RSS.

- `cudagraph_per_shape`: memory grows with each CUDA-graph recording; MB/graph is the slope of
  the server's memory on recordings, poll by poll (no intercept; one poll's growth above
  `jump_bytes` is an allocator or compile step and is kept out), with a confidence;
- `recompile_storm`: `storm_recompiles` recompiles of one process within `storm_window_s`;
- `recompile_limit_eager_fallback`: the agent saw the limit hit, or (recorded traces) a frame
  of one process reached the recompile limit and new shapes keep arriving without a compile;

Compiles and recompiles are counted per process: each worker of a multi-worker server compiles
its own frames (4 uvicorn workers each doing the normal compile + recompile were counted as one
frame's 8 attempts: a storm and an inferred fallback that did not happen). Distinct shapes are
unique across the server's processes: workers seeing the same sizes record the same count.
- `memory_growth_unexplained`: growth that neither recordings nor compiles explain.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

from torch_watchdog import events
from torch_watchdog.sidecar.config import CorrelateConfig
from torch_watchdog.sidecar.core.trend import Trend
from torch_watchdog.sidecar.core.observations import ProcessSample, Sample
from torch_watchdog.sidecar.core.results import Estimates

CAUSES = ("cudagraph_per_shape", "recompile_storm", "recompile_limit_eager_fallback",
          "memory_growth_unexplained")
MAX_SHAPE_KEYS = 200_000  # unique shapes remembered per server (a few MB), then counted
COMPILE_SETTLE_S = 10.0  # memory steps this long after a compile are the compile's
MAX_PADDED_MODELS = 64   # padded models tracked per server (their names label metrics)
PENDING_S = 60.0         # a step may belong to a compile still running (FACTS #7: 6-14 s each)


@dataclass
class Finding:
    t: float
    cause: str
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {**self.detail, "t": round(self.t, 3), "cause": self.cause}


@dataclass
class Regression:
    """y = b·x through the origin, accumulated one interval at a time."""
    n: int = 0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y

    @property
    def slope(self) -> Optional[float]:
        return self.sxy / self.sxx if self.sxx > 0 else None

    @property
    def confidence(self) -> float:
        """1 - (standard error / slope), clipped to [0, 1]."""
        b = self.slope
        if b is None or b <= 0 or self.n < 3:
            return 0.0
        residual = max(0.0, self.syy - 2 * b * self.sxy + b * b * self.sxx)
        se = math.sqrt(residual / (self.n - 1) / self.sxx)
        return max(0.0, min(1.0, 1.0 - se / b))


@dataclass
class State:
    first_t: Optional[float] = None
    now: float = 0.0
    pids: set[int] = field(default_factory=set)
    torch: Optional[str] = None
    recompile_limit: Optional[int] = None
    first_compile_t: Optional[float] = None
    first_hello_t: Optional[float] = None  # the server's warm-up counts from its first hello
    compiles: int = 0
    recompiles: int = 0
    compile_seconds: float = 0.0
    fx_cache_hits: int = 0         # Inductor FX-graph cache, as the agent reports (torch 2.6+)
    fx_cache_misses: int = 0
    # pid -> deque of recompile times
    recompile_times: dict[int, collections.deque[float]] = field(default_factory=dict)
    # (pid, frame id) -> compiles seen
    frame_attempts: dict[tuple[int, str], int] = field(default_factory=dict)
    limit_hits: int = 0
    limit_t: Optional[float] = None                      # the limit is reached (maybe inferred)
    limit_frame: Optional[tuple[int, str]] = None        # (pid, frame id)
    new_shapes_after_limit: int = 0
    records: int = 0
    warmups: int = 0
    graph_breaks: int = 0
    ooms: int = 0
    agent_dropped: int = 0
    # pid -> reason -> the highest `total` its agent's drop reports gave, and "" -> the
    # highest `lost` its heartbeats gave (every reason at once)
    dropped_totals: dict[int, dict[str, int]] = field(default_factory=dict)
    distinct_shapes: int = 0
    # unique shapes per watched callable over all processes: name -> set of shape keys (at
    # most MAX_SHAPE_KEYS in all, then counted), and the most any one process reported
    shape_keys: dict[str, set[Any]] = field(default_factory=dict)
    shape_overflow: dict[str, int] = field(default_factory=dict)
    shape_floor: dict[str, int] = field(default_factory=dict)
    # name -> its part of distinct_shapes
    shape_counted: dict[str, int] = field(default_factory=dict)
    shape_keys_n: int = 0
    requests: int = 0
    # (t, calls, seconds, stall calls, stall seconds) of each `calls` event
    calls: collections.deque[tuple[float, int, float, int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=10_000))
    steady_totals: tuple[int, float] = (0, 0.0)         # non-stall calls, their seconds
    steady_at_limit: Optional[tuple[int, float]] = None  # steady_totals when the limit came
    stalls: int = 0
    stall_seconds: float = 0.0
    stall_causes: collections.Counter[str] = field(default_factory=collections.Counter)
    # memory: the server's (per-process GPU bytes, else device used), and the device
    mem_bytes: Optional[int] = None
    mem_source: Optional[str] = None                     # "process" | "device" | "rss"
    mem_start: Optional[int] = None
    proc_bytes: dict[int, int] = field(default_factory=dict)  # pid -> its memory, same meter
    device_used: Optional[int] = None
    device_total: Optional[int] = None
    device_usable: Optional[int] = None  # used + free: total less what the driver reserves
    host_used: Optional[int] = None
    host_total: Optional[int] = None
    host_available: Optional[int] = None
    # host-memory mode: the server's cgroup memory limit (the lowest of its processes')
    mem_limit: Optional[int] = None
    # per GPU of this server: uuid -> (device used, usable = used + free, this server's bytes
    # there or None): each GPU is forecast against its own budget (FACTS #18: summing two GPUs
    # into one budget let a replica crash with no forecast)
    gpus: dict[str, tuple[int, int, Optional[int]]] = field(default_factory=dict)
    gpu_down: bool = False                               # NVML down or late at the last poll
    trend: Trend = field(default_factory=Trend)  # the memory of each poll, and its growth
    regression: Regression = field(default_factory=Regression)
    records_at_last_sample: int = 0
    compile_jump_bytes: int = 0
    # (t, bytes) not yet attributed
    pending_jumps: list[tuple[float, int]] = field(default_factory=list)
    last_compile_end: float = -math.inf
    active: dict[str, Finding] = field(default_factory=dict)  # cause -> Finding
    findings: list[Finding] = field(default_factory=list)
    # the agent's padding (watch(..., pad=...)), per watched model: the latest `padding`
    # totals and plan, and whether a check refused it (mitigation `padding` `refused`)
    # model -> dict (padding_view)
    padding: dict[str, dict[str, Any]] = field(default_factory=dict)

    # -- derived ------------------------------------------------------------------------
    @property
    def mb_per_graph(self) -> Optional[float]:
        """None until recordings are seen to cost memory: a small model's graphs cost less
        than the allocator's own steps, and a slope <= 0 is noise, not a cost."""
        b = self.regression.slope
        return None if b is None or b <= 0 else b / 1e6

    def explained_bytes(self) -> float:
        b = self.regression.slope or 0.0
        return max(0.0, b) * self.records

    def unexplained_bytes(self) -> float:
        """Growth of the server's memory that recordings and compiles do not account for.
        A recent step is not counted yet: the compile behind it reports only when it ends."""
        mem, start = self.mem_bytes, self.mem_start
        if mem is None or start is None:
            return 0.0
        floor = self.trend.floor  # growth that lasts: a sawtooth's peaks are not counted
        if floor is not None and floor < mem:
            mem = floor
        undecided = sum(b for t, b in self.pending_jumps if b > 0 and t > self.now - PENDING_S) \
            if self.pending_jumps else 0
        return max(0.0, mem - start - self.explained_bytes() - self.compile_jump_bytes -
                   undecided)

    def steady_ms(self, part: str = "all") -> Optional[float]:
        """Mean latency of the calls that were not stalls (from the agent's `calls` windows):
        "all", or "before"/"after" the recompile limit was reached."""
        calls, seconds = self.steady_totals
        if part != "all":
            at = self.steady_at_limit
            if at is None:
                return None
            calls, seconds = at if part == "before" else (calls - at[0], seconds - at[1])
        return 1e3 * seconds / calls if calls > 0 else None

    def estimates(self, cfg: CorrelateConfig) -> Estimates:
        limit_t = self.limit_t
        enough = self.records >= cfg.min_records
        before = self.steady_ms("before" if limit_t is not None else "all")
        after = self.steady_ms("after") if limit_t is not None else None
        return {
            "mb_per_graph": _round(self.mb_per_graph, 4) if enough else None,
            "mb_per_graph_confidence": round(self.regression.confidence, 3) if enough else None,
            "recordings": self.records, "warmups": self.warmups,
            "distinct_shapes": self.distinct_shapes, "requests": self.requests,
            "compiles": self.compiles, "recompiles": self.recompiles,
            "compile_seconds": round(self.compile_seconds, 3),
            "fx_cache_hits": self.fx_cache_hits, "fx_cache_misses": self.fx_cache_misses,
            "recompile_limit_hits": self.limit_hits, "graph_breaks": self.graph_breaks,
            "stalls": self.stalls, "stall_seconds": round(self.stall_seconds, 3),
            "ooms": self.ooms, "memory_source": self.mem_source,
            "memory_bytes": self.mem_bytes, "memory_growth_bytes":
                None if self.mem_bytes is None or self.mem_start is None
                else self.mem_bytes - self.mem_start,
            "explained_by_recordings_bytes": round(self.explained_bytes()),
            "unexplained_bytes": round(self.unexplained_bytes()),
            "device_used_bytes": self.device_used, "device_total_bytes": self.device_total,
            "steady_ms": _round(before, 3), "steady_ms_after_fallback": _round(after, 3),
            "padding": {m: dict(v, buckets=list(v["buckets"]), max_error=dict(v["max_error"]))
                        for m, v in self.padding.items()},
        }

    def padding_refused(self) -> dict[str, dict[str, Any]]:
        """Models whose padding a check refused: model -> {error, detail, t}."""
        return {m: {"error": v.get("error"), "detail": v.get("refused"), "t": v.get("off_t")}
                for m, v in self.padding.items() if v.get("refused")}


def _shape_key(shape: Any) -> Any:
    """A shape as a set member: a tuple of tuples (the agent sends lists), else its repr."""
    try:
        return tuple([tuple(dims) if isinstance(dims, list) else dims for dims in shape])
    except TypeError:
        return repr(shape)


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def apply(state: State, obs: events.Event | Sample, cfg: CorrelateConfig,
          attribution: str = "auto") -> None:
    """Fold one observation into `state`: an agent event of the server's, or a sample as the
    server sees it (its processes and GPUs; `attribution`: config gpu.attribution). The causes
    are evaluated apart (`evaluate_causes`): once a poll, not once an event."""
    t = obs.t
    if state.first_t is None:
        state.first_t = t
    if t > state.now:
        state.now = t
    if isinstance(obs, Sample):
        _sample(state, obs, cfg, attribution)
        return
    state.pids.add(obs.pid)
    handler = _EVENT_HANDLERS.get(obs.kind)
    if handler is not None:
        handler(state, obs, cfg)


# -- events -------------------------------------------------------------------------------
def _on_hello(state: State, e: events.Hello, cfg: CorrelateConfig) -> None:
    state.torch = e.torch
    if state.first_hello_t is None:
        state.first_hello_t = e.t
    limit = e.config.get("recompile_limit", e.config.get("cache_size_limit"))
    if isinstance(limit, int) and not isinstance(limit, bool):
        state.recompile_limit = limit


def _on_compile(state: State, e: Any, cfg: CorrelateConfig) -> None:
    recompile = e.kind == "recompile"
    state.recompiles += recompile
    state.compiles += not recompile
    state.compile_seconds += e.seconds or 0.0
    state.fx_cache_hits += e.fx_cache_hits or 0
    state.fx_cache_misses += e.fx_cache_misses or 0
    if state.first_compile_t is None:
        state.first_compile_t = e.t
    if recompile:
        times = state.recompile_times.get(e.pid)
        if times is None:
            times = state.recompile_times[e.pid] = collections.deque()
        times.append(e.t)
    start = e.t - (e.seconds or 0.0)
    state.last_compile_end = max(state.last_compile_end, e.t)
    # memory steps seen while this compile ran (its event comes at the end) are its own
    for jt, size in list(state.pending_jumps):
        if start - 1.0 <= jt <= e.t + COMPILE_SETTLE_S:
            state.compile_jump_bytes += size
            state.pending_jumps.remove((jt, size))
    frame = (e.pid, (e.compile_id or "").split("/")[0])
    attempts = state.frame_attempts[frame] = state.frame_attempts.get(frame, 0) + 1
    limit = state.recompile_limit or cfg.default_recompile_limit
    if state.limit_hits:
        return  # the agent told us when the limit was hit; nothing to infer
    if attempts == limit:
        state.limit_t, state.limit_frame = e.t, frame  # the fallback shows once new shapes
        state.new_shapes_after_limit = 0               # stop compiling
        state.steady_at_limit = state.steady_totals
    elif attempts > limit and frame == state.limit_frame:
        state.limit_t = None  # it compiled again: the limit is not what we assumed


def _on_limit(state: State, e: events.RecompileLimit, cfg: CorrelateConfig) -> None:
    state.limit_hits += 1
    state.limit_t, state.steady_at_limit = e.t, state.steady_totals
    _activate(state, e.t, "recompile_limit_eager_fallback", {
        "source": "agent", "function": e.function, "limit": e.limit, "last_reason": e.reason,
        "recompiles": state.recompiles, "steady_ms_before": _round(state.steady_ms("before"), 3)})


def _on_record(state: State, e: events.CudagraphRecord, cfg: CorrelateConfig) -> None:
    if e.phase == "record":
        state.records += 1
    else:
        state.warmups += 1


def _on_new_shape(state: State, e: events.NewShape, cfg: CorrelateConfig) -> None:
    name = e.name
    keys = state.shape_keys.setdefault(name, set())
    key = _shape_key(e.shape)
    if key not in keys:
        if state.shape_keys_n < MAX_SHAPE_KEYS:
            keys.add(key)
            state.shape_keys_n += 1
        else:
            state.shape_overflow[name] = state.shape_overflow.get(name, 0) + 1
    # a process's own count covers its new_shape events the sidecar never got (dropped)
    floor = state.shape_floor[name] = max(state.shape_floor.get(name, 0), e.distinct)
    counted = max(floor, len(keys) + state.shape_overflow.get(name, 0))
    was = state.shape_counted.get(name, 0)
    if counted != was:
        state.distinct_shapes += counted - was
        state.shape_counted[name] = counted
    if state.limit_t is not None and e.t > state.limit_t and state.limit_hits == 0:
        if e.t > state.last_compile_end:
            state.new_shapes_after_limit += 1


def _on_stall(state: State, e: events.Stall, cfg: CorrelateConfig) -> None:
    state.stalls += 1
    state.stall_seconds += e.seconds
    state.stall_causes[e.cause or "unknown"] += 1


def _on_calls(state: State, e: events.Calls, cfg: CorrelateConfig) -> None:
    state.requests += e.calls
    state.calls.append((e.t, e.calls, e.seconds, e.stall_calls, e.stall_seconds))
    calls, seconds = state.steady_totals
    state.steady_totals = (calls + e.calls - e.stall_calls, seconds + e.seconds - e.stall_seconds)


def _count(attr: str) -> Callable[[State, Any, CorrelateConfig], None]:
    def handler(state: State, e: Any, cfg: CorrelateConfig) -> None:
        setattr(state, attr, getattr(state, attr) + 1)
    return handler


def _on_dropped(state: State, e: events.Dropped, cfg: CorrelateConfig) -> None:
    # a report's `total` counts every loss since its agent started: a report lost on the way
    # is counted by the next one (summing `count` would lose it for good)
    _told_lost(state, e.pid, e.reason, e.total)


def _on_heartbeat(state: State, e: events.Heartbeat, cfg: CorrelateConfig) -> None:
    # every heartbeat's `lost` is the agent's whole count: exact once one heartbeat arrives
    # after the drops, whatever became of the drop reports
    if isinstance(e.lost, int):
        _told_lost(state, e.pid, "", e.lost)


def _told_lost(state: State, pid: int, reason: str, total: int) -> None:
    """An agent's loss count, per reason (a drop report) or all at once (reason "", a
    heartbeat): the agent's part of agent_dropped is the larger of the two readings."""
    totals = state.dropped_totals.setdefault(pid, {})
    if total <= totals.get(reason, 0):
        return
    before = _lost_of(totals)
    totals[reason] = total
    state.agent_dropped += _lost_of(totals) - before


def _lost_of(totals: dict[str, int]) -> int:
    return max(totals.get("", 0), sum(v for r, v in totals.items() if r))


def _padding(state: State, model: str) -> dict[str, Any]:
    v = state.padding.get(model)
    if v is None:
        if len(state.padding) >= MAX_PADDED_MODELS:  # names come from the agent: bounded
            return {}
        v = state.padding[model] = {"on": True, "buckets": [], "calls": 0, "padded_calls": 0,
                                    "real_tokens": 0, "padding_tokens": 0, "padding_fraction":
                                    None, "checks": 0, "check_seconds": 0.0, "max_error": {},
                                    "recordings_saved": 0, "error": None, "refused": None,
                                    "off_t": None}
    return v


def _on_padding(state: State, e: events.Padding, cfg: CorrelateConfig) -> None:
    v = _padding(state, e.name)
    if not v:
        return
    total = e.real_tokens + e.padding_tokens
    v.update(on=e.on and not v["refused"], buckets=list(e.buckets), calls=e.calls,
             padded_calls=e.padded_calls, real_tokens=e.real_tokens,
             padding_tokens=e.padding_tokens, checks=e.checks, check_seconds=e.check_seconds,
             max_error=dict(e.max_error), recordings_saved=e.recordings_saved,
             checks_skipped=e.checks_skipped or 0, checks_stopped=e.checks_stopped,
             check_pool=e.check_pool,
             padding_fraction=round(e.padding_tokens / total, 6) if total else None)


def _on_mitigation(state: State, e: events.Mitigation, cfg: CorrelateConfig) -> None:
    if e.name != "padding" or not e.model:
        return
    v = _padding(state, e.model)
    if not v:
        return
    if e.buckets is not None:
        v["buckets"] = list(e.buckets)
    if e.action == "refused":
        v.update(on=False, refused=e.detail, error=e.error, off_t=e.t)


_EVENT_HANDLERS: dict[str, Callable[[State, Any, CorrelateConfig], None]] = {
    "hello": _on_hello, "compile": _on_compile, "recompile": _on_compile,
    "recompile_limit": _on_limit, "cudagraph_record": _on_record, "new_shape": _on_new_shape,
    "stall": _on_stall, "calls": _on_calls, "oom": _count("ooms"), "dropped": _on_dropped,
    "heartbeat": _on_heartbeat,
    "graph_break": _count("graph_breaks"), "padding": _on_padding,
    "mitigation": _on_mitigation,
}


# -- samples ------------------------------------------------------------------------------
def _server_memory(sample: Sample, attribution: str) -> tuple[Optional[int], Optional[str]]:
    """Per-process GPU bytes of the server's processes when NVML says, else the device's used
    (`attribution`, config gpu.attribution: "process" never falls back to the device, so a
    shared GPU's other tenants are never taken for the server; "device" always uses it). In a
    pod without hostPID NVML lists host pids that match none of the server's: auto then
    meters the pod's GPUs as a whole."""
    procs = sample.processes
    per_process = [p.gpu_total for p in procs if p.alive]
    if attribution != "device" and per_process and all(v is not None for v in per_process):
        return sum(cast("list[int]", per_process)), "process"  # all() above: no None
    if sample.devices and attribution != "process":
        return sum(d.used_bytes for d in sample.devices), "device"
    if sample.devices:
        return None, None  # process only, and NVML does not list the server's processes
    rss = [p.host_bytes for p in procs if p.alive]
    if rss and all(v is not None for v in rss):  # host-memory mode: no GPU (PSS, else RSS)
        return sum(cast("list[int]", rss)), "rss"  # all() above: no None
    return None, None


def _sample(state: State, s: Sample, cfg: CorrelateConfig, attribution: str) -> None:
    if not s.nvml_up and state.gpus:
        # NVML down or late: the GPUs' numbers are unknown now; the last ones must not feed
        # the forecast, and this poll has no memory reading
        state.gpus, state.device_used, state.device_total = {}, None, None
        state.device_usable, state.gpu_down = None, True
        return
    if s.devices:
        state.gpu_down = False
        procs = [p for p in s.processes if p.alive]
        # one pass over the GPUs, summed in order
        gpus, used_sum, total_sum, usable_sum = {}, 0, 0, 0
        for d in s.devices:
            used, total = d.used_bytes, d.total_bytes
            # NVML v2: free = total - reserved - used; the reserved part (645 MB on an H200)
            # can never be allocated, so the budget is used + free (ops-anchors §1)
            usable = total if d.free_bytes is None else used + d.free_bytes
            gpus[d.uuid] = (used, usable, _bytes_on(procs, d.uuid))
            used_sum, total_sum, usable_sum = used_sum + used, total_sum + total, \
                usable_sum + usable
        state.gpus, state.device_used = gpus, used_sum
        state.device_total, state.device_usable = total_sum, usable_sum
    _host(state, s)
    mem, source = _server_memory(s, attribution)
    if mem is None:
        return
    assert source is not None  # _server_memory gives a source with every memory reading
    state.proc_bytes = _per_process(s, source)
    _memory(state, s, mem, source, cfg)



def _host(state: State, s: Sample) -> None:
    if s.host_total_bytes is not None and s.host_available_bytes is not None:
        state.host_used = s.host_total_bytes - s.host_available_bytes
        state.host_total = s.host_total_bytes
        state.host_available = s.host_available_bytes
        limits = [p.mem_limit_bytes for p in s.processes if p.alive and
                  p.mem_limit_bytes is not None]
        state.mem_limit = min(limits) if limits else None


def _memory(state: State, s: Sample, mem: int, source: str, cfg: CorrelateConfig) -> None:
    if source != state.mem_source:  # a new meter: never regress across the change
        state.mem_source, state.mem_start, state.mem_bytes = source, mem, mem
        state.trend = Trend(cfg.jump_bytes)
        state.records_at_last_sample = state.records
        return
    assert state.mem_bytes is not None  # set with mem_source, never None again: the same meter
    delta, recorded = mem - state.mem_bytes, state.records - state.records_at_last_sample
    state.mem_bytes, state.records_at_last_sample = mem, state.records
    if _loading(state, s.t):  # loading weights and the first compile are not growth to
        state.trend = Trend(cfg.jump_bytes)  # forecast: the trend starts after them
    state.trend.jump_bytes = cfg.jump_bytes
    state.trend.append(s.t, mem, state.records)
    if _settling(state, s.t) and state.records == 0:
        state.mem_start = mem
        state.compile_jump_bytes = 0
        state.pending_jumps = []
        return
    if abs(delta) > cfg.jump_bytes:
        if s.t <= state.last_compile_end + COMPILE_SETTLE_S:
            state.compile_jump_bytes += delta
        else:
            state.pending_jumps.append((s.t, delta))
            state.pending_jumps = [j for j in state.pending_jumps if j[0] > s.t - 2 * PENDING_S]
        return
    if state.records > 0:  # the regression starts with the first recording
        state.regression.add(recorded, delta)


def _per_process(s: Sample, source: str) -> dict[int, int]:
    """Each live process's memory on the server's meter (none on a device-level meter)."""
    if source == "device":
        return {}
    out = {}
    for p in s.processes:
        if p.alive:
            v = p.gpu_total if source == "process" else p.host_bytes
            if v is not None:
                out[p.pid] = v
    return out


def _bytes_on(procs: list[ProcessSample], uuid: str) -> Optional[int]:
    """The processes' bytes on one GPU; None when NVML does not say for one of them."""
    values = [p.gpu_bytes.get(uuid, 0) for p in procs]
    return None if not procs or any(v is None for v in values) else \
        sum(cast("list[int]", values))  # any() above: no None


def _loading(state: State, t: float) -> bool:
    """Before the first recording, settling from the first compile (not a later one)."""
    return not state.records and _settling(state, t, state.first_compile_t)


def _settling(state: State, t: float, compiled: Optional[float] = None) -> bool:
    """Within a compile's settling time (the last one's, or `compiled`'s), or (no compile
    seen) the first minute."""
    if state.first_compile_t is None:
        return state.first_t is None or t < state.first_t + PENDING_S
    return t < (state.last_compile_end if compiled is None else compiled) + COMPILE_SETTLE_S


# -- causes -------------------------------------------------------------------------------
def _activate(state: State, t: float, cause: str, detail: dict[str, Any]) -> None:
    if cause not in state.active:
        finding = Finding(t, cause, detail)
        state.active[cause] = finding
        state.findings.append(finding)


def evaluate_causes(state: State, cfg: CorrelateConfig) -> None:
    t = state.now
    in_window = 0
    for pid, times in list(state.recompile_times.items()) if state.recompile_times else ():
        while times and times[0] < t - cfg.storm_window_s:
            times.popleft()
        if not times:
            del state.recompile_times[pid]
        in_window = max(in_window, len(times))
    if in_window >= cfg.storm_recompiles:
        _activate(state, t, "recompile_storm", {
            "recompiles_in_window": in_window, "window_s": cfg.storm_window_s,
            "compile_seconds": round(state.compile_seconds, 3)})
    elif "recompile_storm" in state.active and not state.recompile_times:
        del state.active["recompile_storm"]
    if (state.limit_t is not None and state.limit_hits == 0
            and state.new_shapes_after_limit >= cfg.fallback_new_shapes):
        _activate(state, t, "recompile_limit_eager_fallback", {
            "source": "inferred", "limit": state.recompile_limit or cfg.default_recompile_limit,
            "recompiles": state.recompiles, "reached_at": round(state.limit_t, 3),
            "new_shapes_without_compile": state.new_shapes_after_limit,
            "steady_ms_before": _round(state.steady_ms("before"), 3)})
    # an active cause stays as it is (_activate): not computed again every poll and server
    b = state.mb_per_graph if "cudagraph_per_shape" not in state.active and \
        state.records >= cfg.min_records else None
    if (b is not None and b > 0
            and (conf := state.regression.confidence) >= cfg.min_confidence):
        _activate(state, t, "cudagraph_per_shape", {
            "recordings": state.records, "distinct_shapes": state.distinct_shapes,
            "mb_per_graph": round(b, 4), "confidence": round(conf, 3),
            "mb_so_far": round(b * state.records, 1)})
    # before a memory reading nothing is unexplained (a threshold of 0 must not fire then)
    if "memory_growth_unexplained" not in state.active and state.mem_bytes is not None and \
            state.mem_start is not None and state.unexplained_bytes() >= cfg.unexplained_bytes:
        _activate(state, t, "memory_growth_unexplained", {
            "unexplained_mb": round(state.unexplained_bytes() / 1e6, 1),
            "growth_mb": round((state.mem_bytes - state.mem_start) / 1e6, 1)})
