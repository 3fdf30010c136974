"""The commands that read a file, through a real process (the console script's way): a file
they cannot use is one line on stderr and exit 2, no traceback; a closed stdout is quiet. The
same inputs in-process: tests/unit/test_bad_inputs.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.test_bad_inputs import FIXTURE, ROOT, _make


@pytest.mark.parametrize("kind", ["truncated .gz", "binary", "plain text"])
def test_the_installed_command_prints_no_traceback(tmp_path, kind):
    """The same through a real process (what the console script runs), for the inputs that
    used to end in a traceback: EOFError, UnboundLocalError."""
    path = _make(tmp_path, kind)
    for command in (["events", path], ["replay", path]):
        r = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", *command],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and path in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_closed_stdout_is_quiet_and_exits_141(tmp_path):
    """`torch-watchdog replay --json ... | head`: the reader goes away first."""
    r, w = os.pipe()
    os.close(r)  # nobody will read: the first write gets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "replay",
                               "--json", FIXTURE], cwd=ROOT, stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 141 and proc.stderr == ""
