"""Each server's view for the metrics, the alerts and the status page, made again only when
what it shows changed.

A view is {"estimates", "forecast", "active_causes", "pids", "gpus"} (Snapshot.servers). The
daemon asks for every server's view every poll; a still server's numbers are those of the poll
before, and building its estimates dict (correlate.State.estimates) was ~6 us a server and poll
(16 us cold, in a daemon that sleeps 100 ms between polls). Here each server's estimates are
built only when one of the values they are computed from changed (`_key`), and a view is the
same dict object as long as its parts are. The dicts are shared by the polls that show them:
their readers (metrics, alerts, the status page, HTTP threads) only read them.

What the estimates read, and how each is watched (tests/unit/test_views.py compares every
poll's views with fresh ones over the step's differential traces and recorded fixtures):
- the event-driven counts (records, compiles, stalls, requests, the padding dicts, which are
  changed in place …): the state object, and the events folded into it (`Server.events`,
  counted by the step for every event it folds), and the counts themselves;
- the sample-driven numbers (the memory and its start, the device's, the regression's sums,
  the compile-step bytes): each of them;
- the regression's count moves with every still poll (a still poll adds (0, 0)), and with it
  only the MB/graph confidence: that one value is computed each poll (only once there are
  enough recordings) and swapped into a copy when its rounding changes;
- the memory steps still pending (unexplained_bytes leaves out those younger than
  correlate.PENDING_S, so they age with `now`): their undecided sum.
"""
from __future__ import annotations

from typing import Any, Optional

from torch_watchdog.sidecar.config import CorrelateConfig
from torch_watchdog.sidecar.core import correlate
from torch_watchdog.sidecar.core.forecast import Forecast


def _key(state: correlate.State, cfg: CorrelateConfig, events: int) -> tuple:
    """Everything State.estimates() reads but the regression's count (see the docstring)."""
    jumps = state.pending_jumps
    if jumps:
        cutoff = state.now - correlate.PENDING_S
        undecided = sum(b for t, b in jumps if t > cutoff)
    else:
        undecided = 0
    reg = state.regression
    return (state, cfg, events, state.records, state.warmups, state.distinct_shapes,
            state.requests, state.compiles, state.recompiles, state.compile_seconds,
            state.fx_cache_hits, state.fx_cache_misses, state.limit_hits, state.limit_t,
            state.graph_breaks, state.stalls, state.stall_seconds, state.ooms,
            state.mem_source, state.mem_bytes, state.mem_start, state.device_used,
            state.device_total, state.compile_jump_bytes, reg.sxx, reg.sxy, reg.syy,
            state.steady_totals, state.steady_at_limit, undecided)


class _Kept:
    __slots__ = ("key", "confidence", "estimates", "forecast", "fc_dict", "active", "pids",
                 "gpus", "view")

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.confidence: Optional[float] = None
        self.estimates: dict = {}
        self.forecast: Optional[Forecast] = None
        self.fc_dict: dict = {}
        self.active: Optional[tuple] = None
        self.pids: frozenset = frozenset()
        self.gpus: frozenset = frozenset()
        self.view: Optional[dict] = None


class ServerViews:
    """Every server's view, kept from poll to poll (one entry per server name)."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self.built = 0   # estimates dicts built (the tests see the cache work)

    def estimates(self, name: str, state: correlate.State, cfg: CorrelateConfig,
                  events: int) -> dict[str, Any]:
        """state.estimates(cfg), the same dict as last poll's when nothing it reads changed."""
        kept = self._entry(name)
        key = _key(state, cfg, events)
        confidence = round(state.regression.confidence, 3) \
            if state.records >= cfg.min_records else None
        if key != kept.key:
            kept.key, kept.estimates = key, state.estimates(cfg)
            kept.confidence = kept.estimates["mb_per_graph_confidence"]
            self.built += 1
        elif confidence != kept.confidence:  # only the count moved: a copy, the new value
            kept.estimates = {**kept.estimates, "mb_per_graph_confidence": confidence}
            kept.confidence = confidence
        return kept.estimates

    def forecast(self, name: str, fc: Forecast) -> dict[str, Any]:
        """fc.as_dict(), made once per Forecast: a still server keeps its Forecast (frozen)
        from poll to poll (core/step.py), and 8 servers' dicts were ~3 us each a poll."""
        kept = self._entry(name)
        if kept.forecast is not fc:
            kept.forecast, kept.fc_dict = fc, fc.as_dict()
        return kept.fc_dict

    def build(self, servers: dict, cfg: CorrelateConfig) -> dict[str, dict[str, Any]]:
        """name -> view of every server (step.Server) in `servers`."""
        out = {}
        for name, server in servers.items():
            state = server.state
            est = self.estimates(name, state, cfg, server.events)
            fc = self.forecast(name, server.forecast)
            kept = self._kept[name]
            active = tuple(state.active)
            gpus = state.gpus or server.gpus
            view = kept.view
            if (view is None or view["estimates"] is not est or view["forecast"] is not fc or
                    active != kept.active or server.pids.keys() != kept.pids or
                    (gpus.keys() if isinstance(gpus, dict) else gpus) != kept.gpus):
                kept.active, kept.pids, kept.gpus = active, frozenset(server.pids), \
                    frozenset(gpus)
                view = kept.view = {"estimates": est, "forecast": fc, "active_causes": active,
                                    "pids": sorted(server.pids), "gpus": sorted(gpus)}
            out[name] = view
        if len(self._kept) > len(out):  # servers come and go (renamed, configured away)
            self._kept = {k: v for k, v in self._kept.items() if k in out}
        return out

    def _entry(self, name: str) -> _Kept:
        kept = self._kept.get(name)
        if kept is None:
            kept = self._kept[name] = _Kept()
        return kept
