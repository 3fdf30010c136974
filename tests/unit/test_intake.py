"""sidecar/sources/intake.py: a poll's share of the agents' events — at most INTAKE_EVENTS of
them, the rest left in the socket; what does not fit the pending list is dropped and counted,
never counted received; a busy poll makes the wait between polls read as datagrams come."""
from torch_watchdog import events
from torch_watchdog.sidecar.sources import intake as intake_mod
from torch_watchdog.sidecar.sources.intake import Intake


def heartbeat(seq: int) -> events.Heartbeat:
    return events.Heartbeat(t=1.0, pid=7, seq=seq, uptime_s=1.0, queue_depth=0, errors=0)


class Receiver:
    """Hands out what it holds, `left` at a time, as the real one does (datagrams counted)."""

    def __init__(self, n: int, per_datagram: int = 100):
        self.held = [(heartbeat(i), 7) for i in range(n)]
        self.datagrams, self.per_datagram, self.asked = 0, per_datagram, []

    def receive(self, left: int, deadline: float) -> list:
        self.asked.append(left)
        got, self.held = self.held[:left], self.held[left:]
        self.datagrams += -(-len(got) // self.per_datagram)
        return got


def test_a_poll_takes_at_most_its_budget_and_the_next_poll_the_rest():
    intake = Intake(0.1)
    intake.receiver = Receiver(2 * intake_mod.INTAKE_EVENTS + 10)
    assert intake.take() and not intake.take()  # the wait took this poll's share: no more
    first = intake.for_poll()
    assert len(first) == intake_mod.INTAKE_EVENTS and intake.eager  # busy: read between polls
    second = intake.for_poll()
    assert [e.seq for e in second[:1]] == [intake_mod.INTAKE_EVENTS]
    assert intake.accepted == len(first) + len(second)


def test_what_the_pending_list_cannot_hold_is_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(intake_mod, "MAX_PENDING", 50)
    intake = Intake(0.1)
    intake.receiver = Receiver(80)
    intake.take()
    assert len(intake.pending) == 50 and intake.backlog_dropped == 30 and intake.accepted == 50
    assert [e.seq for e in intake.for_poll()] == list(range(50))


def test_a_quiet_wait_spares_the_poll_its_read_and_a_quiet_poll_is_not_eager():
    intake = Intake(0.1)
    receiver = intake.receiver = Receiver(5)
    intake.quiet = True  # the wait found the socket empty just before the poll
    assert intake.for_poll() == [] and receiver.asked == [] and not intake.eager
    assert len(intake.for_poll()) == 5 and not intake.eager  # one datagram: not busy
    assert not Intake(0.1).watching and Intake(0.1).for_poll() == []  # no socket yet
