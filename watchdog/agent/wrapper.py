"""Watched and watch(): the drop-in wrapper around a served model, and its slow paths."""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional

from torch_watchdog import events
from torch_watchdog.agent import settings, shapes
from torch_watchdog.agent.calls import make_call
from torch_watchdog.agent.crashes import crash_is_oom, crash_text, gpu_memory, is_gpu_crash, is_oom
from torch_watchdog.agent.forks import _AFTER_FORK
from torch_watchdog.agent.shapes import _Hot
from torch_watchdog.agent.signature import as_shape, memory_key, shape_text

watched: weakref.WeakSet = weakref.WeakSet()  # every Watched of this process; watch() adds each

# What the torch hooks last saw on each serving thread, written by hooks.py (rare):
# `activity`/`activity_ns` of the last compile or cudagraph step, `oom_ns` of the last OOM
# seen. Read by a watched call on its slow path only: a stall's cause, an OOM the allocator's
# observer already reported.
tls = threading.local()


def _unset(*args: Any, **kwargs: Any) -> None:  # a Watched's callable until _start()
    raise TypeError("a Watched made without watch()")


class Watched(functools.partial):
    """Calls `fn` unchanged; other attributes are the wrapped object's.

    Whatever the arguments, a call returns what `fn` returned and raises only what `fn` raised
    (the same object): every step of the bookkeeping around it is guarded. A call that fails
    with a CUDA/cuDNN/cuBLAS error while its GPU is nearly full is reported as an `oom` event
    of source "crash" (crashes.crash_is_oom).

    A functools.partial of the hot path (calls.make_call: the C path's `Hot` object where it
    is built, else the PythonPath's `call`), not a class with a `__call__`. Why:
    calling an instance of a Python class goes through `slot_tp_call` (a method lookup, an
    argument tuple, a second call), while a partial (a C type) is called through its
    vectorcall, which subclasses inherit from Python 3.12 on. A class with `__slots__` whose
    `__call__` is a slot holding the same hot path (no Python frame added) still pays
    slot_tp_call's argument tuple and keyword dict on every call: it added 1.10x this class's
    time for `model(x)` and ~1.5x for `model(a=, b=)` on CPython 3.12
    (benchmarks/results/agent_overhead.md, "Why `Watched` is a partial"). The hot path reads
    nothing through `self`: Watched defines `__getattr__`, which turns off CPython's specialised
    attribute loads. partial's own attributes `func`, `args` and `keywords` are the wrapped
    object's here (properties below); the partial's state is set only through
    `functools.partial.__setstate__` (at creation, in a forked child, and by a drain, which
    swaps the hot path for one that refuses calls).
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
        call, self._totals = make_call(h, weakref.ref(self))
        functools.partial.__setstate__(self, (call, (), None, None))
        # running totals, only ever incremented by serving threads; the agent's thread
        # subtracts its previous reading (`_taken`) instead of resetting them
        self._taken = (0, 0, 0, 0)

    def _refuse(self, refused: Callable) -> None:
        """Every call from now on goes to `refused` (drain.py: it raises Draining); the calls
        in hand finish on the hot path they entered. A forked child starts afresh
        (`_forget`)."""
        functools.partial.__setstate__(self, (refused, (), None, None))

    # the running totals of the hot path, the wrapped callable and the stall totals
    calls = property(lambda self: self._totals()[0])
    total_ns = property(lambda self: self._totals()[1])
    _fn = property(lambda self: self._h.fn)
    stall_calls = property(lambda self: self._h.stall_calls)
    stall_ns = property(lambda self: self._h.stall_ns)
    # partial's attribute names: the wrapped object's, as every other attribute
    func = property(lambda self: self._h.fn.func)
    args = property(lambda self: self._h.fn.args)
    keywords = property(lambda self: self._h.fn.keywords)

    # and so is `__dict__` (a partial has one; a Watched stores nothing there, see __setattr__)
    __dict__ = property(lambda self: self._h.fn.__dict__)  # type: ignore[assignment]

    def __setattr__(self, name: str, value: Any) -> None:
        """Only Watched's own slots: a partial's instance dict would otherwise take any name
        and hide the model's attribute of that name."""
        if name not in Watched.__slots__:
            raise AttributeError(f"'Watched' object has no attribute {name!r}")
        object.__setattr__(self, name, value)

    def __reduce__(self) -> Any:
        """copy, deepcopy and pickle: a new watch() of (the copy of) the wrapped callable,
        with its own shape memory and totals (partial's would copy the hot path and its
        state)."""
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
        """A fresh shape memory and running totals (in a forked child: _after_fork keeps the
        old memory)."""
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
            key = memory_key(sig)  # None: no readable shape (its events say [])
            new = new and key is not None and h.unseen(key)
            if new:
                h.add(key)
            # the event's shape is built only for an event: a shape past the ration costs its
            # key and nothing more
            shape = None
            if new and self._rationed(t0 + dt):
                shape = as_shape(sig) if key is not None else []
                self._new_shape(shape, dt)
            if seconds >= settings.current.stall_s:
                h.stall_calls += 1
                h.stall_ns += dt
                if shape is None:
                    shape = as_shape(sig) if key is not None else []
                cause = tls.activity if getattr(tls, "activity_ns", -1) >= t0 else None
                settings.current.emit(events.Stall(
                    t=time.time(), pid=os.getpid(), name=self.name, shape=shape,
                    seconds=dt / 1e9, new_shape=new, cause=cause))
        except Exception:  # never into the server; the event is lost, the call is not
            pass

    def _new_shape(self, shape: events.Shape, dt: int) -> None:
        emit_later = settings.current.emit_later
        if emit_later is not None:
            # queued as a tuple of untracked values: see signature.shape_text
            emit_later(("new_shape", time.time(), os.getpid(), self.name, shape_text(shape),
                        dt / 1e9, self._h.count))
        else:
            settings.current.emit(events.NewShape(
                t=time.time(), pid=os.getpid(), name=self.name, shape=shape, seconds=dt / 1e9,
                distinct=self._h.count))

    def _rationed(self, now_ns: int) -> bool:
        """Take one new_shape event from the ration, if one is left."""
        h = self._h
        ration = min(float(shapes.NEW_SHAPE_BURST),
                     h.ration + (now_ns - h.ration_ns) * shapes.NEW_SHAPE_PER_S / 1e9)
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
                settings.current.emit(events.Oom(
                    t=time.time(), pid=os.getpid(), source="exception", device=None,
                    requested_bytes=None, limit_bytes=None, free_bytes=None,
                    message=events.clip(str(exc), 500)))
                return
            text = crash_text(exc)
            if not is_gpu_crash(text):
                return
            memory = gpu_memory(args, kwargs, self._h.tensor)
            if memory is None:
                return  # CUDA not initialised: not a GPU this process filled
            device, free, total = memory
            if crash_is_oom(text, free, total):
                settings.current.emit(events.Oom(
                    t=time.time(), pid=os.getpid(), source="crash", device=device,
                    requested_bytes=None, limit_bytes=total, free_bytes=free,
                    message=events.clip(text, 500)))
        except Exception:
            pass

    def take_window(self) -> tuple[int, int, int, int, int]:
        """(calls, total_ns, stall_calls, stall_ns, distinct_shapes) since the last take."""
        now = (*self._totals(), self.stall_calls, self.stall_ns)
        delta = tuple(a - b for a, b in zip(now, self._taken, strict=True))
        self._taken = now
        return (*delta, self._h.count)


def _rewatch(fn: Callable, name: str) -> "Watched":
    return watch(fn, name)


def watch(fn: Callable, name: Optional[str] = None, pad: Any = None) -> Watched:
    """Wrap a model or function: per-call shape and wall time, new shapes and stalls as events.
    `pad`: opt-in bucketed padding (agent/pad/) around the watched model; None: none."""
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


# The shape memories a forked child inherited, kept and never touched. Why: a worker must
# report the shapes *it* meets (a master's warm-up shapes are not in the worker's CUDA graphs),
# so each wrapper starts a fresh memory after fork; freeing the master's would write to every
# remembered key (its refcount) inside os.fork(), copying those pages into each worker, while
# kept they stay shared with the master.
_inherited: list = []


def _after_fork() -> None:
    """In a forked child (run inside os.fork()): every watched callable starts with no shapes,
    no calls and a full new_shape ration, whether or not an agent is installed. Only the
    forking thread exists here: plain assignments, no locks."""
    failed = None
    for w in list(watched):
        try:
            _inherited.append(w._h)
            w._forget()
        except Exception as e:  # the others still start fresh; the hook counts the error
            failed = e
    if failed is not None:
        raise failed


_AFTER_FORK.append(_after_fork)
