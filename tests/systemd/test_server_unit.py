"""An inference server unit with the shipped drop-in and the agent, under a real systemd:
found by `server.unit` through its cgroup, an impostor outside it not believed, and a reload
by each method a systemd host would use."""
from __future__ import annotations

import json
import time

import pytest

from tests.systemd.conftest import BASE_CONFIG, CONFIG, SERVER, SIDECAR

SOCKET = "/run/torch-watchdog/events.sock"
IMPOSTOR = "tw-impostor.service"
# reload_now() sets the server's memory budget at 1 TB, then at 50 MB: under the toy server's
# (torch imported), an OOM now
RELOADING = BASE_CONFIG + """forecast: {{process_budget_bytes: {budget}}}
policy: {{warmup_s: 0}}
reload: {{method: {method}, grace_s: 10, hello_timeout_s: {hello_timeout_s}}}
"""
CONTROL = "/run/torch-watchdog/events.sock.ctl"


def cgroup_pids(machine) -> set[int]:
    group = machine.show(SERVER, "ControlGroup")["ControlGroup"]
    out = machine.sh(f"cat /sys/fs/cgroup/unified{group}/cgroup.procs 2>/dev/null || "
                     f"cat /sys/fs/cgroup{group}/cgroup.procs").stdout
    return {int(p) for p in out.split()}


def server_view(machine) -> dict:
    return next((s for s in machine.status()["servers"] if s["server"] == SERVER), {})


def serving(machine) -> int:
    """The server's main pid, once that process answers requests."""
    pid = machine.wait(lambda: machine.main_pid(SERVER), 20, "the server running", SERVER)
    machine.wait(lambda: machine.served_by() == pid, 60, "the server answering", SERVER)
    return pid


def start_impostor(machine) -> int:
    """A process of the server's user, in a unit of its own, saying hello for the server."""
    machine.sh(f"systemctl reset-failed {IMPOSTOR} 2>/dev/null; systemd-run --unit={IMPOSTOR} "
               f"--uid=llm -p SupplementaryGroups=torch-watchdog /opt/llm/bin/python "
               f"/opt/tw-test/impostor.py {SOCKET}")
    return machine.wait(lambda: machine.main_pid(IMPOSTOR), 10, "the impostor", IMPOSTOR)


@pytest.fixture
def server(machine):
    """The server running and answering; afterwards, the suite's state back."""
    machine.sh(f"systemctl start {SERVER}")
    yield serving(machine)
    machine.sh(f"systemctl stop {IMPOSTOR} 2>/dev/null; rm -f /etc/systemd/system/{SERVER}.d/"
               f"zz-test-*.conf; systemctl daemon-reload; systemctl restart {SERVER}")
    machine.configure(BASE_CONFIG)


def test_the_server_is_found_by_its_units_cgroup_and_an_impostor_is_not_believed(machine,
                                                                                  server):
    machine.configure(BASE_CONFIG)
    in_cgroup = cgroup_pids(machine)
    assert server in in_cgroup
    machine.wait(lambda: set(server_view(machine).get("pids", ())) == in_cgroup, 15,
                 "the sidecar watching the unit's cgroup")
    impostor = start_impostor(machine)
    machine.wait(lambda: impostor in {p for s in machine.status()["servers"]
                                      for p in s["pids"]}, 15, "the impostor's hello heard")
    view = server_view(machine)
    assert impostor not in view["pids"] and set(view["pids"]) == in_cgroup, view


def reload_now(machine, method: str, hello_timeout_s: float) -> None:
    """The sidecar restarted with `method` and a budget the server is under; once it watches
    the server (and, for `agent`, its agent connected to the control socket), the budget
    lowered under the server's memory by `systemctl reload`: the forecast says OOM now."""
    config = dict(method=method, hello_timeout_s=hello_timeout_s)
    machine.configure(RELOADING.format(budget=10 ** 12, **config))
    pid = machine.main_pid(SERVER)
    machine.wait(lambda: pid in server_view(machine).get("pids", ()), 15, "the server watched")
    if method == "agent":  # the listening socket, and the one it accepted from the agent
        machine.wait(lambda: machine.sh(f"grep -c ' {CONTROL}$' /proc/net/unix",
                                        check=False).stdout.strip() == "2", 40,
                     "the agent connected to the control socket")
    machine.write(CONFIG, RELOADING.format(budget=50_000_000, **config))
    machine.sh(f"systemctl reload {SIDECAR}")


def reloaded(machine, timeout: float) -> dict:
    """The one reload's finished record (reloads.json): one reload, of the server alone."""
    done = lambda: [e for e in machine.reloads() if e.get("ok") is not None]  # noqa: E731
    machine.wait(done, timeout, "the reload's outcome")
    time.sleep(1)  # a second reload (a phantom server's) would be decided within hold_polls
    entries = machine.reloads()
    assert [e["server"] for e in entries] == [SERVER], json.dumps(entries, indent=1)
    return entries[0]


@pytest.mark.parametrize("method", ["systemd", "signal", "agent"])
def test_a_reload_ends_ok_with_the_new_process_serving(machine, server, method):
    if method == "agent":
        # only RestartForceExitStatus=75 may bring it back: the drain's exit, not Restart=
        machine.dropin(SERVER, "zz-test-restart", "[Service]\nRestart=no\n")
    reload_now(machine, method, hello_timeout_s=60)
    entry = reloaded(machine, 90)
    assert entry["ok"] is True, json.dumps(entry)
    new = serving(machine)
    assert new != server
    assert f"back: pid {new} said hello" in entry["detail"], entry
    if method == "agent":
        assert "exit code 75" in entry["detail"], entry
        assert "status=75" in machine.journal(SERVER)
    props = machine.show(SIDECAR, "ActiveState")
    assert props["ActiveState"] == "active"
    assert machine.status()["actions_total"].get("reload_ok") == 1


def test_a_server_that_never_comes_back_ends_reload_failed(machine, server):
    machine.dropin(SERVER, "zz-test-restart", "[Service]\nRestart=no\n")
    # an impostor's hellos for the server keep coming meanwhile: no proof it came back
    impostor = start_impostor(machine)
    reload_now(machine, "signal", hello_timeout_s=10)
    entry = reloaded(machine, 60)
    assert entry["ok"] is False and entry["failed"] is True, json.dumps(entry)
    assert "no hello from a new process of the server within 10 s" in entry["detail"], entry
    assert machine.show(SERVER, "ActiveState")["ActiveState"] in ("inactive", "failed")
    assert machine.main_pid(IMPOSTOR) == impostor
    assert machine.status()["actions_total"].get("reload_failed") == 1


def test_a_server_that_does_not_catch_draining_is_drained_and_started_again(machine, server):
    """The unit runs a loop that catches nothing (plain_server.py): the drain's first refused
    call ends its main thread, yet it exits 75 and RestartForceExitStatus=75 starts it again
    (Restart=no: nothing else would)."""
    machine.dropin(SERVER, "zz-test-plain", "[Service]\nExecStart=\nExecStart=/opt/llm/bin/"
                   "python /opt/llm/plain_server.py\nRestart=no\n")
    machine.sh(f"systemctl restart {SERVER}")
    old = machine.wait(lambda: machine.main_pid(SERVER), 20, "the plain server running", SERVER)
    reload_now(machine, "agent", hello_timeout_s=60)
    entry = reloaded(machine, 90)
    assert entry["ok"] is True, json.dumps(entry)
    assert "exit code 75" in entry["detail"], entry
    new = machine.wait(lambda: machine.main_pid(SERVER) not in (0, old) and
                       machine.main_pid(SERVER), 30, "the plain server started again", SERVER)
    assert f"back: pid {new} said hello" in entry["detail"], entry
    assert "status=75" in machine.journal(SERVER)
