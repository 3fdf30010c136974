"""The restart file (agent/drain.py) in a directory others can write (issue 28, item 1): a
planted link is never written through, a FIFO never blocks the agent's start, and a forged
request of another user's does not stand. Issue 37, item 2: nor does one of the server's own
user naming a live process that did not write it (pid 1, a sleep in another container): it
was kept at every start, and the liveness probe failed for ever."""
from __future__ import annotations

import logging
import os
import subprocess
import threading

import pytest

from tests.conftest import restart_requester
from torch_watchdog.agent import drain


@pytest.fixture
def shared(tmp_path):
    """An emptyDir-style directory: anyone may write in it."""
    folder = tmp_path / "run"
    folder.mkdir()
    os.chmod(folder, 0o777)
    victim = tmp_path / "victim"
    victim.write_text("the server user's own file\n")
    os.chmod(victim, 0o600)
    return str(folder / "restart-requested"), victim


def test_a_link_planted_at_the_old_temporary_name_or_at_the_file_is_not_followed(shared):
    path, victim = shared
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")  # the name the agent used to write
    assert drain.write_restart_file(path, "drain") is None
    assert victim.read_text() == "the server user's own file\n"
    assert open(path).read().split()[0] == str(os.getpid()) and not os.path.islink(path)
    os.unlink(path)
    os.symlink(victim, path)  # a link at the file itself: replaced, not followed
    assert drain.write_restart_file(path, "drain") is None
    assert victim.read_text() == "the server user's own file\n" and not os.path.islink(path)
    leftovers = [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".restart")]
    assert leftovers == []


def test_a_fifo_or_a_link_at_the_file_never_blocks_the_start_and_is_cleared(shared):
    path, victim = shared
    os.mkfifo(path)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (drain.clear_stale_restart_file(path), done.set()),
                              daemon=True)
    worker.start()
    assert done.wait(5), "clear_stale_restart_file blocked on a FIFO"
    assert not os.path.exists(path)
    os.symlink(victim, path)
    drain.clear_stale_restart_file(path)
    assert not os.path.lexists(path) and victim.exists()


def _ticks(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read().rsplit(b")", 1)[1].split()[19].decode()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another uid")
def test_a_forged_request_of_another_user_naming_a_live_process_does_not_stand(shared):
    path, _ = shared
    with open(path, "w") as fh:
        fh.write(f"1 {_ticks(1)} drain\n")  # pid 1 runs for ever: the probe would fail for ever
    os.chown(path, 65534, 65534)
    drain.clear_stale_restart_file(path)
    assert not os.path.exists(path)


def test_a_request_naming_a_live_process_that_did_not_write_it_is_removed_with_a_warning(
        shared, caplog):
    path, _ = shared
    other = subprocess.Popen(["sleep", "60"])  # a process of the same user, in another container
    try:
        for forged in (f"1 {_ticks(1)} drain\n", f"{other.pid} {_ticks(other.pid)} drain\n"):
            with open(path, "w") as fh:
                fh.write(forged)
            assert drain.request_stands(path)[0] is False
            with caplog.at_level(logging.WARNING, logger="torch_watchdog.agent"):
                drain.clear_stale_restart_file(path)
            assert not os.path.exists(path), forged
            assert "did not write it" in caplog.text
            caplog.clear()
    finally:
        other.kill()
        other.wait()


def test_the_request_of_the_process_that_wrote_it_stands_while_it_runs(shared):
    path, _ = shared
    with restart_requester(path) as asker:
        assert drain.request_stands(path) == (True, f"pid {asker.pid} asked and still runs")
        drain.clear_stale_restart_file(path)  # another process of the server, starting
        assert os.path.exists(path)
    drain.clear_stale_restart_file(path)
    assert not os.path.exists(path)
