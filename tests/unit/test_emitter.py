"""The agent's emitter without a receiver thread: the queue's bound, drop reports, the event
log and its rotation, queued tuples. Sending to real receivers (a collector thread, a sidecar
that restarts): tests/integration/test_emitter_socket.py."""
import os
import time

from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter


def _hb(i: int) -> events.Heartbeat:
    return events.Heartbeat(t=time.time(), pid=os.getpid(), seq=i, uptime_s=0.0,
                            queue_depth=0, errors=0)


def _dropped_lines(log: str) -> list[events.Dropped]:
    with open(log) as f:
        return [e for e in map(events.decode, f) if e.kind == "dropped"]


def test_drop_reports_come_only_for_new_drops_at_most_once_a_period(short_tmp):
    log = os.path.join(short_tmp, "events.jsonl")
    dead = os.path.join(short_tmp, "nobody.sock")
    em = Emitter(dead, log, drop_report_s=0.0)  # not started: each round is called by hand
    em.emit(_hb(1))
    em.drain()
    for _ in range(20):
        em._report_drops()
        em.drain()
    assert [(d.count, d.total) for d in _dropped_lines(log)] == [(1, 1)]
    em.emit(_hb(2))  # one new loss: one new report
    em.drain()
    for _ in range(20):
        em._report_drops()
    assert [(d.count, d.total) for d in _dropped_lines(log)] == [(1, 1), (1, 2)]
    em.stop()

    em = Emitter(dead, os.path.join(short_tmp, "b.jsonl"), drop_report_s=3600)
    for i in range(10):  # new losses every round, but one report per period
        em.emit(_hb(i))
        em.drain()
        em._report_drops()
    assert [(d.count, d.total) for d in _dropped_lines(os.path.join(short_tmp, "b.jsonl"))
            ] == [(1, 1)]
    em.stop()


def test_queue_is_bounded_and_overflow_counted():
    em = Emitter(None, None, queue_size=10)  # not started: nothing drains
    for i in range(25):
        em.emit(_hb(i))
    assert em.depth() == 10 and em.dropped["queue_full"] == 15


def test_log_rotates_once_past_its_size(short_tmp):
    log = os.path.join(short_tmp, "events.jsonl")
    em = Emitter(None, log, log_max_bytes=2000)
    for i in range(100):
        em.emit(_hb(i))
        if i % 10 == 9:  # one drain writes its batch at once; ~1 KB here
            em.drain()
    em.stop()
    assert os.path.getsize(log) <= 2000 and os.path.getsize(log + ".1") <= 2000
    with open(log) as f:
        last = [events.decode(line).seq for line in f]
    assert last[-1] == 99


def test_a_new_shape_queued_as_a_tuple_is_sent_as_its_event_in_order(short_tmp):
    import gc

    log = os.path.join(short_tmp, "events.jsonl")
    em = Emitter(None, log, tick_s=0.02)
    em.emit(_hb(1))
    later = ("new_shape", 12.5, os.getpid(), "llm", "x1,7;x1,7,4096;x", 0.25, 3)
    em.emit_later(later)
    em.emit(_hb(2))
    gc.collect()
    assert not gc.is_tracked(later)  # what waits in the queue costs the collections nothing
    em.start()
    em.stop()
    with open(log) as f:
        got = [events.decode(line) for line in f]
    assert [e.kind for e in got] == ["heartbeat", "new_shape", "heartbeat"]
    assert got[1] == events.NewShape(t=12.5, pid=os.getpid(), name="llm",
                                     shape=[[1, 7], [1, 7, 4096], []], seconds=0.25,
                                     distinct=3)


def test_a_queued_tuple_that_builds_no_event_is_an_error_not_a_dead_thread(short_tmp):
    log = os.path.join(short_tmp, "events.jsonl")
    errors = []
    em = Emitter(None, log, tick_s=0.02, on_error=errors.append)
    em.emit_later(("no_such_kind", 1.0))
    em.emit_later(("new_shape", 1.0))  # missing fields
    em.emit(_hb(1))
    em.start()
    em.stop()
    with open(log) as f:
        assert [events.decode(line).kind for line in f] == ["heartbeat"]
    assert len(errors) == 2


def test_emit_later_respects_the_queue_bound():
    em = Emitter(None, None, queue_size=3)
    for i in range(5):
        em.emit_later(("new_shape", 1.0, 1, "m", f"x{i}", 0.1, i))
    assert em.depth() == 3 and em.dropped["queue_full"] == 2
