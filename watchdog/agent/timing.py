"""watch(): a drop-in wrapper that times each call and notes its input shapes, with no GPU sync.

The hot path reads tensor `.shape` (host metadata, no device access), two `perf_counter`
calls and a comparison or set lookup; events are built only on the slow path — a shape seen
for the first time or a call over the stall threshold. Stalls from warm-up, recording and
recompiles are CPU-visible (FACTS #4), so wall time around the call is enough.

Nothing the bookkeeping meets (hostile arguments, unreadable or unhashable shapes, a failing
emit) reaches the caller: a watched call returns what the model returned and raises only what
the model raised, the same object. A call that fails with a CUDA/cuDNN/cuBLAS error while its
GPU is nearly full is reported as an `oom` event of source "crash" (`crash_is_oom`).
"""
from __future__ import annotations

import collections
import functools
import gc
import itertools
import keyword
import os
import sys
import threading
import time
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Optional

from torch_watchdog import events, pure_python
from torch_watchdog.agent.forks import _AFTER_FORK

# watch()'s hot path in C (_hotpath.c: `model(x)` and `model(a=, b=)` with tensors, no Python
# frame), built where a C compiler was at install; without it, or with
# TORCH_WATCHDOG_PURE_PYTHON=1 (set before the agent is imported), the same path in Python
# below (_make_call) serves every call.
_hotpath: Any = None
if not pure_python():
    try:
        from torch_watchdog.agent import _hotpath
    except ImportError:  # not built here (no compiler at install, a free-threaded CPython)
        _hotpath = None

# Per serving thread, written by hooks.py (rare): `activity`/`activity_ns` of the last compile
# or cudagraph step, `oom_ns` of the last OOM seen. Read by watch() on its slow path only.
tls = threading.local()

def current_shape() -> Any:
    """The signature of the watched call in progress on this thread (the innermost one), else
    that of one in progress on another thread (best effort), else None. The C path keeps a
    per-thread stack of its calls' signatures (a push and a pop in C, a few ns a call; a call
    it hands to the Python path is marked there); the Python path's are read from the call's
    own frame (its `sig` local), so that path writes nothing for it. Why: the readers are rare
    (hooks.py tags a cudagraph warm-up or recording, drain.py polls every 5 ms while draining)
    and a shared slot written twice per call cost ~10 ns a write on every call (a
    thread-local ~50 ns) in Python. A walk costs ~1 us per 20 frames, paid by the reader
    only; it is also exact per thread, where the slot was the last writer's."""
    try:
        if _hotpath is not None:
            where, shape = _hotpath.current()
            if where == 1:  # the innermost call on this thread is the C path's
                return shape
        shape = _shape_in(sys._getframe(1))
        if shape is not _NO_ARG:
            return shape
        me = threading.get_ident()
        for ident, frame in list(sys._current_frames().items()):
            if ident != me:
                shape = _shape_in(frame)
                if shape is not _NO_ARG:
                    return shape
        if _hotpath is not None:
            anywhere, here, shape = _hotpath.everywhere()
            if anywhere > here:  # another thread's call on the C path: the last one begun
                return shape
    except Exception:
        pass
    return None


def calls_in_flight() -> bool:
    """Is a watched call in progress on any thread (drain.py's question)? Exact on the C path
    (a count), whatever the signature; else a frame of the Python path."""
    try:
        if _hotpath is not None and _hotpath.everywhere()[0] > 0:
            return True
    except Exception:
        pass
    return current_shape() is not None


def _shape_in(frame: Any) -> Any:
    """The `sig` of the innermost watched call on this stack (None before it is read), or
    _NO_ARG if there is none."""
    while frame is not None:
        if frame.f_code is _CALL_CODE:
            names = frame.f_locals
            if "sig" in names:
                return names["sig"]
            if "sb" in names:  # two keyword arguments: the tuple is built only on a miss
                return names["sa"], names["sb"]
            return None
        frame = frame.f_back
    return _NO_ARG


# What the installed agent tells every watched callable. Module globals, not attributes of an
# object: the hot path reads them on every call and a global read is the cheapest there is.
def _discard(event: events.Event) -> None:
    return None


INERT = {"emit": _discard, "emit_later": None, "stall_ns": 50_000_000, "max_shapes": 65_536,
         "route_eager": False}
emit: Callable[[events.Event], None] = _discard
# The emitter's emit_later (install() sets it): new_shape events are queued as tuples of
# untracked values and built on the sender thread; None: built here and given to `emit`.
emit_later: Optional[Callable[[tuple], None]] = None
stall_ns: int = INERT["stall_ns"]
stall_s: float = stall_ns / 1e9  # the same, for the hot path's clock (seconds, see _make_call)
max_shapes: int = INERT["max_shapes"]
route_eager: bool = False  # graph budget in "eager" mode: novel shapes skip the compiler
if _hotpath is not None:
    _hotpath.configure(stall_s, route_eager)


def configure(**settings: Any) -> None:
    """Set emit / emit_later / stall_ns / max_shapes / route_eager (install() and the
    mitigations do)."""
    unknown = set(settings) - set(INERT)
    if unknown:
        raise TypeError(f"unknown runtime setting(s) {sorted(unknown)}")
    globals().update(settings)
    globals()["stall_s"] = stall_ns / 1e9
    if _hotpath is not None:
        _hotpath.configure(stall_s, bool(route_eager))


def reset() -> None:
    """Back to inert: watched callables keep working and send nowhere."""
    configure(**INERT)


watched: "weakref.WeakSet[Watched]" = weakref.WeakSet()


# Nested containers (a list of tensors, a BatchEncoding) are read up to this many items: a
# signature must cost the same whatever the caller passes (a list of 10,000 tensors would add
# ~2 ms a call).
MAX_NESTED = 64

# Signatures remembered as new shapes are stored as plain tuples of ints (`_key`), never as the
# torch.Size objects the calls produce. Why: a torch.Size is a tuple *subclass*, which the GC
# never untracks, so 65,536 remembered shapes were 65,536 more tracked objects in the oldest
# generation; their promotion set off a full collection of the whole heap (torch alone is
# ~165,000 tracked objects) inside a watched call: 115-141 ms, against 1.5-6 ms for the worst
# bare call in the same loop (benchmarks/agent_overhead.py, "gc"). An exact tuple of ints is
# untracked by the first young collection it meets, so the set adds nothing for the GC to walk
# or count, and a torch.Size still finds its tuple (same hash, equal), so lookups convert nothing.
# The same burst also queued one NewShape event per shape (an event and 1 + n lists, all
# tracked); held until the sender's next tick they reached the oldest generation too (108,000
# lists and 54,000 events per 131,000 calls) and set off the 216-354 ms full collections seen
# with the agent installed. So new_shape events are rationed per watched callable: a burst of
# NEW_SHAPE_BURST, then NEW_SHAPE_PER_S; shapes past the ration are still remembered and
# counted (`distinct` of the next new_shape, `distinct_shapes` of every calls event), and a
# stall on one still says new_shape. (The emitter's 10,000-event queue dropped them anyway.)
# A burst of 1,000 events (3,000 tracked objects, waiting for the sender's next tick) was
# still the biggest thing in the first gen-1 collection after it: 0.23-0.34 ms of CPU inside
# one watched call; with 256, 0.12-0.19 ms (2-core VM, benchmarks/agent_overhead.py's loop).
# Past the burst, a shape a millisecond still gets its event.
NEW_SHAPE_BURST = 256
NEW_SHAPE_PER_S = 1000
# No set of shapes grows past HOT_SHAPES either: a set's table is reallocated and rehashed as
# it grows, and the step at 19,661 entries (to 131,072 slots, 2 MB) took 1.9 ms of CPU inside
# the call that added the shape (0.48 ms at 4,916; 0.12 ms at 1,229; the worst bare call of
# the benchmark's 500,000 is ~0.12 ms of CPU). The first HOT_SHAPES shapes stay in the one set
# every call looks in (a 2,048-slot table holds up to 1,228 entries); later ones go to the
# cold memory, looked in only when the hot set misses: shards of ~COLD_SHARD_SHAPES keys each,
# picked by hash, for the same reason (one dict of 65,536 keys took 2-3 ms to grow).
#
# Each cold shard is a dict from hash(key) to the key, and it holds only *untracked* objects
# (ints, and tuples a collection has already untracked), so the dict itself stays untracked:
# no collection ever walks it. Why: a set is always a tracked container, and a collection of
# the generation holding it visits every entry (a cache miss each: ~70 ns). The cold sets this
# replaces (64 shards of up to 1,024 keys, made when the hot set filled) were still young when
# they took their first ~7,000 keys, and the gen-1 collection that promoted them cost
# 0.36-0.57 ms of CPU inside one watched call, the worst of 500,000 (~7,000 cache misses).
# A fresh key is still tracked, and inserting a tracked object would track the dict again
# (MAINTAIN_TRACKING), into the youngest generation, until the next *full* collection; so a
# fresh key waits in `fresh` (a set, and a deque in the order of arrival, both at most ~one
# young generation of keys: the first young collection after a key is made untracks it) and
# moves to a dict once untracked. Two serving threads adding at once may move a still-tracked
# key: the dict is then tracked again (slower collections, never a wrong answer). Hash
# collisions are resolved by probing (`_probe`), so the memory stays exact: equal shapes are
# one key, distinct shapes two, as in a set. With the GC disabled nothing is untracked and
# `fresh` holds the keys past the hot set (bounded by max_shapes, as before).
#
# Measured (benchmarks/agent_overhead.py --only gc --gc-trials 3, 2-core VM shared with other
# jobs, old and new run alternately, 4 and 3 runs; CPU time, since the wall-clock worst of the
# *bare* calls was 0.3-4.4 ms from other jobs' preemption): worst watched call, median of the
# trials, sets 0.45-0.62 ms, untracked dicts (and a burst of 256) 0.19-0.24 ms, worst bare
# 0.05-0.20 ms; the longest gen-1 collection inside a watched call 0.48-0.62 ms before,
# 0.18-0.26 ms after (what is left is the young objects of the queued new_shape events).
HOT_SHAPES = 1228
COLD_SHARD_SHAPES = 1024
# A collection untracks a whole young generation of fresh keys at once (~700); moving them all
# in the next add took 0.3-1.1 ms of CPU in that call. A few per add keep `fresh` drained
# (one key arrives per add) and each add's share small.
SETTLE_PER_ADD = 4


def shape_signature(args: tuple, kwargs: dict, tensor_type: type) -> tuple:
    """One entry per argument, positional then keyword in call order: a tensor's shape, a tuple
    of shapes for a list/tuple/dict of tensors (e.g. a tokenizer's BatchEncoding), else None.
    Never raises: an argument that cannot be read is None."""
    try:
        parts = [a.shape if type(a) is tensor_type else _other(a, tensor_type) for a in args]
        if kwargs:
            parts += [a.shape if type(a) is tensor_type else _other(a, tensor_type)
                      for a in kwargs.values()]
        return tuple(parts)
    except Exception:  # a hostile argument: read each one on its own
        return tuple([_entry(a, tensor_type) for a in _values(args, kwargs)])


def _values(args: tuple, kwargs: dict) -> list:
    try:
        return [*args, *kwargs.values()]
    except Exception:
        return list(args)


def _entry(a: Any, tensor_type: type) -> Any:
    try:
        return a.shape if type(a) is tensor_type else _other(a, tensor_type)
    except Exception:
        return None


def _other(a: Any, tensor_type: type) -> Any:
    if isinstance(a, tensor_type):
        return a.shape
    if isinstance(a, dict):
        a = list(itertools.islice(a.values(), MAX_NESTED))
    elif isinstance(a, (list, tuple)):
        a = a[:MAX_NESTED]
    else:
        return None  # never iterate anything else: a generator would be consumed
    return tuple([x.shape for x in a if isinstance(x, tensor_type)]) or None


def _dims(shape: Any) -> Optional[tuple]:
    """A shape as an exact tuple of ints (GC-untracked), or None if it is not one."""
    if not isinstance(shape, tuple):
        return None
    dims = tuple(shape)
    for d in dims:
        if type(d) is not int:
            return None  # SymInt, a hijacked `.shape`: not a shape to remember
    return dims


def _key(sig: Any) -> Optional[tuple]:
    """The signature to remember: equal to `sig` and of the same hash, made of exact tuples,
    ints and None only (nothing the GC tracks); None if `sig` is not a signature."""
    if type(sig) is not tuple:  # a torch.Size, from the one-tensor path
        return _dims(sig)
    out = []
    for entry in sig:
        if entry is None:
            out.append(None)
        elif type(entry) is tuple:  # the shapes inside one list/tuple/dict argument
            inner = [_dims(s) for s in entry]
            if None in inner:
                return None
            out.append(tuple(inner))
        else:
            dims = _dims(entry)
            if dims is None:
                return None
            out.append(dims)
    return tuple(out)  # exact tuples of ints and None: young collections untrack it


def as_shape(sig: Any) -> events.Shape:
    """A signature as the schema's list of shapes (arguments without tensors left out)."""
    if type(sig) is not tuple or (sig and not isinstance(sig[0], (tuple, type(None)))):
        return [list(sig)]  # one shape, from the single-argument fast path
    out: events.Shape = []
    for entry in sig:
        if type(entry) is tuple:
            out.extend(list(x) for x in entry)
        elif entry is not None:
            out.append(list(entry))
    return out


_NO_ARG = object()  # "no first positional argument" for the hot path's signature


def _unset(*args: Any, **kwargs: Any) -> None:  # a Watched's callable until _start()
    raise TypeError("a Watched made without watch()")


def _make_call(h: "_Hot", ref: "weakref.ref[Watched]"
               ) -> tuple[Callable, Callable[[], tuple[int, int]]]:
    """The hot path of one watched callable (the function its Watched calls, see Watched), and
    a reader of its running totals (calls, total ns): one exact-type check, `.shape`, two
    clock reads, one comparison (or set lookup), two counters. `ref`: the Watched, for the
    slow paths only (a strong reference would make a cycle: the Watched holds this function).

    Measured choices (thread CPU time on a shared 2-core VM, where `x.shape` alone costs
    ~130 ns, a clock read 60-100 ns, `sig in seen` ~80 ns and calling an instance ~65 ns: the
    floor of the +500 ns target is there): a call with one tensor binds it to a
    positional-only parameter and calls `fn(x)`, not `fn(*args, **kwargs)` (~150 ns less), on
    a branch of its own that builds no tuple; a signature equal to the last known one skips
    the set lookup (`sig == last` ~45 ns: consecutive calls of one shape, as decode steps
    are); the counters and what the call reads are closure variables (~30 ns less than
    attributes of an object); two keyword arguments are read unrolled (~40 ns less than a
    loop, ~300 ns less than a helper with two comprehensions). Try blocks cost nothing until
    they catch (Python 3.11+). Against the previous version in the same batches
    (benchmarks/agent_overhead.py --baseline, medians of 5 runs): 0.91-0.96x of its added time.
    Then (issue 11's last targets): nothing written per call for `current_shape()` (two slot
    writes: its rare readers walk the frames instead); `last` rebound only when it changes;
    the clock is `perf_counter()` (floats come from a free list; perf_counter_ns's ints and
    their arithmetic were ~8 % of the added time, 3.11); two keyword arguments read by their
    remembered names (unpacking `kwargs.values()` ~76 ns, two subscripts ~30 ns), their
    shapes compared one by one (no tuple on a hit) and passed on through `_caller` (not
    `fn(**kwargs)`, which copies the dict and unpacks it again: 240 ns against 107 ns, 3.12);
    no `self` parameter (the function is called through functools.partial's vectorcall, see
    Watched). Added time against main's in the same batches (2026-12-01, 2-core VM, CPython
    3.11, torch 2.13, --baseline, medians of 3 runs, 4 invocations): model(x) 0.89-0.92x,
    model(x=, mask=) 0.85-0.86x; through fn(*args, **kwargs) 0.89-0.92x and 0.83-0.86x. On
    CPython 3.12 (no torch there: benchmarks/watch_stand_in.py, a stand-in tensor),
    where partial's vectorcall is inherited, 0.81-0.85x and 0.68-0.72x (0.85-0.90x and
    0.80-0.85x through fn(*args, **kwargs)). On the H200 host (torch 2.11, CPython 3.12, 3
    invocations): model(x) +531-615 ns (0.88-0.89x; the 500 ns target is not met),
    model(x=, mask=) +921-1,571 ns (0.74-0.75x), the GC ratio 1.47-1.92x (target 2x).
    What was left is the interpreter's: so, where _hotpath.c is built, those two calls take
    its path (this function returns its `Hot` object, which hands every other call to
    __call__ here): on the H200 host +221-245 ns and +342-355 ns, 0.47-0.54x and 0.41-0.45x
    of this path's added time in the same batches (README, Benchmarks).
    """
    fn, tensor, seen, clock = h.fn, h.tensor, h.seen, time.perf_counter
    calls = 0
    total = 0.0  # seconds
    last: Any = _NO_ARG  # the last signature found in `seen`, so it is known (see below)
    # two keyword arguments: their names in the last such call (read by name, not through
    # kwargs.values(): ~50 ns less), and their last shapes found in `seen` (compared one by
    # one: no tuple to build on a hit). The signature is in the remembered names' order.
    ka = kb = ""
    la = lb = _NO_ARG
    call2: Optional[Callable] = None  # _caller(ka, kb)

    def totals() -> tuple[int, int]:
        return calls, round(total * 1e9)

    def __call__(x: Any = _NO_ARG, /, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls, total, last, ka, kb, la, lb, call2
        if type(x) is tensor and not args and not kwargs:  # model(x): the common call
            try:
                sig = x.shape
            except Exception:  # a torch function mode that hijacks `.shape`
                sig = None
            t0 = clock()
            try:
                out = ref()._route(sig)(x) if route_eager else fn(x)
            except BaseException as e:
                calls += 1
                ref()._failed(e, sig, t0, (x,), {})
                raise
            dt = clock() - t0
            calls += 1
            total += dt
            try:
                if sig != last:
                    if sig not in seen:  # not the last shape, not a hot one: look further
                        if not h.full and (not h.spill or _cold_unseen(h, sig)):
                            ref()._slow(sig, dt, t0, True)
                            return out
                    else:
                        last = sig
            except Exception:  # unhashable (SymInt sizes, a hijacked `.shape`): not a shape
                pass
            if dt >= stall_s:
                ref()._slow(sig, dt, t0, False)
            return out

        if x is _NO_ARG and not args and len(kwargs) == 2:  # model(input_ids=, attention_mask=)
            for first in kwargs:
                break
            try:
                if first != ka:
                    raise KeyError(first)
                a, b = kwargs[ka], kwargs[kb]
            except KeyError:  # other names, or another order, than the last such call's
                ka, kb = kwargs
                a, b = kwargs[ka], kwargs[kb]
                call2 = _caller(ka, kb)
            try:
                sa = a.shape if type(a) is tensor else _other(a, tensor)
                sb = b.shape if type(b) is tensor else _other(b, tensor)
            except Exception:  # a hostile argument: read each one on its own
                sa, sb = _entry(a, tensor), _entry(b, tensor)
            t0 = clock()
            try:
                target = ref()._route((sa, sb)) if route_eager else fn
                out = target(**kwargs) if call2 is None else call2(target, a, b)
            except BaseException as e:
                calls += 1
                ref()._failed(e, (sa, sb), t0, args, kwargs)
                raise
            dt = clock() - t0
            calls += 1
            total += dt
            try:
                if sa != la or sb != lb:
                    sig = (sa, sb)
                    if sig not in seen:
                        if not h.full and (not h.spill or _cold_unseen(h, sig)):
                            ref()._slow(sig, dt, t0, True)
                            return out
                    else:
                        la, lb = sa, sb
            except Exception:
                pass
            if dt >= stall_s:
                ref()._slow((sa, sb), dt, t0, False)
            return out

        # several arguments, other keywords, none, or not a tensor
        try:
            if x is not _NO_ARG:
                args = (x, *args)
            sig = shape_signature(args, kwargs, tensor)
        except Exception:  # a hostile argument: read each one on its own
            sig = shape_signature(args, kwargs, tensor)
        t0 = clock()
        try:
            out = (ref()._route(sig) if route_eager else fn)(*args, **kwargs)
        except BaseException as e:
            calls += 1
            ref()._failed(e, sig, t0, args, kwargs)
            raise
        dt = clock() - t0
        calls += 1
        total += dt
        try:
            if sig != last:
                if sig not in seen:
                    if not h.full and (not h.spill or _cold_unseen(h, sig)):
                        ref()._slow(sig, dt, t0, True)
                        return out
                else:
                    last = sig
        except Exception:
            pass
        if dt >= stall_s:
            ref()._slow(sig, dt, t0, False)
        return out

    if _hotpath is None:
        return __call__, totals

    # The C path (_hotpath.Hot) takes `model(x)` and `model(a=, b=)` with tensors and hands
    # every other call to __call__ above; what it meets that is not the last shape nor a hot
    # one, a stall and a failure come back here, as on the Python path.
    def miss(sig: Any, dt: float, t0: float) -> bool:
        if not h.full and (not h.spill or _cold_unseen(h, sig)):
            ref()._slow(sig, dt, t0, True)
            return True
        return False

    def slow(sig: Any, dt: float, t0: float, new: bool) -> None:
        ref()._slow(sig, dt, t0, new)

    def failed(e: BaseException, sig: Any, t0: float, args: tuple, kwargs: dict) -> None:
        ref()._failed(e, sig, t0, args, kwargs)

    hot = _hotpath.Hot(fn, tensor, seen, __call__, miss, slow, failed)

    def both_totals() -> tuple[int, int]:
        c_calls, c_total = hot.totals()
        return calls + c_calls, round((total + c_total) * 1e9)

    return hot, both_totals


_CALLERS: dict = {}


def _caller(ka: str, kb: str) -> Optional[Callable]:
    """`call(fn, a, b)` that returns `fn(<ka>=a, <kb>=b)`, compiled once per pair of names;
    None if they are not plain identifiers (the call then goes through `fn(**kwargs)`). Why:
    `fn(**kwargs)` copies the dict and unpacks it again for the callee's vectorcall:
    240 ns against 107 ns through this helper (CPython 3.12; 3.11: 194 and 100 ns)."""
    key = (ka, kb)
    call = _CALLERS.get(key, _NO_ARG)
    if call is _NO_ARG:
        call = None
        if all(k.isascii() and k.isidentifier() and not keyword.iskeyword(k) for k in key):
            if len(_CALLERS) >= 256:  # a server cycling through names: stay bounded
                _CALLERS.clear()
            scope: dict = {}
            exec(f"def call(fn, a, b):\n    return fn({ka}=a, {kb}=b)\n", scope)  # noqa: S102
            call = scope["call"]
        _CALLERS[key] = call
    return call


# The hot path's code object: current_shape() looks for frames running it.
_CALL_CODE = next(c for c in _make_call.__code__.co_consts
                  if getattr(c, "co_name", None) == "__call__")


_MASK = (1 << 64) - 1


def _probe(slot: int) -> int:
    """The next slot of the cold dict after `slot` (only ever needed on a hash collision)."""
    return (slot * 5 + 1) & _MASK


def _cold_unseen(h: "_Hot", sig: Any) -> bool:
    """`sig` is in neither the cold dicts nor `fresh` (may raise: an unhashable signature)."""
    slot = hash(sig)
    cold = h.cold[slot % len(h.cold)]
    key = cold.get(slot)
    while key is not None:
        if key == sig:  # a torch.Size equals its tuple
            return False
        slot = _probe(slot)
        key = cold.get(slot)
    return not h.fresh or sig not in h.fresh


class _Hot:
    """The shape memory of one watched callable (read by the agent's thread; written by the
    serving threads): `_key`s, at most max_shapes, HOT_SHAPES of them in `seen`, the rest in
    the `cold` shards (hash -> untracked key) or, while a collection has not yet untracked them,
    in `fresh` (see HOT_SHAPES)."""

    __slots__ = ("fn", "tensor", "seen", "cold", "fresh", "arrival", "spill", "count", "full",
                 "stall_calls", "stall_ns", "ration", "ration_ns")

    def __init__(self, fn: Callable, tensor_type: type):
        self.fn = fn
        self.tensor = tensor_type
        self.seen: set = set()
        self.cold: list[dict] = []  # made when `seen` is full; see HOT_SHAPES
        self.fresh: set = set()
        self.arrival: collections.deque = collections.deque()  # `fresh`, oldest first
        self.spill = False  # `seen` is full: look in the cold memory on a miss
        self.count = 0
        self.full = False
        # the Watched's stall totals and new_shape ration (here, not on the Watched: its
        # attributes are set through Watched.__setattr__, a Python call)
        self.stall_calls = self.stall_ns = 0
        self.ration, self.ration_ns = float(NEW_SHAPE_BURST), perf_counter_ns()

    def unseen(self, sig: Any) -> bool:
        return sig not in self.seen and (not self.spill or _cold_unseen(self, sig))

    def add(self, key: tuple) -> None:
        if not self.spill:
            self.seen.add(key)
            if len(self.seen) >= HOT_SHAPES:
                shards = max(1, (max_shapes - HOT_SHAPES) // COLD_SHARD_SHAPES + 1)
                self.cold = [{} for _ in range(shards)]  # empty dicts: untracked
                self.spill = True
        else:
            self.fresh.add(key)
            self.arrival.append(key)
            self.settle()
        self.count += 1
        self.full = self.count >= max_shapes

    def settle(self) -> None:
        """Move up to SETTLE_PER_ADD of the fresh keys a collection has untracked into the cold
        dicts, oldest first."""
        arrival, fresh, shards, tracked = self.arrival, self.fresh, self.cold, gc.is_tracked
        for _ in range(SETTLE_PER_ADD):
            if not arrival or tracked(arrival[0]):
                return
            key = arrival.popleft()
            slot = hash(key)
            cold = shards[slot % len(shards)]
            while slot in cold:
                slot = _probe(slot)
            cold[slot] = key
            fresh.discard(key)

    def keys(self) -> list:
        return [*self.seen, *(k for shard in self.cold for k in shard.values()), *self.arrival]


def _shape_text(shape: events.Shape) -> str:
    """A new_shape event's shape as text, "x2,3;x4" for [[2, 3], [4]] (the emitter's builder
    reads it back on the sender thread: emitter.shape_from_text). Why text: a queued NewShape
    event is a dataclass and 1 + n lists, all tracked; held until the sender's next tick, up to
    NEW_SHAPE_BURST of them reached the middle generation, and the gen-1 collection that walked
    them was the worst of 500,000 watched calls (0.14-0.24 ms of CPU on the 2-core VM, 0.04 ms
    with no events queued; benchmarks/agent_overhead.py gc). A tuple of str and numbers is
    untracked by the first collection it meets; one holding tuples may need two (a collection
    can meet the outer tuple before the inner ones are untracked)."""
    return ";".join(["x" + ",".join([str(d) for d in dims]) for dims in shape])


class Watched(functools.partial):
    """Calls `fn` unchanged; other attributes are the wrapped object's.

    Whatever the arguments, a call returns what `fn` returned and raises only what `fn` raised
    (the same object): every step of the bookkeeping around it is guarded.

    A functools.partial of the hot path (`_make_call`: the C path's `Hot` object where it is
    built, else a closure over this callable's state), not a class with a `__call__`. Why:
    calling an instance of a Python class goes through `slot_tp_call` (a method lookup, an argument tuple, a second call); a partial (a C type)
    is called through its vectorcall, which subclasses inherit from Python 3.12 on: one
    tensor, CPython 3.12, 196 ns a call of an instance against 127 ns a call of this partial
    (a trivial function: 96 ns); on 3.11, where subclasses do not inherit it, +12 ns. The
    hot path reads nothing through `self` (it is a closure: Watched defines `__getattr__`,
    which turns off CPython's specialised attribute loads, ~170 ns for the 7 loads a call
    once made). partial's own attributes `func`, `args` and `keywords` are the wrapped
    object's here (properties below); the partial's state is set only through
    `functools.partial.__setstate__` (at creation and in a forked child).
    """

    __slots__ = ("__wrapped__", "name", "_h", "_totals", "_eager", "_taken")

    def __new__(cls, fn: Callable, name: str, tensor_type: type) -> "Watched":
        self = super().__new__(cls, _unset)
        self.__wrapped__ = fn
        self.name = name
        # the uncompiled callable, for routing novel shapes to eager under a graph budget
        self._eager = getattr(fn, "_orig_mod", None)
        if self._eager is None:
            self._eager = getattr(fn, "_torchdynamo_orig_callable", None)
        self._start(_Hot(fn, tensor_type))
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all done in __new__
        pass

    def _start(self, h: "_Hot") -> None:
        """A shape memory, running totals from zero and the hot path over them."""
        self._h = h
        call, self._totals = _make_call(h, weakref.ref(self))
        functools.partial.__setstate__(self, (call, (), None, None))
        # running totals, only ever incremented by serving threads; the agent's thread
        # subtracts its previous reading (`_taken`) instead of resetting them
        self._taken = (0, 0, 0, 0)

    # the running totals of the hot path, and the wrapped callable, under their old names
    calls = property(lambda self: self._totals()[0])
    total_ns = property(lambda self: self._totals()[1])
    _fn = property(lambda self: self._h.fn)
    stall_calls = property(lambda self: self._h.stall_calls)
    stall_ns = property(lambda self: self._h.stall_ns)
    # partial's attribute names: the wrapped object's, as every other attribute
    func = property(lambda self: getattr(self._h.fn, "func"))
    args = property(lambda self: getattr(self._h.fn, "args"))
    keywords = property(lambda self: getattr(self._h.fn, "keywords"))

    # and so is `__dict__` (a partial has one; a Watched stores nothing there, see __setattr__)
    __dict__ = property(lambda self: getattr(self._h.fn, "__dict__"))  # type: ignore[assignment]

    def __setattr__(self, name: str, value: Any) -> None:
        """Only Watched's own slots, as before it was a partial (whose instance dict would
        otherwise take any name and hide the model's attribute of that name)."""
        if name not in Watched.__slots__:
            raise AttributeError(f"'Watched' object has no attribute {name!r}")
        object.__setattr__(self, name, value)

    def __reduce__(self) -> Any:
        """copy, deepcopy and pickle: a new watch() of (the copy of) the wrapped callable,
        with its own shape memory and totals (partial's would copy the hot path's closure)."""
        return _rewatch, (self._h.fn, self.name)

    def _route(self, sig: Any) -> Callable:
        """Under an "eager" graph budget, a shape never seen goes to the uncompiled callable."""
        try:
            if self._eager is not None and self._h.unseen(sig):
                return self._eager
        except Exception:
            pass
        return self._h.fn

    def _forget(self) -> None:
        """A fresh shape memory and running totals (in a forked child: see `_after_fork`)."""
        _inherited.append(self._h)
        self._start(_Hot(self._h.fn, self._h.tensor))

    def __getattr__(self, name: str) -> Any:  # only reached for names not found on Watched
        return getattr(self._h.fn, name)

    def __repr__(self) -> str:
        return f"<watched {self.name!r}: {self._h.fn!r}>"

    def _slow(self, sig: Any, seconds: float, start: float, new: bool) -> None:
        """A new shape or a stall: `seconds` the call's wall time, `start` when it began
        (time.perf_counter(), the clock of perf_counter_ns() in seconds)."""
        try:
            dt, t0 = round(seconds * 1e9), round(start * 1e9)
            h = self._h
            key = _key(sig)  # None: no readable shape (its events say [])
            new = new and key is not None and h.unseen(key)
            if new:
                h.add(key)
            # the event's shape is built only for an event: a shape past the ration costs its
            # key and nothing more
            shape = None
            if new and self._rationed(t0 + dt):
                shape = as_shape(sig) if key is not None else []
                if emit_later is not None:
                    # queued as a tuple of untracked values: see _shape_text
                    emit_later(("new_shape", time.time(), os.getpid(), self.name,
                                _shape_text(shape), dt / 1e9, h.count))
                else:
                    emit(events.NewShape(t=time.time(), pid=os.getpid(), name=self.name,
                                         shape=shape, seconds=dt / 1e9, distinct=h.count))
            if seconds >= stall_s:
                h.stall_calls += 1
                h.stall_ns += dt
                if shape is None:
                    shape = as_shape(sig) if key is not None else []
                cause = tls.activity if getattr(tls, "activity_ns", -1) >= t0 else None
                emit(events.Stall(t=time.time(), pid=os.getpid(), name=self.name, shape=shape,
                                  seconds=dt / 1e9, new_shape=new, cause=cause))
        except Exception:  # never into the server; the event is lost, the call is not
            pass

    def _rationed(self, now_ns: int) -> bool:
        """Take one new_shape event from the ration, if one is left."""
        h = self._h
        ration = min(float(NEW_SHAPE_BURST),
                     h.ration + (now_ns - h.ration_ns) * NEW_SHAPE_PER_S / 1e9)
        h.ration_ns = now_ns
        h.ration = ration - 1 if ration >= 1 else ration
        return ration >= 1

    def _failed(self, exc: BaseException, sig: Any, start: float, args: tuple,
                kwargs: dict) -> None:
        try:
            t0 = round(start * 1e9)  # see _slow
            if getattr(tls, "oom_ns", -1) >= t0:
                return  # the allocator's observer already reported this call's OOM
            if is_oom(exc):
                emit(events.Oom(t=time.time(), pid=os.getpid(), source="exception",
                                device=None, requested_bytes=None, limit_bytes=None,
                                free_bytes=None, message=events.clip(str(exc), 500)))
                return
            text = crash_text(exc)
            if not is_gpu_crash(text):
                return
            memory = gpu_memory(args, kwargs, self._h.tensor)
            if memory is None:
                return  # CUDA not initialised: not a GPU this process filled
            device, free, total = memory
            if crash_is_oom(text, free, total):
                emit(events.Oom(t=time.time(), pid=os.getpid(), source="crash",
                                device=device, requested_bytes=None, limit_bytes=total,
                                free_bytes=free, message=events.clip(text, 500)))
        except Exception:
            pass

    def take_window(self) -> tuple[int, int, int, int, int]:
        """(calls, total_ns, stall_calls, stall_ns, distinct_shapes) since the last take."""
        now = (*self._totals(), self.stall_calls, self.stall_ns)
        delta = tuple(a - b for a, b in zip(now, self._taken))
        self._taken = now
        return (*delta, self._h.count)


def _rewatch(fn: Callable, name: str) -> "Watched":
    return watch(fn, name)


# The shape memories a forked child inherited, kept and never touched. Why: a worker must
# report the shapes *it* meets (a master's warm-up shapes are not in the worker's CUDA graphs),
# so each wrapper starts a fresh memory after fork; freeing the master's would write to every
# remembered key (its refcount) inside os.fork(), copying those pages into each worker for
# nothing: with 65,536 shapes, 62-72 ms inside os.fork() and 6.7 MB more private memory per
# worker (a 2-core VM), while kept they stay shared with the master.
_inherited: list = []


def _after_fork() -> None:
    """In a forked child (the agent's `_AFTER_FORK`, run inside os.fork()): every watched
    callable starts with no shapes, no calls and a full new_shape ration, whether or not an
    agent is installed. Only the forking thread exists here: plain assignments, no locks."""
    failed = None
    if _hotpath is not None:
        _hotpath.after_fork()  # the other threads' calls in progress are not this process's
    for w in list(watched):
        try:
            w._forget()
        except Exception as e:  # the others still start fresh; the hook counts the error
            failed = e
    if failed is not None:
        raise failed


_AFTER_FORK.append(_after_fork)


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or the CUDA error that bypasses the allocator (FACTS #9)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)[:2000]
        return "cudaErrorMemoryAllocation" in text or "out of memory" in text
    return False


# A crash is a crash (issue 10 item 9): on a nearly full H200 the first failure was cuDNN
# attention's `RuntimeError: Expected mha_graph.execute(...) is_good() to be true`, not an OOM
# error; cuBLAS and CUDA errors do the same when a workspace cannot be allocated. Such an error
# on a GPU with under NEARLY_FULL of its memory free (or whose free memory cannot be read any
# more, as after a sticky CUDA error) is reported as an `oom` of source "crash".
GPU_CRASH_MARKERS = ("CUDA error", "cudaError", "CUDA driver error", "CUBLAS_STATUS",
                     "CUDNN", "cuDNN", "mha_graph", "AcceleratorError", "CUFFT_", "CUSOLVER_",
                     "CUSPARSE_STATUS", "NCCL error")
NEARLY_FULL = 0.05


def crash_text(exc: BaseException) -> str:
    """The exception's class name and message, as the markers are looked for in."""
    return f"{type(exc).__name__}: {str(exc)[:2000]}"


def is_gpu_crash(text: str) -> bool:
    return any(marker in text for marker in GPU_CRASH_MARKERS)


def crash_is_oom(text: str, free: Optional[int], total: Optional[int]) -> bool:
    """Report a failed call as an OOM? A CUDA/cuDNN/cuBLAS error while its GPU had less than
    NEARLY_FULL of its memory free, or while free memory was unknown."""
    if not is_gpu_crash(text):
        return False
    if free is None or not total or total <= 0:
        return True
    return free < NEARLY_FULL * total


def _cuda() -> Any:
    """torch.cuda if torch is imported (the server's; never imported here), else None."""
    return getattr(sys.modules.get("torch"), "cuda", None)


def gpu_memory(args: tuple, kwargs: dict, tensor_type: type
               ) -> Optional[tuple[Optional[int], Optional[int], Optional[int]]]:
    """(device, free, total) of the GPU a failed call used: the first CUDA tensor argument's,
    else the current device; free and total None if they cannot be read. None when CUDA is not
    initialised (never initialised by us: that breaks servers that fork later)."""
    cuda = _cuda()
    if cuda is None or not cuda.is_initialized():
        return None
    device = None
    for a in _values(args, kwargs)[:MAX_NESTED]:
        try:
            if isinstance(a, tensor_type) and a.is_cuda:
                device = a.device.index
                break
        except Exception:
            continue
    try:
        if device is None:
            device = cuda.current_device()
        free, total = cuda.mem_get_info(device)
        return device, int(free), int(total)
    except Exception:  # the context may be broken by the very error we are looking at
        return device, None, None


def watch(fn: Callable, name: Optional[str] = None, pad: Any = None) -> Watched:
    """Wrap a model or function: per-call shape and wall time, new shapes and stalls as events.
    `pad`: opt-in bucketed padding (agent/pad.py) around the watched model; None: none."""
    import torch  # the server has it; importing torch_watchdog.agent alone must not

    if pad is not None:  # a wrapper around the Watched: the Watched's own path is unchanged
        from torch_watchdog.agent import pad as padding

        w = watch(fn, name)
        return padding.wrap(w, pad, w.name)  # type: ignore[return-value]
    if isinstance(fn, Watched):
        return fn
    if not callable(fn):
        raise TypeError(f"watch() needs a callable, got {type(fn).__name__}")
    label = name or getattr(fn, "__name__", None) or type(
        getattr(fn, "_orig_mod", fn)).__name__
    w = Watched(fn, label, torch.Tensor)
    watched.add(w)
    return w
