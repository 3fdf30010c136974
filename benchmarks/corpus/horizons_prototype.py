"""A prototype, not wired into the sidecar: growth read at every horizon from a minute to a day,
and the time to the moment allocation fails. Scored offline against main's forecast on the
corpus as recorded and stretched (benchmarks/corpus/stretch.py).

    python benchmarks/corpus/horizons_prototype.py [--scales 1 10 60 360] [--json]

The estimator (pure; `History` and `estimate`):
- History: the memory's maximum per bucket, in tiers of coarser buckets for longer spans
  (1 s buckets for 2 min ... 12 min buckets for a day, TIER_BUCKETS each): bounded memory per
  server (about 6 x 130 numbers) for 24 h of 10 Hz polls, O(1) per poll.
- Per horizon H (HORIZONS, 1 min to 24 h) the points of the tier whose buckets fit H in at most
  TIER_BUCKETS: the upper envelope from H's start (the running maximum, from the highest of
  H's first ENVELOPE_S or eighth: a sawtooth's troughs and a staircase's flats do not count,
  its peaks and steps do), less one-off steps (a rise over OUTLIER times the median rise: a
  model load, a KV pool). A horizon is read when its history covers it, its envelope rose at
  least MIN_RISES times over at least SPREAD_S (the first climb of a sawtooth is a burst), and
  the growth has not stopped (the silence since the last rise is at most PAUSE x the longest
  pause between rises before it: a staircase's flat, a burst's idle gap, are pauses it has
  seen; a plateau's silence outgrows them).
- The horizon that explains the recent growth best decides: the highest R^2 of a straight
  line through its envelope (a staircase with many steps over a long horizon; a ramp that
  began an hour ago over the part since it began; decelerating growth over its recent part),
  the longer one on a near tie. The rate is that line's slope, the step the median rise.
- The time to OOM is to the moment allocation fails: the first step that does not fit under
  the fail level (reaching it fails), the next step due the lower quartile of the gaps
  between steps after the last one (to the poll: History keeps it), one step every
  step / rate after that. The level is the highest of the last LEVEL_S; the fail level the
  budget (a process budget, as in the corpus) or, on a device, its total less
  FAIL_FREE_BYTES (allocations failed at ~19 MiB NVML free on an H200), not a budget less a
  byte headroom.

Scored like benchmarks/judgment.py: a decision when the forecast is <= reload_lead_s (60 s) at
HOLD consecutive evaluations (evaluated once a second of log time, not every poll), the
`oom_forecast` alert when <= alert_lead_s (30 min), predicted/actual at 1, 2, 5, 10 x the lead;
none in the first WARMUP_S after the first compile (the policy's warm-up). Memory is the
server process's NVML memory, as the corpus' budgets count it. There is no discovery model
here (the graph-growth forecast of main): only memory.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
from collections import deque
from typing import Any, Iterable, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

HORIZONS = (60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0,
            86400.0)
TIER_S = (1.0, 5.0, 15.0, 60.0, 240.0, 720.0)   # bucket widths
TIER_BUCKETS = 130
MIN_RISES = 3
OUTLIER = 8.0
MIN_R2 = 0.5
NEAR_TIE = 0.02
COVER = 0.9           # a horizon is read once the history spans this part of it
LEVEL_S = 30.0
ENVELOPE_S = 30.0
FAIL_FREE_BYTES = 19 << 20
RISE_BYTES = 1 << 20  # a rise of the envelope smaller than this is noise
SPREAD_S = 20.0       # the rises a horizon is read from span at least this long
PAUSE = 1.5           # a silence this many times the longest pause before: growth stopped
WARMUP_S = 30.0       # from the first compile: no decision (as the policy's warm-up)


class History:
    """The memory's maximum per bucket, per tier (bounded)."""

    def __init__(self) -> None:
        self.tiers: list[deque[list[float]]] = [deque(maxlen=TIER_BUCKETS) for _ in TIER_S]
        self.first_t: Optional[float] = None
        self.last_t: Optional[float] = None
        # the last poll that rose over the highest of the LEVEL_S before it: when the latest
        # step came, to the poll (the tiers know it to a bucket, minutes at long horizons)
        self.last_rise_t: Optional[float] = None
        self._high: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        if self.first_t is None:
            self.first_t = t
        self.last_t = t
        high = self._high   # the highest of the last LEVEL_S: a monotonic deque
        while high and high[0][0] < t - LEVEL_S:
            high.popleft()
        if high and value > high[0][1] + RISE_BYTES:
            self.last_rise_t = t
        while high and high[-1][1] <= value:
            high.pop()
        high.append((t, value))
        for width, tier in zip(TIER_S, self.tiers):
            b = math.floor(t / width)
            if tier and tier[-1][0] == b:
                if value > tier[-1][1]:
                    tier[-1][1] = value
            else:
                tier.append([b, value])

    def points(self, horizon: float) -> tuple[float, list[tuple[float, float]]]:
        """(bucket width, [(bucket end time, max)]) over the last `horizon`."""
        assert self.last_t is not None
        i = next((i for i, w in enumerate(TIER_S) if horizon / w <= TIER_BUCKETS - 2),
                 len(TIER_S) - 1)
        width, since = TIER_S[i], self.last_t - horizon
        return width, [(min((b + 1) * width, self.last_t), v) for b, v in self.tiers[i]
                       if (b + 1) * width > since]

    def level(self) -> Optional[float]:
        """The highest of the last LEVEL_S."""
        return self._high[0][1] if self._high else None


class Reading(NamedTuple):
    horizon: float
    rate: float          # bytes/s
    r2: float
    rises: int
    step: float          # the median rise: the size of the growth's allocations
    last_rise_t: float
    soon: float          # the lower quartile of the gaps between rises


def read_horizon(history: History, horizon: float) -> Optional[Reading]:
    if history.first_t is None or history.last_t is None \
            or history.last_t - history.first_t < COVER * horizon:
        return None
    _, pts = history.points(horizon)
    if len(pts) < 4:
        return None
    rises: list[tuple[float, float]] = []   # (t, rise)
    # the envelope starts at the highest of the horizon's first ENVELOPE_S (or eighth): a
    # sawtooth's peak, not the trough the horizon happened to begin in
    head = pts[0][0] + max(ENVELOPE_S, horizon / 8)
    top = max(v for t, v in pts if t <= head)
    for t, v in pts:
        if t <= head:
            continue
        if v > top + RISE_BYTES:
            rises.append((t, v - top))
            top = v
        elif v > top:
            top = v
    if len(rises) < MIN_RISES:
        return None
    limit = OUTLIER * statistics.median(r for _, r in rises)
    kept = [(t, r) for t, r in rises if r <= limit]
    if len(kept) < MIN_RISES:
        return None
    times = [t for t, _ in kept]
    if times[-1] - times[0] < SPREAD_S:
        return None   # a burst (the first climb of a sawtooth), not yet a trend
    pauses = [b - a for a, b in zip(times, times[1:])]
    silence = history.last_t - times[-1]
    if silence > PAUSE * max(pauses, default=0.0):
        return None   # the growth stopped: longer than any pause it took before
    # the envelope less its one-offs, at each point
    env, level, j = [], 0.0, 0
    for t, _ in pts:
        if t < head:
            continue
        while j < len(kept) and kept[j][0] <= t:
            level += kept[j][1]
            j += 1
        env.append((t, level))
    n = len(env)
    mt = sum(t for t, _ in env) / n
    mv = sum(v for _, v in env) / n
    sxx = sum((t - mt) ** 2 for t, _ in env)
    sxy = sum((t - mt) * (v - mv) for t, v in env)
    syy = sum((v - mv) ** 2 for _, v in env)
    if sxx <= 0 or syy <= 0 or sxy <= 0:
        return None
    # the next step may come as soon as the shorter gaps between steps did
    soon = sorted(pauses)[len(pauses) // 4] if pauses else math.inf
    return Reading(horizon, sxy / sxx, sxy * sxy / (sxx * syy), len(kept),
                   statistics.median(r for _, r in kept), times[-1], soon)


def estimate(history: History) -> Optional[Reading]:
    """The reading of the horizon that explains the recent growth best, or None."""
    best: Optional[Reading] = None
    for h in HORIZONS:
        r = read_horizon(history, h)
        if r is None or r.r2 < MIN_R2:
            continue
        if best is None or r.r2 >= best.r2 - NEAR_TIE:
            best = r
    return best


def fail_level(budget: Optional[float] = None, device_total: Optional[float] = None,
               others_bytes: float = 0.0) -> float:
    """The server's memory at which allocation fails: its budget where one is set (the
    corpus' emulated GPUs), else the device's total less what other processes hold and the
    FAIL_FREE_BYTES a device keeps when allocations fail."""
    if budget is not None:
        return budget
    if device_total is None:
        raise ValueError("a budget or a device total")
    return device_total - others_bytes - FAIL_FREE_BYTES


def seconds_to_fail(history: History, fail_level: float) -> float:
    reading, level = estimate(history), history.level()
    if reading is None or level is None:
        return math.inf
    # the allocation that fails is the first step that does not fit: the steps that still
    # fit, one every step / rate, after the next one is due
    every = reading.step / reading.rate
    fit = max(0.0, math.ceil((fail_level - level) / reading.step) - 1)   # (reaching it fails)
    assert history.last_t is not None
    last = reading.last_rise_t
    if history.last_rise_t is not None and history.last_rise_t > last - TIER_S[-1]:
        last = history.last_rise_t
    due = max(0.0, last + min(every, reading.soon) - history.last_t)
    return due + fit * every


# -- offline scoring (I/O at the edge) --------------------------------------------------------
EVAL_S = 1.0
HOLD = 3
LEAD_S, ALERT_LEAD_S = 60.0, 1800.0


def _series(observations: Iterable[Any], pids: set[int]):
    from torch_watchdog.sidecar.core.observations import Sample

    for obs in observations:
        if isinstance(obs, Sample):
            for p in obs.processes:
                if p.pid in pids and p.alive and p.gpu_total is not None:
                    yield obs.t, p.pid, p.gpu_total


@functools.lru_cache(maxsize=1)
def _oracles() -> dict[tuple[int, str, str], float]:
    """The oracle's lead per row of the committed scoreboard (main's replay knows when each
    agent was first heard of)."""
    path = os.path.join(ROOT, "benchmarks", "results", "judgment.json")
    with open(path) as fh:
        board = json.load(fh)
    return {(int(k), r["file"], r["scenario"]): r["oracle_lead_s"]
            for k, b in board["scales"].items() for r in b["rows"] if r["oom"]}


def score(name: str, k: int) -> list[dict[str, Any]]:
    import judgment
    import stretch
    from torch_watchdog.sidecar.offline.traces import Reader

    label = judgment.labels()[name]
    obs: Iterable[Any] = Reader(os.path.join(judgment.CORPUS, label["file"]))
    if k != 1:
        obs = stretch.stretch(obs, *stretch.window(label), k)
        label = stretch.stretched_label(label, k)
    truth = {int(p): s for p, s in label["servers"].items()}
    hist = {p: History() for p in truth}
    state = {p: {"next": -math.inf, "hold": 0, "reload": None, "alert": None, "cal": [],
                 "targets": sorted(((m, s["oom_t"] - m * LEAD_S) for m in judgment.AT_LEADS
                                    if s["oom_t"] is not None and s["growth_visible_s"]
                                    and m * LEAD_S <= s["growth_visible_s"]),
                                   key=lambda x: x[1]), "prev": None}
             for p, s in truth.items()}
    for t, pid, mem in _series(obs, set(truth)):
        h, st, s = hist[pid], state[pid], truth[pid]
        h.add(t, mem)
        end = s["oom_t"] if s["oom_t"] is not None else s["end_t"]
        if t < st["next"] or t >= end or t < s["compiled_t"] + WARMUP_S:
            continue
        st["next"] = t + EVAL_S
        while st["targets"] and st["targets"][0][1] < t:
            m, _ = st["targets"].pop(0)
            if st["prev"] is not None:
                pt, pred = st["prev"]
                st["cal"].append([m, None if math.isinf(pred) else round(pred, 1),
                                  round(s["oom_t"] - pt, 1)])
        pred = seconds_to_fail(h, fail_level(budget=s["budget_bytes"]))
        st["prev"] = (t, pred)
        if pred <= ALERT_LEAD_S and st["alert"] is None:
            st["alert"] = t
        st["hold"] = st["hold"] + 1 if pred <= LEAD_S else 0
        if st["hold"] >= HOLD and st["reload"] is None:
            st["reload"] = t
    rows = []
    for pid, s in sorted(truth.items()):
        st, oom = state[pid], s["oom_t"]
        row: dict[str, Any] = {"file": name, "scenario": s["scenario"], "scale": k,
                               "oom": oom is not None}
        if oom is None:
            row.update(reloads=int(st["reload"] is not None),
                       alerts=["oom_forecast"] if st["alert"] is not None else [],
                       verdict="false reload" if st["reload"] is not None else "ok")
        else:
            visible = s["growth_visible_s"]
            lead = None if st["reload"] is None else round(oom - st["reload"], 1)
            oracle = _oracles().get((k, name, s["scenario"]), LEAD_S)
            row.update(growth_visible_s=visible, lead_s=lead, oracle_lead_s=oracle,
                       in_targets=visible >= judgment.VISIBLE_S,
                       too_early=lead is not None and lead > max(3 * LEAD_S, 0.1 * visible),
                       alert_lead_s=None if st["alert"] is None else round(oom - st["alert"], 1),
                       calibration=sorted(st["cal"]), reloads=int(lead is not None),
                       alerts=["oom_forecast"] if st["alert"] is not None else [])
            if visible >= judgment.ALERT_VISIBLE_S:
                row["alert_in_time"] = st["alert"] is not None and \
                    oom - st["alert"] >= judgment.ALERT_MIN_LEAD_S
            if not visible:
                row["verdict"] = "false reload" if lead is not None else "ok"
            elif lead is None:
                row["verdict"] = "missed"
            elif lead >= judgment.MIN_LEAD_S and lead >= 0.5 * oracle:
                row["verdict"] = "hit"
            else:
                row["verdict"] = "late"
        rows.append(row)
    return rows


def main() -> int:
    import multiprocessing

    import judgment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=int, nargs="+", default=list(judgment.SCALES))
    p.add_argument("--only", nargs="+")
    p.add_argument("--jobs", type=int)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    todo = [j for j in judgment.plan(a.scales, judgment.labels()) if not a.only or j[0] in a.only]
    todo.sort(key=lambda j: -j[1])
    with multiprocessing.get_context("fork").Pool(a.jobs or os.cpu_count()) as pool:
        done = dict(zip(todo, pool.starmap(score, todo, chunksize=1)))
    board: dict[str, Any] = {"scales": {}}
    for k in sorted({k for _, k in todo}):
        rows = [r for j in sorted(todo) if j[1] == k for r in done[j]]
        board["scales"][str(k)] = {**judgment.summary(rows), "rows": rows}
    print(json.dumps(board, indent=1) if a.json else judgment.table(board))
    return 0


if __name__ == "__main__":
    sys.exit(main())
