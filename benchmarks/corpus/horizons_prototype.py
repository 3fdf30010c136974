"""A prototype, its estimator now the sidecar's (watchdog/sidecar/core/horizons.py): growth
read at every horizon from a minute to a day, and the time to the moment allocation fails,
scored offline (memory alone, no discovery model) on the corpus as recorded and stretched
(benchmarks/corpus/stretch.py).

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
import sys
from typing import Any, Iterable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from torch_watchdog.sidecar.core.horizons import (  # noqa: E402  the estimator, now the core's
    EVAL_S, HORIZONS, TIER_BUCKETS, TIER_S, History, Reading, estimate, read_horizon)
from torch_watchdog.sidecar.core.horizons import seconds_to_fail as _seconds_to_fail  # noqa: E402

__all__ = ["HORIZONS", "TIER_BUCKETS", "TIER_S", "History", "Reading", "estimate",
           "fail_level", "read_horizon", "seconds_to_fail"]

FAIL_FREE_BYTES = 19 << 20
WARMUP_S = 30.0       # from the first compile: no decision (as the policy's warm-up)


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
    if reading is None or level is None or history.last_t is None:
        return math.inf
    return _seconds_to_fail(reading, fail_level - level, history.last_t, history.last_rise_t)


# -- offline scoring (I/O at the edge) --------------------------------------------------------
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
