"""Every drain ends with the drain exit code, whatever the server's code does with `Draining`
(issue 37, item 1). Before: a queue worker that did not catch it died of it in the main thread
with status 1 before the drain thread's exit; the sidecar logged "drained 0 of 1 process(es),
exit code ?" and the launcher (`--restart on-drain`) exited with it: the server stayed down."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, wait_for, with_root
from torch_watchdog.agent.drain import EX_TEMPFAIL
from torch_watchdog.sidecar.actions.control import ControlServer

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "plain_worker.py")


def started(progress: str) -> list[int]:
    try:
        with open(progress) as fh:
            return [int(line.split()[0]) for line in fh if line.endswith("\n")]
    except FileNotFoundError:
        return []


def drain(tmp: str, pid: int):
    """The sidecar's side of a drain: the control socket, a drain request, its outcome."""
    control = ControlServer(os.path.join(tmp, "ev.sock.ctl"))
    try:
        assert wait_for(lambda: pid in control.connected(), 30), "the agent never connected"
        return control.drain({pid}, 10.0)
    finally:
        control.close()


@pytest.mark.parametrize("how", ["uncaught", "thread", "exit", "return"])
def test_a_server_that_does_not_handle_draining_exits_with_the_drain_code(short_tmp, how):
    progress, err = os.path.join(short_tmp, "progress"), os.path.join(short_tmp, "err")
    env = dict(os.environ, PYTHONPATH=with_root(), OMP_NUM_THREADS="1")
    rc = os.path.join(short_tmp, "rc")
    # the worker's exit status, kept by a shell: the drain's outcome waits for the worker's
    # exit (psutil), which would reap a child of this process and leave no status to read
    with open(err, "w") as fh:
        proc = subprocess.Popen(["sh", "-c", '"$@"; echo $? > "$0"', rc, sys.executable,
                                 WORKER, os.path.join(short_tmp, "ev.sock"), progress, how],
                                cwd=ROOT, env=env, stderr=fh, stdout=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: started(progress), 60), open(err).read()[-2000:]
        outcome = drain(short_tmp, started(progress)[0])
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    code = int(open(rc).read())
    assert code == EX_TEMPFAIL, (code, open(err).read()[-2000:])
    assert outcome.ok, outcome.detail
    assert f"exit code {EX_TEMPFAIL}" in outcome.detail and "drained 1 of 1" in outcome.detail


def test_under_the_launcher_a_plain_loop_is_drained_and_started_again(short_tmp):
    """`torch-watchdog run` (its default `--restart on-drain`) restarts the drained worker: the
    next generation serves, and the launcher is still running."""
    progress, err = os.path.join(short_tmp, "progress"), os.path.join(short_tmp, "err")
    env = dict(os.environ, PYTHONPATH=with_root(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch_watchdog.cli", "run", "--", "python", WORKER,
           os.path.join(short_tmp, "ev.sock"), progress, "uncaught"]
    with open(err, "w") as fh:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=fh, stdout=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: started(progress), 90), open(err).read()[-2000:]
        first = started(progress)[0]
        outcome = drain(short_tmp, first)
        assert outcome.ok, outcome.detail
        assert wait_for(lambda: len(started(progress)) >= 2, 90), open(err).read()[-2000:]
        time.sleep(1.0)
        assert launcher.poll() is None, open(err).read()[-2000:]
        assert started(progress)[1] != first
        assert f"exit code {EX_TEMPFAIL}" in outcome.detail
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(60)
