"""The agents' events between two polls: read from the receiver within a budget, held, counted.

A flood must not starve the loop: a poll takes at most INTAKE_EVENTS events and INTAKE_SHARE of
the poll interval reading them; the rest waits in the kernel's ~10-datagram queue, and the
agents count what it cannot hold. The socket is read at each poll, and between polls only after
a busy poll (`eager`): waking for every datagram of a quiet agent costs more than the datagram.
"""
from __future__ import annotations

import time
from typing import Optional

from torch_watchdog import events
from torch_watchdog.sidecar.sources.receiver import Receiver

MAX_PENDING = 100_000   # events held between polls; more are dropped and counted
INTAKE_EVENTS = 5_000
INTAKE_SHARE = 0.25
BATCH_S = 0.002         # after a read, let the socket fill this long before reading again
# between polls, the socket is read as datagrams come only after a poll that took this many
# (of the kernel queue's ~11): an agent whose burst finds the queue full retries for 1 s
EAGER_DATAGRAMS = 3


class Intake:
    """What the receiver hands in, held until the next poll takes it."""

    def __init__(self, poll_interval_s: float):
        self.poll_interval_s = poll_interval_s
        self.receiver: Optional[Receiver] = None
        self.pending: list[tuple[events.Event, int]] = []
        self.accepted = 0         # agent events taken into a poll
        self.backlog_dropped = 0  # dropped for want of room, never counted received
        self.eager = False        # read datagrams as they come between polls
        # the wait before this poll found the socket empty: the poll need not ask it again
        self.quiet = False
        self._events, self._seconds = 0, 0.0  # this poll's intake so far
        self._datagrams_at_poll = 0

    @property
    def watching(self) -> bool:
        """Whether the wait between polls should wake for datagrams."""
        return self.receiver is not None and self.eager

    def take(self) -> bool:
        """Take datagrams within this poll's budget; False once it is used up."""
        left = INTAKE_EVENTS - self._events
        share = INTAKE_SHARE * self.poll_interval_s
        if self.receiver is None or left <= 0 or self._seconds >= share:
            return False
        started = time.monotonic()
        got = self.receiver.receive(left, started + share - self._seconds)
        self._events += len(got)
        self._seconds += time.monotonic() - started
        room = MAX_PENDING - len(self.pending)
        self.pending.extend(got[:room])
        self.accepted += min(room, len(got))
        self.backlog_dropped += max(0, len(got) - room)
        return True

    def for_poll(self) -> list[events.Event]:
        """This poll's events, in the order they came; the budget starts again."""
        receiver = self.receiver
        if receiver is not None:
            if not self.quiet:
                self.take()
            self.eager = receiver.datagrams - self._datagrams_at_poll >= EAGER_DATAGRAMS or \
                self._events >= INTAKE_EVENTS or \
                self._seconds >= INTAKE_SHARE * self.poll_interval_s
            self._datagrams_at_poll = receiver.datagrams
        self.quiet = False
        got, self.pending = self.pending, []
        self._events, self._seconds = 0, 0.0
        return [event for event, _pid in got]
