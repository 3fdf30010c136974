"""When a drain may exit: no watched call in hand, none ended for QUIET_S of time the process
was scheduled, and the server's threads seen waiting. A call's answer is sent after the call
returns: an answer worked out for longer than QUIET_S after the call (post-processing, a
thread descheduled on a loaded machine) was cut off by the exit."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.fakes import Clock
from torch_watchdog.agent import drain
from torch_watchdog.agent.wrapper import watch

pytestmark = pytest.mark.usefixtures("hot_path")  # on the C and the Python path


def serve_one(work_after, sent: threading.Event) -> threading.Thread:
    """A server thread: one watched call, then `work_after()` (sending the answer), then sent."""
    model = watch(lambda x: x * 2, name="drain-wait")

    def run() -> None:
        model(torch.ones(3))
        work_after()
        sent.set()

    return threading.Thread(target=run, name="server")


def test_the_exit_waits_for_a_thread_still_working_after_its_call():
    sent, answering = threading.Event(), threading.Event()

    def answer() -> None:  # 0.8 s of Python after the call: running, never waiting
        answering.set()
        until = time.monotonic() + 0.8
        while time.monotonic() < until:
            pass

    server = serve_one(answer, sent)
    server.start()
    try:
        assert answering.wait(10)  # the call returned; its answer is being worked out
        left = drain.wait_idle(time.monotonic() + 30)
        assert sent.is_set(), "the drain would have exited before the answer was sent"
        assert left == 0
    finally:
        server.join(10)


def test_a_thread_waiting_for_its_next_request_does_not_hold_the_exit():
    sent, nxt = threading.Event(), threading.Event()
    server = serve_one(lambda: None, sent)
    waiting = threading.Thread(target=nxt.wait, args=(30,), name="accept")
    waiting.start()
    server.start()
    try:
        assert sent.wait(10)
        started = time.monotonic()
        assert drain.wait_idle(started + 30) == 0
        assert time.monotonic() - started < 10  # not the deadline
        assert waiting.is_alive()
    finally:
        nxt.set()
        server.join(10)
        waiting.join(10)


def test_a_thread_that_never_waits_holds_the_exit_no_longer_than_hold_s():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spinner")
    spinner.start()
    try:
        started = time.monotonic()
        assert drain.wait_idle(started + 60, quiet_s=0.05, hold_s=0.5) == 0
        took = time.monotonic() - started
        assert 0.5 <= took < 30, took  # held, then let go well before the deadline
    finally:
        stop.set()
        spinner.join(10)


class StallingClock(Clock):
    """A clock the test moves: each sleep advances it, `stalls` add a jump at given polls."""

    def __init__(self, stalls: dict[int, float]):
        super().__init__(1000.0)
        self.polls, self.stalls = 0, stalls

    def sleep(self, s: float) -> None:
        self.polls += 1
        self.advance(s + self.stalls.get(self.polls, 0.0))


def test_a_stall_of_the_drain_thread_is_not_quiet_time():
    """A 10 s stall at the second poll: a plain clock would read 10 s quiet and exit there."""
    clock = StallingClock({2: 10.0})
    drain.wait_idle(clock() + 60, quiet_s=0.25, busy=lambda: False, clock=clock,
                    sleep=clock.sleep)
    # 0.25 s of quiet at 5 ms a poll, the stall counted as one long step (20 ms), two clear
    # reads of the threads
    assert 45 <= clock.polls <= 55, clock.polls


def test_busy_threads_hold_the_exit_until_seen_idle_twice_in_a_row():
    reads = iter([True, True, False, True, False, False, True])
    clock = StallingClock({})
    drain.wait_idle(clock() + 60, quiet_s=0.1, busy=lambda: next(reads), clock=clock,
                    sleep=clock.sleep)
    assert next(reads) is True  # returned after the two idle reads in a row, not before
