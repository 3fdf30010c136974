"""The hot path of a watched callable: the call timed, its signature looked up in the shape
memory, and the call on its thread's stack of calls in progress while it runs.

Two implementations of one path. `_hotpath.c` (where it is built) takes the two calls a server
makes on every request, `model(x)` and `model(a=, b=)` with exact tensors, and hands every
other call to `PythonPath`, which serves every call where the C one is not built (or with
TORCH_WATCHDOG_PURE_PYTHON=1). Both leave every decision to the same Python methods: a
signature not in the hot set (`PythonPath.miss`), a stall (`slow`) and a failed call
(`failed`). Wall time around the call is enough, with no GPU sync: the stalls of warm-up,
recording and recompiles are visible on the CPU.
"""
from __future__ import annotations

import importlib
import threading
import weakref
from time import perf_counter
from typing import Any, Callable

from torch_watchdog import pure_python
from torch_watchdog.agent import settings
from torch_watchdog.agent.shapes import _Hot, cold_unseen
from torch_watchdog.agent.signature import shape_signature

# The C path where it is built and not turned off, else None (the Python path serves every
# call). Read at use, not imported by name, so that setting it to None here (the tests do)
# takes every watch() made after it to the Python path.
_hotpath: Any = None
if not pure_python():
    try:
        _hotpath = importlib.import_module("torch_watchdog.agent._hotpath")
    except ImportError:  # not built here (no compiler at install, a free-threaded CPython)
        _hotpath = None


def _copy_settings(s: settings.Settings) -> None:
    """The C path's copy of what it reads on every call (see settings.COPIES)."""
    if _hotpath is not None:
        _hotpath.configure(s.stall_s, bool(s.route_eager))


settings.COPIES.append(_copy_settings)
_copy_settings(settings.current)


# The Python path's calls in progress: one stack of signatures per thread (appended and popped
# by that thread only), and every thread's by thread id, for inflight.py's readers. The stack
# is an attribute of a plain threading.local, made on the thread's first watched call: read
# through a subclass of it, the read took about twice as long (scratch timing, 2-core VM).
stacks: dict[int, list[Any]] = {}
this_thread = threading.local()


def new_stack() -> list[Any]:
    """This thread's stack (on its first watched call; an ended thread's is left, empty,
    until a thread with the same id replaces it)."""
    stack: list[Any] = []
    this_thread.stack = stack
    stacks[threading.get_ident()] = stack
    return stack


_NOTHING = object()  # no signature found yet
_settings = settings.current  # the one record (configure() changes it in place)


class PythonPath:
    """The hot path of one watched callable in Python, and the slow paths both hot paths
    call. `ref`: the Watched, weakly (it holds this object: a strong reference would make a
    cycle); `h`: its shape memory, whose `fn`, `tensor` and `seen` are copied here (read on
    every call: one attribute lookup instead of two); `calls`, `total`: the calls this path
    ran, their seconds; `last`: the last signature found in the hot set."""

    __slots__ = ("fn", "tensor", "seen", "h", "ref", "calls", "total", "last")

    def __init__(self, h: _Hot, ref: weakref.ref[Any]):
        self.fn, self.tensor, self.seen = h.fn, h.tensor, h.seen
        self.h = h
        # Any, not Optional: a path is called only through its Watched, which is alive then
        self.ref: Callable[[], Any] = ref
        self.calls = 0
        self.total = 0.0
        self.last: Any = _NOTHING

    def call(self, x: Any = _NOTHING, /, *args: Any, **kwargs: Any) -> Any:
        """The model's call, timed, with the model's result or exception unchanged.

        Its signature: for `model(x)` with one exact tensor, its shape (None if reading it
        raises, as under a torch function mode that hijacks `.shape`), as the C path reads it;
        for every other call, signature.shape_signature()'s, read here without the call where
        the arguments are two exact tensors by keyword (`model(a=, b=)`). After the call, a
        signature that is not the last one found is looked up in the hot set; one in neither
        goes to `miss`, a stall to `slow`.

        Why this shape (benchmarks/results/agent-internals.md, "The plain hot path"): each
        Python call here costs ~60-100 ns, so a hit calls no helper; the first argument is
        a parameter of its own, so that `model(x)` builds no argument tuple and calls the
        model as `target(x)`."""
        tensor = self.tensor
        one = type(x) is tensor and not args and not kwargs  # model(x)
        args = args if one or x is _NOTHING else (x, *args)  # all of them but in model(x)
        try:
            if one:
                sig = x.shape
            elif args or len(kwargs) != 2:
                sig = shape_signature(args, kwargs, tensor)
            else:  # model(a=, b=)
                a, b = kwargs.values()
                sig = ((a.shape, b.shape) if type(a) is tensor and type(b) is tensor
                       else shape_signature(args, kwargs, tensor))
        except Exception:  # a hijacked `.shape`: shape_signature reads each one on its own
            sig = None if one else shape_signature(args, kwargs, tensor)
        target = self.ref()._route(sig) if _settings.route_eager else self.fn
        try:
            stack = this_thread.stack
        except AttributeError:  # this thread's first watched call
            stack = new_stack()
        stack.append(sig)
        t0 = perf_counter()
        try:
            out = target(x) if one else target(*args, **kwargs)
        except BaseException as e:
            self.calls += 1
            self.failed(e, sig, t0, (x,) if one else args, kwargs)
            raise
        finally:
            if stack:  # greenlets switching inside a call pop each other's entries
                del stack[-1]
        dt = perf_counter() - t0
        self.calls += 1
        self.total += dt
        try:
            if sig != self.last:  # a hit on the last signature skips the set lookup
                if sig in self.seen:
                    self.last = sig
                elif self.miss(sig, dt, t0):
                    return out
        except Exception:  # unhashable (SymInt sizes, a hijacked `.shape`): not a shape
            pass
        if dt >= _settings.stall_s:
            self.slow(sig, dt, t0, False)
        return out

    def miss(self, sig: Any, dt: float, t0: float) -> bool:
        """`sig` is not in the hot set: report it as new (its event says whether it was a
        stall) if the memory has room and the cold memory does not hold it. True if reported.
        May raise (an unhashable signature)."""
        h = self.h
        if not h.full and (not h.spill or cold_unseen(h, sig)):
            self.slow(sig, dt, t0, True)
            return True
        return False

    def slow(self, sig: Any, dt: float, t0: float, new: bool) -> None:
        self.ref()._slow(sig, dt, t0, new)

    def failed(self, e: BaseException, sig: Any, t0: float, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        self.ref()._failed(e, sig, t0, args, kwargs)

    def totals(self) -> tuple[int, int]:
        """(calls, total ns) of the calls this path ran."""
        return self.calls, round(self.total * 1e9)


def make_call(h: _Hot, ref: weakref.ref[Any]
              ) -> tuple[Callable[..., Any], Callable[[], tuple[int, int]]]:
    """The hot path of one watched callable (what its Watched calls) and a reader of its
    running totals (calls, total ns): the C path's `Hot` over a PythonPath where it is built,
    else the PythonPath's `call` (a bound method: called faster than an instance)."""
    path = PythonPath(h, ref)
    if _hotpath is None:
        return path.call, path.totals
    hot = _hotpath.Hot(h.fn, h.tensor, h.seen, path.call, path.miss, path.slow, path.failed)

    def totals() -> tuple[int, int]:
        c_calls, c_total = hot.totals()
        return path.calls + c_calls, round((path.total + c_total) * 1e9)

    return hot, totals
