"""The agent's emitter sending to real Unix datagram receivers on its sender thread: delivery,
drops counted and reported, a full receiver never blocking, a sidecar that restarts. Without
a receiver thread: tests/unit/test_emitter.py."""
import os
import socket
import time

from tests.unit.test_emitter import _dropped_lines, _hb
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter


def test_events_reach_the_socket_and_the_log(collector, short_tmp):
    log = os.path.join(short_tmp, "events.jsonl")
    em = Emitter(collector.path, log, tick_s=0.02)
    em.start()
    for i in range(50):
        em.emit(_hb(i))
    assert collector.wait(lambda c: len(c.of("heartbeat")) == 50, 5)
    em.stop()
    assert [e.seq for e in collector.of("heartbeat")] == list(range(50))
    with open(log) as f:
        assert [events.decode(line).seq for line in f] == list(range(50))
    assert em.sent == 50 and em.dropped == {"queue_full": 0, "socket": 0, "log": 0}


def test_absent_sidecar_drops_counts_then_reconnects(short_tmp):
    from tests.conftest import Collector

    path = os.path.join(short_tmp, "late.sock")
    em = Emitter(path, None, tick_s=0.02, reconnect_s=0.05, drop_report_s=0.1)
    em.start()
    t0 = time.perf_counter()
    for i in range(1000):
        em.emit(_hb(i))
    assert time.perf_counter() - t0 < 1.0  # never blocked on the missing peer
    deadline = time.monotonic() + 5
    while em.dropped["socket"] < 1000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert em.dropped["socket"] >= 1000  # the 1000 events, and the drop report nobody heard
    late = Collector(path)  # the sidecar comes up
    try:
        time.sleep(0.1)
        em.emit(_hb(9999))
        assert late.wait(lambda c: any(e.seq == 9999 for e in c.of("heartbeat")), 5)
        # the loss is reported once the peer is back, with the running total; the reports
        # that were lost are not losses of the server's events and are not in it
        assert late.wait(lambda c: any(d.total == 1000 for d in c.of("dropped")), 5)
        assert all(d.reason == "socket" for d in late.of("dropped"))
        assert sum(d.count for d in late.of("dropped")) == 1000
    finally:
        em.stop()
        late.close()


def test_drop_reports_never_sustain_themselves(short_tmp):
    """Only an event log, and no sidecar at the default socket: the socket drops every event,
    drop reports included. Main wrote a `dropped` line every tick, forever."""
    log = os.path.join(short_tmp, "events.jsonl")
    ticks = []
    em = Emitter(os.path.join(short_tmp, "nobody.sock"), log, tick_s=0.01, reconnect_s=0.01,
                 drop_report_s=0.05, on_tick=lambda: ticks.append(1))
    em.start()
    em.emit(_hb(1))
    deadline = time.monotonic() + 10
    while len(ticks) < 60 and time.monotonic() < deadline:  # >= 12 report periods
        time.sleep(0.01)
    em.stop()
    assert len(ticks) >= 60
    (report,) = _dropped_lines(log)  # the heartbeat's loss, once
    assert (report.reason, report.count, report.total) == ("socket", 1, 1)


def test_full_receiver_buffer_never_blocks(short_tmp):
    path = os.path.join(short_tmp, "full.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sink.bind(path)  # bound, never read: the buffer fills
    em = Emitter(path, None, tick_s=0.01)
    em.start()
    def accounted() -> int:  # every event ends up sent or counted as dropped (the emitter's
        # own `dropped` reports are events too, so this can pass 20,000)
        return em.sent + em.dropped["socket"] + em.dropped["queue_full"]

    try:
        t0 = time.perf_counter()
        for i in range(20000):
            em.emit(_hb(i))
        assert time.perf_counter() - t0 < 2.0  # the producer never waited for the receiver
        deadline = time.monotonic() + 10
        while accounted() < 20000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accounted() >= 20000 and em.dropped["socket"] > 0
    finally:
        em.stop()
        sink.close()


def test_events_are_packed_several_to_a_datagram(collector):
    em = Emitter(collector.path, None)  # not started: one drain sends what is queued
    for i in range(300):
        em.emit(_hb(i))
    em.drain()
    assert collector.wait(lambda c: len(c.of("heartbeat")) == 300, 5)
    assert em.sent == 300 and em.dropped["socket"] == 0
    assert collector.datagrams < 10  # ~100 bytes an event: a few datagrams, not 300


def test_unwritable_log_is_counted_and_socket_still_served(collector):
    em = Emitter(collector.path, "/proc/no-such-dir/events.jsonl", tick_s=0.02)
    em.start()
    for i in range(5):
        em.emit(_hb(i))
    assert collector.wait(lambda c: len(c.of("heartbeat")) == 5, 5)
    assert collector.wait(lambda c: any(d.reason == "log" for d in c.of("dropped")), 5)
    em.stop()
    assert em.dropped["log"] >= 5


def test_tick_errors_never_kill_the_thread(collector):
    calls = []

    def bad_tick():
        calls.append(1)
        raise RuntimeError("boom")

    errors = []
    em = Emitter(collector.path, None, tick_s=0.01, on_tick=bad_tick, on_error=errors.append)
    em.start()
    time.sleep(0.2)
    em.emit(_hb(1))
    assert collector.wait(lambda c: len(c.of("heartbeat")) == 1, 5)
    em.stop()
    assert len(calls) > 3 and all(isinstance(e, RuntimeError) for e in errors)


# -- a sidecar that restarts: the emitter tells the agent once, and its hello goes at once -------

def _hello() -> events.Hello:
    return events.Hello(t=time.time(), pid=os.getpid(), torch="2.x", agent="test", devices=[],
                        config={}, capabilities={}, watched=[], argv="test", server="srv")


def _restarting(path: str, gap_s: float = 0.0, heartbeats_s: float = 0.02):
    """An emitter sending a heartbeat every `heartbeats_s` to a real receiver at `path`, whose
    hook queues a hello (as the agent does); the receiver is then closed, unlinked and, after
    `gap_s`, bound again. Returns (emitter, new receiver, seconds from re-bind to hello, heartbeats
    on the new receiver before that hello)."""
    from tests.conftest import Collector

    old = Collector(path)
    em = Emitter(path, None, tick_s=0.02, reconnect_s=0.2)
    em._on_receiver_change = lambda: em.emit(_hello())
    em.start()
    seq = iter(range(10**6))
    em.emit(_hb(next(seq)))
    assert old.wait(lambda c: c.of("heartbeat"), 5)
    time.sleep(1.2)  # past the first stat of the path: this receiver is the one it knows
    old.close()
    os.unlink(path)  # the sidecar stops ...
    gap_end = time.monotonic() + gap_s
    while time.monotonic() < gap_end:
        em.emit(_hb(next(seq)))
        time.sleep(heartbeats_s)
    new = Collector(path)  # ... and its successor binds the same path
    bound = time.monotonic()
    while not new.of("hello") and time.monotonic() - bound < 5:
        em.emit(_hb(next(seq)))
        time.sleep(heartbeats_s)
    took = time.monotonic() - bound
    kinds = [e.kind for e in new.events]
    before = kinds.index("hello") if "hello" in kinds else len(kinds)
    return em, new, took, before


def test_a_rebound_socket_is_one_receiver_change_and_gets_the_hello_within_a_second(short_tmp):
    """Unlinked and bound again between two sends: no send failed, the stat of the path (an
    inode of its own) tells."""
    em, new, took, _ = _restarting(os.path.join(short_tmp, "ev.sock"))
    try:
        assert new.of("hello") and took < 1.5, took
        for i in range(100):  # sends go on to the new receiver: no further change
            em.emit(_hb(i))
            time.sleep(0.02)
        assert em.receiver_changes == 1 and len(new.of("hello")) == 1
        assert not em.dropped["socket"]
    finally:
        em.stop()
        new.close()


def test_a_receiver_back_after_failed_sends_gets_the_hello_with_the_first_events(
        short_tmp, monkeypatch):
    """Sends fail while the path is gone, and one goes through again: that send tells (the stat
    is put off here), and the hello follows in the same round of the sender thread."""
    from torch_watchdog.agent import emitter

    monkeypatch.setattr(emitter, "RECEIVER_STAT_S", 3600.0)
    em, new, took, before = _restarting(os.path.join(short_tmp, "ev.sock"), gap_s=0.5)
    try:
        assert new.of("hello") and took < 1.0, took  # reconnect_s=0.2 here
        assert before <= 3, [e.kind for e in new.events]  # behind one round's heartbeats at most
        for i in range(50):
            em.emit(_hb(i))
            time.sleep(0.02)
        assert em.receiver_changes == 1 and len(new.of("hello")) == 1
        assert em.dropped["socket"] > 0  # the heartbeats sent into the gap
    finally:
        em.stop()
        new.close()


def test_a_sidecar_down_for_two_seconds_is_told_once_by_either_sign(short_tmp):
    """Failed sends and the stat both see this restart: one change, one hello."""
    em, new, took, _ = _restarting(os.path.join(short_tmp, "ev.sock"), gap_s=2.0)
    try:
        assert new.of("hello") and took < 1.5, took
        for i in range(100):
            em.emit(_hb(i))
            time.sleep(0.02)
        assert em.receiver_changes == 1 and len(new.of("hello")) == 1
    finally:
        em.stop()
        new.close()


def test_a_sidecar_that_comes_up_after_the_process_gets_the_hello_at_once(short_tmp):
    from tests.conftest import Collector

    path = os.path.join(short_tmp, "late.sock")
    em = Emitter(path, None, tick_s=0.02, reconnect_s=5.0)  # long back-off: the stat tells
    em._on_receiver_change = lambda: em.emit(_hello())
    em.emit(_hello())  # the agent's first hello, into nothing
    em.start()
    time.sleep(1.2)
    late = Collector(path)
    try:
        bound = time.monotonic()
        assert late.wait(lambda c: c.of("hello"), 3)
        assert time.monotonic() - bound < 1.5 and em.receiver_changes == 1
    finally:
        em.stop()
        late.close()


def test_steady_traffic_to_one_receiver_is_never_a_change(collector):
    em = Emitter(collector.path, None, tick_s=0.02)
    em.start()
    for i in range(150):  # 3 s: three stats of the path
        em.emit(_hb(i))
        time.sleep(0.02)
    assert collector.wait(lambda c: len(c.of("heartbeat")) == 150, 5)
    em.stop()
    assert em.receiver_changes == 0


def test_a_failing_receiver_hook_is_counted_and_the_thread_goes_on(short_tmp):
    from tests.conftest import Collector

    path = os.path.join(short_tmp, "ev.sock")
    errors: list[BaseException] = []

    def bad_hook() -> None:
        raise RuntimeError("boom")

    em = Emitter(path, None, tick_s=0.02, on_error=errors.append, on_receiver_change=bad_hook)
    em.start()
    time.sleep(1.2)  # the first stat: nothing there
    late = Collector(path)
    try:
        assert late.wait(lambda c: em.receiver_changes == 1, 3)
        em.emit(_hb(1))
        assert late.wait(lambda c: c.of("heartbeat"), 3)
        assert [type(e) for e in errors] == [RuntimeError]
    finally:
        em.stop()
        late.close()


def test_no_receiver_is_told_once_and_the_first_receiver_once(short_tmp):
    """An agent whose TORCH_WATCHDOG_SOCKET names a path where no sidecar listens said
    nothing: its events went nowhere. One call when the first sends find no receiver, one when
    a receiver first takes them; none for what follows (a sidecar restarted)."""
    from tests.conftest import Collector

    path = os.path.join(short_tmp, "ev.sock")
    told: list[bool] = []
    em = Emitter(path, None, tick_s=0.02, reconnect_s=0.1, on_link=told.append)
    em.start()
    try:
        for i in range(20):  # 0.4 s of sends to no one
            em.emit(_hb(i))
            time.sleep(0.02)
        assert told == [False]
        receiver = Collector(path)
        assert receiver.wait(lambda c: (em.emit(_hb(99)), c.of("heartbeat"))[1], 5)
        deadline = time.monotonic() + 2
        while told != [False, True] and time.monotonic() < deadline:
            time.sleep(0.02)
        receiver.close()
        os.unlink(path)
        for i in range(20):  # gone again, then back: nothing more to tell
            em.emit(_hb(i))
            time.sleep(0.02)
        again = Collector(path)
        assert again.wait(lambda c: (em.emit(_hb(7)), c.of("heartbeat"))[1], 5)
        again.close()
        assert told == [False, True]
    finally:
        em.stop()
