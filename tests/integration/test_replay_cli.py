"""`torch-watchdog replay` as a process: its JSON on a recorded trace, exit 2 on a missing file.
The replay itself: tests/unit/test_replay.py."""
import json
import subprocess
import sys

from tests.unit.test_replay import ROOT, fixture


def test_cli_replay_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "replay", "--json",
                          fixture("h200-torch2.11-seq-static.jsonl.gz")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"findings", "actions", "estimates"}
    for a in result["actions"]:
        assert a["action"] in ("alert", "reload") and isinstance(a["t"], float) and a["reason"]
    bad = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "replay",
                          str(tmp_path / "missing.jsonl")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "no such file" in bad.stderr
