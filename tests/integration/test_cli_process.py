"""The command line as a real process: `listen` printing what an agent sends, `run --help`.
The commands in-process: tests/unit/test_cli.py."""
import os
import subprocess
import sys
import time

from tests.unit.test_events import SAMPLES
from torch_watchdog.agent.emitter import Emitter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_listen_prints_what_an_agent_sends(short_tmp):
    import dataclasses
    import select
    import socket

    path = os.path.join(short_tmp, "l.sock")
    proc = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "listen", "--socket",
                             path], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(b"garbage", path)
        s.close()
        em = Emitter(path, None)
        em.emit(dataclasses.replace(SAMPLES[3], pid=os.getpid(), t=time.time()))
        em.drain()
        # the emitter's own events (a drop report, if its first send found no socket) may
        # come first: the recompile is among the lines printed within 10 s
        lines, deadline = [], time.monotonic() + 10
        while not any("recompile" in x for x in lines) and time.monotonic() < deadline:
            assert select.select([proc.stdout], [], [], 10)[0], f"listen printed {lines}"
            lines.append(proc.stdout.readline())
        recompiles = [x for x in lines if "recompile" in x]
        assert recompiles and "size mismatch" in recompiles[0], lines
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "dropped 1 bad datagram(s) so far" in err and "'malformed': 1" in err
    assert not os.path.exists(path)


def test_run_help_is_the_launchers_help_and_a_command_without_the_separator_is_refused():
    """`torch-watchdog run --help` printed a traceback (it ran a script named --help)."""
    run = [sys.executable, "-m", "torch_watchdog.cli", "run"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert shown.returncode == 0 and "--restart" in shown.stdout and not shown.stderr
    wrong = subprocess.run([*run, "--no-standby", "python", "x.py"], capture_output=True,
                           text=True, cwd=ROOT)
    assert wrong.returncode == 2 and "comes after `--`" in wrong.stderr
    assert "Traceback" not in wrong.stderr
