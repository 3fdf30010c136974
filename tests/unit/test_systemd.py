import os
import socket
import time
import uuid

import pytest

from torch_watchdog.sidecar.actions.systemd import Notifier, watchdog_interval_s


@pytest.fixture(params=["path", "abstract"])
def manager(request, short_tmp):
    """A fake service manager: (NOTIFY_SOCKET value, the socket it listens on)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        value = os.path.join(short_tmp, "notify")
        sock.bind(value)
    else:
        name = f"tw-notify-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        value = "@" + name
    sock.settimeout(2)
    yield value, sock
    sock.close()


def test_assignments_arrive_exactly(manager):
    value, sock = manager
    n = Notifier({"NOTIFY_SOCKET": value})
    assert n.enabled
    assert n.ready()
    assert sock.recv(4096) == b"READY=1"
    assert n.ready("serving 2 GPUs")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 2 GPUs"
    assert n.status("headroom 3.1 GiB\nforecast: none\r\n")
    assert sock.recv(4096) == b"STATUS=headroom 3.1 GiB forecast: none"
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert n.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    assert n.notify("EXTEND_TIMEOUT_USEC=5000000", "STATUS=slow start")
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=5000000\nSTATUS=slow start"


def test_reloading_carries_the_monotonic_clock(manager):
    value, sock = manager
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert Notifier({"NOTIFY_SOCKET": value}).reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = sock.recv(4096).decode().split("\n")
    assert first == "RELOADING=1"
    key, usec = second.split("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


def test_disabled_without_notify_socket():
    for environ in ({}, {"NOTIFY_SOCKET": ""}):
        n = Notifier(environ)
        assert not n.enabled
        assert n.ready("x") is False and n.watchdog() is False and n.reloading() is False


def test_missing_socket_returns_false(short_tmp):
    n = Notifier({"NOTIFY_SOCKET": os.path.join(short_tmp, "gone")})
    assert n.enabled
    assert n.ready() is False
    assert Notifier({"NOTIFY_SOCKET": "@tw-nobody-" + uuid.uuid4().hex}).watchdog() is False


def test_bad_addresses_return_false():
    assert Notifier({"NOTIFY_SOCKET": "/" + "x" * 200}).ready() is False  # over 108 bytes
    assert Notifier({"NOTIFY_SOCKET": "/a\0b"}).ready() is False
    assert Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).ready() is False


def test_defaults_to_the_process_environment(manager, monkeypatch):
    value, sock = manager
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert Notifier().watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"WATCHDOG_USEC": "10000000"}, 5.0),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}, 1.5),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "x"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_PID": str(os.getpid())}, None),
])
def test_watchdog_interval_s(environ, expected):
    assert watchdog_interval_s(environ) == expected
