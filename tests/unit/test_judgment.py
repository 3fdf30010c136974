"""benchmarks/judgment.py on the corpus of real GPU runs: no scenario scores worse than in the
committed scoreboard, and the targets that hold stay held."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOARD = os.path.join(ROOT, "benchmarks", "results", "judgment.json")


def test_the_scoreboard_does_not_regress():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "judgment.py"),
                          "--json", "--check", BOARD], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    board = json.loads(out.stdout)
    assert board["false_reloads"] == 0 and board["false_alerts"] == 0
    rows = {(r["file"], r["scenario"]): r for r in board["rows"]}
    assert len(rows) >= 12
    # every OOM with growth to see for a minute reloaded >= 20 s before it
    for r in rows.values():
        if r.get("in_targets"):
            assert r["lead_s"] is not None and r["lead_s"] >= 20, r
    # no run without an OOM reloaded, and the flat controls quiet
    assert all(r["reloads"] == 0 for r in rows.values() if not r["oom"])


def test_a_worse_scoreboard_is_a_regression():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import judgment

    with open(BOARD) as fh:
        board = json.load(fh)
    worse = json.loads(json.dumps(board))
    hit = next(r for r in worse["rows"] if r["verdict"] == "hit")
    hit["verdict"], hit["lead_s"] = "late", 5.0
    flat = next(r for r in worse["rows"] if r["scenario"] == "bucketed-control")
    flat["alerts"] = ["oom_forecast"]
    found = judgment.regressions(worse, board)
    assert len(found) == 3 and any("late" in f for f in found)
    assert judgment.regressions(board, board) == []
