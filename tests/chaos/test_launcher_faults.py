"""The launcher must never be the outage (issue 28, item 7): a broken stderr, a preload that
hangs, a server that exits at once with the drain code."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import wait_for, with_root

HERE = os.path.dirname(__file__)
CHILD = os.path.join(HERE, "launcher_child.py")


def launch(*opts: str, child: tuple, stderr=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([with_root(), HERE]))
    return subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "run", *opts, "--",
                             "python", CHILD, *map(str, child)], env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr)


def starts(progress: str) -> int:
    try:
        with open(progress) as fh:
            return len(fh.read().splitlines())
    except FileNotFoundError:
        return 0


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_a_launcher_whose_stderr_is_gone_still_runs_the_server(tmp_path):
    progress = str(tmp_path / "progress")
    r, w = os.pipe()
    os.close(r)  # the reader is gone: every write to stderr is EPIPE
    try:
        p = launch("--no-standby", child=(progress, 60, 0), stderr=w)
    finally:
        os.close(w)
    try:
        assert wait_for(lambda: starts(progress) == 1, 30), "the server never started"
        time.sleep(1.0)
        assert p.poll() is None, f"the launcher exited {p.returncode}"
    finally:
        stop(p)


def test_a_preload_that_hangs_does_not_keep_the_next_generation_from_running(tmp_path):
    progress, err = str(tmp_path / "progress"), tmp_path / "launcher.err"
    with open(err, "w") as fh:  # the first generation "drains" (exits 75) after 1 s
        p = launch("--no-default-preload", "--preload", "hang_preload",
                   child=(progress, 1, 75), stderr=fh)
    try:
        assert wait_for(lambda: starts(progress) >= 2, 40), err.read_text()
        assert "not ready" in err.read_text()
    finally:
        stop(p)


def test_a_server_that_exits_with_the_drain_code_at_once_is_started_with_backoff(tmp_path):
    progress = str(tmp_path / "progress")
    p = launch("--no-standby", child=(progress, 0, 75), stderr=subprocess.DEVNULL)
    try:
        time.sleep(8)
        n = starts(progress)
        assert 2 <= n <= 6, f"{n} starts in 8 s"  # 1 + 1 s + 2 s + 4 s ... (was ~10 a second)
        assert p.poll() is None
    finally:
        stop(p)


def test_a_killed_launcher_leaves_no_server_and_no_grandchild_behind(tmp_path):
    """SIGKILL to the launcher: a server that ignores SIGTERM, and the grandchild it started
    in a session of its own, are stopped by the launcher's reaper (SIGTERM, then SIGKILL after
    its grace)."""
    from torch_watchdog.launcher import REAP_EVERY_S, REAP_GRACE_S

    pids = str(tmp_path / "pids")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([with_root(), HERE]))
    p = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "run", "--no-standby",
                          "--", "python", os.path.join(HERE, "launcher_family.py"), pids],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: os.path.exists(pids) and open(pids).read().endswith("\n"), 60)
        server, grandchild = map(int, open(pids).read().split())
        time.sleep(REAP_EVERY_S + 1)  # the reaper notes the launcher's tree this often
        p.kill()
        p.wait()

        def gone(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True

        assert wait_for(lambda: gone(server) and gone(grandchild), REAP_GRACE_S + 15), \
            (gone(server), gone(grandchild))
    finally:
        stop(p)
