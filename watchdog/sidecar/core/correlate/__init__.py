"""Fold agent events and source samples into a server's state, and name the causes of what is
seen.

Deterministic and free of I/O: `apply(state, observation, cfg)` folds one observation into a
server's state, and `evaluate_causes(state, cfg)` names what it shows (the step calls both, for
the live daemon and for replay alike). The state is in parts, each with its own fold:
`compiles`, `shapes`, `calls`, `memory`, `padding`, `freeze` and `losses` (this package's modules).

The server's memory is its per-process GPU memory (NVML), else the device's used memory, else
(host-memory mode, no GPU) its PSS or RSS. Causes (stable names, documented in the README):
- `cudagraph_per_shape`: memory grows with each CUDA-graph recording (memory.py: MB per graph,
  with a confidence);
- `recompile_storm`: `storm_recompiles` recompiles of one process within `storm_window_s`;
- `recompile_limit_eager_fallback`: the agent saw the limit hit, or (recorded traces) a frame
  of one process reached the recompile limit and new shapes keep arriving without a compile;
- `memory_growth_unexplained`: growth that neither recordings nor compiles explain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from torch_watchdog import events
from torch_watchdog.sidecar.config.schema import CorrelateConfig
from torch_watchdog.sidecar.core.correlate.calls import Calls
from torch_watchdog.sidecar.core.correlate.compiles import Compiles
from torch_watchdog.sidecar.core.correlate.freeze import Freeze
from torch_watchdog.sidecar.core.correlate.losses import Losses
from torch_watchdog.sidecar.core.correlate.memory import COMPILE_SETTLE_S, PENDING_S, Memory
from torch_watchdog.sidecar.core.correlate.padding import Padding
from torch_watchdog.sidecar.core.correlate.shapes import Shapes
from torch_watchdog.sidecar.core.observations import Sample
from torch_watchdog.sidecar.core.results import Estimates

MAX_POOL_PIDS = 256  # processes whose primed-pool report is kept per server (then the latest half)
CAUSES = ("cudagraph_per_shape", "recompile_storm", "recompile_limit_eager_fallback",
          "memory_growth_unexplained")


@dataclass
class Finding:
    t: float
    cause: str
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {**self.detail, "t": round(self.t, 3), "cause": self.cause}


@dataclass
class State:
    """One server's state: what its agents and the sources said, in parts."""
    first_t: Optional[float] = None
    now: float = 0.0
    refresh_at: float = -math.inf  # when the active causes' numbers are next read again
    pids: set[int] = field(default_factory=set)  # every process its events came from
    torch: Optional[str] = None                  # the torch version its agents reported
    first_hello_t: Optional[float] = None        # its warm-up counts from its first hello
    records: int = 0                             # CUDA-graph recordings
    warmups: int = 0                             # CUDA-graph warm-up calls (no memory yet)
    ooms: int = 0
    compiles: Compiles = field(default_factory=Compiles)
    shapes: Shapes = field(default_factory=Shapes)
    calls: Calls = field(default_factory=Calls)
    memory: Memory = field(default_factory=Memory)
    padding: Padding = field(default_factory=Padding)
    freeze: Freeze = field(default_factory=Freeze)
    # pid -> (t, bytes): a primed graph pool's reserved bytes not in use (agent/pools.py): NVML
    # counts them, the graphs have not used them yet
    pool_slack: dict[int, tuple[float, int]] = field(default_factory=dict)
    losses: Losses = field(default_factory=Losses)
    active: dict[str, Finding] = field(default_factory=dict)  # cause -> its finding
    findings: list[Finding] = field(default_factory=list)     # every finding, in order

    def unexplained_bytes(self) -> float:
        return self.memory.unexplained_bytes(self.records, self.now)

    def estimates(self, cfg: CorrelateConfig) -> Estimates:
        c, calls, mem = self.compiles, self.calls, self.memory
        limited = c.limit_t is not None
        enough = self.records >= cfg.min_records
        before = calls.steady_ms("before" if limited else "all")
        after = calls.steady_ms("after") if limited else None
        return {
            "mb_per_graph": _round(mem.mb_per_graph, 4) if enough else None,
            "mb_per_graph_confidence": round(mem.regression.confidence, 3) if enough else None,
            "recordings": self.records, "warmups": self.warmups,
            "distinct_shapes": self.shapes.distinct, "requests": calls.requests,
            "compiles": c.compiles, "recompiles": c.recompiles,
            "compile_seconds": round(c.seconds, 3),
            "fx_cache_hits": c.fx_cache_hits, "fx_cache_misses": c.fx_cache_misses,
            "recompile_limit_hits": c.limit_hits, "graph_breaks": c.graph_breaks,
            "stalls": calls.stalls, "stall_seconds": round(calls.stall_seconds, 3),
            "ooms": self.ooms, "memory_source": mem.source,
            "memory_bytes": mem.bytes, "memory_growth_bytes":
                None if mem.bytes is None or mem.start is None else mem.bytes - mem.start,
            "explained_by_recordings_bytes": round(mem.explained_bytes(self.records)),
            "unexplained_bytes": round(self.unexplained_bytes()),
            "device_used_bytes": mem.device_used, "device_total_bytes": mem.device_total,
            "steady_ms": _round(before, 3), "steady_ms_after_fallback": _round(after, 3),
            "padding": self.padding.view(),
        }


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def apply(state: State, obs: Union[events.Event, Sample], cfg: CorrelateConfig,
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
        state.memory.on_sample(obs, cfg, attribution, state.records,
                               (_loading(state, t), _settling(state, t)),
                               state.compiles.last_end)
        return
    state.pids.add(obs.pid)
    handler = _EVENT_HANDLERS.get(obs.kind)
    if handler is not None:
        handler(state, obs, cfg)


def _loading(state: State, t: float) -> bool:
    """Before the first recording, settling from the first compile (not a later one)."""
    return not state.records and _settling(state, t, state.compiles.first_t)


def _settling(state: State, t: float, compiled: Optional[float] = None) -> bool:
    """Within a compile's settling time (the last one's, or `compiled`'s), or (no compile
    seen) the first minute."""
    if state.compiles.first_t is None:
        return state.first_t is None or t < state.first_t + PENDING_S
    return t < (state.compiles.last_end if compiled is None else compiled) + COMPILE_SETTLE_S


# -- events: each to the part it is about ---------------------------------------------------
def _on_hello(state: State, e: events.Hello, cfg: CorrelateConfig) -> None:
    state.torch = e.torch
    if state.first_hello_t is None:
        state.first_hello_t = e.t
    state.compiles.on_hello(e)


def _on_compile(state: State, e: Union[events.Compile, events.Recompile],
                cfg: CorrelateConfig) -> None:
    if state.compiles.on_compile(e, cfg.default_recompile_limit):
        state.calls.mark_limit()
    # memory steps seen while this compile ran (its event comes at the end) are its own
    state.memory.on_compile(e.t - (e.seconds or 0.0), e.t)


def _on_limit(state: State, e: events.RecompileLimit, cfg: CorrelateConfig) -> None:
    state.compiles.on_limit(e)
    state.calls.mark_limit()
    _activate(state, e.t, "recompile_limit_eager_fallback", {
        "source": "agent", "function": e.function, "limit": e.limit, "last_reason": e.reason,
        "recompiles": state.compiles.recompiles,
        "steady_ms_before": _round(state.calls.steady_ms("before"), 3)})


def _on_record(state: State, e: events.CudagraphRecord, cfg: CorrelateConfig) -> None:
    if e.phase == "record":
        state.records += 1
    else:
        state.warmups += 1


def _on_new_shape(state: State, e: events.NewShape, cfg: CorrelateConfig) -> None:
    state.shapes.on_new_shape(e)
    state.compiles.on_new_shape(e.t)


def _on_oom(state: State, e: events.Oom, cfg: CorrelateConfig) -> None:
    state.ooms += 1


def _on_graph_break(state: State, e: events.GraphBreak, cfg: CorrelateConfig) -> None:
    state.compiles.graph_breaks += 1


def _on_mitigation(state: State, e: events.Mitigation) -> None:
    state.padding.on_mitigation(e)
    state.freeze.on_mitigation(e)


def _on_dropped(state: State, e: events.Dropped, cfg: CorrelateConfig) -> None:
    state.losses.told(e.pid, e.reason, e.total)


def _on_heartbeat(state: State, e: events.Heartbeat, cfg: CorrelateConfig) -> None:
    # every heartbeat's `lost` is the agent's whole count: exact once one heartbeat arrives
    # after the drops, whatever became of the drop reports
    if isinstance(e.lost, int):
        state.losses.told(e.pid, "", e.lost)
    reserved, active = e.pool_reserved_bytes, e.pool_active_bytes
    if isinstance(reserved, int) and isinstance(active, int) and 0 <= active <= reserved:
        state.pool_slack[e.pid] = (e.t, reserved - active)
        if len(state.pool_slack) > MAX_POOL_PIDS:   # workers come and go: the latest kept
            kept = sorted(state.pool_slack.items(), key=lambda kv: kv[1][0])[-MAX_POOL_PIDS // 2:]
            state.pool_slack = dict(kept)


_EVENT_HANDLERS: dict[str, Callable[[State, Any, CorrelateConfig], None]] = {
    "hello": _on_hello, "compile": _on_compile, "recompile": _on_compile,
    "recompile_limit": _on_limit, "cudagraph_record": _on_record, "new_shape": _on_new_shape,
    "stall": lambda state, e, cfg: state.calls.on_stall(e),
    "calls": lambda state, e, cfg: state.calls.on_calls(e, state.shapes.distinct),
    "oom": _on_oom, "graph_break": _on_graph_break,
    "dropped": _on_dropped, "heartbeat": _on_heartbeat,
    "padding": lambda state, e, cfg: state.padding.on_padding(e),
    "mitigation": lambda state, e, cfg: _on_mitigation(state, e),
    "cudagraph_warning": lambda state, e, cfg: state.freeze.on_limit(e),
}


# -- causes -------------------------------------------------------------------------------
def _activate(state: State, t: float, cause: str, detail: dict[str, Any]) -> None:
    if cause not in state.active:
        finding = Finding(t, cause, detail)
        state.active[cause] = finding
        state.findings.append(finding)


# an active cause's numbers are read again this often, not at every poll: the status page is
# rebuilt at most once a second (present/publisher.PUBLISH_S), alerts are re-sent far less often
REFRESH_S = 1.0


def _now_storm(state: State, cfg: CorrelateConfig) -> dict[str, Any]:
    c = state.compiles
    return {"recompiles_in_window": c.recompiles_in_window(state.now, cfg.storm_window_s)
            if c.recompile_times else 0, "compile_seconds": round(c.seconds, 3)}


def _now_fallback(state: State, cfg: CorrelateConfig) -> dict[str, Any]:
    c = state.compiles
    return {"recompiles": c.recompiles, "new_shapes_without_compile": c.new_shapes_after_limit}


def _now_graphs(state: State, cfg: CorrelateConfig) -> dict[str, Any]:
    b = state.memory.mb_per_graph
    return {"recordings": state.records, "distinct_shapes": state.shapes.distinct} | (
        {} if b is None else {"mb_per_graph": round(b, 4),
                              "mb_so_far": round(b * state.records, 1)})


def _now_unexplained(state: State, cfg: CorrelateConfig) -> dict[str, Any]:
    mem = state.memory
    if mem.bytes is None or mem.start is None:
        return {}
    return {"unexplained_mb": round(state.unexplained_bytes() / 1e6, 1),
            "growth_mb": round((mem.bytes - mem.start) / 1e6, 1)}


NOW = {"recompile_storm": _now_storm, "recompile_limit_eager_fallback": _now_fallback,
       "cudagraph_per_shape": _now_graphs, "memory_growth_unexplained": _now_unexplained}


def refresh_causes(state: State, cfg: CorrelateConfig) -> None:
    """Each active cause's numbers as they are now, at most every REFRESH_S: its text, its
    alert and the counts beside them say one thing ("4 recompiles within 5 min" stayed while
    the counts said 7). Its finding, as logged when found, keeps the first numbers."""
    if not state.active or state.now < state.refresh_at:
        return
    state.refresh_at = state.now + REFRESH_S
    for cause, f in list(state.active.items()):
        read = NOW.get(cause)
        detail = f.detail if read is None else {**f.detail, **read(state, cfg)}
        if detail != f.detail:
            state.active[cause] = Finding(f.t, cause, detail)


def evaluate_causes(state: State, cfg: CorrelateConfig) -> None:
    refresh_causes(state, cfg)
    t, c = state.now, state.compiles
    in_window = c.recompiles_in_window(t, cfg.storm_window_s) if c.recompile_times else 0
    if in_window >= cfg.storm_recompiles:
        _activate(state, t, "recompile_storm", {
            "recompiles_in_window": in_window, "window_s": cfg.storm_window_s,
            "compile_seconds": round(c.seconds, 3)})
    elif "recompile_storm" in state.active and not c.recompile_times:
        del state.active["recompile_storm"]
    if (c.limit_t is not None and c.limit_hits == 0
            and c.new_shapes_after_limit >= cfg.fallback_new_shapes):
        _activate(state, t, "recompile_limit_eager_fallback", {
            "source": "inferred", "limit": c.limit or cfg.default_recompile_limit,
            "recompiles": c.recompiles, "reached_at": round(c.limit_t, 3),
            "new_shapes_without_compile": c.new_shapes_after_limit,
            "steady_ms_before": _round(state.calls.steady_ms("before"), 3)})
    mem = state.memory
    # an active cause stays as it is (_activate): not computed again every poll and server
    b = mem.mb_per_graph if "cudagraph_per_shape" not in state.active and \
        state.records >= cfg.min_records else None
    if (b is not None and b > 0
            and (conf := mem.regression.confidence) >= cfg.min_confidence):
        _activate(state, t, "cudagraph_per_shape", {
            "recordings": state.records, "distinct_shapes": state.shapes.distinct,
            "mb_per_graph": round(b, 4), "confidence": round(conf, 3),
            "mb_so_far": round(b * state.records, 1)})
    # before a memory reading nothing is unexplained (a threshold of 0 must not fire then)
    if "memory_growth_unexplained" not in state.active and mem.bytes is not None and \
            mem.start is not None and state.unexplained_bytes() >= cfg.unexplained_bytes:
        _activate(state, t, "memory_growth_unexplained", {
            "unexplained_mb": round(state.unexplained_bytes() / 1e6, 1),
            "growth_mb": round((mem.bytes - mem.start) / 1e6, 1)})
