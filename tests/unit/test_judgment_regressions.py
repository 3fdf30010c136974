"""benchmarks/judgment.py's regression check (`--check`), on the committed scoreboard and
edits of it: what counts as worse and what does not. The boards themselves, replayed from the
corpus at every time scale: tests/scoreboard/test_judgment.py."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOARD = os.path.join(ROOT, "benchmarks", "results", "judgment.json")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import judgment  # noqa: E402


def test_a_worse_scoreboard_is_a_regression():
    with open(BOARD) as fh:
        board = json.load(fh)
    assert judgment.regressions(board, board) == []
    worse = json.loads(json.dumps(board))
    x1 = worse["scales"]["1"]
    hit = next(r for r in x1["rows"] if r["verdict"] == "hit")
    hit["verdict"], hit["lead_s"] = "late", 5.0
    flat = next(r for r in x1["rows"] if r["scenario"] == "bucketed-control")
    flat["alerts"] = ["oom_forecast"]
    found = judgment.regressions(worse, board)
    assert len(found) == 3 and any("late" in f for f in found), found
    assert all(f.startswith("x1 ") for f in found)
    # an OOM's forecast alert that fires again after it resolved: paged twice for one growth
    again = json.loads(json.dumps(board))
    again["scales"]["60"]["forecast_alerts_again"] += 1
    assert judgment.regressions(again, board) == [
        f"x60: forecast_alerts_again {board['scales']['60']['forecast_alerts_again']} -> "
        f"{board['scales']['60']['forecast_alerts_again'] + 1}"]


def test_at_scale_too_early_a_late_alert_and_worse_calibration_are_regressions():
    with open(BOARD) as fh:
        board = json.load(fh)
    worse = json.loads(json.dumps(board))
    x60 = worse["scales"]["60"]
    timely = next(r for r in x60["rows"] if r.get("lead_s") and not r["too_early"])
    timely["lead_s"], timely["too_early"] = 3 * 3600.0, True
    alerted = next(r for r in x60["rows"] if r.get("alert_in_time"))
    alerted["alert_in_time"], alerted["alert_lead_s"] = False, 60.0
    board["scales"]["1"]["median_abs_log2"] = 0.858   # a finite median before...
    worse["scales"]["1"]["median_abs_log2"] = None    # ... most points without a forecast now
    found = judgment.regressions(worse, board)
    assert any(f.startswith("x60 ") and "too early" in f for f in found), found
    assert any(f.startswith("x60 ") and "oom_forecast alert" in f for f in found), found
    assert any(f.startswith("x1: median") for f in found), found


def test_a_reload_that_came_too_early_may_come_later():
    """The forecast's next change brings reloads decided hours early to the lead: that is
    better, not a regression, as long as they keep the oracle's lead."""
    before = {"scales": {"60": {
        "rows": [{"file": "f", "scenario": "s", "verdict": "hit", "lead_s": 1000.0,
                  "oracle_lead_s": 60.0, "too_early": True, "alerts": []}],
        "ramps_calibrated": "0/3", "median_abs_log2": None, "false_reloads": 0,
        "false_alerts": 0, "forecast_alerts_without_oom": 0}}}
    now = json.loads(json.dumps(before))
    row = now["scales"]["60"]["rows"][0]
    row["lead_s"], row["too_early"] = 65.0, False
    now["scales"]["60"]["median_abs_log2"] = 0.2
    assert judgment.regressions(now, before) == []
    row["lead_s"] = 40.0       # now less than the oracle's lead: worse
    assert judgment.regressions(now, before) == ["x60 f/s: lead 1000.0 s -> 40.0"]


def test_a_scoreboard_from_before_the_scales_is_checked_as_x1():
    with open(BOARD) as fh:
        board = json.load(fh)
    old = {"rows": json.loads(json.dumps(board["scales"]["1"]["rows"])), "false_reloads": 0,
           "false_alerts": 0}
    assert judgment.regressions(board, old) == []
    row = next(r for r in old["rows"] if r["scenario"] == "leak-small")
    assert row["lead_s"] < row["oracle_lead_s"]
    row["lead_s"] += 30.0   # it used to be reloaded 30 s earlier
    assert judgment.regressions(board, old) == [
        f"x1 leak-small/leak-small: lead {row['lead_s']} s -> {row['lead_s'] - 30.0:.1f}"]
