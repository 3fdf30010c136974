"""The event schema shared by the agent and the sidecar: versioned, stdlib only, strict decode.

Every event is one JSON object with `v` (schema version), `kind`, `t` (wall-clock seconds since
the epoch, float) and `pid`, plus the fields of its kind. On the wire a datagram carries one or
more events, one per line (`\n`-separated), at most MAX_DATAGRAM_BYTES; the event log is the
same lines in a file. `decode` rejects anything else — an
unknown version or kind, a missing or extra field, a value of the wrong type — with
`EventDecodeError`, never another exception, so a receiver can count and drop garbage.
Fields added to a kind after its first release have a default and may be missing (logs written
by an older agent still decode); an older sidecar rejects them, so upgrade the sidecar first.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

SCHEMA_VERSION = 1
DEFAULT_SOCKET = "/run/torch-watchdog/events.sock"  # where the sidecar listens by default
# The agent truncates long strings well below this; a datagram is at most MAX_DATAGRAM_BYTES.
MAX_EVENT_BYTES = 64 * 1024
MAX_DATAGRAM_BYTES = MAX_EVENT_BYTES
MAX_TEXT_CHARS = 2000

Shape = list[list[int]]  # one list of sizes per tensor argument, in call order
Scalar = Union[str, int, float, bool, None]


class EventDecodeError(ValueError):
    """A datagram or log line that is not a valid event of this schema version."""


@dataclass(frozen=True)
class Event:
    t: float
    pid: int
    kind = "event"  # class attribute, overridden per kind; not a dataclass field


@dataclass(frozen=True)
class Hello(Event):
    """First event of an agent, re-sent periodically and when CUDA comes up."""
    torch: str
    agent: str
    devices: list[str]            # GPU UUIDs ("GPU-…") once CUDA is initialised, else []
    config: dict[str, Scalar]     # compile-relevant torch config (recompile_limit, …)
    capabilities: dict[str, bool]  # which hooks this torch version allowed
    watched: list[str]
    argv: str
    # the server this process belongs to (a group of processes reloaded together): install(
    # server=...), TORCH_WATCHDOG_SERVER, a torch.distributed job, the systemd unit, else
    # "pgid:<process group>", with "/cuda:<CUDA_VISIBLE_DEVICES>" (agent/identity.py); None
    # from agents older than the field
    server: Optional[str] = None
    ppid: Optional[int] = None    # the parent's pid: a forked worker names its master
    # the sender's uid, as the kernel told the sidecar's receiver (which also puts the
    # kernel's ppid in place of the agent's): set by the sidecar, never believed from an agent
    uid: Optional[int] = None
    kind = "hello"


def serve_deployment(server: str) -> Optional[str]:
    """`<application>/<deployment>` of a Ray Serve replica's name (`serve:app/Model/1`,
    agent/serve.py), else None: what alerts are grouped by across replicas and nodes."""
    if not server.startswith("serve:"):
        return None
    head, sep, rank = server[len("serve:"):].rpartition("/")
    return head if sep and head and rank.isdigit() else None


def per_start(server: str) -> Optional[tuple[str, str]]:
    """(kind, the rest) of an automatic server name that changes with each start
    (`pgid:7212/cuda:0` -> ("pgid", "cuda:0"), `dist:<addr>:<port>` -> ("dist", "")); None for
    a name that stays (a systemd service's, an explicit one). A restarted server named anew
    is known by it: the same kind and rest, under the same supervisor."""
    head, _, rest = server.partition("/")
    kind = head.partition(":")[0]
    if kind in ("pgid", "pid"):
        return "pgid", rest
    if kind in ("dist", "torchrun"):
        return "dist", rest
    return None


@dataclass(frozen=True)
class Heartbeat(Event):
    seq: int
    uptime_s: float
    queue_depth: int
    errors: int                   # internal agent errors so far (each was swallowed)
    # events this agent lost so far, every reason (drop reports that were lost themselves not
    # counted): cumulative in every heartbeat, so a lost drop report is told by the next
    # heartbeat even once nothing is dropped any more; None from agents older than the field
    lost: Optional[int] = None
    kind = "heartbeat"


@dataclass(frozen=True)
class Compile(Event):
    """A Dynamo compile of a frame seen for the first time."""
    compile_id: Optional[str]
    function: Optional[str]
    seconds: Optional[float]
    # Inductor FX-graph cache hits/misses of this compile (per-compile metrics where torch fills
    # them, else the change in torch's own cache counters; None where neither exists): a
    # restart without a persistent TORCHINDUCTOR_CACHE_DIR misses and compiles from scratch
    fx_cache_hits: Optional[int] = None
    fx_cache_misses: Optional[int] = None
    kind = "compile"


@dataclass(frozen=True)
class Recompile(Event):
    """A Dynamo compile of a frame that already had compiled code: a guard failed."""
    compile_id: Optional[str]
    function: Optional[str]
    seconds: Optional[float]
    reason: Optional[str]
    fx_cache_hits: Optional[int] = None
    fx_cache_misses: Optional[int] = None
    kind = "recompile"


@dataclass(frozen=True)
class RecompileLimit(Event):
    """Dynamo gave up recompiling a frame: new inputs now run eager, silently."""
    function: Optional[str]
    limit: Optional[int]
    reason: Optional[str]
    compile_id: Optional[str]
    kind = "recompile_limit"


@dataclass(frozen=True)
class CudagraphRecord(Event):
    """phase "warmup": 1st call of a new size (no memory yet); "record": the graph is captured."""
    phase: str
    compile_id: Optional[str]
    key: Optional[list[int]]      # the cudagraph tree's symint key; None: no symints or unknown
    shape: Optional[Shape]        # the watched call's input shapes, when inside watch()
    seconds: Optional[float]
    kind = "cudagraph_record"


@dataclass(frozen=True)
class CudagraphWarning(Event):
    """Inductor's "observed N distinct sizes" warning, or a cudagraph skip."""
    message: str
    distinct_sizes: Optional[int]
    kind = "cudagraph_warning"


@dataclass(frozen=True)
class GraphBreak(Event):
    reason: str
    location: Optional[str]
    kind = "graph_break"


@dataclass(frozen=True)
class NewShape(Event):
    name: str
    shape: Shape
    seconds: float                # wall time of that first call
    distinct: int                 # distinct shapes this watched callable has seen
    kind = "new_shape"


@dataclass(frozen=True)
class Stall(Event):
    name: str
    shape: Shape
    seconds: float
    new_shape: bool
    cause: Optional[str]          # "compile", "recompile", "cudagraph_warmup", "cudagraph_record"
    kind = "stall"


@dataclass(frozen=True)
class Calls(Event):
    """Per watched callable, the calls since the previous Calls event."""
    name: str
    calls: int
    seconds: float
    stall_calls: int
    stall_seconds: float
    distinct_shapes: int
    window_s: float
    kind = "calls"


@dataclass(frozen=True)
class Oom(Event):
    source: str                   # "allocator" (OOM observer), "exception" (an OOM error leaving
                                  # watch()) or "crash" (a CUDA/cuDNN/cuBLAS error on a nearly
                                  # full GPU: FACTS #17 saw cuDNN's mha_graph fail, not an OOM)
    device: Optional[int]
    requested_bytes: Optional[int]
    limit_bytes: Optional[int]
    free_bytes: Optional[int]
    message: Optional[str]
    kind = "oom"


@dataclass(frozen=True)
class Dropped(Event):
    reason: str                   # "queue_full", "socket", "log"
    count: int                    # since the previous Dropped event of this reason
    total: int                    # since the agent started
    kind = "dropped"


@dataclass(frozen=True)
class Mitigation(Event):
    name: str                     # "graph_budget", "recompile_guard" or "padding"
    action: str                   # "engaged" or "unavailable"; padding: "engaged" (a first
                                  # plan), "plan" (buckets added), "refused" (padding changed an
                                  # output, or failed: off for that model), "signature_off" (a
                                  # padded call failed where the unpadded one did not: off for
                                  # that call signature), "caller_error" (a call failed padded
                                  # and unpadded alike: the caller's; padding stays on; once per
                                  # exception type), "checks_capped" (sampled checks stopped),
                                  # "check_pool_off" (no private pool)
    detail: str
    model: Optional[str] = None   # padding: the watched model
    error: Optional[float] = None  # padding refused: the relative error seen at real positions
    buckets: Optional[list[int]] = None  # padding: the plan
    kind = "mitigation"


@dataclass(frozen=True)
class Padding(Event):
    """Per padded model (`watch(..., pad=...)`), every heartbeat with calls: totals since the
    model was wrapped."""
    name: str
    on: bool                      # False once a check refused padding
    buckets: list[int]            # the plan
    calls: int                    # calls with a length the policy read
    padded_calls: int             # of them, calls served through a bucket
    real_tokens: int              # their real lengths, summed
    padding_tokens: int           # the padding added to them (compute spent on padding)
    checks: int                   # calls also run unpadded and compared
    check_seconds: float          # the time those unpadded runs and comparisons took
    max_error: dict[str, float]   # the largest relative error seen, per output dtype
    recordings_saved: int         # lengths served through a bucket less the buckets used
    # where the checks' unpadded runs allocate (agent/pad.py CheckMemory); None on a CPU
    check_pool: Optional[str] = None        # "released" | "kept" | "shared"
    check_pool_bytes: Optional[int] = None  # the largest a check's allocations reserved
    check_left_bytes: Optional[int] = None  # reserved memory sampled checks left behind
    checks_skipped: Optional[int] = None    # sampled checks not run (memory bounds, below)
    checks_stopped: Optional[str] = None    # why sampled checks stopped (the cap), if they did
    kind = "padding"


@dataclass(frozen=True)
class Drain(Event):
    """A cooperative drain (reload method `agent`, agent/drain.py): "draining" when the sidecar
    asked (ready() is False from then on), "drained" right before the process exits."""
    phase: str                    # "draining" | "drained"
    grace_s: float                # the longest the agent waits for the calls in hand
    seconds: Optional[float] = None   # drained: from the request to the exit
    in_flight: Optional[int] = None   # drained: watched calls still running (0: all finished)
    exit_code: Optional[int] = None   # drained: the code the process exits with
    detail: Optional[str] = None
    kind = "drain"


@dataclass(frozen=True)
class Warm(Event):
    """The compile-artifact bundle (agent/warm.py): loaded at install, saved after warm-up and
    before a planned exit, or skipped (mismatched, corrupt, unsupported) with the reason."""
    action: str                   # "loaded" | "saved" | "skipped" | "missing"
    path: Optional[str]
    bytes: Optional[int]
    seconds: Optional[float]
    detail: Optional[str]
    kind = "warm"


KINDS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (Hello, Heartbeat, Compile, Recompile, RecompileLimit, CudagraphRecord,
                CudagraphWarning, GraphBreak, NewShape, Stall, Calls, Oom, Dropped, Mitigation,
                Padding, Drain, Warm)
}
_HINTS = {kind: typing.get_type_hints(cls) for kind, cls in KINDS.items()}
_FIELDS = {kind: [f.name for f in dataclasses.fields(cls)] for kind, cls in KINDS.items()}
_DEFAULTS = {kind: {f.name: f.default for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING} for kind, cls in KINDS.items()}


def to_dict(event: Event) -> dict[str, Any]:
    d = {"v": SCHEMA_VERSION, "kind": event.kind}
    d.update((name, getattr(event, name)) for name in _FIELDS[event.kind])
    return d


def encode(event: Event) -> bytes:
    """One compact JSON object, UTF-8. Raises ValueError if it exceeds MAX_EVENT_BYTES."""
    data = json.dumps(to_dict(event), separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_EVENT_BYTES:
        raise ValueError(f"{event.kind} event is {len(data)} bytes, over {MAX_EVENT_BYTES}")
    return data


def decode(data: Union[bytes, str]) -> Event:
    """Parse and validate one event; any problem raises EventDecodeError."""
    if len(data) > MAX_EVENT_BYTES:
        raise EventDecodeError(f"event of {len(data)} bytes exceeds {MAX_EVENT_BYTES}")
    try:
        text = data.decode() if isinstance(data, (bytes, bytearray)) else data
        try:  # the C scanner alone: half the time of json.loads (no encoding sniffing)
            obj, end = _SCAN(text, 0)
        except StopIteration:  # not a JSON value at offset 0: leading blanks, or garbage
            obj, end = json.loads(text), len(text)  # valid after blanks; garbage raises here
        if end != len(text) and not text[end:].isspace():
            obj = json.loads(text)  # trailing garbage raises here
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise EventDecodeError(f"not JSON: {e}") from None
    return from_dict(obj)


def from_dict(obj: Any) -> Event:
    # the common case, a valid event with every field: one generated function checks and
    # builds it; anything else takes the path below, which says what is wrong
    if type(obj) is dict:
        kind = obj.get("kind")
        if type(kind) is str:
            build = _BUILDERS.get(kind)
            if build is not None:
                event = build(obj)
                if event is not None:
                    return event
    if type(obj) is not dict and not isinstance(obj, dict):
        raise EventDecodeError("event is not a JSON object")
    if "v" not in obj:
        raise EventDecodeError("no schema version `v`: not an agent event")
    v = obj["v"]
    if type(v) is not int or v != SCHEMA_VERSION:  # 1.0 == True == 1 in Python, not here
        raise EventDecodeError(f"unsupported schema version {v!r}")
    kind = obj.get("kind")
    spec = _SPECS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise EventDecodeError(f"unknown event kind {kind!r}")
    assert isinstance(kind, str)  # spec is None unless kind is a str
    cls, size, check = spec
    if len(obj) != size:
        extra = set(obj) - set(_FIELDS[kind]) - {"v", "kind"}
        if extra:
            raise EventDecodeError(f"{kind}: unknown field(s) {sorted(extra)}")
        obj = {**_DEFAULTS[kind], **obj}  # fields added later may be missing
    try:
        bad = check(obj)
    except KeyError as e:
        raise EventDecodeError(f"{kind}: missing field {e.args[0]!r}") from None
    if bad is not None:
        raise EventDecodeError(f"{kind}: field {bad!r} has a bad value {obj[bad]!r:.80}")
    if obj["pid"] <= 0:
        raise EventDecodeError(f"{kind}: bad pid")
    # every field is checked: fill the frozen instance directly, skipping the dataclass
    # __init__ (one object.__setattr__ per field: most of the decode time at 1,000 events/s)
    event = object.__new__(cls)
    fields = event.__dict__
    fields.update(obj)
    del fields["v"], fields["kind"]
    return event


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A fast predicate for one field's annotation (built once per kind, at import).
    bool is never an int; an int is a float; floats must be finite."""
    origin = typing.get_origin(hint)
    if origin is Union:
        parts = [_checker(arg) for arg in typing.get_args(hint)]
        return lambda v: any(p(v) for p in parts)
    if origin is list:
        item = _checker(typing.get_args(hint)[0])
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict:
        key, item = (_checker(a) for a in typing.get_args(hint))
        return lambda v: type(v) is dict and all(key(k) and item(x) for k, x in v.items())
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: type(v) is bool
    if hint is int:
        return lambda v: type(v) is int
    if hint is float:
        return lambda v: (type(v) is float and math.isfinite(v)) or type(v) is int
    return lambda v: type(v) is hint


def _inline(hint: Any, v: str = "v", finite: bool = False) -> Optional[str]:
    """The check of a scalar field as a Python expression on variable `v` (None: not a
    scalar). `finite`: the parser never gives inf or nan (orjson refuses them)."""
    if hint in (int, bool, str):
        return f"type({v}) is {hint.__name__}"
    if hint is float:
        return f"(type({v}) is float or type({v}) is int)" if finite else \
            f"((type({v}) is float and _finite({v})) or type({v}) is int)"
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union and len(args) == 2 and type(None) in args:
        inner = _inline(next(a for a in args if a is not type(None)), v, finite)
        return None if inner is None else f"({v} is None or {inner})"
    return None


def _statements(hint: Any, var: str, name: str, indent: str, depth: int = 0,
                finite: bool = False) -> Optional[list[str]]:
    """Lines that `return name` unless `var` matches `hint`: scalars inline, lists as plain
    loops (a generator per list was a third of a cudagraph_record's decode), None if neither."""
    inline = _inline(hint, var, finite)
    if inline is not None:
        return [f"{indent}if not {inline}: return {name!r}"]
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) is Union and len(args) == 2 and type(None) in args
    inner = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(inner) is not list:
        return None
    item = f"x{depth}"
    if optional:
        head, indent = [f"{indent}if {var} is not None:"], indent + "    "
    else:
        head = []
    body = _statements(typing.get_args(inner)[0], item, name, indent + "    ", depth + 1,
                       finite)
    if body is None:
        return None
    return head + [f"{indent}if type({var}) is not list: return {name!r}",
                   f"{indent}for {item} in {var}:"] + body


def _check_lines(kind: str, indent: str = "    ", finite: bool = False) -> list[str]:
    """The statements of `_validator`'s check: each returns the name of a bad field."""
    lines = []
    for name in _FIELDS[kind]:
        lines.append(f"{indent}v = o[{name!r}]")
        body = _statements(_HINTS[kind][name], "v", name, indent, finite=finite)
        lines += body if body is not None else \
            [f"{indent}if not _nested[{name!r}](v): return {name!r}"]
    return lines


def _namespace(kind: str) -> dict[str, Any]:
    return {"_finite": math.isfinite,
            "_nested": {name: _checker(_HINTS[kind][name]) for name in _FIELDS[kind]}}


def _validator(kind: str) -> Callable[[dict[str, Any]], Optional[str]]:
    """One generated function per kind: the name of the first bad field, or None; KeyError
    for a missing one. Scalar checks are inlined (a call per field was half the decode time),
    lists of scalars or lists are loops; dicts use `_checker`'s predicates."""
    lines = ["def check(o):"] + _check_lines(kind) + ["    return None"]
    namespace = _namespace(kind)
    exec("\n".join(lines), namespace)  # noqa: S102 (our own field names, built at import)
    namespace["check"].source = "\n".join(lines)
    check: Callable[[dict[str, Any]], Optional[str]] = namespace["check"]
    return check


def _builder(kind: str, finite: bool = False) -> Callable[[dict[str, Any]], Optional[Event]]:
    """One generated function per kind: the event of a dict holding every field of the kind,
    each valid (`_validator`'s checks, inlined), else None (from_dict's checks then say why).
    A dict of the kind's size with a field missing has an unknown one: None too. `finite`:
    for a parser that never gives inf or nan (FINITE_BUILDERS)."""
    checks = [line.rsplit(" return ", 1)[0] + " return None" if " return " in line else line
              for line in _check_lines(kind, "        ", finite)]
    lines = ["def build(o):",
             f"    if len(o) != {len(_FIELDS[kind]) + 2}: return None",
             "    v = o.get('v')",
             f"    if type(v) is not int or v != {SCHEMA_VERSION}: return None",
             "    try:"] + checks + [
             "    except KeyError: return None",
             "    if o['pid'] <= 0: return None",
             "    event = _new(_cls)",
             "    fields = event.__dict__",
             "    fields.update(o)",
             "    del fields['v'], fields['kind']",
             "    return event"]
    namespace = {**_namespace(kind), "_new": object.__new__, "_cls": KINDS[kind]}
    exec("\n".join(lines), namespace)  # noqa: S102 (our own field names, built at import)
    namespace["build"].source = "\n".join(lines)
    build: Callable[[dict[str, Any]], Optional[Event]] = namespace["build"]
    return build


_VALIDATORS = {kind: _validator(kind) for kind in KINDS}
_BUILDERS = {kind: _builder(kind) for kind in KINDS}
# kind -> the builder for a dict from orjson, which refuses NaN, Infinity and numbers past a
# double's range (json's parser takes them): no isfinite() per float (the receiver's path)
FINITE_BUILDERS = {kind: _builder(kind, finite=True) for kind in KINDS}
# kind -> (class, fields + `v` + `kind`, validator): one lookup per event
_SPECS = {kind: (cls, len(_FIELDS[kind]) + 2, _VALIDATORS[kind]) for kind, cls in KINDS.items()}
# scan_once: the decoder's C scanner, (value, end) of the JSON value at an offset; a real
# attribute (set in JSONDecoder.__init__) that the stubs do not declare
_SCAN: Callable[[str, int], tuple[Any, int]]
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def clip(text: Optional[str], limit: int = MAX_TEXT_CHARS) -> Optional[str]:
    """Bound a free-text field so one event always fits in a datagram."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"
