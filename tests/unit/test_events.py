import json
import math

import pytest

from torch_watchdog import events
from torch_watchdog.events import EventDecodeError

SAMPLES = [
    events.Hello(t=1.5, pid=7, torch="2.13.0", agent="0.1.0", devices=["GPU-1"],
                 config={"recompile_limit": 8, "triton.cudagraphs": False, "x": None, "y": 0.5,
                         "z": "s"},
                 capabilities={"compile_callbacks": True}, watched=["llm"], argv="serve.py"),
    events.Heartbeat(t=2.0, pid=7, seq=3, uptime_s=4.0, queue_depth=0, errors=0),
    events.Compile(t=2.0, pid=7, compile_id="0/0", function="forward (m.py:3)", seconds=1.25),
    events.Recompile(t=2.0, pid=7, compile_id="0/1", function=None, seconds=None,
                     reason="0/0: tensor 'x' size mismatch at index 1. expected 16, actual 32"),
    events.RecompileLimit(t=2.0, pid=7, function="f", limit=8, reason="r", compile_id=None),
    events.CudagraphRecord(t=2.0, pid=7, phase="record", compile_id="0/1", key=[32],
                           shape=[[1, 32]], seconds=0.007),
    events.CudagraphRecord(t=2.0, pid=7, phase="warmup", compile_id=None, key=None, shape=None,
                           seconds=None),
    events.CudagraphWarning(t=2.0, pid=7, message="observed 9 distinct sizes", distinct_sizes=9),
    events.GraphBreak(t=2.0, pid=7, reason="print", location="m.py:3"),
    events.NewShape(t=2.0, pid=7, name="llm", shape=[[1, 32], []], seconds=0.05, distinct=2),
    events.Stall(t=2.0, pid=7, name="llm", shape=[[1, 32]], seconds=6.5, new_shape=True,
                 cause="recompile"),
    events.Calls(t=2.0, pid=7, name="llm", calls=10, seconds=0.1, stall_calls=1,
                 stall_seconds=0.05, distinct_shapes=3, window_s=2.0),
    events.Oom(t=2.0, pid=7, source="allocator", device=0, requested_bytes=1 << 30,
               limit_bytes=1 << 37, free_bytes=1 << 20, message=None),
    events.Dropped(t=2.0, pid=7, reason="socket", count=3, total=10),
    events.Heartbeat(t=2.0, pid=7, seq=3, uptime_s=4.0, queue_depth=0, errors=0, lost=12),
    events.Mitigation(t=2.0, pid=7, name="graph_budget", action="engaged", detail="64 sizes"),
    events.Mitigation(t=2.0, pid=7, name="padding", action="refused", detail="off for llm",
                      model="llm", error=0.25, buckets=[64, 128]),
    events.Padding(t=2.0, pid=7, name="llm", on=True, buckets=[64, 128], calls=10,
                   padded_calls=9, real_tokens=500, padding_tokens=76, checks=2,
                   check_seconds=0.01, max_error={"float32": 2.5e-07}, recordings_saved=7),
    events.Drain(t=2.0, pid=7, phase="drained", grace_s=30.0, seconds=1.5, in_flight=0,
                 exit_code=75, detail="1 callback"),
    events.Warm(t=2.0, pid=7, action="loaded", path="/var/cache/torch-watchdog/x.bundle",
                bytes=4096, seconds=0.2, detail=None),
]


def test_every_kind_has_a_sample():
    assert {e.kind for e in SAMPLES} == set(events.KINDS)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_round_trip(event):
    data = events.encode(event)
    assert events.decode(data) == event
    assert events.decode(data.decode()) == event
    obj = json.loads(data)
    assert obj["v"] == events.SCHEMA_VERSION and obj["kind"] == event.kind


def _mutated(**changes):
    obj = events.to_dict(SAMPLES[2])
    obj.update(changes)
    return json.dumps(obj)


@pytest.mark.parametrize("data, why", [
    (b"not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (_mutated(v=2), "version"),
    (_mutated(v="1"), "version"),
    (_mutated(v=1.0), "version"),
    (_mutated(v=True), "version"),
    (b"hello", "not JSON"),
    (b"hello\n", "not JSON"),         # a line of text, as read from a file
    (b"\n", "not JSON"),
    (b"", "not JSON"),
    (b"  hello \n", "not JSON"),
    (b"1 2", "not JSON"),
    (_mutated(kind="explode"), "unknown event kind"),
    (_mutated(kind=None), "unknown event kind"),
    (_mutated(extra=1), "unknown field"),
    (_mutated(seconds="fast"), "bad value"),
    (_mutated(pid=True), "bad value"),
    (_mutated(pid=-1), "bad pid"),
    (_mutated(t=1e400), "bad value"),
    (_mutated(compile_id=3), "bad value"),
    (json.dumps({k: v for k, v in events.to_dict(SAMPLES[2]).items() if k != "function"}),
     "missing field"),
    (_mutated() + "x", "not JSON"),
    (_mutated() + _mutated(), "not JSON"),
    (_mutated(t=float("nan")), "bad value"),
    (_mutated(pid=1.5), "bad value"),
    (b" " * (events.MAX_EVENT_BYTES + 1), "exceeds"),
    (b"[" * 100000 + b"]" * 100000, "exceeds"),
])
def test_strict_decode_rejects_garbage(data, why):
    with pytest.raises(EventDecodeError, match=why):
        events.decode(data)


@pytest.mark.parametrize("wrap", [lambda d: d, lambda d: d + "\n", lambda d: "  " + d,
                                  lambda d: (d + "\r\n").encode()])
def test_blank_space_around_an_event_is_fine(wrap):
    assert events.decode(wrap(_mutated())) == SAMPLES[2]


def test_nested_types_are_checked():
    obj = events.to_dict(SAMPLES[9])
    obj["shape"] = [[1, "32"]]
    with pytest.raises(EventDecodeError):
        events.from_dict(obj)
    obj = events.to_dict(SAMPLES[0])
    obj["capabilities"] = {"x": 1}
    with pytest.raises(EventDecodeError):
        events.from_dict(obj)


def test_encode_refuses_nan_and_oversize():
    with pytest.raises(ValueError):
        events.encode(events.Heartbeat(t=math.nan, pid=1, seq=1, uptime_s=0, queue_depth=0,
                                       errors=0))
    with pytest.raises(ValueError):
        events.encode(events.GraphBreak(t=1.0, pid=1, reason="x" * events.MAX_EVENT_BYTES,
                                        location=None))


def test_clip_bounds_text():
    assert events.clip(None) is None
    assert events.clip("short") == "short"
    clipped = events.clip("x" * 5000)
    assert len(clipped) == events.MAX_TEXT_CHARS and clipped.endswith("…")


def _numeric_fields() -> list[tuple[events.Event, str]]:
    """(sample, field) for every field of every kind whose annotation takes a number."""
    import typing

    out = []
    for sample in SAMPLES:
        for name, hint in typing.get_type_hints(type(sample)).items():
            if name == "kind":
                continue
            args = typing.get_args(hint) or (hint,)
            if int in args or float in args:
                out.append((sample, name))
    return out


@pytest.mark.parametrize("sample, name", _numeric_fields(),
                         ids=lambda x: x if isinstance(x, str) else x.kind)
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_never_a_number(sample, name, value):
    obj = events.to_dict(sample)
    obj[name] = value
    with pytest.raises(EventDecodeError, match="bad value"):
        events.decode(json.dumps(obj))


def test_every_numeric_field_was_checked():
    fields = {(s.kind, name) for s, name in _numeric_fields()}
    assert ("heartbeat", "seq") in fields and ("oom", "requested_bytes") in fields
    assert ("compile", "seconds") in fields and len(fields) >= 30


# -- decode accepts and rejects exactly as before, with the same messages -----------------------
def _outcome(obj):
    try:
        event = events.from_dict(obj)
    except EventDecodeError as e:
        return "rejected", str(e)
    return "accepted", type(event).__name__, events.to_dict(event)


def _digest(objects) -> tuple[int, int, str]:
    """(cases, accepted, sha256 of every outcome's repr, in order)."""
    import hashlib

    h, cases, accepted = hashlib.sha256(), 0, 0
    for obj in objects:
        outcome = _outcome(obj)
        h.update(repr(outcome).encode())
        cases += 1
        accepted += outcome[0] == "accepted"
    return cases, accepted, h.hexdigest()


# values that probe every check: bool vs int vs float, non-finite floats, nested list shapes
_PROBES = [None, True, False, 0, 1, -3, 7, 2 ** 70, 1.0, 0.5, -0.0, math.nan, math.inf, -math.inf,
           "", "x", [], [1], [1, 2], [True], [1.5], [None], ["a"], [[]], [[1]], [[1, 2], [3]],
           [[True]], [[1.0]], [[None]], [1, [2]], [[1], 2], [["a"]], [[[1]]], {}, {"a": 1},
           {"a": True}, {"a": 1.5}, {"a": None}, {"a": "s"}, {"a": [1]}, {"a": math.nan},
           {1: 1}, (1, 2)]


def _differential_cases():
    import random

    rng = random.Random(1234)
    for sample in SAMPLES:
        good = events.to_dict(sample)
        yield good
        for name in good:
            for probe in _PROBES:
                yield {**good, name: probe}
            yield {k: x for k, x in good.items() if k != name}  # one field missing
        yield {**good, "extra": 1}
        for _ in range(200):  # several fields changed at once, in any order
            obj = dict(good)
            for name in rng.sample(sorted(good), rng.randint(1, 3)):
                obj[name] = rng.choice(_PROBES)
            items = list(obj.items())
            rng.shuffle(items)
            yield dict(items)
    yield from ([], None, 1, "x", {"kind": "heartbeat"}, {"v": 1, "kind": "nope"},
                {"v": 1, "kind": ["hello"]}, {"v": 1})


def fixture_lines():
    """Every line of the recorded fixtures (tests/fixtures), as bytes without its newline."""
    import glob
    import os

    from torch_watchdog import jsonl

    here = os.path.join(os.path.dirname(__file__), "..", "fixtures")
    paths = sorted(glob.glob(os.path.join(here, "*.jsonl*")))
    assert paths, "the recorded fixtures are missing"
    for path in paths:
        for line in jsonl.read_lines(path):
            line = line.encode() if isinstance(line, str) else line
            yield line.rstrip(b"\n")


def _fixture_objects():
    for line in fixture_lines():
        try:
            yield json.loads(line)
        except ValueError:
            continue


# The outcomes over _differential_cases() of f6d0dc7's decode (validators and builders generated
# per kind), hashed: the plain validator that replaced them gives every outcome alike, messages
# included. A change to SAMPLES or _PROBES changes the cases: check the outcomes, then the digest.
# (issue 52 added heartbeat's pool_reserved_bytes/pool_active_bytes and cudagraph_warning's
# rerecord_limit/graph, optional: their probes decode as the other optional fields do)
DIFFERENTIAL_DIGEST = (12804, 971,
                       "2b75d7c4e42f0539439c089db04a269cec09f5ed8ec3a40d5dd2161984275686")


def test_decode_accepts_and_rejects_as_before():
    cases, accepted, digest = _digest(_differential_cases())
    assert 0 < accepted < cases  # both outcomes were exercised
    assert (cases, accepted, digest) == DIFFERENTIAL_DIGEST


def test_recorded_fixtures_decode_to_what_they_say():
    """Every agent event of the recorded fixtures decodes to its own fields (those it lacks at
    their defaults); the rest are not agent events (other logs' lines)."""
    agent_events = 0
    for obj in _fixture_objects():
        outcome = _outcome(obj)
        if outcome[0] == "accepted":
            agent_events += 1
            assert outcome[2] == {**outcome[2], **obj}, obj
        else:
            assert "v" not in obj or obj.get("kind") not in events.KINDS or \
                obj["v"] != events.SCHEMA_VERSION, (obj, outcome)
    assert agent_events > 0
