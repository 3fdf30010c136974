"""Bursts into the sidecar's receiver from other threads: a sender of 5,000 datagrams, and the
agent's emitter on its sender thread; nothing lost. The receiver alone:
tests/unit/test_receiver.py."""
import socket
import threading
import time

from tests.unit.test_receiver import NO_DROPS, _hb, _receive_until
from tests.unit.test_receiver import path, rx  # noqa: F401  (the fixtures)
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter


def test_burst_of_5000_is_not_lost(rx):  # noqa: F811
    # The kernel queues only net.unix.max_dgram_qlen (10) Unix datagrams whatever SO_RCVBUF
    # says, so the burst starts before receive() and a blocking sender waits for the drain.
    n = 5000

    def send():
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for i in range(n):
                s.sendto(events.encode(_hb(i)), rx.path)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(0.05)
    got = _receive_until(rx, n)
    sender.join(5)
    assert [e.seq for e, _ in got] == list(range(n))
    assert rx.received == n and rx.dropped == NO_DROPS


def test_emitter_burst_reaches_a_draining_receiver(rx):  # noqa: F811
    em = Emitter(rx.path, None, tick_s=0.05)
    em.start()
    try:
        for i in range(2000):
            em.emit(_hb(i))
        got = _receive_until(rx, 2000)
    finally:
        em.stop()
    assert [e.seq for e, _ in got if e.kind == "heartbeat"] == list(range(2000))
    assert em.dropped == {"queue_full": 0, "socket": 0, "log": 0}
    assert rx.dropped == NO_DROPS
