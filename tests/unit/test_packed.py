"""The receiver's packed path (orjson and the schema's builders: receiver._decode_packed)
against the line path (events.decode): whatever it takes, it reads as json and the schema's
checks do; whatever they refuse, it declines (None), and the line path then counts and says
why."""
import json
import random

import pytest

from torch_watchdog import events


@pytest.fixture
def parse():
    from torch_watchdog.sidecar.sources import receiver

    if receiver._fast_loads is None:
        pytest.skip("orjson is not installed here (a dependency of the sidecar)")
    return receiver._decode_packed


def _line_path(data: bytes):
    try:
        return events.decode(data)
    except events.EventDecodeError:
        return None


def _same(got, expected) -> bool:
    """The same event: class, fields, and each value's type and bits (repr tells 1 from 1.0
    and 0.0 from -0.0)."""
    return type(got) is type(expected) and \
        repr(events.to_dict(got)) == repr(events.to_dict(expected))


def _check(parse, data: bytes) -> bool:
    """Whether the packed path took `data` (one line); fails if it took it otherwise than the
    line path, or took what the line path refuses."""
    got, expected = parse(data), _line_path(data)
    if got is None:
        return False
    assert expected is not None, data
    assert len(got) == 1 and _same(got[0], expected), (data, got, expected)
    return True


def test_every_agent_event_of_the_recorded_fixtures_reads_as_the_line_path_reads_it(parse):
    taken, by_kind = 0, {}
    from tests.unit.test_events import fixture_lines

    for line in fixture_lines():  # a line of the log, as a datagram carries it
        if _check(parse, line):
            taken += 1
            kind = json.loads(line)["kind"]
            by_kind[kind] = by_kind.get(kind, 0) + 1
    # the kinds an agent sends at rate are all taken here, not left to the Python path
    assert taken > 1000 and {"heartbeat", "new_shape", "cudagraph_record", "calls"} <= \
        set(by_kind), by_kind


def test_every_probe_of_the_schema_reads_as_the_line_path_reads_it_or_is_declined(parse):
    """tests/unit/test_events.py's probes of every check, written compact (as the agent
    writes) and with json.dumps' blanks."""
    from tests.unit.test_events import _differential_cases

    taken = declined = 0
    for obj in _differential_cases():
        for separators in ((",", ":"), (", ", ": ")):
            try:
                data = json.dumps(obj, separators=separators).encode()
            except (TypeError, ValueError):
                continue
            if _check(parse, data):
                taken += 1
            else:
                declined += 1
    assert taken > 200 and declined > 2000


_GOOD = [
    events.Heartbeat(t=1796129051.7643976, pid=2756, seq=1, uptime_s=1.0, queue_depth=0,
                     errors=1),
    events.NewShape(t=1796129051.25, pid=2756, name="m", shape=[[1, 33], [4]], seconds=0.05,
                    distinct=7),
    events.CudagraphRecord(t=1796129051.7644854, pid=1, phase="record", compile_id="0/1",
                           key=[2, -3], shape=None, seconds=None),
    events.Stall(t=1.5e9, pid=9, name="m", shape=[[]], seconds=12, new_shape=True, cause=None),
    events.Calls(t=1796129051.0, pid=3, name="m", calls=100, seconds=0.25, stall_calls=0,
                 stall_seconds=0, distinct_shapes=2, window_s=1.0),
    events.Mitigation(t=1.0, pid=3, name="padding", action="plan", detail="x", model="m",
                      error=None, buckets=[64, 128]),
]
# bytes a mutation puts in: JSON's structure, blanks, escapes, number parts, non-ASCII
_BITS = [b" ", b"\t", b"\r", b"\n", b",", b":", b"{", b"}", b"[", b"]", b'"', b"\\", b"\\u0041",
         b"\\n", b"0", b"1", b"9", b"-", b"+", b".", b"e", b"E", b"e400", b"e-400", b"00",
         b"true", b"false", b"null", b"NaN", b"Infinity", b"1" * 19, b"\xc3\xa9", b"\xff",
         b"\xed\xa0\x80", b"\x00", b"\x0c", b'"v":1,', b'"pid":7,', b'"kind":"stall",', b"{}"]


def _mutants(rng: random.Random, line: bytes):
    for _ in range(2500):
        data = bytearray(line)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data) + 1)
            op = rng.random()
            if op < 0.4:
                data[at:at] = rng.choice(_BITS)
            elif op < 0.7:
                del data[at:at + rng.randint(1, 4)]
            else:
                data[at:at + 1] = rng.choice(_BITS)
        yield bytes(data)


def test_mutated_events_read_as_the_line_path_reads_them_or_are_declined(parse):
    rng = random.Random(20261201)
    taken = declined = 0
    for event in _GOOD:
        line = events.encode(event)
        assert _check(parse, line), line  # the unmutated line is taken
        for data in _mutants(rng, line):
            if _check(parse, data):
                taken += 1
            else:
                declined += 1
    assert taken > 300 and declined > 5000


def _numbers(rng: random.Random):
    """Numbers as json writes them and as it reads them: short and long mantissas, exponents
    near and past Clinger's fast path (2^53, 10^22), subnormals, overflow, negative zero."""
    yield from ("0", "-0", "0.0", "-0.0", "1e22", "1e23", "9007199254740993.0",
                "9007199254740992.0", "4.35e-300", "5e-324", "1e-400", "1.7976931348623157e308",
                "1e309", "123456789012345678", "1234567890123456789", "-999999999999999999",
                "0.1", "0.30000000000000004", "1796129051.7643976", "1796129051.764397")
    for _ in range(4000):
        r = rng.random()
        if r < 0.3:
            yield repr(rng.uniform(-1e10, 1e10))
        elif r < 0.5:
            yield repr(rng.random() * 10 ** rng.randint(-30, 30))
        else:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 22)))
            digits = digits.lstrip("0") or "0"
            point = rng.randint(0, len(digits))
            text = digits if point == len(digits) or digits == "0" else \
                f"{digits[:point] or '0'}.{digits[point:]}"
            if rng.random() < 0.4:
                text += f"e{rng.randint(-30, 30)}"
            yield ("-" if rng.random() < 0.3 else "") + text


def test_numbers_read_exactly_as_json_reads_them(parse):
    rng = random.Random(7)
    floats = ints = 0
    for text in _numbers(rng):
        # a float field (`t`, int or float) and an int field (`seq`, int only)
        for name, data in (("t", '{"v":1,"kind":"heartbeat","t":%s,"pid":5,"seq":1,'
                                 '"uptime_s":1.0,"queue_depth":0,"errors":0}' % text),
                           ("seq", '{"v":1,"kind":"heartbeat","t":1.0,"pid":5,"seq":%s,'
                                   '"uptime_s":1.0,"queue_depth":0,"errors":0}' % text)):
            if _check(parse, data.encode()):
                value = getattr(parse(data.encode())[0], name)
                assert repr(value) == repr(json.loads(text)), text
                floats += type(value) is float
                ints += type(value) is int
    assert floats > 2000 and ints > 200


def test_text_escaped_or_in_utf8_reads_as_the_line_path_reads_it(parse):
    """json.dumps (events.encode) writes non-ASCII as \\u escapes, another writer UTF-8: both
    read as the line path reads them; invalid UTF-8 is declined."""
    event = events.Stall(t=1.0, pid=9, name="mé€😀", shape=[[1]], seconds=1.0, new_shape=False,
                         cause="compile")
    escaped = events.encode(event)
    assert b"\\u00e9" in escaped and _check(parse, escaped)
    raw = json.dumps(events.to_dict(event), ensure_ascii=False).encode()
    assert _check(parse, raw) and parse(raw)[0].name == "mé€😀"
    for bad in (b"\xff", b"\xed\xa0\x80", b"\xc3"):  # not UTF-8, a surrogate, cut short
        assert parse(raw.replace("é".encode(), bad)) is None
    for text in ('a"b', "a\nb", "a\\b", "a\x01b"):
        assert _check(parse, events.encode(events.GraphBreak(t=1.0, pid=2, reason=text,
                                                             location=None)))


def test_a_datagram_is_taken_whole_or_declined_whole(parse):
    rng = random.Random(3)
    good = [events.encode(e) for e in _GOOD]
    declined = [json.dumps(events.to_dict(_GOOD[0])).replace('"seq": 1', '"seq": 1.0').encode(),
                b'{"v":1,"kind":"heartbeat"}', b"", b"not json", b"1" * 19,
                events.encode(events.NewShape(t=1.0, pid=5, name="a", shape=[[1.5]],
                                              seconds=1.0, distinct=1))]
    for line in declined:
        assert parse(line) is None, line
    for _ in range(300):
        lines = [rng.choice(good) for _ in range(rng.randint(1, 30))]
        got = parse(b"\n".join(lines))
        assert got is not None and len(got) == len(lines)
        assert all(_same(g, events.decode(x)) for g, x in zip(got, lines))
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(declined))
        assert parse(b"\n".join(lines)) is None
    assert parse(b"\n".join(good) + b"\n") is None  # a blank line: the line path skips it
    too_long = good[1].replace(b'"m"', b'"' + b"x" * 70000 + b'"')
    assert len(too_long) > events.MAX_EVENT_BYTES
    assert parse(b"\n".join([good[0], too_long])) is None  # counted oversized by the line path


class _Probe(events.Event):
    """A kind of this test's own: its class and field names are referenced by nothing else
    (the schema's, such as "shape", change with whatever other threads hold)."""
    probe_sizes_x9: list[list[int]]
    probe_label_x9: str


