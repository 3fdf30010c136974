"""The sidecar's shipped unit under a real systemd: READY=1, the watchdog pings and a stuck
loop, the hardening, `systemctl reload` with a good and a broken config."""
from __future__ import annotations

import time

from tests.systemd.conftest import BASE_CONFIG, CONFIG, SERVER, SIDECAR

WATCHDOG_S = 30  # WatchdogSec= of the shipped unit


def watchdog_s(machine) -> float:
    value = machine.show(SIDECAR, "WatchdogUSec")["WatchdogUSec"]
    assert value == f"{WATCHDOG_S}s", value
    return WATCHDOG_S


def since_active_s(machine) -> float:
    # CLOCK_MONOTONIC is the kernel's, the same inside the container
    usec = int(machine.show(SIDECAR, "ActiveEnterTimestampMonotonic")
               ["ActiveEnterTimestampMonotonic"])
    return time.monotonic() - usec / 1e6


def test_ready_then_pings_keep_it_alive_past_watchdog_sec(machine):
    machine.sh(f"systemctl start {SIDECAR}")  # Type=notify: returns once READY=1 came
    props = machine.show(SIDECAR, "Type", "ActiveState", "SubState", "MainPID", "NRestarts",
                         "StatusText", "WatchdogTimestampMonotonic")
    assert (props["Type"], props["ActiveState"], props["SubState"]) == \
        ("notify", "active", "running"), machine.journal(SIDECAR)
    assert props["StatusText"], "no STATUS= line"
    pings = int(props["WatchdogTimestampMonotonic"])
    machine.wait(lambda: int(machine.show(SIDECAR, "WatchdogTimestampMonotonic")
                             ["WatchdogTimestampMonotonic"]) > pings, 5, "a WATCHDOG=1 ping")
    time.sleep(max(0.0, watchdog_s(machine) + 5 - since_active_s(machine)))
    after = machine.show(SIDECAR, "ActiveState", "MainPID", "NRestarts")
    assert after == {"ActiveState": "active", "MainPID": props["MainPID"],
                     "NRestarts": props["NRestarts"]}, machine.journal(SIDECAR)
    assert "Watchdog timeout" not in machine.journal(SIDECAR)


def test_a_stuck_loop_is_killed_and_restarted_within_watchdog_sec(machine):
    # the fault: sitecustomize.py on the sidecar's PYTHONPATH blocks its loop's next poll once
    # /run/tw-fault/hang exists; its other threads (the status page) go on
    machine.dropin(SIDECAR, "fault", "[Service]\nEnvironment=PYTHONPATH=/opt/tw-fault\n")
    try:
        machine.sh(f"systemctl restart {SIDECAR}")
        before = machine.show(SIDECAR, "MainPID", "NRestarts")
        limit = watchdog_s(machine)
        machine.sh("mkdir -p /run/tw-fault && touch /run/tw-fault/hang")
        hung = time.monotonic()
        time.sleep(3)
        assert machine.status()["age_s"] > 2  # alive and serving, but no poll completes
        machine.wait(lambda: machine.show(SIDECAR, "SubState")["SubState"] != "running",
                     limit + 5, "systemd's watchdog stopping the stuck sidecar")
        killed_after = time.monotonic() - hung
        machine.sh("rm -f /run/tw-fault/hang")  # the restarted sidecar polls again
        assert killed_after <= limit + 1.5, killed_after
        old = int(before["MainPID"])
        machine.wait(lambda: machine.show(SIDECAR, "ActiveState")["ActiveState"] == "active"
                     and machine.main_pid(SIDECAR) not in (0, old), 30,
                     "the restart (RestartSec=5)")
        after = machine.show(SIDECAR, "NRestarts")
        assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
        journal = machine.journal(SIDECAR)
        assert f"Watchdog timeout (limit {limit}s)!" in journal, journal
        machine.wait(lambda: machine.status()["sidecar"]["polls"] > 0, 15,
                     "the restarted sidecar polling")
    finally:
        machine.remove_dropin(SIDECAR, "fault")
        machine.sh(f"rm -f /run/tw-fault/hang; systemctl restart {SIDECAR}")


def test_systemctl_reload_takes_a_good_config_and_keeps_the_old_one_for_a_broken_one(machine):
    machine.sh(f"systemctl restart {SIDECAR}")
    pid = machine.main_pid(SIDECAR)

    def reload_logged(line: str, n: int) -> None:
        machine.sh(f"systemctl reload {SIDECAR}")  # ExecReload: SIGHUP to the main pid
        machine.wait(lambda: machine.journal(SIDECAR, 400).count(line) > n, 10, line)

    try:
        machine.write(CONFIG, BASE_CONFIG + "poll_interval_s: 0.2\n")
        reload_logged('"config reloaded"', 0)
        machine.wait(lambda: machine.status()["sidecar"]["poll_interval_s"] == 0.2, 5,
                     "the new poll interval in force")
        machine.write(CONFIG, BASE_CONFIG + "poll_interval_s: -1\n")
        reload_logged('"config reload failed; keeping the old config"', 0)
        assert "poll_interval_s" in machine.journal(SIDECAR, 5)  # the problem is named
        time.sleep(2)  # the status is published once a second
        assert machine.status()["sidecar"]["poll_interval_s"] == 0.2
        props = machine.show(SIDECAR, "ActiveState", "MainPID")
        assert props == {"ActiveState": "active", "MainPID": str(pid)}
    finally:
        machine.write(CONFIG, BASE_CONFIG)
        machine.sh(f"systemctl restart {SIDECAR}")


def test_hardening_leaves_proc_socket_and_state_dirs_and_nothing_more(machine):
    machine.sh(f"systemctl restart {SIDECAR}")
    server = machine.main_pid(SERVER)
    # what the sidecar itself did: found the server's processes (the cgroup tree), read their
    # memory (/proc), bound its socket in its runtime directory
    machine.wait(lambda: server in machine.status()["scope"]["pids"], 15, "the server watched")
    assert machine.status()["memory"]["server"]["rss_bytes"] > 0
    machine.sh("test -S /run/torch-watchdog/events.sock")
    # a directory the sidecar's user owns outside its own: writable but for the hardening
    machine.sh("mkdir -p /srv/tw-owned && chown torch-watchdog: /srv/tw-owned /home")
    pid = machine.main_pid(SIDECAR)
    # in the sidecar's own mount namespace (ProtectSystem=, PrivateTmp=, ProtectHome= are
    # mounts), as its user
    out = machine.sh(f"nsenter -t {pid} -m setpriv --reuid=torch-watchdog "
                     f"--regid=torch-watchdog --init-groups /opt/torch-watchdog/bin/python "
                     f"/opt/tw-test/probe.py {server}").stdout
    got = dict(line.split() for line in out.splitlines())
    assert got == {"proc": "ok", "run": "ok", "state": "ok", "owned": "EROFS", "etc": "EROFS",
                   "var_tmp": "ok", "home": "EACCES", "tmp": "ok"}, got
    # PrivateTmp=: what it writes in /tmp and /var/tmp stays its own
    machine.sh("test ! -e /tmp/tw-probe && test ! -e /var/tmp/tw-probe")
    machine.sh("rm -f /run/torch-watchdog/probe /var/lib/torch-watchdog/probe; "
               "chown root: /home; rm -rf /srv/tw-owned")
