"""The hot path of a watched callable: the call timed and its signature looked up."""
from __future__ import annotations

import keyword
import time
import weakref
from typing import Any, Callable, Optional

from torch_watchdog.agent import native
from torch_watchdog.agent.shapes import _Hot, cold_unseen
from torch_watchdog.agent.signature import entry, other_entry, shape_signature

# Wall time around the call is enough, with no GPU sync: the stalls of warm-up, recording and
# recompiles are CPU-visible (FACTS #4).

# settings.stall_s and settings.route_eager, as this path's own globals: it reads them on every
# call, and a module global is the cheapest read there is. settings.configure() sets them (at
# settings' import, and after), as it sets the C path's (_hotpath.configure).
stall_s: float = 0.05
route_eager: Any = False


def configure(stall: float, eager: Any) -> None:
    """This path's stall threshold in seconds and eager routing (settings.configure() calls it)."""
    global stall_s, route_eager
    stall_s, route_eager = stall, eager


NO_ARG = object()  # "no first positional argument" for the hot path's signature


def make_call(h: _Hot, ref: "weakref.ref[Any]"
              ) -> tuple[Callable, Callable[[], tuple[int, int]]]:
    """The hot path of one watched callable (the function its Watched calls, see Watched), and
    a reader of its running totals (calls, total ns): one exact-type check, `.shape`, two
    clock reads, one comparison (or set lookup), two counters. `ref`: the Watched, for the
    slow paths only (a strong reference would make a cycle: the Watched holds this function).

    Each choice is for the per-call cost (benchmarks/results/agent-internals.md): `model(x)`
    binds x to a positional-only parameter on a branch of its own, with no tuple built; a
    signature equal to the last known one skips the set lookup; state is in closure variables,
    not attributes; the clock is perf_counter() (floats come from a free list); two keyword
    arguments are read by their remembered names and passed on through `_caller`. Where
    _hotpath.c is built, its `Hot` object takes `model(x)` and `model(a=, b=)` and hands every
    other call to __call__ here.
    """
    fn, tensor, seen, clock = h.fn, h.tensor, h.seen, time.perf_counter
    calls = 0
    total = 0.0  # seconds
    last: Any = NO_ARG  # the last signature found in `seen`, so it is known (see below)
    # two keyword arguments: their names in the last such call (read by name: cheaper than
    # unpacking kwargs.values()), and their last shapes found in `seen` (compared one by one:
    # no tuple to build on a hit). The signature is in the remembered names' order.
    ka = kb = ""
    la = lb = NO_ARG
    call2: Optional[Callable] = None  # _caller(ka, kb)

    def totals() -> tuple[int, int]:
        return calls, round(total * 1e9)

    def __call__(x: Any = NO_ARG, /, *args: Any, **kwargs: Any) -> Any:
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
                        if not h.full and (not h.spill or cold_unseen(h, sig)):
                            ref()._slow(sig, dt, t0, True)
                            return out
                    else:
                        last = sig
            except Exception:  # unhashable (SymInt sizes, a hijacked `.shape`): not a shape
                pass
            if dt >= stall_s:
                ref()._slow(sig, dt, t0, False)
            return out

        if x is NO_ARG and not args and len(kwargs) == 2:  # model(input_ids=, attention_mask=)
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
                sa = a.shape if type(a) is tensor else other_entry(a, tensor)
                sb = b.shape if type(b) is tensor else other_entry(b, tensor)
            except Exception:  # a hostile argument: read each one on its own
                sa, sb = entry(a, tensor), entry(b, tensor)
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
                        if not h.full and (not h.spill or cold_unseen(h, sig)):
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
            if x is not NO_ARG:
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
                    if not h.full and (not h.spill or cold_unseen(h, sig)):
                        ref()._slow(sig, dt, t0, True)
                        return out
                else:
                    last = sig
        except Exception:
            pass
        if dt >= stall_s:
            ref()._slow(sig, dt, t0, False)
        return out

    hotpath = native._hotpath
    if hotpath is None:
        return __call__, totals

    # The C path (_hotpath.Hot) takes `model(x)` and `model(a=, b=)` with tensors and hands
    # every other call to __call__ above; what it meets that is not the last shape nor a hot
    # one, a stall and a failure come back here, as on the Python path.
    def miss(sig: Any, dt: float, t0: float) -> bool:
        if not h.full and (not h.spill or cold_unseen(h, sig)):
            ref()._slow(sig, dt, t0, True)
            return True
        return False

    def slow(sig: Any, dt: float, t0: float, new: bool) -> None:
        ref()._slow(sig, dt, t0, new)

    def failed(e: BaseException, sig: Any, t0: float, args: tuple, kwargs: dict) -> None:
        ref()._failed(e, sig, t0, args, kwargs)

    hot = hotpath.Hot(fn, tensor, seen, __call__, miss, slow, failed)

    def both_totals() -> tuple[int, int]:
        c_calls, c_total = hot.totals()
        return calls + c_calls, round((total + c_total) * 1e9)

    return hot, both_totals


_CALLERS: dict = {}


def _caller(ka: str, kb: str) -> Optional[Callable]:
    """`call(fn, a, b)` that returns `fn(<ka>=a, <kb>=b)`, compiled once per pair of names;
    None if they are not plain identifiers (the call then goes through `fn(**kwargs)`). Why:
    `fn(**kwargs)` copies the dict and unpacks it again for the callee's vectorcall."""
    key = (ka, kb)
    call = _CALLERS.get(key, NO_ARG)
    if call is NO_ARG:
        call = None
        if all(k.isascii() and k.isidentifier() and not keyword.iskeyword(k) for k in key):
            if len(_CALLERS) >= 256:  # a server cycling through names: stay bounded
                _CALLERS.clear()
            scope: dict = {}
            exec(f"def call(fn, a, b):\n    return fn({ka}=a, {kb}=b)\n", scope)  # noqa: S102
            call = scope["call"]
        _CALLERS[key] = call
    return call


# The hot path's code object: inflight.current_shape() looks for frames running it.
CALL_CODE = next(c for c in make_call.__code__.co_consts
                 if getattr(c, "co_name", None) == "__call__")
