"""The sidecar's judgment, scored: replays the corpus of real GPU runs (tests/fixtures/corpus,
recorded by benchmarks/record_corpus.py) through the step the daemon runs and prints, per
scenario and time scale, what it decided and when, against the truth.

    python benchmarks/judgment.py [--json] [--check benchmarks/results/judgment.json]
                                  [--scales 1 10 60 360] [--jobs N]

Time scales: x1 is the corpus as recorded (every run, the flat controls too); xK is the same
run with its growth phase stretched K times (benchmarks/corpus/stretch.py: the steps K times
further apart, the polls at 10 Hz and the heartbeats at their cadence): every growth scenario
at x10 and x60 (OOM 7 min to 3.5 h after growth began), x360 (10-14 h) for one leak and one
graph growth.

Per server of a scenario: its first reload decision before its OOM and that decision's lead
(seconds before the OOM), the lead an oracle would have had (the first poll at which the true
time to OOM was <= reload_lead_s), and the alerts. Verdicts:
- an OOM whose growth was visible >= 60 s before it: `hit` when reloaded >= 20 s before the
  OOM with at least half the oracle's lead, else `late` or `missed`;
- an OOM with less to see (growth under 60 s, or none): `hit`/`late`/`missed` too, scored but
  outside the targets; with no trend at all a reload before it is `false reload`;
- no OOM: `ok`, or `false reload`; on a flat control also `false alert` for any alert.
Calibration, per OOM: the forecast time to OOM against the true one at 1, 2, 5 and 10 x
reload_lead_s before the OOM (where growth was visible by then; the last poll at or before);
the decision's lead against the oracle's; `too early` when that lead is over max(3 x
reload_lead_s, 10 % of the visible growth); the first `oom_forecast` alert's lead, which must
be >= 25 min where growth was visible >= 30 min (alert_lead_s is 30 min).
`--check`: exit 1 if any scenario at any scale scores worse than in the given scoreboard (see
`regressions`).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any, Iterable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "corpus"))

import peers  # noqa: E402
import stretch  # noqa: E402
from torch_watchdog import events  # noqa: E402
from torch_watchdog.sidecar.config import Config  # noqa: E402
from torch_watchdog.sidecar.core import step  # noqa: E402
from torch_watchdog.sidecar.core.observations import ConfigChange, Sample  # noqa: E402
from torch_watchdog.sidecar.offline.traces import Reader  # noqa: E402

CORPUS = os.path.join(ROOT, "tests", "fixtures", "corpus")
VISIBLE_S = 60.0     # growth visible this long before the OOM: in the targets
MIN_LEAD_S = 20.0
FLAT = {"bucketed-control", "plateau-99.5", "sawtooth", "shared-flat"}
GOOD = {"hit", "ok"}
SCALES = (1, 10, 60, 360)
AT_LEADS = (1, 2, 5, 10)          # calibration: this many reload_lead_s before the OOM
# one leak, one graph growth at ~10 h (the corpus's; the held-out corpus's)
X360 = ("leak-medium", "gpt2-variable-seq-2", "slow-leak", "llama-variable-seq")
HELD_OUT = os.path.join(ROOT, "tests", "fixtures", "heldout")
ALERT_VISIBLE_S = 1800.0          # growth visible this long: the alert must come ...
ALERT_MIN_LEAD_S = 1500.0         # ... this long before the OOM
# straight ramps, where predicted/actual must be within CALIBRATED at 2-10 x the lead
# graph growth that saturates under the budget: stretched too (no alert at any pace)
PLATEAUS = {"resnet-variable-images", "gpt2-saturating", "vit-variable-res"}
RAMPS = {"fragmentation", "kv-cache-growth", "leak-small", "leak-medium", "leak-large",
         "slow-leak", "static-kv-cache", "tenant-bert"}
CALIBRATED = (0.75, 1.33)
MEDIAN_SLACK = 0.05               # --check: the median |log2(pred/actual)| may wobble this much


def use_corpus(path: str) -> None:
    """Score the corpus in `path` (its labels.json and sample logs) from now on; replays in
    worker processes (forked) see it too."""
    global CORPUS
    CORPUS = os.path.abspath(path)


def labels() -> dict[str, Any]:
    with open(os.path.join(CORPUS, "labels.json")) as fh:
        return json.load(fh)


def growth_files(all_labels: dict[str, Any]) -> list[str]:
    """The corpus files with growth to stretch: an OOM after visible growth, or growth that
    plateaus (not the flat controls, nor an OOM with no trend before it)."""
    return [name for name, label in sorted(all_labels.items())
            if any(s["growth_visible_s"] or s["scenario"] in PLATEAUS
                   for s in label["servers"].values())]


def plan(scales: Iterable[int], all_labels: dict[str, Any]) -> list[tuple[str, int]]:
    jobs = []
    for k in scales:
        names = sorted(all_labels) if k == 1 else [n for n in X360 if n in all_labels] \
            if k == 360 else growth_files(all_labels)
        jobs += [(name, k) for name in names]
    return jobs


class _Watch:
    """What the score needs from a replay beyond its actions: when each pid was first heard
    of, and each OOM's forecast at the calibration times (the last poll at or before each)."""

    def __init__(self, label: dict[str, Any], lead_s: float):
        self.seen: dict[int, float] = {}
        self.targets: dict[int, list[tuple[int, float]]] = {}   # pid -> (m, time), in order
        self.prev: dict[int, tuple[float, float]] = {}           # pid -> (t, forecast s)
        self.got: dict[int, list[list[Any]]] = {}                 # pid -> [m, predicted, actual]
        self.oom: dict[int, float] = {}
        for pid_s, truth in label["servers"].items():
            visible = truth["growth_visible_s"]
            if truth["oom_t"] is None or not visible:
                continue
            pid, oom = int(pid_s), truth["oom_t"]
            self.oom[pid] = oom
            self.got[pid] = []
            self.targets[pid] = [(m, oom - m * lead_s) for m in sorted(AT_LEADS, reverse=True)
                                 if m * lead_s <= visible]

    def event(self, obs: Any) -> None:
        if isinstance(obs, events.Hello):
            self.seen.setdefault(obs.pid, obs.t)

    def sample(self, host: step.Host, t: float) -> None:
        for pid, targets in self.targets.items():
            while targets and targets[0][1] < t:
                m, _ = targets.pop(0)
                before = self.prev.get(pid)
                if before is not None:
                    predicted = None if math.isinf(before[1]) else round(before[1], 1)
                    self.got[pid].insert(0, [m, predicted, round(self.oom[pid] - before[0], 1)])
            if targets:
                name = host.owner.get(pid)
                server = host.servers.get(name) if name is not None else None
                self.prev[pid] = (t, math.inf if server is None else server.forecast.seconds)


def replay(name: str, k: int
           ) -> tuple[dict[str, Any], step.Host, list, _Watch, Config, int, float]:
    """One corpus file at scale k through the daemon's step: its label (moved), the host, the
    actions, what was watched, the config last in force, the polls, and the wall seconds."""
    started = time.perf_counter()
    label, observations = observations_of(name, k)
    config, host, actions = Config(), step.Host(), []
    watch: Optional[_Watch] = None
    polls = 0
    for obs in observations:
        if isinstance(obs, ConfigChange):   # the live sidecar's config from then on (SIGHUP)
            config = obs.config
            continue
        if watch is None:   # the lead of the config the log starts with
            watch = _Watch(label, config.policy.reload_lead_s)
        actions.extend(step.step(host, obs, config).actions)
        if isinstance(obs, Sample):
            polls += 1
            watch.sample(host, obs.t)
        else:
            watch.event(obs)
    assert watch is not None, name
    return label, host, actions, watch, config, polls, time.perf_counter() - started


def score_file(name: str, k: int = 1) -> dict[str, Any]:
    label, host, actions, watch, cfg, polls, wall = replay(name, k)
    lead_s = cfg.policy.reload_lead_s
    rows = []
    for pid_s, truth in sorted(label["servers"].items()):
        pid = int(pid_s)
        server = next((n for n, s in host.servers.items() if pid in s.state.pids), None)
        mine = [a for a in actions if a.server == server] if server else []
        oom = truth["oom_t"]
        # until the OOM, or the end of a run that had none (after it, its pids are no one's)
        before = [a for a in mine if a.t < (oom if oom is not None else truth["end_t"])]
        reloads = [a for a in before if a.kind.value == "reload"]
        alerts = sorted({a.reason for a in before if a.kind.value == "alert"})
        first = watch.seen.get(pid, truth["compiled_t"])
        row: dict[str, Any] = {"scenario": truth["scenario"], "file": name, "scale": k,
                               "server": server, "oom": oom is not None,
                               "reloads": len(reloads), "alerts": alerts}
        row.update(verdict(truth, reloads[0].t if reloads else None, first, lead_s,
                           bool(alerts)))
        if oom is not None:
            visible = truth["growth_visible_s"]
            alerted = [a.t for a in before if a.kind.value == "alert"
                       and a.reason == "oom_forecast"]
            row.update(alert_lead_s=round(oom - alerted[0], 1) if alerted else None,
                       forecast_alerts=len(alerted), calibration=watch.got.get(pid, []))
            if visible >= ALERT_VISIBLE_S:
                row["alert_in_time"] = bool(alerted) and oom - alerted[0] >= ALERT_MIN_LEAD_S
        rows.append(row)
    return {"rows": rows, "wall_s": round(wall, 1), "polls": polls}


def verdict(truth: dict[str, Any], reload_t: Optional[float], first: float, lead_s: float,
            alerted: bool = False) -> dict[str, Any]:
    """A server's verdict from its first reload before the OOM (or the run's end), the
    sidecar's or a peer's: the lead, the oracle's, too early, hit/late/missed/false reload."""
    oom = truth["oom_t"]
    if oom is None:
        return {"verdict": "false reload" if reload_t is not None else
                "false alert" if alerted and truth["scenario"] in FLAT else "ok"}
    oracle = oom - max(first, oom - lead_s)
    lead = None if reload_t is None else round(oom - reload_t, 1)
    visible = truth["growth_visible_s"]
    out: dict[str, Any] = {
        "growth_visible_s": visible, "lead_s": lead, "oracle_lead_s": round(oracle, 1),
        "in_targets": visible >= VISIBLE_S,
        "too_early": lead is not None and lead > max(3 * lead_s, 0.1 * visible)}
    if visible == 0.0:
        out["verdict"] = "false reload" if lead is not None else "ok"
    elif lead is None:
        out["verdict"] = "missed"
    elif lead >= MIN_LEAD_S and lead >= 0.5 * oracle:
        out["verdict"] = "hit"
    else:
        out["verdict"] = "late"
    return out


def observations_of(name: str, k: int) -> tuple[dict[str, Any], Iterable[Any]]:
    """A corpus file's label and observations at scale k (stretched, the label moved)."""
    label = labels()[name]
    observations: Iterable[Any] = Reader(os.path.join(CORPUS, label["file"]))
    if k != 1:
        observations = stretch.stretch(observations, *stretch.window(label), k)
        label = stretch.stretched_label(label, k)
    return label, observations


def score_peers(name: str, k: int = 1) -> list[dict[str, Any]]:
    """Each peer rule (benchmarks/peers.py) on a corpus file at scale k, per server, with the
    sidecar's verdicts: its first firing before the OOM (or the run's end) as its reload."""
    label, observations = observations_of(name, k)
    lead_s = Config().policy.reload_lead_s   # the corpus's sidecars ran the default lead
    pids = [int(p) for p in label["servers"]]
    series = peers.scrapes(observations, pids)
    rows = []
    for pid_s, truth in sorted(label["servers"].items()):
        got = series[int(pid_s)]
        if not got:
            continue
        end = truth["oom_t"] if truth["oom_t"] is not None else truth["end_t"]
        before = [(t, v) for t, v in got if t < end]
        for peer, fired in peers.fire_times(before, truth["budget_bytes"], got[0][0],
                                             lead_s).items():
            row = {"peer": peer, "scenario": truth["scenario"], "file": name, "scale": k,
                   "oom": truth["oom_t"] is not None, "fired_t": fired}
            row.update(verdict(truth, fired, truth["compiled_t"], lead_s,
                               alerted=fired is not None))
            rows.append(row)
    return rows


def peer_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per peer at one scale: the sidecar's summary fields that a firing time gives."""
    out = {}
    for peer in peers.PEERS:
        mine = [r for r in rows if r["peer"] == peer]
        target = [r for r in mine if r.get("in_targets")]
        out[peer] = {
            "recall": f"{sum(r['verdict'] == 'hit' for r in target)}/{len(target)}",
            "false_reloads": sum(r["verdict"] == "false reload" for r in mine),
            "fired_on_flat_controls": sum(r["fired_t"] is not None for r in mine
                                          if r["scenario"] in FLAT),
            "too_early": sum(bool(r.get("too_early")) for r in mine),
            "late": sum(r["verdict"] == "late" for r in mine),
            "median_lead_over_oracle": peers.lead_ratio_median(mine)}
    return out


def _score(job: tuple[str, int]) -> dict[str, Any]:
    return score_file(*job)


def _score_peers(job: tuple[str, int]) -> list[dict[str, Any]]:
    return score_peers(*job)


def abs_log2(predicted: Optional[float], actual: float) -> float:
    """|log2(predicted / actual)|: inf where nothing was forecast (or 0 s was)."""
    if predicted is None or predicted <= 0 or actual <= 0:
        return math.inf
    return abs(math.log2(predicted / actual))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    target = [r for r in rows if r.get("in_targets")]
    points = [abs_log2(p, a) for r in rows if r["oom"] for _, p, a in r.get("calibration", [])]
    ramp = [(p, a) for r in rows if r["scenario"] in RAMPS
            for m, p, a in r.get("calibration", []) if m >= 2]
    alerting = [r for r in rows if "alert_in_time" in r]
    median = statistics.median(points) if points else None
    calibrated = sum(p is not None and CALIBRATED[0] <= p / a <= CALIBRATED[1] for p, a in ramp)
    return {"recall": f"{sum(r['verdict'] == 'hit' for r in target)}/{len(target)}",
            "false_reloads": sum(r["verdict"] == "false reload" for r in rows),
            "false_alerts": sum(len(r["alerts"]) for r in rows if r["scenario"] in FLAT),
            # an OOM forecast alerted for a run that never ran out (growth that plateaus)
            "forecast_alerts_without_oom": sum("oom_forecast" in r["alerts"] for r in rows
                                               if not r["oom"]),
            "too_early": sum(bool(r.get("too_early")) for r in rows),
            "median_abs_log2": None if median is None or math.isinf(median)
            else round(median, 3),
            "calibration_points": len(points),
            "unforecast_points": sum(math.isinf(p) for p in points),
            "ramps_calibrated": f"{calibrated}/{len(ramp)}",
            "alerts_in_time": f"{sum(r['alert_in_time'] for r in alerting)}/{len(alerting)}",
            # an OOM's forecast alert fired again after it resolved (one growth, paged again)
            "forecast_alerts_again": sum(max(0, r.get("forecast_alerts", 0) - 1) for r in rows),
            "targets_met": all(r["verdict"] in GOOD for r in rows
                               if r.get("in_targets") or not r["oom"]
                               or r.get("growth_visible_s") == 0.0)}


def _map(fn: Any, todo: list[tuple[str, int]], jobs: Optional[int]) -> dict:
    workers = min(len(todo), jobs or os.cpu_count() or 1)
    if workers <= 1:
        return {j: fn(j) for j in todo}
    # the longest first: a x360 replay is most of the work
    order = sorted(todo, key=lambda j: -j[1])
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return dict(zip(order, pool.map(fn, order, chunksize=1)))


def scoreboard(scales: Iterable[int] = SCALES, jobs: Optional[int] = None,
               only: Optional[list[str]] = None, with_peers: bool = False) -> dict[str, Any]:
    todo = [j for j in plan(scales, labels()) if not only or j[0] in only]
    started = time.perf_counter()
    done = _map(_score, todo, jobs)
    peer_rows = _map(_score_peers, todo, jobs) if with_peers else {}
    board: dict[str, Any] = {"scales": {}}
    for k in sorted({k for _, k in todo}):
        rows = [row for j in todo if j[1] == k for row in done[j]["rows"]]
        board["scales"][str(k)] = {**summary(rows), "rows": rows,
                                   "replay": {n: {"polls": done[(n, kk)]["polls"],
                                                  "wall_s": done[(n, kk)]["wall_s"]}
                                              for n, kk in todo if kk == k}}
        if with_peers:
            mine = [row for j in todo if j[1] == k for row in peer_rows[j]]
            board["scales"][str(k)]["peers"] = {"summary": peer_summary(mine), "rows": mine}
    board["wall_s"] = round(time.perf_counter() - started, 1)
    return board


def _key(r: dict[str, Any]) -> tuple[str, str]:
    return r["file"], r["scenario"]


def regressions(now: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """What scores worse than `before`, at each scale both have:
    - a verdict that was good and is not;
    - a reload lead more than 1 s shorter, and shorter than the oracle's (a reload at least the
      oracle's lead ahead is not worse for coming later: one that came too early may);
    - a reload that was not too early and is;
    - an alert in time (>= 25 min ahead of an OOM grown for >= 30 min) that is not;
    - more alerts on a flat control;
    - per scale: fewer ramps calibrated, a median |log2(predicted/actual)| more than
      MEDIAN_SLACK worse, more false reloads, alerts on flat controls, OOM forecast alerts
      on runs without an OOM, or forecast alerts fired again for an OOM already alerted."""
    out = []
    # a scoreboard from before the scales (rows at top level) is the one at x1
    scales = before.get("scales", {"1": before})
    for k, board in now["scales"].items():
        was_board = scales.get(k)
        if was_board is None:
            continue
        old = {_key(r): r for r in was_board["rows"]}
        for r in board["rows"]:
            was: Optional[dict] = old.get(_key(r))
            if was is None:
                continue
            key = f"x{k} {r['file']}/{r['scenario']}"
            if was["verdict"] in GOOD and r["verdict"] not in GOOD:
                out.append(f"{key}: {was['verdict']} -> {r['verdict']}")
            lead, old_lead = r.get("lead_s"), was.get("lead_s")
            if old_lead is not None and (lead is None or (lead < old_lead - 1.0
                                                          and lead < r["oracle_lead_s"])):
                out.append(f"{key}: lead {old_lead} s -> {lead}")
            if r.get("too_early") and was.get("too_early") is False:
                out.append(f"{key}: lead {old_lead} s -> {lead}, too early")
            if was.get("alert_in_time") and not r.get("alert_in_time"):
                out.append(f"{key}: oom_forecast alert {was.get('alert_lead_s')} s -> "
                           f"{r.get('alert_lead_s')} s before the OOM")
            if r["scenario"] in FLAT and len(r["alerts"]) > len(was["alerts"]):
                out.append(f"{key}: alerts {was['alerts']} -> {r['alerts']}")
        out += _summary_regressions(f"x{k}", board, was_board)
    return out


def _summary_regressions(scale: str, board: dict[str, Any], was: dict[str, Any]) -> list[str]:
    out = []

    def count(v: str) -> int:
        return int(v.split("/")[0])

    if "ramps_calibrated" in was and \
            count(board["ramps_calibrated"]) < count(was["ramps_calibrated"]):
        out.append(f"{scale}: ramps calibrated {was['ramps_calibrated']} -> "
                   f"{board['ramps_calibrated']}")
    m_now, m_was = board["median_abs_log2"], was.get("median_abs_log2")
    if m_was is not None and (m_now is None or m_now > m_was + MEDIAN_SLACK):
        out.append(f"{scale}: median |log2(predicted/actual)| {m_was} -> {m_now}")
    for field in ("false_reloads", "false_alerts", "forecast_alerts_without_oom",
                  "forecast_alerts_again"):
        if field in was and board[field] > was[field]:
            out.append(f"{scale}: {field} {was[field]} -> {board[field]}")
    return out


def _ratio(p: Optional[float], a: float) -> str:
    return "none" if p is None else f"{p / a:.2f}" if a > 0 else "-"


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def table(board: dict[str, Any]) -> str:
    out = []
    for k, b in board["scales"].items():
        out += [f"### x{k}", "",
                "| scenario | OOM (growth seen) | verdict | lead | oracle | lead/oracle | "
                "predicted/actual at 1x, 2x, 5x, 10x the lead | first forecast alert | alerts |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in b["rows"]:
            oom = f"yes ({_duration(r['growth_visible_s'])})" if r["oom"] else "no"
            lead = "" if r.get("lead_s") is None else _duration(r["lead_s"]) + \
                (" (too early)" if r.get("too_early") else "")
            oracle = "" if not r["oom"] else f"{r['oracle_lead_s']:.1f} s"
            ratio = "" if r.get("lead_s") is None or not r.get("oracle_lead_s") else \
                f"{r['lead_s'] / r['oracle_lead_s']:.2f}"
            cal = {m: _ratio(p, a) for m, p, a in r.get("calibration", [])}
            calib = ", ".join(cal.get(m, "-") for m in AT_LEADS) if r["oom"] else ""
            alert = "" if not r["oom"] else "none" if r.get("alert_lead_s") is None else \
                _duration(r["alert_lead_s"]) + ("" if r.get("alert_in_time") in (None, True)
                                                 else " (late)") + \
                (f", fired {r['forecast_alerts']} times" if r.get("forecast_alerts", 0) > 1
                 else "")
            name = r["scenario"] if r["file"] == r["scenario"] else \
                f"{r['scenario']} ({r['file']})"
            out.append(f"| {name} | {oom} | {r['verdict']} | {lead} | {oracle} | {ratio} | "
                       f"{calib} | {alert} | {', '.join(r['alerts']) or '-'} |")
        out += ["", f"x{k}: recall {b['recall']} (OOMs with growth seen >= {VISIBLE_S:.0f} s), "
                f"too early {b['too_early']}, median |log2(predicted/actual)| "
                f"{b['median_abs_log2'] if b['median_abs_log2'] is not None else 'inf'} over "
                f"{b['calibration_points']} points ({b['unforecast_points']} with no forecast), "
                f"ramps within {CALIBRATED[0]}-{CALIBRATED[1]} at 2-10x the lead "
                f"{b['ramps_calibrated']}, forecast alerts >= 25 min ahead "
                f"{b['alerts_in_time']} (fired again {b.get('forecast_alerts_again', '-')}), "
                f"false reloads {b['false_reloads']}, alerts on flat "
                f"controls {b['false_alerts']}, OOM forecast alerts on runs without an OOM "
                f"{b['forecast_alerts_without_oom']}, targets met: {b['targets_met']}", ""]
    return "\n".join(out)


SWEPT = ("trend", "horizons", "forecast", "policy")   # the forecast path's modules (issue 51)
SWEEP_FACTORS = (0.5, 1.5)


def constants() -> list[tuple[str, str, float]]:
    """The forecast path's tuned numbers: every module-level int or float (not a flag, not a
    tuple) named in capitals in core/{trend,horizons,forecast,policy}.py."""
    import importlib

    out = []
    for short in SWEPT:
        mod = importlib.import_module(f"torch_watchdog.sidecar.core.{short}")
        for name, value in vars(mod).items():
            if name.isupper() and isinstance(value, (int, float)) and \
                    not isinstance(value, bool) and math.isfinite(value):
                out.append((short, name, value))
    return out


def _moved(value: float, factor: float) -> float:
    if isinstance(value, int):
        return max(1, round(value * factor)) if value >= 1 else round(value * factor)
    return value * factor


def _sweep_one(job: tuple[Optional[tuple[str, str, float]], float, tuple[str, ...],
                          tuple[int, ...]]) -> dict[str, Any]:
    """One constant moved by one factor (None: the baseline), the boards at `scales` of each
    corpus replayed in this (forked, one-job) process: each row's verdict and lead."""
    import importlib

    const, factor, corpora, scales = job
    if const is not None:
        short, name, value = const
        setattr(importlib.import_module(f"torch_watchdog.sidecar.core.{short}"), name,
                _moved(value, factor))
    got = {}
    for corpus in corpora:
        use_corpus(corpus)
        for name_k in plan(scales, labels()):
            for r in score_file(*name_k)["rows"]:
                key = f"{os.path.basename(corpus)} x{r['scale']} {r['file']}/{r['scenario']}"
                got[key] = (r["verdict"], r.get("lead_s"))
    return got


def sweep(scales: Iterable[int], corpora: Iterable[str], jobs: Optional[int]) -> str:
    """`--sweep`: each constant of the forecast path moved to 0.5x and 1.5x, alone, and the
    verdicts (and leads, by more than 1 s) that change against the baseline, at `scales` of
    each corpus. A constant whose moves change nothing is one the board does not ask for."""
    todo: list[Any] = [(None, 1.0, tuple(corpora), tuple(scales))]
    todo += [(c, f, tuple(corpora), tuple(scales)) for c in constants() for f in SWEEP_FACTORS]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(len(todo), jobs or os.cpu_count() or 1), maxtasksperchild=1) as pool:
        results = pool.map(_sweep_one, todo, chunksize=1)
    base = results[0]
    lines, idle = [], []
    for (const, factor, _, _), got in zip(todo[1:], results[1:]):
        short, name, value = const
        verdicts = [f"{k}: {base[k][0]} -> {v[0]}" for k, v in got.items() if v[0] != base[k][0]]
        leads = [k for k, v in got.items() if v[0] == base[k][0] and
                 (v[1] is None) != (base[k][1] is None) or
                 (v[1] is not None and base[k][1] is not None and abs(v[1] - base[k][1]) > 1)]
        lines.append(f"{short}.{name} = {value:g} x{factor:g} ({_moved(value, factor):g}): "
                     f"{len(verdicts)} verdicts, {len(leads)} leads changed")
        lines += [f"    {v}" for v in verdicts]
        if not verdicts and not leads:
            idle.append(f"{short}.{name}")
    names = sorted({f"{c[0]}.{c[1]}" for c in constants()})
    unmoved = [n for n in names if idle.count(n) == len(SWEEP_FACTORS)]
    lines += ["", f"{len(names)} constants; changing nothing at either move: "
              f"{', '.join(unmoved) or 'none'}"]
    return "\n".join(lines)


def peer_table(board: dict[str, Any]) -> str:
    """The peers' rows beside the sidecar's, per scale (empty without --peers)."""
    if not any("peers" in b for b in board["scales"].values()):
        return ""
    out = ["", "### Peers: the sidecar against the rules SREs write instead", "",
           "| scale | rule | recall | late | false reloads | fired on flat controls | "
           "too early | median lead/oracle of hits |", "| --- | --- | --- | --- | --- | --- | "
           "--- | --- |"]
    for k, b in board["scales"].items():
        rows = b["rows"]
        ours = {"recall": b["recall"], "false_reloads": b["false_reloads"],
                "late": sum(r["verdict"] == "late" for r in rows),
                "fired_on_flat_controls": sum(r["reloads"] > 0 for r in rows
                                              if r["scenario"] in FLAT),
                "too_early": b["too_early"],
                "median_lead_over_oracle": peers.lead_ratio_median(rows)}
        for name, p in [("the sidecar", ours), *b.get("peers", {}).get("summary", {}).items()]:
            ratio = "-" if p["median_lead_over_oracle"] is None else p["median_lead_over_oracle"]
            out.append(f"| x{k} | {name} | {p['recall']} | {p['late']} | {p['false_reloads']} | "
                       f"{p['fired_on_flat_controls']} | {p['too_early']} | {ratio} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", help="a scoreboard (--json output) that must not be beaten down")
    p.add_argument("--scales", type=int, nargs="+", default=list(SCALES))
    p.add_argument("--only", nargs="+", help="corpus files (labels.json names)")
    p.add_argument("--jobs", type=int, help="replays at once (default: one per CPU)")
    p.add_argument("--peers", action="store_true",
                   help="score the rules SREs write instead beside it (benchmarks/peers.py)")
    p.add_argument("--sweep", action="store_true",
                   help="move each forecast constant to 0.5x and 1.5x: which verdicts change "
                        "(at --scales; the corpus and the held-out runs)")
    p.add_argument("--corpus", default=CORPUS,
                   help=f"a corpus folder with its labels.json (held out: {HELD_OUT})")
    a = p.parse_args()
    if a.sweep:
        print(sweep(a.scales, [a.corpus, HELD_OUT] if a.corpus == CORPUS else [a.corpus],
                    a.jobs))
        return 0
    use_corpus(a.corpus)
    board = scoreboard(a.scales, a.jobs, a.only, a.peers)
    print(json.dumps(board, indent=1) if a.json else table(board) + peer_table(board))
    if a.check:
        with open(a.check) as fh:
            worse = regressions(board, json.load(fh))
        for line in worse:
            print("regression:", line, file=sys.stderr)
        return 1 if worse else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
