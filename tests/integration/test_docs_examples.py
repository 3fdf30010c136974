"""Example outputs in docs/ are the program's: each is produced again here and compared, so a
change of behaviour fails until the page is brought up to date (docs/sidecar.md's replay
example had drifted to an alert at 53.9 s and a reload at 61.8 s; the program said 44.3 and
44.5 s)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT, with_root

SIDECAR_MD = os.path.join(ROOT, "docs", "sidecar.md")
TRACE = "tests/fixtures/h200-oom300.jsonl.gz"


def replay_lines() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "replay", TRACE],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=with_root()),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return out.splitlines()


def test_the_replay_example_in_sidecar_md_is_what_replay_prints():
    text = open(SIDECAR_MD).read()
    start = text.index("```text\n", text.index(f"On `{TRACE}`:")) + len("```text\n")
    shown = text[start:text.index("```\n", start)].splitlines()
    printed = replay_lines()
    assert shown == printed
    reload_t = next(float(m.group(1)) for line in printed
                    if (m := re.match(r"\s+\+([\d.]+) s  reload: ", line)))
    row = next(line for line in text.splitlines() if line.startswith("| `h200-oom300` "))
    at, before = re.search(r"reload at ([\d.]+) s, ([\d.]+) s before", row).groups()
    crash = float(re.search(r"crashed at ([\d.]+) s", row).group(1))
    assert float(at) == reload_t and float(before) == round(crash - reload_t, 1), row
