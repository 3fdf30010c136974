"""A hostile local peer cannot end the sidecar's drain channel (issue 28, items 2 and 3): a
deeply nested line, more connections than descriptors, descriptors past select()'s 1024, and
the drain still reaches the server's agent afterwards."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import wait_for
from tests.integration.test_control_socket import _reap, agent_process
from torch_watchdog.sidecar.actions import control


def test_a_deeply_nested_line_leaves_the_channel_working(short_tmp):
    path = os.path.join(short_tmp, "c.ctl")
    server = control.ControlServer(path)
    hostile = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        hostile.connect(path)
        hostile.sendall(b"[" * 3000 + b"\n" + b"{" * 3000 + b"\n")
        time.sleep(0.3)
        assert server._thread.is_alive()
        pid = agent_process(path, reply=True)
        try:
            assert wait_for(lambda: pid in server.connected(), 10)
            outcome = server.drain({pid}, 1.0)
            assert outcome.ok, outcome.detail
        finally:
            _reap(pid)
    finally:
        hostile.close()
        server.close()


def test_connections_stay_under_the_descriptor_limit_and_per_uid(short_tmp, monkeypatch):
    """Processes of one uid connecting past its share are refused, the closed ones are let go,
    and the drain reaches the agent that connects afterwards."""
    monkeypatch.setattr(control, "MAX_PEERS_PER_UID", 20)
    path = os.path.join(short_tmp, "c.ctl")
    server = control.ControlServer(path)
    flood = []
    try:
        for _ in range(40):  # 40 processes of this uid, each holding a connection
            pid = os.fork()
            if pid == 0:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(path)
                    time.sleep(3)
                finally:
                    os._exit(0)
            flood.append(pid)
        assert wait_for(lambda: server.refused >= 20, 10), server.refused
        assert len(server.connected()) == 20
        for pid in flood:
            _reap(pid)
        assert wait_for(lambda: not server.connected(), 10)  # the closed ones are let go
        monkeypatch.setattr(control, "MAX_PEERS_PER_UID", 256)
        pid = agent_process(path, reply=True)
        try:
            assert wait_for(lambda: pid in server.connected(), 10)
            assert server.drain({pid}, 1.0).ok
        finally:
            _reap(pid)
    finally:
        for pid in flood:
            _reap(pid)
        server.close()


def test_descriptors_past_1024_and_a_full_table_do_not_stop_the_channel(short_tmp):
    """In a process whose descriptors are numbered past select()'s 1024 and that then runs
    out of them: the channel reads on, and once descriptors are free it accepts again."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the hard descriptor limit {hard} is below the test's 1,400")
    limit = 1400 if hard == resource.RLIM_INFINITY else min(hard, 1400)
    code = textwrap.dedent(f"""
        import os, resource, socket, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # fds past 1024
        from torch_watchdog.sidecar.actions import control
        server = control.ControlServer({os.path.join(short_tmp, "c.ctl")!r})
        more = []
        try:
            while True:
                more.append(os.open("/dev/null", os.O_RDONLY))  # the table full
        except OSError:
            pass
        print("ready", flush=True)
        time.sleep(1.0)
        for fd in more:
            os.close(fd)
        time.sleep(1.5)
        print("alive", server._thread.is_alive(), "errors", server.errors,
              "connected", len(server.connected()), flush=True)
        server.close()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(os.path.join(short_tmp, "c.ctl"))  # queued while the table is full
        out = child.stdout.readline().split()
        peer.close()
    finally:
        child.wait(10)
    assert out[:2] == ["alive", "True"] and out[5] == "1", out
