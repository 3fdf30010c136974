"""Time to OOM, two ways, from the folded state (pure). The OOM is the moment allocation
fails: on a GPU when its free memory is down to FAIL_FREE_BYTES, against a configured budget
(`process_budget_bytes`, `per_process_budget_bytes`) or a cgroup limit at the budget itself.
No margin is taken off: the policy acts `reload_lead_s` before it.

- trend: the server's memory growth at the horizon (a minute to a day) that explains it best
  (core/horizons.py), the time to the first step that does not fit;
- discovery: growth comes from CUDA graphs for *new* sizes, and new sizes dry up as the shape
  space is covered. With requests drawn from S sizes, after n requests the expected distinct
  sizes are D = S(1 - e^(-n/S)) and the sizes seen twice (so recorded: a size's first call is a
  warm-up, its second records the graph) are
  S(1 - e^(-x) - x e^(-x)), x = n/S. S is the value that explains the D distinct shapes seen in
  n requests; the future is x growing at the recent request rate, memory growing by MB/graph
  per recording. The plateau is every size recorded: will it ever run out?
- where the model is refuted (the traffic's mix changed), the trend's graph growth is capped
  by the shape space the horizon's own requests show (`graph_bound`).
"""
from __future__ import annotations

import bisect
import functools
import math
from operator import itemgetter
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, cast

from torch_watchdog.sidecar.config.schema import ForecastConfig
from torch_watchdog.sidecar.core import horizons
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.results import ForecastView
from torch_watchdog.sidecar.core.trend import Trend

FOREVER = math.inf
# NVML free memory at which a device's allocations fail: PyTorch's allocator and cuDNN failed
# with 9-19 MiB free on an H200 (graph growth, leaks with and without expandable segments):
# the driver keeps that much for itself. Counting a larger headroom as the OOM forecast it
# 20-60 s early at a few MiB/s, hours early at slow rates
FAIL_FREE_BYTES = 19 << 20
# the graph growth to come, as read from the last horizon's shape space, counted this many
# times over before it is taken to stay below the budget (traffic that is not uniform over its
# sizes shows fewer of them than it has)
BOUND_MARGIN = 1.0
# the longest horizon at which the window's recent rate is the growth's: over longer ones the
# growth is slow, and a burst of recordings lasts only as long as it has
BURST_HORIZON_S = 120.0
REFUTE_RECORDS = 3   # recordings in a window beyond twice the model's expectation: refuted


@dataclass(frozen=True)
class Forecast:
    budget_bytes: Optional[int]                   # where allocation fails (the OOM)
    level_bytes: Optional[int]
    seconds_linear: float = FOREVER               # the trend's (core/horizons.py)
    seconds_discovery: Optional[float] = None   # None: the model does not apply (yet)
    plateau_bytes: Optional[float] = None
    shape_space: Optional[float] = None
    growth_bytes_per_s: Optional[float] = None
    # growth that recordings do not explain (a leak in the server's own code), at its own rate:
    # a saturated shape space stops the recordings' growth, not this
    seconds_unexplained: float = FOREVER
    unexplained_bytes_per_s: Optional[float] = None
    gpu_uuid: Optional[str] = None                 # the GPU this forecast is for (the nearest)
    trend_horizon_s: Optional[float] = None        # the horizon the trend was read over
    # recordings explain the growth the trend read (most of it came with them, or a recording
    # for each rise)
    trend_explained: bool = False
    # how much sooner than expected the trend's next step may come: its steps' gaps, the lower
    # quartile against the median
    trend_early_s: float = 0.0

    @property
    def seconds(self) -> float:
        """The forecast to act on: recordings by the discovery model plus unexplained growth
        when the model applies, else the whole trend."""
        return self._sooner(0.0)

    @property
    def seconds_earliest(self) -> float:
        """The forecast the policy acts on: `seconds` with the trend's next step as soon as
        steps have come before (the lower quartile of their gaps, not the median). A margin
        the decision takes, not the forecast: a leak of steps far apart read 0 s by the
        quartile for minutes before its OOM."""
        return self._sooner(self.trend_early_s)

    def _sooner(self, early: float) -> float:
        """`seconds` with the trend's times `early` seconds sooner."""
        linear = max(0.0, self.seconds_linear - early)
        if self.seconds_discovery is None:
            return linear
        return min(self.seconds_discovery, max(0.0, self.seconds_unexplained - early))

    @property
    def driver(self) -> Optional[str]:
        """What drives the forecast: "recordings", "unexplained" growth, or the "trend"."""
        if self.seconds == FOREVER:
            return None
        if self.seconds_discovery is None:
            return "trend"
        return "unexplained" if self.seconds_unexplained < self.seconds_discovery \
            else "recordings"

    @property
    def cause(self) -> Optional[str]:
        """The cause a reload for this forecast names: growth of graphs recorded for new
        shapes, or growth that recordings do not explain."""
        driver = self.driver
        if driver is None:
            return None
        if driver == "recordings" or driver == "trend" and self.trend_explained:
            return "cudagraph_per_shape"
        return "memory_growth_unexplained"

    @property
    def will_oom(self) -> Optional[bool]:
        if self.plateau_bytes is None or self.budget_bytes is None:
            return None
        return self.plateau_bytes >= self.budget_bytes or self.seconds_unexplained < FOREVER

    def as_dict(self) -> ForecastView:
        def num(v: Optional[float]) -> Optional[float]:
            return None if v is None or v == FOREVER else round(v, 3)
        return {"seconds_to_oom": num(self.seconds),
                "seconds_to_oom_earliest": num(self.seconds_earliest), "seconds_to_oom_linear":
                num(self.seconds_linear), "seconds_to_oom_discovery": num(self.seconds_discovery),
                "seconds_to_oom_unexplained": num(self.seconds_unexplained),
                "driver": self.driver, "gpu_uuid": self.gpu_uuid,
                "plateau_bytes": num(self.plateau_bytes), "will_oom": self.will_oom,
                "budget_bytes": self.budget_bytes, "level_bytes": self.level_bytes,
                "shape_space_estimate": num(self.shape_space),
                "growth_bytes_per_s": num(self.growth_bytes_per_s),
                "unexplained_bytes_per_s": num(self.unexplained_bytes_per_s)}


class _View(NamedTuple):
    """One budget the server can run out of: a GPU (its level and budget, and the server's
    share of its own growth that lands there), or the process / host budget. A tuple: cheaper
    to build than a frozen dataclass, per GPU, server and poll."""
    uuid: Optional[str]
    level: int
    budget: int
    share: float


def forecast(state: State, cfg: ForecastConfig, min_records: int = 20) -> Forecast:
    """The nearest time to OOM over the server's budgets (each GPU on its own)."""
    if state.memory.gpu_down:  # the GPUs' numbers are unknown: no forecast rather than a stale one
        return Forecast(None, None)
    views = _views(state, cfg)
    if not views:
        level, budget = _level_and_budget(state, cfg)
        return Forecast(budget, level)
    slope, leak, request_rate = rates(state, cfg)
    model = _discovery(state, cfg, min_records, request_rate)
    best: Optional[Forecast] = None
    for view in views:
        fc = _forecast_view(state, view, slope, leak, model, cfg.window_s)
        if best is None or fc.seconds < best.seconds:
            best = fc
    assert best is not None  # views is not empty
    return best


def rates(state: State, cfg: ForecastConfig,
          ) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """The forecast's inputs that move with time alone: the memory's growth rate and its rate
    outside recordings over the window, and the request rate."""
    slope, leak = state.memory.trend.rates(state.now - cfg.window_s)
    return slope, leak, _request_rate(state, cfg.window_s)



def _views(state: State, cfg: ForecastConfig) -> list[_View]:
    if cfg.per_process_budget_bytes is not None and state.memory.per_process:
        # each process against its own budget, with its share of the server's growth
        total = sum(state.memory.per_process.values())
        return [_View(None, b, cfg.per_process_budget_bytes,
                      b / total if total > 0 else 1.0 / len(state.memory.per_process))
                for _, b in sorted(state.memory.per_process.items())]
    if cfg.process_budget_bytes is not None:
        if state.memory.bytes is None:
            return []
        return [_View(None, state.memory.bytes, cfg.process_budget_bytes, 1.0)]
    if state.memory.gpus:
        return _gpu_views(state)
    level, budget = _level_and_budget(state, cfg)
    return [] if level is None or budget is None else [_View(None, level, budget, 1.0)]


def _gpu_views(state: State) -> list[_View]:
    """Each GPU against its own budget (usable - FAIL_FREE_BYTES). The server's growth is split over
    its GPUs by where its memory is (per-process NVML), else evenly; a GPU holding none of
    the server's memory is not its to run out of."""
    mine = {u: b for u, (_, _, b) in state.memory.gpus.items()}
    known = state.memory.source == "process" and all(b is not None for b in mine.values())
    # known: mine holds no None (hence the casts)
    total = sum(cast("dict[str, int]", mine).values()) if known else 0
    views = []
    for uuid, (used, usable, _) in sorted(state.memory.gpus.items()):
        share = cast(int, mine[uuid]) / total if known and total > 0 else \
            1.0 / len(state.memory.gpus)
        if known and mine[uuid] == 0:
            continue
        views.append(_View(uuid, used, usable - FAIL_FREE_BYTES, share))
    return views


@dataclass(frozen=True)
class Discovery:
    """The discovery model's inputs: the shape space `space`; `saturated`, every size of it
    recorded (no more growth from recordings); else the observed/expected recordings `scale`,
    the bytes a recording costs and the request rate."""
    space: Optional[float]
    saturated: bool = False
    scale: float = 1.0
    per_graph: float = 0.0
    rate: Optional[float] = None


def _discovery(state: State, cfg: ForecastConfig, min_records: int,
               request_rate: Optional[float]) -> Optional[Discovery]:
    """The discovery model's inputs, or None when it does not apply (yet)."""
    n, distinct = state.calls.requests, state.shapes.distinct
    space = shape_space(n, distinct)
    if saturated(space, n, state.records):
        if refuted(state, cfg.window_s, space, 1.0) or outgrown(state, space):
            return None
        # every size is recorded (bucketed traffic: 9 sizes in hundreds of requests): the
        # recordings' growth is over; a trend through the warm-up would forecast an OOM that
        # never comes. Growth outside recordings still counts (a leak)
        return Discovery(space, saturated=True)
    b = state.memory.mb_per_graph
    if b is None or b <= 0 or state.records < min_records or space is None \
            or not math.isfinite(space):
        return None
    model_now = recorded(space, n)
    # observed/expected recordings: graph partitions, serving threads, non-uniform traffic
    scale = state.records / model_now if model_now > 0 else 1.0
    if refuted(state, cfg.window_s, space, scale):
        return None
    return Discovery(space, scale=scale, per_graph=b * 1e6, rate=request_rate)


def _forecast_view(state: State, v: _View, slope: Optional[float], leak: Optional[float],
                   model: Optional[Discovery], window_s: float) -> Forecast:
    over = v.uuid is None and v.level >= v.budget
    # over a configured or host budget already: an OOM now, growing or not (flat at 1.55 GiB
    # over a 1.3 GiB budget said "no OOM forecast"). A GPU's budget keeps its rate: an
    # allocator may cache up to the last free MiB and run there for hours

    def seconds_at(rate: Optional[float]) -> float:
        if over:
            return 0.0
        if rate is None or rate * v.share <= 0:
            return FOREVER
        return max(0.0, (v.budget - v.level) / (rate * v.share))

    linear, earliest, explained = _trend(state, v, over)
    reading = state.memory.reading
    if reading is None and _young(state):
        # no horizon covered yet (the first minute of the trend): the window's recent rate
        # stands in, as growth that runs out of memory within a minute must still be read
        linear = earliest = seconds_at(slope)
        explained = _explained(state, -math.inf, horizons.MIN_RISES)
    if explained:
        # graph growth speeds up as larger shapes come: the window's recent rate reads that
        # sooner than a line through the horizon. Against growth read over minutes, a burst
        # of recordings a few seconds long is not the next ten minutes' rate: there each part
        # of the window goes on for as long again as it has lasted, then the window's own
        # rate or the horizon's, the faster (a line through the horizon lags growth that
        # speeds up)
        recent = None if reading is None or reading.horizon <= BURST_HORIZON_S else \
            state.memory.trend.recent(state.now - window_s)
        window = seconds_at(slope) if reading is None or recent is None else \
            lasting(v.budget - v.level, recent, max(reading.rate, recent[0][1]), v.share)
        linear, earliest = min(linear, window), min(earliest, window)
    if model is None and explained and reading is not None and 0.0 < earliest < FOREVER:
        # graph growth with no discovery model (refuted: the traffic's mix changed): it can
        # add no more than a graph for each size yet to be recorded, at what a graph cost
        # over the horizon; a shape space that runs dry below the budget is no OOM
        bound = graph_bound(state, reading.horizon, reading.rate)
        if bound is not None and v.level + BOUND_MARGIN * bound * v.share < v.budget:
            linear = earliest = FOREVER
    # growth recordings do not explain: the trend's where it reads growth they do not
    # explain; none before the trend reads growth (a first minute's climb is not yet a
    # trend), nor while recordings explain it (the window's rate outside recordings read an
    # allocator's steps between a saturating shape space's recordings as a leak)
    unexplained = linear if reading is not None and not explained else FOREVER
    common: dict[str, Any] = dict(growth_bytes_per_s=slope, unexplained_bytes_per_s=leak,
                                  gpu_uuid=v.uuid, seconds_unexplained=unexplained,
                                  trend_horizon_s=reading.horizon if reading else None,
                                  trend_explained=explained, trend_early_s=linear - earliest
                                  if earliest < linear < FOREVER else 0.0)
    if model is None:
        return Forecast(v.budget, v.level, linear, **common)
    space = model.space
    if model.saturated:
        return Forecast(v.budget, v.level, linear, FOREVER, v.level, space, **common)
    assert space is not None  # a model that is not saturated has a finite shape space
    per_graph, scale, n = model.per_graph * v.share, model.scale, state.calls.requests
    plateau = v.level + per_graph * max(0.0, scale * space - state.records)
    seconds = _seconds_to(v.level, v.budget, per_graph, state.records, n, space * scale, space,
                          model.rate)
    return Forecast(v.budget, v.level, linear, seconds, plateau, space, **common)


def lasting(room: float, parts: list[tuple[float, float]], after: float,
            share: float = 1.0) -> float:
    """Seconds until growth takes `room`, where each recent part of the window ((seconds,
    bytes/s), the window first) goes on for as long again as it has lasted, the newest first,
    and the growth goes on at `after` bytes/s beyond the window (`share` of it lands here).
    No room left is an OOM now."""
    if room <= 0:
        return 0.0
    elapsed = 0.0
    for span, rate in reversed(parts):
        grows = rate * share * (span - elapsed)
        if grows >= room:
            return elapsed + room / (rate * share)
        room -= grows
        elapsed = span
    return elapsed + room / (after * share) if after * share > 0 else FOREVER


def graph_bound(state: State, span: float, rate: float) -> Optional[float]:
    """The bytes recordings can still add, read from the last `span`: the shape space that
    explains the new sizes its requests brought (on top of those seen before it; its requests
    counted from where new sizes began), a graph per size yet recorded (or as many as each size
    has had), each costing the growth from the span's first recording on per recording after
    it. None where the span says nothing (no requests or recordings in it, or every request a
    new size)."""
    calls, start, trend = state.calls, state.now - span, state.memory.trend
    if not calls.marks:
        return None
    # the counts at two `calls` windows: the requests a window reports came before it, the
    # sizes they brought with them (a stretched or slow agent's windows lag the shapes)
    then, last = calls.at(start) or (start, 0, 0), calls.marks[-1]
    then = _discovery_start(calls.marks, then)
    n, new = last[1] - then[1], last[2] - then[2]
    records = trend.records_since(start)
    if n <= 0 or not records or new >= n:
        return None
    space = window_space(n, new, then[2])
    if not math.isfinite(space):
        return None
    distinct = max(1, state.shapes.distinct)
    per_size = max(1.0, state.records / distinct)
    remaining = max(0.0, per_size * max(space, distinct) - state.records)
    return remaining * per_recording(trend, start, state.now, rate, records)


def _discovery_start(marks: list[tuple[float, int, int]], then: tuple[float, int, int]
                     ) -> tuple[float, int, int]:
    """The last mark from `then` on before new sizes came: requests of the old sizes before
    the span's first new one tell how often those repeat, not how many new sizes follow.
    Two bisections (the marks' sizes never fall: a count of distinct shapes)."""
    i = bisect.bisect_right(marks, then[0], key=itemgetter(0))
    j = bisect.bisect_right(marks, then[2], lo=i, key=itemgetter(2))
    return marks[j - 1] if j > i else then


def per_recording(trend: Trend, start: float, now: float, rate: float, records: int) -> float:
    """The bytes a recording costs, read from the span since `start` growing at `rate`: the
    growth from the span's first recording on per recording after it. Growth before the
    first recording (a new size's warm-up, the pool's last segment of an earlier burst) is
    not the recordings' cost: counted in, it makes early graphs read dearer than the graphs
    that follow. The whole span per recording where one poll brought them all."""
    first = trend.first_record_since(start)
    after = trend.records_since(first) if first is not None else None
    if first is None or not after:
        return rate * (now - start) / records
    return rate * (now - first) / after


@functools.lru_cache(maxsize=256)
def window_space(n: int, new: int, before: int) -> float:
    """S with (S - before)(1 - e^(-n/S)) = new: the sizes that explain `new` sizes not seen
    before in `n` requests, `before` sizes seen already (a lower bound: those count in S)."""
    if new <= 0:
        return float(before)

    def seen(space: float) -> float:
        return (space - before) * -math.expm1(-n / space)

    lo = hi = float(before + new)
    while seen(hi) < new:
        hi *= 2
        if hi > 1e12:
            return FOREVER
    for _ in range(60):
        mid = (lo + hi) / 2
        if seen(mid) < new:
            lo = mid
        else:
            hi = mid
    return hi


def _explained(state: State, since: float, rises: int) -> bool:
    """Recordings explain the growth from `since` on: most of it came while graphs were
    recorded, or a recording came for each of its `rises` (a graph pool's segments land a few
    polls after the recordings that fill them)."""
    trend = state.memory.trend
    outside = trend.outside_share(since)
    return outside is not None and outside < 0.5 or (trend.records_since(since) or 0) >= rises


def _young(state: State) -> bool:
    """The history is too short for the shortest horizon to be read."""
    h = state.memory.history
    return h.first_t is None or h.last_t is None or \
        h.last_t - h.first_t < horizons.COVER * horizons.HORIZONS[0]


def _trend(state: State, v: _View, over: bool) -> tuple[float, float, bool]:
    """The trend's time to OOM on this view (core/horizons.py: the growth at the horizon that
    explains it best, to the first step that does not fit), expected and earliest, and
    whether recordings explain that growth (most of it came while graphs were recorded)."""
    mem, reading = state.memory, state.memory.reading
    if reading is None:
        return (0.0, 0.0, False) if over else (FOREVER, FOREVER, False)
    explained = _explained(state, state.now - reading.horizon,
                           max(horizons.MIN_RISES, reading.rises))
    if over:
        return 0.0, 0.0, explained
    room, last = v.budget - v.level, mem.history.last_rise_t  # memory let go of is room again
    return (horizons.seconds_to_fail(reading, room, state.now, last, v.share, expected=True),
            horizons.seconds_to_fail(reading, room, state.now, last, v.share), explained)


def _level_and_budget(state: State, cfg: ForecastConfig) -> tuple[Optional[int], Optional[int]]:
    mem = state.memory
    if cfg.process_budget_bytes is not None:
        return mem.bytes, cfg.process_budget_bytes
    capacity = mem.device_usable if mem.device_usable is not None else mem.device_total
    if mem.device_used is not None and capacity is not None:
        return mem.device_used, capacity - FAIL_FREE_BYTES
    if mem.source == "rss" and mem.bytes is not None:  # host-memory mode
        # the server's own memory against what it may use: its cgroup's limit (the OOM killer
        # acts there), else what the machine has available on top of what the server holds
        # (the machine's other jobs are not the server's growth)
        if mem.limit is not None:
            return mem.bytes, mem.limit
        if mem.host_available is not None:
            return mem.bytes, mem.bytes + mem.host_available
    return None, None


def _recent_calls(state: State, window_s: float) -> list[tuple[float, int]]:
    """(t, calls) of the `calls` windows from the first within `window_s` to the newest,
    read newest first (the deque holds hours of them)."""
    cutoff, recent = state.now - window_s, []
    for entry in reversed(state.calls.windows):
        if entry[0] < cutoff:
            break
        recent.append((entry[0], entry[1]))
    recent.reverse()
    return recent


def _request_rate(state: State, window_s: float) -> Optional[float]:
    """Requests a second over the `calls` windows back from the newest to the first one older
    than the window."""
    recent = _recent_calls(state, window_s)
    if len(recent) < 2:  # no agent's report (yet), or one
        return None
    span = recent[-1][0] - recent[0][0]
    return sum(c for _, c in recent[1:]) / span if span > 0 else None


def refuted(state: State, window_s: float, space: Optional[float], scale: float) -> bool:
    """Recordings over the window outpace what the model expects of its requests (traffic
    whose mix changed: bucketed for an hour, then every length): the model's history no longer
    says what comes, and the trend does. Cumulative counts fit to hours of bucketed traffic
    called a shape space saturated while new recordings came every second."""
    seen = state.memory.trend.records_since(state.now - window_s)
    if not seen or seen <= REFUTE_RECORDS or space is None or not math.isfinite(space):
        return False
    in_window = sum(c for _, c in _recent_calls(state, window_s))
    n = state.calls.requests
    expected = scale * (recorded(space, n) - recorded(space, max(0, n - in_window)))
    return seen > 2 * expected + REFUTE_RECORDS


def outgrown(state: State, space: Optional[float]) -> bool:
    """New sizes over the trend's horizon outnumber what a saturated shape space of `space`
    sizes brings in its requests: the space is not saturated at the time scale the growth is
    read at. Over hours of traffic the cumulative counts call a space saturated while a few
    new sizes a minute, each a recording, go on growing the memory; a window of a minute holds
    too few of them to say so, and the forecast came and went."""
    reading = state.memory.reading
    if reading is None or not state.calls.marks or space is None or not math.isfinite(space):
        return False
    start = state.now - reading.horizon
    then, last = state.calls.at(start), state.calls.marks[-1]
    if then is None:
        return False
    n, new, total = last[1] - then[1], last[2] - then[2], last[1]
    expected = space * (math.exp(-(total - n) / space) - math.exp(-total / space))
    return new > 2 * expected + REFUTE_RECORDS


@functools.lru_cache(maxsize=256)
def shape_space(requests: int, distinct: int) -> Optional[float]:
    """S with S(1 - e^(-n/S)) = D: the number of sizes that explains D distinct in n requests.
    Infinite when every request was new; None without data. Cached: a pure function of two
    counts that change only with an agent's `calls` report, asked for at every poll."""
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
