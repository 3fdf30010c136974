"""The control channel's two ends over real Unix sockets: the sidecar's server (its thread)
and agents in forked processes: who may connect, what a drain asks for and what counts as
done; a restart request that stands while its writer runs. The agent end alone:
tests/unit/test_control.py."""
from __future__ import annotations

import os
import time

from tests.conftest import restart_requester, wait_for
from tests.unit.test_control import client
from torch_watchdog.sidecar.actions import control


def agent_process(path: str, reply: bool) -> int:
    """A forked process with the agent's end: on a drain request it replies "drained" and
    exits 75 (`reply`), or goes on as if it never heard (the sidecar never signals itself)."""
    pid = os.fork()
    if pid:
        return pid
    try:
        requests: list = []
        c = client(path, requests)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            c.poll()
            if requests and reply:
                c.send({"v": 1, "kind": "drained", "pid": os.getpid(), "in_flight": 0,
                        "seconds": 0.1, "exit_code": 75, "detail": f"grace {requests[0]}"})
                os._exit(75)
            time.sleep(0.01)
    finally:
        os._exit(1)


def test_a_drain_reaches_the_connected_agent_and_its_exit_ends_it(short_tmp):
    path = os.path.join(short_tmp, "c.ctl")
    server = control.ControlServer(path)
    pid = agent_process(path, reply=True)
    try:
        assert wait_for(lambda: pid in server.connected(), 10)
        o = server.drain({pid, 999999}, 7.0)
        assert o.ok, o.detail
        assert o.detail == ("drained 1 of 1 process(es), exit code 75, calls in hand finished; "
                            "grace 7.0")
    finally:
        _reap(pid)
        server.close()
    assert not os.path.exists(path)


def test_an_agent_that_never_replies_is_not_a_done_reload(short_tmp, monkeypatch):
    path = os.path.join(short_tmp, "c.ctl")
    server = control.ControlServer(path)
    monkeypatch.setattr(control, "REPLY_SLACK_S", 0.3)
    monkeypatch.setattr(control, "EXIT_WAIT_S", 0.2)
    pid = agent_process(path, reply=False)
    try:
        assert wait_for(lambda: pid in server.connected(), 10)
        o = server.drain({pid}, 0.1)
        assert not o.ok and f"no drained reply from pid(s) [{pid}]" in o.detail
        assert f"pid(s) [{pid}] still running" in o.detail
    finally:
        _reap(pid)
        server.close()


def _reap(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def test_the_sidecar_closes_connections_from_uids_it_does_not_allow(short_tmp):
    path = os.path.join(short_tmp, "c.ctl")
    server = control.ControlServer(path, allowed_uids={os.geteuid() + 1})
    c = client(path, [])
    try:
        c.poll()
        assert wait_for(lambda: server.refused >= 1, 5)
        assert server.connected() == {}
        assert server.drain({os.getpid()}, 1.0).detail.startswith(
            "no agent of the server is connected")
    finally:
        c.close()
        server.close()


def test_the_agent_ignores_a_socket_bound_by_an_untrusted_uid(short_tmp):
    path = os.path.join(short_tmp, "c.ctl")
    os.chmod(short_tmp, 0o777)  # the directory's owner is not trusted by a writable dir
    server = control.ControlServer(path)
    c = client(path, [], trusted={os.geteuid() + 12345})
    try:
        c.poll()
        assert not c.connected and "not the sidecar" in c.refused
    finally:
        c.close()
        server.close()


def test_a_restart_request_stands_only_while_the_process_that_wrote_it_runs(tmp_path):
    from torch_watchdog.agent.drain import clear_stale_restart_file
    path = str(tmp_path / "restart-requested")
    with restart_requester(path):
        clear_stale_restart_file(path)
        assert os.path.exists(path)  # that process still runs: the request stands
        pid, ticks, _ = open(path).read().split()
        for stale in (f"{pid} {int(ticks) + 1} drain\n",       # the pid is another process now
                      f"{os.getpid()} 1 drain\n"):             # ours: a restarted container
            open(path, "w").write(stale)
            clear_stale_restart_file(path)
            assert not os.path.exists(path), stale
        open(path, "w").write(f"{pid} {ticks} drain\n")
    clear_stale_restart_file(path)  # the process that asked is gone
    assert not os.path.exists(path)
