"""Time to OOM, two ways, from the folded state (pure).

- linear: the growth rate of the device's used memory over the last `window_s`, one-poll
  steps (a model load, a ballast) left out;
- discovery: growth comes from CUDA graphs for *new* sizes, and new sizes dry up as the shape
  space is covered. With requests drawn from S sizes, after n requests the expected distinct
  sizes are D = S(1 - e^(-n/S)) and the sizes seen twice (so recorded, FACTS #4) are
  S(1 - e^(-x) - x e^(-x)), x = n/S. S is the value that explains the D distinct shapes seen in
  n requests; the future is x growing at the recent request rate, memory growing by MB/graph
  per recording. The plateau is every size recorded: will it ever run out?
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch_watchdog.sidecar.config import ForecastConfig
from torch_watchdog.sidecar.core.correlate import State

FOREVER = math.inf


@dataclass(frozen=True)
class Forecast:
    budget_bytes: Optional[int]
    level_bytes: Optional[int]
    seconds_linear: float = FOREVER
    seconds_discovery: Optional[float] = None   # None: the model does not apply (yet)
    plateau_bytes: Optional[float] = None
    shape_space: Optional[float] = None
    growth_bytes_per_s: Optional[float] = None

    @property
    def seconds(self) -> float:
        """The forecast to act on: the discovery model when it applies, else the trend."""
        return self.seconds_linear if self.seconds_discovery is None else self.seconds_discovery

    @property
    def will_oom(self) -> Optional[bool]:
        if self.plateau_bytes is None or self.budget_bytes is None:
            return None
        return self.plateau_bytes >= self.budget_bytes

    def as_dict(self) -> dict:
        def num(v):
            return None if v is None or v == FOREVER else round(v, 3)
        return {"seconds_to_oom": num(self.seconds), "seconds_to_oom_linear":
                num(self.seconds_linear), "seconds_to_oom_discovery": num(self.seconds_discovery),
                "plateau_bytes": num(self.plateau_bytes), "will_oom": self.will_oom,
                "budget_bytes": self.budget_bytes, "level_bytes": self.level_bytes,
                "shape_space_estimate": num(self.shape_space),
                "growth_bytes_per_s": num(self.growth_bytes_per_s)}


def forecast(state: State, cfg: ForecastConfig, min_records: int = 20,
             jump_bytes: int = 16 << 20) -> Forecast:
    level, budget = _level_and_budget(state, cfg)
    if level is None or budget is None:
        return Forecast(budget, level)
    slope = _trend(state, cfg.window_s, cfg.process_budget_bytes is not None, jump_bytes)
    linear = (budget - level) / slope if slope and slope > 0 else FOREVER
    n, distinct = state.requests, state.distinct_shapes
    space = shape_space(n, distinct)
    if saturated(space, n, state.records):
        # every size is recorded (bucketed traffic: 9 sizes in hundreds of requests): the
        # warm-up's growth is over; a trend through it would forecast an OOM that never comes
        return Forecast(budget, level, max(0.0, linear), FOREVER, level, space, slope)
    b = state.mb_per_graph
    if b is None or b <= 0 or state.records < min_records:
        return Forecast(budget, level, max(0.0, linear), growth_bytes_per_s=slope)
    per_graph = b * 1e6
    if space is None or not math.isfinite(space):
        return Forecast(budget, level, max(0.0, linear), growth_bytes_per_s=slope)
    model_now = recorded(space, n)
    # observed/expected recordings: graph partitions, serving threads, non-uniform traffic
    scale = state.records / model_now if model_now > 0 else 1.0
    plateau = level + per_graph * max(0.0, scale * space - state.records)
    rate = _request_rate(state, cfg.window_s)
    seconds = _seconds_to(level, budget, per_graph, state.records, n, space * scale, space, rate)
    return Forecast(budget, level, max(0.0, linear), seconds, plateau, space, slope)


def _level_and_budget(state: State, cfg: ForecastConfig) -> tuple[Optional[int], Optional[int]]:
    if cfg.process_budget_bytes is not None:
        return state.mem_bytes, cfg.process_budget_bytes
    capacity = state.device_usable if state.device_usable is not None else state.device_total
    if state.device_used is not None and capacity is not None:
        return state.device_used, capacity - cfg.headroom_bytes
    if state.host_used is not None and state.host_total is not None:  # host-memory mode
        return state.host_used, state.host_total - cfg.headroom_bytes
    return None, None


def _trend(state: State, window_s: float, per_process: bool, jump_bytes: int) -> Optional[float]:
    """Growth rate (bytes/s) of the level over the last window, steps left out: one poll's
    jump (a model loaded, a ballast, a compile's workspace) says nothing about the rate."""
    points = []
    for t, mem, _, used, _ in reversed(state.samples):  # newest first: stop at the window
        if t < state.now - window_s:
            break
        level = mem if per_process else used
        if level is not None:
            points.append((t, level))
    points.reverse()
    if len(points) < 3 or points[-1][0] <= points[0][0]:
        return None
    growth = sum(b - a for (_, a), (_, b) in zip(points, points[1:]) if abs(b - a) <= jump_bytes)
    return growth / (points[-1][0] - points[0][0])


def _request_rate(state: State, window_s: float) -> Optional[float]:
    recent = []
    for t, calls, *_ in reversed(state.calls):
        if t < state.now - window_s:
            break
        recent.append((t, calls))
    recent.reverse()
    if len(recent) < 2:
        return None
    span = recent[-1][0] - recent[0][0]
    return sum(c for _, c in recent[1:]) / span if span > 0 else None


def shape_space(requests: int, distinct: int) -> Optional[float]:
    """S with S(1 - e^(-n/S)) = D: the number of sizes that explains D distinct in n requests.
    Infinite when every request was new; None without data."""
    if requests <= 0 or distinct <= 0:
        return None
    if distinct >= requests:
        return FOREVER
    lo, hi = float(distinct), float(distinct)
    while _seen(hi, requests) < distinct:  # grows until it brackets the root
        hi *= 2
        if hi > 1e12:
            return FOREVER
    for _ in range(100):
        mid = (lo + hi) / 2
        if _seen(mid, requests) < distinct:
            lo = mid
        else:
            hi = mid
    return hi


def _seen(space: float, n: float) -> float:
    return space * -math.expm1(-n / space)


def saturated(space: Optional[float], n: int, records: int) -> bool:
    """Fewer than one more recording is expected, ever: each size is seen twice already."""
    if space is None or not math.isfinite(space) or records == 0:
        return False
    return space - recorded(space, n) < 1.0


def recorded(space: float, n: float) -> float:
    """Expected sizes seen at least twice after n requests over `space` sizes."""
    x = n / space
    return space * (1 - math.exp(-x) - x * math.exp(-x))


def _seconds_to(level: float, budget: float, per_graph: float, records: int, n: int,
                final_records: float, space: float, rate: Optional[float]) -> float:
    """Seconds until recordings grow the level to the budget; inf if the plateau is below."""
    if level >= budget:
        return 0.0
    needed = records + (budget - level) / per_graph
    if needed >= final_records or not rate or rate <= 0:
        return FOREVER  # every size recorded and still under budget: a plateau
    scale = final_records / space
    lo, hi = float(n), float(n)
    while scale * recorded(space, hi) < needed:
        hi = hi * 2 + 1
    for _ in range(60):
        mid = (lo + hi) / 2
        if scale * recorded(space, mid) < needed:
            lo = mid
        else:
            hi = mid
    return (hi - n) / rate
