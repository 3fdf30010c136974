"""`<state_dir>/servers.json` (actions/known.py): written when the servers' processes change,
read back at the next start with each pid checked to be the same process; a bad file places
nothing and says why."""
from __future__ import annotations

import json
import os

from tests.fakes import Clock
from torch_watchdog.sidecar.actions.known import KnownServers
from torch_watchdog.sidecar.core.observations import KnownServer

SERVERS = (KnownServer("llm-a", (101, 102), 1000, (1,), ("GPU-a",), "serve a"),
           KnownServer("llm-b", (202,), 1000, (1,), ("GPU-b",), "serve b"))
STARTS = {101: 50.0, 102: 51.0, 202: 52.0}


def book(tmp_path, starts=STARTS, clock=None) -> KnownServers:
    return KnownServers(str(tmp_path / "servers.json"), starts.get, clock or Clock(0.0))


def test_the_servers_come_back_with_the_processes_that_are_still_the_same(tmp_path):
    assert book(tmp_path).save(SERVERS, STARTS.get)
    # 102 exited and its pid was reused (a later start); 202 is gone
    back = book(tmp_path, {101: 50.0, 102: 90.0}).read(7.0)
    assert back is not None and back.t == 7.0
    assert back.servers == (KnownServer("llm-a", (101,), 1000, (1,), ("GPU-a",), "serve a"),)


def test_a_missing_file_is_a_first_start_and_a_bad_one_is_said_not_fatal(tmp_path):
    assert book(tmp_path).read(1.0) is None and book(tmp_path).error is None
    path = tmp_path / "servers.json"
    for bad in (b"{not json", b"[]", json.dumps({"version": 9}).encode(),
                json.dumps({"version": 1, "starts": {"101": 50.0},
                            "servers": [{"name": "x", "pids": ["101"]}]}).encode(),
                json.dumps({"version": 1, "starts": {}, "servers": [{"name": 3, "pids": []}]}
                           ).encode()):
        path.write_bytes(bad)
        b = book(tmp_path)
        assert b.read(1.0) is None and b.error and str(path) in b.error


def test_written_only_when_the_servers_change_and_at_most_once_a_second(tmp_path):
    clock = Clock(0.0)
    b = book(tmp_path, clock=clock)
    path = tmp_path / "servers.json"
    b.save(SERVERS, STARTS.get)
    first = os.stat(path).st_mtime_ns, os.stat(path).st_ino
    clock.t = 5.0
    b.save(SERVERS, STARTS.get)  # unchanged: not written again
    assert (os.stat(path).st_mtime_ns, os.stat(path).st_ino) == first
    b.save(SERVERS[:1], STARTS.get)
    clock.t = 5.5
    b.save(SERVERS[1:], STARTS.get)  # changed again within the second: written next time
    assert book(tmp_path).read(1.0).servers[0].name == "llm-a"
    clock.t = 6.5
    b.save(SERVERS[1:], STARTS.get)
    assert [s.name for s in book(tmp_path).read(1.0).servers] == ["llm-b"]


def test_a_write_that_fails_is_said_and_retried(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    b = KnownServers(str(blocked / "servers.json"), STARTS.get, Clock(0.0))
    assert b.save(SERVERS, STARTS.get) is False and b.error
