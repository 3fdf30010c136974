"""watch(): a drop-in wrapper that times each call and notes its input shapes, with no GPU sync.

The hot path reads tensor `.shape` (host metadata, no device access), two `perf_counter_ns`
calls and a set lookup; events are built only on the slow path — a shape seen for the first
time or a call over the stall threshold. Stalls from warm-up, recording and recompiles are
CPU-visible (FACTS #4), so wall time around the call is enough.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Optional

from torch_watchdog import events

# Per serving thread, written by hooks.py (rare): `activity`/`activity_ns` of the last compile
# or cudagraph step, `oom_ns` of the last OOM seen. Read by watch() on its slow path only.
tls = threading.local()

# The shape signature of the watched call in progress (None between calls), for hooks.py to
# tag cudagraph events. A plain global, not thread-local: it is written twice per call and a
# thread-local costs ~50 ns a write. With several serving threads the tag is best effort.
current_sig: Any = None


def current_shape() -> Any:
    return current_sig


# What the installed agent tells every watched callable. Module globals, not attributes of an
# object: the hot path reads them on every call and a global read is the cheapest there is.
def _discard(event: events.Event) -> None:
    return None


INERT = {"emit": _discard, "stall_ns": 50_000_000, "max_shapes": 65_536, "route_eager": False}
emit: Callable[[events.Event], None] = _discard
stall_ns: int = INERT["stall_ns"]
max_shapes: int = INERT["max_shapes"]
route_eager: bool = False  # graph budget in "eager" mode: novel shapes skip the compiler


def configure(**settings: Any) -> None:
    """Set emit / stall_ns / max_shapes / route_eager (install() and the mitigations do)."""
    unknown = set(settings) - set(INERT)
    if unknown:
        raise TypeError(f"unknown runtime setting(s) {sorted(unknown)}")
    globals().update(settings)


def reset() -> None:
    """Back to inert: watched callables keep working and send nowhere."""
    configure(**INERT)


watched: "weakref.WeakSet[Watched]" = weakref.WeakSet()


def shape_signature(args: tuple, kwargs: dict, tensor_type: type) -> tuple:
    """One entry per argument, positional then keyword in call order: a tensor's shape, a tuple
    of shapes for a list/tuple/dict of tensors (e.g. a tokenizer's BatchEncoding), else None."""
    parts = []
    for group in (args, kwargs.values()):
        for a in group:
            parts.append(a.shape if type(a) is tensor_type else _other(a, tensor_type))
    return tuple(parts)


def _other(a: Any, tensor_type: type) -> Any:
    if isinstance(a, tensor_type):
        return a.shape
    if isinstance(a, dict):
        a = a.values()
    elif not isinstance(a, (list, tuple)):
        return None
    return tuple(x.shape for x in a if isinstance(x, tensor_type)) or None


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


class Watched:
    """Calls `fn` unchanged; other attributes are the wrapped object's."""

    __slots__ = ("__wrapped__", "name", "_fn", "_eager", "_tensor", "_seen", "_full",
                 "calls", "total_ns", "stall_calls", "stall_ns", "_taken", "__weakref__")

    def __init__(self, fn: Callable, name: str, tensor_type: type):
        self.__wrapped__ = fn
        self.name = name
        self._fn = fn
        # the uncompiled callable, for routing novel shapes to eager under a graph budget
        self._eager = getattr(fn, "_orig_mod", None)
        if self._eager is None:
            self._eager = getattr(fn, "_torchdynamo_orig_callable", None)
        self._tensor = tensor_type
        self._seen: set = set()
        self._full = False
        # running totals, only ever incremented by serving threads; the agent's thread
        # subtracts its previous reading (`_taken`) instead of resetting them
        self.calls = self.total_ns = self.stall_calls = self.stall_ns = 0
        self._taken = (0, 0, 0, 0)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 1:
            sig = shape_signature(args, kwargs, self._tensor)
        else:
            try:
                sig = args[0].shape  # a tensor: torch.Size (zero-cost try on 3.11+)
            except AttributeError:
                sig = ()
        fn = self._fn
        if route_eager and self._eager is not None and self._unseen(sig):
            fn = self._eager
        global current_sig
        current_sig = sig
        t0 = perf_counter_ns()
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            current_sig = None
            self._failed(e, sig, t0)
            raise
        dt = perf_counter_ns() - t0
        current_sig = None
        self.calls += 1
        self.total_ns += dt
        try:
            slow = dt >= stall_ns or (sig not in self._seen and not self._full)
        except TypeError:  # an argument whose `.shape` is unhashable: not a tensor
            sig, slow = (), dt >= stall_ns
        if slow:
            self._slow(sig, dt, t0)
        return out

    def _unseen(self, sig: Any) -> bool:
        try:
            return sig not in self._seen
        except TypeError:
            return False

    def __getattr__(self, name: str) -> Any:  # only reached for names not in __slots__
        return getattr(self._fn, name)

    def __repr__(self) -> str:
        return f"<watched {self.name!r}: {self._fn!r}>"

    def _slow(self, sig: Any, dt: int, t0: int) -> None:
        try:
            new = sig not in self._seen and not self._full
            if new:
                self._seen.add(sig)
                self._full = len(self._seen) >= max_shapes
            now, pid, shape = time.time(), os.getpid(), as_shape(sig)
            if new:
                emit(events.NewShape(t=now, pid=pid, name=self.name, shape=shape,
                                             seconds=dt / 1e9, distinct=len(self._seen)))
            if dt >= stall_ns:
                self.stall_calls += 1
                self.stall_ns += dt
                cause = tls.activity if getattr(tls, "activity_ns", -1) >= t0 else None
                emit(events.Stall(t=now, pid=pid, name=self.name, shape=shape,
                                          seconds=dt / 1e9, new_shape=new, cause=cause))
        except Exception:  # never into the server; the event is lost, the call is not
            pass

    def _failed(self, exc: BaseException, sig: Any, t0: int) -> None:
        try:
            self.calls += 1
            if not is_oom(exc) or getattr(tls, "oom_ns", -1) >= t0:
                return  # not an OOM, or the allocator's observer already reported it
            emit(events.Oom(t=time.time(), pid=os.getpid(), source="exception",
                                    device=None, requested_bytes=None, limit_bytes=None,
                                    free_bytes=None, message=events.clip(str(exc), 500)))
        except Exception:
            pass

    def take_window(self) -> tuple[int, int, int, int, int]:
        """(calls, total_ns, stall_calls, stall_ns, distinct_shapes) since the last take."""
        now = (self.calls, self.total_ns, self.stall_calls, self.stall_ns)
        delta = tuple(a - b for a, b in zip(now, self._taken))
        self._taken = now
        return (*delta, len(self._seen))


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or the CUDA error that bypasses the allocator (FACTS #9)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)[:2000]
        return "cudaErrorMemoryAllocation" in text or "out of memory" in text
    return False


def watch(fn: Callable, name: Optional[str] = None) -> Watched:
    """Wrap a model or function: per-call shape and wall time, new shapes and stalls as events."""
    import torch  # the server has it; importing torch_watchdog.agent alone must not

    if isinstance(fn, Watched):
        return fn
    if not callable(fn):
        raise TypeError(f"watch() needs a callable, got {type(fn).__name__}")
    label = name or getattr(fn, "__name__", None) or type(
        getattr(fn, "_orig_mod", fn)).__name__
    w = Watched(fn, label, torch.Tensor)
    watched.add(w)
    return w
