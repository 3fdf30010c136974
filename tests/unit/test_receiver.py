"""The sidecar's datagram receiver on a real Unix socket, in one thread: what it takes, what it
drops and why, the socket file's life. Bursts from a sender thread, and from the agent's
emitter: tests/integration/test_receiver_burst.py."""
import dataclasses
import json
import os
import random
import select
import socket
import stat
import time

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.sources.receiver import Receiver

NO_DROPS = {"malformed": 0, "oversized": 0, "version": 0, "foreign": 0, "spoofed": 0}


def _hb(seq: int, pid: int = 0) -> events.Heartbeat:
    return events.Heartbeat(t=time.time(), pid=pid or os.getpid(), seq=seq, uptime_s=0.0,
                            queue_depth=0, errors=0)


def _raw(**changes) -> bytes:
    obj = events.to_dict(_hb(1))
    obj.update(changes)
    return json.dumps(obj).encode()


@pytest.fixture
def path(short_tmp):
    return os.path.join(short_tmp, "events.sock")


@pytest.fixture
def rx(path):
    r = Receiver(path)
    yield r
    r.close()


@pytest.fixture
def tx():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.settimeout(5)  # a full receiver queue (10 datagrams) fails the test instead of hanging it
    yield s
    s.close()


def _receive_until(rx: Receiver, n: int, timeout: float = 10.0) -> list:
    """Poll the receiver's fd like the daemon loop does, until n good events or a timeout."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        select.select([rx], [], [], 0.1)
        got.extend(rx.receive())
    return got


def test_good_events_round_trip_with_the_kernel_reported_sender_pid(rx, tx):
    hello = events.Hello(t=time.time(), pid=os.getpid(), torch="2.6.0", agent="0.1.0",
                         devices=["GPU-0"], config={"recompile_limit": 8},
                         capabilities={"dynamo": True}, watched=["model"], argv="serve")
    for ev in (_hb(1), hello, _hb(2)):
        tx.sendto(events.encode(ev), rx.path)
    got = rx.receive()
    assert [(type(e).__name__, pid) for e, pid in got] == [
        ("Heartbeat", os.getpid()), ("Hello", os.getpid()), ("Heartbeat", os.getpid())]
    # a hello is told with the kernel's word on who sent it: its uid and its parent
    assert got[1][0] == dataclasses.replace(hello, uid=os.getuid(), ppid=os.getppid())
    assert rx.received == 3 and rx.dropped == NO_DROPS
    assert rx.receive() == []  # drained, and it did not block


def test_bad_datagrams_are_counted_by_reason_and_good_ones_still_arrive(rx, tx):
    datagrams = [
        events.encode(_hb(1)),
        b"\xff\xfe not json",
        b"",
        b"[1, 2, 3]",
        b"[" * 60_000,                         # under the size limit, too deep for json
        _raw(seq="one"),                       # wrong type: malformed, not a version problem
        _raw(v=events.SCHEMA_VERSION + 1),     # a newer agent
        _raw(kind="from_the_future"),          # an unknown kind
        events.encode(_hb(2)),
        b"x" * (events.MAX_EVENT_BYTES + 1),   # one byte too long
        events.encode(_hb(3)),
    ]
    got = []
    for data in datagrams:
        tx.sendto(data, rx.path)
        if len(data) > 1000:  # measured: one 60 KB datagram in flight fills a default SO_SNDBUF
            got.extend(rx.receive())
    got.extend(rx.receive())
    assert [e.seq for e, _ in got] == [1, 2, 3]
    assert rx.dropped == {**NO_DROPS, "malformed": 5, "version": 2, "oversized": 1}
    assert rx.received == 3


def test_exactly_max_event_bytes_is_not_oversized(rx, tx):
    data = _raw(errors=0)
    padded = data + b" " * (events.MAX_EVENT_BYTES - len(data))  # JSON allows trailing space
    tx.sendto(padded, rx.path)
    assert [e.seq for e, _ in rx.receive()] == [1]


def test_random_bytes_never_raise(rx, tx):
    rng = random.Random(1234)
    for i in range(300):
        tx.sendto(bytes(rng.randrange(256) for _ in range(rng.randrange(64))), rx.path)
        if i % 8 == 7:  # read before the kernel's queue of 10 datagrams fills
            rx.receive()
    rx.receive()
    assert rx.received == 0
    assert sum(rx.dropped.values()) >= 300  # each line of a datagram is an event (or not)


def test_one_datagram_may_carry_several_events(rx, tx):
    lines = [events.encode(events.Heartbeat(t=time.time(), pid=os.getpid(), seq=i, uptime_s=0.0,
                                            queue_depth=0, errors=0)) for i in range(5)]
    tx.sendto(b"\n".join(lines[:3]) + b"\n" + b"not json\n" + b"\n".join(lines[3:]), rx.path)
    assert [e.seq for e, _ in rx.receive()] == [0, 1, 2, 3, 4]
    assert rx.dropped["malformed"] == 1


def test_each_line_of_a_packed_datagram_is_judged_on_its_own(rx, tx):
    # the agent packs many events per datagram: a spoofed, a newer-schema, a wrong-typed and a
    # blank line among good ones are each dropped by their reason, and the good ones arrive
    lines = [events.encode(_hb(1)), events.encode(_hb(2, pid=os.getpid() + 1)), b"",
             _raw(v=events.SCHEMA_VERSION + 1), _raw(seq=True), events.encode(_hb(3))]
    tx.sendto(b"\n".join(lines), rx.path)
    assert [(e.seq, pid) for e, pid in rx.receive()] == [(1, os.getpid()), (3, os.getpid())]
    assert rx.dropped == {**NO_DROPS, "spoofed": 1, "version": 1, "malformed": 1}
    assert rx.received == 2


def test_a_packed_datagram_of_valid_lines_arrives_whole_and_a_spoofed_one_is_still_caught(rx, tx):
    # every line a valid event: the datagram is taken on the fast path (orjson, a line each)
    kinds = [_hb(1),
             events.NewShape(t=time.time(), pid=os.getpid(), name="m", shape=[[1, 7], [2]],
                             seconds=0.05, distinct=1),
             events.CudagraphRecord(t=time.time(), pid=os.getpid(), phase="record",
                                    compile_id="0/1", key=[7], shape=[[1, 7]], seconds=0.01),
             _hb(2, pid=os.getpid() + 1), _hb(3)]
    tx.sendto(b"\n".join(events.encode(e) for e in kinds), rx.path)
    got = [e for e, _ in rx.receive()]
    assert got == [kinds[0], kinds[1], kinds[2], kinds[4]]
    assert rx.dropped == {**NO_DROPS, "spoofed": 1}


def test_lines_that_are_json_only_when_joined_are_each_dropped(rx, tx):
    # joined into one array, `{"a":[{}` + `{}]}` would be one object and `{..},{..}` two: each
    # line is judged alone, as one event per line, so all three are malformed
    good = events.to_dict(_hb(1))
    split = json.dumps(good, separators=(",", ":"))
    lines = [split[:-1] + ',"devices":[{}', '{}]}',
             split + "," + split, split]
    tx.sendto("\n".join(lines).encode(), rx.path)
    assert [e.seq for e, _ in rx.receive()] == [1]
    assert rx.dropped == {**NO_DROPS, "malformed": 3}


def test_two_lines_that_join_into_one_event_inside_a_string_are_each_dropped(rx, tx):
    # `...,"name":"x}` + `{y",...}`: neither line is JSON, but joined by a comma the two read
    # as one valid new_shape whose name is "x},{y". Each line is judged alone: two malformed
    good = events.to_dict(events.NewShape(t=time.time(), pid=os.getpid(), name="x},{y",
                                          shape=[[1, 2]], seconds=0.1, distinct=1))
    text = json.dumps(good, separators=(",", ":"))
    cut = text.index("},{") + 1
    tx.sendto((text[:cut] + "\n" + text[cut + 1:]).encode(), rx.path)
    assert rx.receive() == []
    assert rx.dropped == {**NO_DROPS, "malformed": 2}


def test_sender_with_a_uid_not_allowed_is_foreign(path, tx):
    with Receiver(path, allowed_uids={os.getuid() + 1}) as rx:
        tx.sendto(events.encode(_hb(1)), path)
        assert rx.receive() == []
        assert rx.dropped == {**NO_DROPS, "foreign": 1}


def test_sender_with_an_allowed_uid_is_accepted(path, tx):
    with Receiver(path, allowed_uids={os.getuid()}) as rx:
        tx.sendto(events.encode(_hb(1)), path)
        assert [pid for _, pid in rx.receive()] == [os.getpid()]


def test_event_claiming_another_pid_is_spoofed(rx, tx):
    other = os.getpid() + 1
    assert other > 0
    tx.sendto(events.encode(_hb(1, pid=other)), rx.path)
    tx.sendto(events.encode(_hb(2)), rx.path)
    assert [e.seq for e, _ in rx.receive()] == [2]
    assert rx.dropped == {**NO_DROPS, "spoofed": 1}


def test_max_batch_bounds_one_call(path, tx):
    with Receiver(path, max_batch=3) as rx:
        for i in range(5):
            tx.sendto(events.encode(_hb(i)), path)
        assert [e.seq for e, _ in rx.receive()] == [0, 1, 2]
        assert [e.seq for e, _ in rx.receive()] == [3, 4]


def test_socket_mode_and_new_parent_directory(short_tmp):
    path = os.path.join(short_tmp, "run", "tw", "events.sock")
    with Receiver(path) as rx:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o007 == 0
        assert rx.fileno() >= 0


def test_custom_mode(path):
    with Receiver(path, mode=0o600):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_stale_socket_is_replaced(path, tx):
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(path)
    dead.close()  # the file stays behind, as after a crash
    with Receiver(path) as rx:
        tx.sendto(events.encode(_hb(1)), path)
        assert [e.seq for e, _ in rx.receive()] == [1]


def test_live_socket_is_not_stolen(path):
    with Receiver(path):
        with pytest.raises(OSError, match="another receiver"):
            Receiver(path)
        assert stat.S_ISSOCK(os.stat(path).st_mode)


def test_regular_file_is_not_replaced(path):
    with open(path, "w") as f:
        f.write("keep me")
    with pytest.raises(FileExistsError, match="not a socket"):
        Receiver(path)
    with open(path) as f:
        assert f.read() == "keep me"


def test_close_unlinks_and_is_idempotent(path):
    rx = Receiver(path)
    assert os.path.exists(path)
    rx.close()
    assert not os.path.exists(path)
    rx.close()


def test_a_sender_in_a_child_pid_namespace_is_told_in_our_pids(path, tx):
    """A node-level sidecar and a server in a container: the server's agent says pid 7 (its
    own namespace's), the kernel says the sender is our pid; /proc's NSpid joins the two."""
    me = os.getpid()
    with Receiver(path, ns_ids=lambda pid: (7, 4000) if pid == me else None) as rx:
        hello = events.Hello(t=time.time(), pid=7, torch="2.13", agent="0", devices=[],
                             config={}, capabilities={}, watched=[], argv="x", ppid=1)
        tx.sendto(events.encode(hello), rx.path)
        tx.sendto(events.encode(_hb(1, pid=7)), rx.path)
        tx.sendto(events.encode(_hb(2, pid=8)), rx.path)  # not its pid in any namespace
        got = _receive_until(rx, 2)
        assert [(e.kind, e.pid, s) for e, s in got] == [("hello", me, me), ("heartbeat", me, me)]
        assert got[0][0].ppid == 4000  # its parent, in our pids
        got += rx.receive()  # the third datagram was queued as its sendto returned
        assert len(got) == 2 and rx.dropped["spoofed"] == 1


def test_namespace_ids_of_a_process_in_our_namespace_is_none():
    from torch_watchdog.sidecar.sources.receiver import namespace_ids
    assert namespace_ids(os.getpid()) is None
    assert namespace_ids(2 ** 22 + 12345) is None  # no such process


def test_a_packed_datagram_decodes_to_what_each_line_decodes_to_with_or_without_orjson(rx, tx):
    # the receiver's faster parser (orjson, where installed) must not change an event: an
    # integer past 64 bits (orjson reads it as a float) in a float field stays json's integer;
    # a negative one of 19 digits too (past int64: a float to orjson)
    from torch_watchdog.sidecar.sources import receiver

    long_int = 2 ** 64 + 1
    lines = [events.encode(_hb(1)),
             json.dumps({**events.to_dict(_hb(2)), "uptime_s": long_int}).encode(),
             json.dumps({**events.to_dict(_hb(3)), "uptime_s": -9999999999999999999}).encode(),
             events.encode(events.NewShape(t=time.time(), pid=os.getpid(), name="m\u00e9",
                                           shape=[[1, 2]], seconds=1e-300, distinct=3))]
    data = b"\n".join(lines)
    expected = [events.decode(line) for line in lines]
    assert receiver._decode_packed(data) is None  # json's, line by line
    plain = b"\n".join([lines[0], lines[3]])
    assert receiver._decode_packed(plain) == [expected[0], expected[3]]
    tx.sendto(data, rx.path)
    got = [e for e, _ in rx.receive()]
    assert got == expected
    assert type(got[1].uptime_s) is int and got[2].uptime_s == -9999999999999999999


def test_the_packed_path_accepts_exactly_what_the_line_path_accepts():
    """Every probe of the schema's checks (tests/unit/test_events.py), as an agent would put it
    in a datagram: the packed path (orjson and the builders without isfinite) gives the event
    the line path gives, or hands the datagram to the line path, never another event."""
    from tests.unit.test_events import _differential_cases
    from torch_watchdog.sidecar.sources import receiver

    if receiver._fast_loads is None:
        pytest.skip("orjson is not installed: there is no packed path")
    taken = refused = 0
    for obj in _differential_cases():
        try:
            data = json.dumps(obj).encode()  # NaN and Infinity as json writes them
        except (TypeError, ValueError):
            continue
        try:
            expected = events.decode(data)
        except events.EventDecodeError:
            expected = None
        got = receiver._decode_packed(data)
        if got is None:  # the line path decides (an event missing a field added later too)
            refused += 1
        else:
            taken += 1
            assert got == [expected] and type(got[0]) is type(expected), obj
            assert events.to_dict(got[0]) == events.to_dict(expected)
    assert taken > 100 and refused > 1000
