"""The event schema shared by the agent and the sidecar: versioned, stdlib only (orjson used where
installed), strict decode.

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
import itertools
import json
import math
import operator
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
    # the CUDA allocator's private pools (CUDA graphs'), read only where torch 2.15's
    # cudagraph_initial_mempool_allocation_gb primes the graph pool in one block: NVML then
    # counts the whole block from the start, and the growth is the pool's bytes in use
    pool_reserved_bytes: Optional[int] = None
    pool_active_bytes: Optional[int] = None
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
    """Inductor's "observed N distinct sizes" warning, a cudagraph skip, or (torch 2.15) a
    graph that hit `cudagraph_dynamic_shape_rerecord_limit`: its recorded sizes replay, new
    sizes run without a graph (`rerecord_limit`, `graph`: "<compile id> <mode>")."""
    message: str
    distinct_sizes: Optional[int]
    rerecord_limit: Optional[int] = None
    graph: Optional[str] = None
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
                                  # full GPU: cuDNN attention's `mha_graph.execute` fails
                                  # there without an OOM error)
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
    name: str                     # "graph_budget", "freeze", "recompile_guard" or "padding"
    action: str                   # "engaged" or "unavailable" (freeze: also "released");
                                  # padding: "engaged" (a first plan), "plan" (buckets
                                  # added), "refused" (padding changed an output, or
                                  # failed: off for that model), "signature_off" (a
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
    # where the checks' unpadded runs allocate (agent/pad/memory.py CheckMemory); None on a CPU
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
def to_dict(event: Event) -> dict[str, Any]:
    d = {"v": SCHEMA_VERSION, "kind": event.kind}
    d.update((name, getattr(event, name)) for name in _SPECS[event.kind].names_in_order)
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
    if _fast_loads is not None and type(data) is bytes and _LONG_INT not in data.translate(
            _DIGITS):
        try:  # orjson, where installed: what it accepts, json reads alike (below)
            obj = _fast_loads(data)
        except Exception:  # noqa: BLE001 (its error, for what json may yet read: json decides)
            pass
        else:
            return from_dict(obj)
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
    """The event of a decoded JSON object; any problem raises EventDecodeError, naming the
    first one: the version, the kind, an unknown field, then each field in the kind's order
    (missing, or a bad value), then the pid. A field with a default may be missing (an agent
    older than the field)."""
    if not isinstance(obj, dict):
        raise EventDecodeError("event is not a JSON object")
    v = obj.get("v", _MISSING)
    if type(v) is not int or v != SCHEMA_VERSION:  # 1.0 == True == 1 in Python, not here
        if v is _MISSING:
            raise EventDecodeError("no schema version `v`: not an agent event")
        raise EventDecodeError(f"unsupported schema version {v!r}")
    kind = obj.get("kind")
    spec = _SPECS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise EventDecodeError(f"unknown event kind {kind!r}")
    # in the fields' order (t, pid: Event's, then the kind's), each value: all of them where the
    # object has as many keys as the kind has names (then no key is unknown), else each one
    # or its default (_MISSING where it has none), once every key is known
    try:
        values = spec.get(obj) if len(obj) == spec.size else None
    except KeyError:  # as many keys, one of them unknown
        values = None
    if values is None:
        if not obj.keys() <= spec.names:
            extra = obj.keys() - spec.names
            raise EventDecodeError(f"{kind}: unknown field(s) {sorted(extra)}")
        values = tuple(map(obj.get, spec.names_in_order, spec.defaults))
    # every field's check: its value's type among those of its annotation (all fields at once:
    # one lookup among the rows of types they may have), then what the type leaves open (a
    # float finite, a list's items)
    if tuple(map(type, values)) not in spec.rows or not spec.rest(values):
        raise _first_problem(kind, spec, values)
    if values[1] <= 0:
        raise EventDecodeError(f"{kind}: bad pid")
    return spec.cls(*values)


def _first_problem(kind: Any, spec: _Spec, values: tuple[Any, ...]) -> EventDecodeError:
    """from_dict's error for the first field, in the kind's order, that is missing or fails
    its check (the same checks: the types, then the rest)."""
    rest = dict(spec.deep)
    fields = zip(spec.names_in_order, values, spec.types, strict=True)
    for i, (name, value, types) in enumerate(fields):
        if value is _MISSING:
            return EventDecodeError(f"{kind}: missing field {name!r}")
        if type(value) not in types or (i in rest and not rest[i](value)):
            return EventDecodeError(f"{kind}: field {name!r} has a bad value {value!r:.80}")
    raise AssertionError(f"{kind}: no bad field")  # pragma: no cover - from_dict found one


# A field's check, from its annotation: the types its value may have (exact: a bool is never
# an int; an int is a float) and, where the type does not settle it, the rest: a predicate
# true for a value of any other type, false for a float that is not finite or a list or dict
# with a bad item (None where the type settles it). Small closures built once per annotation:
# a call per field, or per item, was most of the decode time.
class _Check(typing.NamedTuple):
    types: frozenset[type]
    rest: Optional[Callable[[Any], bool]]


def _check_of(hint: Any) -> _Check:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:  # Optional[X], Scalar
        parts = [_check_of(arg) for arg in args]
        rests = [part.rest for part in parts if part.rest is not None]
        types = frozenset().union(*(part.types for part in parts))
        if len(rests) <= 1:  # each rest passes the other parts' types
            return _Check(types, rests[0] if rests else None)
        return _Check(types, lambda v: all(rest(v) for rest in rests))
    if origin is list:
        return _Check(frozenset([list]), _list_of(args[0]))
    if origin is dict:
        keys, items = _check_of(args[0]), _check_of(args[1])
        if keys.rest is not None:
            raise TypeError(f"dict keys of {hint}: only types that settle it")
        return _Check(frozenset([dict]), _dict_of(keys.types, items))
    if hint is float:
        return _Check(frozenset([float, int]), _finite)
    if not isinstance(hint, type):
        raise TypeError(f"no check for the annotation {hint!r}")
    return _Check(frozenset([hint]), None)


def _finite(v: Any) -> bool:
    return type(v) is not float or _isfinite(v)


def _list_of(hint: Any) -> Callable[[Any], bool]:
    """The rest of the check of a list of `hint`s: each item's, as a plain loop (a shape, a
    list of lists of ints, in two nested loops: no call per item)."""
    types, rest = _check_of(hint)
    if rest is None and len(types) == 1:
        return _list_of_type(next(iter(types)))
    inner = _check_of(typing.get_args(hint)[0]) if typing.get_origin(hint) is list else None
    if inner is not None and inner.rest is None and len(inner.types) == 1:
        return _lists_of_type(next(iter(inner.types)))

    def list_of(v: Any) -> bool:
        if type(v) is list:
            for x in v:
                if type(x) not in types or (rest is not None and not rest(x)):
                    return False
        return True

    return list_of


def _list_of_type(exact: type) -> Callable[[Any], bool]:
    def list_of_type(v: Any) -> bool:
        if type(v) is list:
            for x in v:
                if type(x) is not exact:
                    return False
        return True

    return list_of_type


def _lists_of_type(exact: type) -> Callable[[Any], bool]:
    def lists_of_type(v: Any) -> bool:
        if type(v) is list:
            for x in v:
                if type(x) is not list:
                    return False
                for y in x:
                    if type(y) is not exact:
                        return False
        return True

    return lists_of_type


def _dict_of(keys: frozenset[type], item: _Check) -> Callable[[Any], bool]:
    types, rest = item.types, item.rest

    def dict_of(v: Any) -> bool:
        if type(v) is dict:
            for k, x in v.items():
                if type(k) not in keys or type(x) not in types or \
                        (rest is not None and not rest(x)):
                    return False
        return True

    return dict_of


_MISSING: Any = object()  # a field with no default, not in the object
_isfinite = math.isfinite


class _Spec(typing.NamedTuple):
    """What from_dict needs of a kind: its class, the names an event may have (its fields,
    `v`, `kind`) and their number, and per field in order: its name, its default (or
    _MISSING), the types its value may have; the fields' values of a dict that has them all
    (`get`), every row of types the fields may have (a few hundred at most), and
    (index, rest) of the fields whose type does not settle it (_Check), and all those in one."""
    cls: type[Event]
    names: frozenset[str]
    size: int
    names_in_order: tuple[str, ...]
    defaults: tuple[Any, ...]
    types: tuple[frozenset[type], ...]
    get: Callable[[dict[str, Any]], tuple[Any, ...]]
    rows: frozenset[tuple[type, ...]]
    deep: tuple[tuple[int, Callable[[Any], bool]], ...]
    rest: Callable[[tuple[Any, ...]], bool]  # every one of `deep`'s checks, on the values


def _rest_of_fields(deep: tuple[tuple[int, Callable[[Any], bool]], ...],
                    ) -> Callable[[tuple[Any, ...]], bool]:
    """One call for every rest of a kind's fields, up to three inline (a loop over them was
    half their time), more in a chain."""
    if not deep:
        return lambda values: True
    (i, r), more = deep[0], deep[1:]
    if not more:
        return lambda values: r(values[i])
    (j, q), more = more[0], more[1:]
    if not more:
        return lambda values: r(values[i]) and q(values[j])
    (k, p), more = more[0], more[1:]
    if not more:
        return lambda values: r(values[i]) and q(values[j]) and p(values[k])
    tail = _rest_of_fields(more)
    return lambda values: r(values[i]) and q(values[j]) and p(values[k]) and tail(values)


def _spec(cls: type[Event]) -> _Spec:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    checks = [_check_of(hints[f.name]) for f in fields]
    names = tuple(f.name for f in fields)
    types = tuple(c.types for c in checks)
    get = operator.itemgetter(*names)  # two fields at least (t, pid): a tuple
    deep = tuple((i, c.rest) for i, c in enumerate(checks) if c.rest is not None)
    return _Spec(cls, frozenset(names + ("v", "kind")), len(names) + 2, names,
                 tuple(_MISSING if f.default is dataclasses.MISSING else f.default
                       for f in fields),
                 types, get, frozenset(itertools.product(*types)), deep, _rest_of_fields(deep))


_SPECS = {kind: _spec(cls) for kind, cls in KINDS.items()}
# scan_once: the decoder's C scanner, (value, end) of the JSON value at an offset; a real
# attribute (set in JSONDecoder.__init__) that the stubs do not declare
_SCAN: Callable[[str, int], tuple[Any, int]]
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
# orjson, where installed (the sidecar's dependency; an agent may lack it), parses an event
# several times faster than json and reads whatever it accepts as json does, except integers
# past 64 bits (as floats: from 19 digits on, for negative ones): data with a number of 19
# digits or more is json's alone (an event's numbers have at most 17 significant digits).
# What orjson refuses and json reads (a lone surrogate, NaN, 1e400) is json's too. The
# receiver reads the same three names for its datagrams.
_fast_loads: Optional[Callable[[bytes], Any]]
try:
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - where orjson is not installed: json alone
    _fast_loads = None
# every digit as "0", everything else as " ": a run of 19 zeros is a number that long
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_INT = b"0" * 19


def clip(text: Optional[str], limit: int = MAX_TEXT_CHARS) -> Optional[str]:
    """Bound a free-text field so one event always fits in a datagram."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"
