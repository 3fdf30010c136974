"""The padding wrapper: `Padded`, what `watch(..., pad=policy)` returns (`wrap`), its call
path (pad, call, check or cut back), its checks against the uncompiled model, its plan and
its `padding` events (`emit_stats`). The package docstring (pad/__init__.py) says how."""
from __future__ import annotations

import bisect
import copy
import os
import random
import threading
import time
import weakref
from time import perf_counter_ns
from typing import Any, Callable, NamedTuple, Optional

import torch

from torch_watchdog import buckets as advisor
from torch_watchdog import events
from torch_watchdog.agent import settings
from torch_watchdog.agent.forks import _AFTER_FORK
from torch_watchdog.agent.pad.memory import CheckMemory
from torch_watchdog.agent.pad.outputs import Unsupported, compare
from torch_watchdog.agent.pad.policies import CHECK_MEMORY_BYTES, Policy, Tokens

MAX_SIZES = 16_384            # distinct lengths remembered per model (the plan's input)
MAX_SIGNATURES = 4_096        # call signatures whose check is remembered per model
MAX_TOLD_ERRORS = 16          # exception types of the caller's told in an event, per model
PLAN_FIRST_AT = 32            # calls before the first plan; then at 2x, 4x, ... calls


class Padding(NamedTuple):
    """Padded arguments, for a check that runs them on the uncompiled model."""
    args: tuple
    kwargs: dict


def _tag(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.dtype, v.shape, v.device
    if v is None or isinstance(v, (bool, int, float, str)):
        return v  # flags: output_hidden_states, use_cache, return_dict
    return type(v).__name__


def _lengths(got: Any) -> Optional[tuple[int, ...]]:
    """A policy's length() (None, an int or a tuple of them) as a tuple of ints; None: the
    call is not padded."""
    if got is None:
        return None
    return tuple(map(int, got)) if isinstance(got, tuple) else (int(got),)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {events.clip(str(e), 300)}"


def _shapes(key: tuple) -> str:
    """A signature's tensor shapes (positional, then keywords by name), for a message."""
    try:
        args, kwargs = key
        tags = [*args, *(tag for _, tag in sorted(kwargs, key=lambda kv: kv[0]))]
        return ", ".join(str(list(t[1])) for t in tags if isinstance(t, tuple) and
                         len(t) == 3 and isinstance(t[1], torch.Size)) or "these shapes"
    except Exception:
        return "these shapes"


def signature(args: tuple, kwargs: dict) -> tuple:
    """What a check of a padded call vouches for: its padded arguments' shapes, dtypes and
    devices, which keywords it passes and the value of each flag (a mask passed or not,
    output_hidden_states, use_cache: another output structure, another check)."""
    return tuple(map(_tag, args)), frozenset((k, _tag(v)) for k, v in kwargs.items())


padded_models: "weakref.WeakSet[Padded]" = weakref.WeakSet()


class Padded:
    """Calls the watched model with padded inputs; other attributes are the model's.

    The serving thread reads `plan` (an immutable tuple, swapped whole by the planning
    thread) and `on`; counters are plain ints (several serving threads: best effort)."""

    def __init__(self, watched: Any, policy: Policy, name: str):
        self.__wrapped__ = watched
        self.name = name
        self.policy = copy.copy(policy)  # one per model
        self.on = True
        self.plan: tuple[int, ...] = self.policy.buckets
        # the unpadded reference: the uncompiled model, so that a check never compiles or
        # records a graph for a length of its own
        fn = getattr(watched, "__wrapped__", watched)
        self.reference = watched
        for owner, attr in ((watched, "_eager"), (fn, "_orig_mod"),
                            (fn, "_torchdynamo_orig_callable")):
            eager = getattr(owner, attr, None)
            if eager is not None:
                self.reference = eager
                break
        self.sizes: dict[int, int] = {}
        # call signature (padded arguments: keywords, flags, shapes) -> (the most padding a
        # check of it saw per axis, the layout of its outputs): the calls a check covers
        self.checked: dict[Any, tuple[tuple, Any]] = {}
        self.served: set[tuple] = set()      # lengths served through a bucket
        self.used: set[tuple] = set()        # buckets that served a call
        self.calls = self.padded_calls = self.real_tokens = self.padding_tokens = 0
        self.checks = self.check_ns = self.sampled_ns = 0
        self._since = perf_counter_ns()
        self.max_error: dict[str, float] = {}
        self.refused: Optional[str] = None
        # signatures whose padded call failed where the unpadded one did not: served unpadded
        self.off_signatures: dict[Any, str] = {}
        self.caller_errors = 0               # calls that failed padded and unpadded alike
        self._told_errors: set[str] = set()
        self._plan_at = PLAN_FIRST_AT
        self._planning = False
        self._reported: Any = None           # (calls, on, checks) at the last padding event
        self.memory = CheckMemory(
            getattr(self.policy, "check_memory_bytes", CHECK_MEMORY_BYTES),
            lambda action, detail: self._emit(action, f"{self.name}: {detail}"))
        padded_models.add(self)

    def __getattr__(self, name: str) -> Any:  # only for names not found on Padded
        if name == "__wrapped__":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<padded {self.name!r} buckets={list(self.plan)} on={self.on}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.__wrapped__
        if not self.on:
            return model(*args, **kwargs)
        try:
            got = self.policy.length(args, kwargs)
            ns = _lengths(got)
        except Exception as e:
            failed = e
        else:
            failed = None
        if failed is not None:  # outside the except: the caller's traceback is its own call's
            return self._unpadded(failed, "the policy could not read the call", None, args,
                                  kwargs)
        if not ns or min(ns) < 1:
            return model(*args, **kwargs)
        bs = self._bucket(ns)
        if bs is None or bs == ns:
            return model(*args, **kwargs)
        # the policy's own terms: an int for a policy that gave one
        n, b = (ns, bs) if isinstance(got, tuple) else (ns[0], bs[0])
        try:
            pargs, pkwargs = self.policy.pad(args, kwargs, n, b)
            key = signature(pargs, pkwargs)
        except Exception as e:
            failed = e
        if failed is not None:
            return self._unpadded(failed, "padding", None, args, kwargs)
        if key in self.off_signatures:
            return model(*args, **kwargs)
        try:
            out = model(*pargs, **pkwargs)
        except Exception as e:  # the caller's error, or padding's: the unpadded call tells
            failed = e
        if failed is not None:
            return self._unpadded(failed, "the padded call", key, args, kwargs)
        return self._padded_out(out, args, kwargs, key, (n, b, ns, bs))

    def _bucket(self, ns: tuple[int, ...]) -> Optional[tuple[int, ...]]:
        """The buckets of a call of lengths `ns`, counted as served; None above the largest
        bucket (or with no plan yet). The lengths are observed either way."""
        self._observe(ns)
        plan = self.plan
        if not plan or max(ns) > plan[-1]:
            return None
        bs = tuple(plan[bisect.bisect_left(plan, n)] for n in ns)
        self._served(ns, bs)
        return bs

    def _padded_out(self, out: Any, args: tuple, kwargs: dict, key: Any, sizes: tuple) -> Any:
        """What the caller gets of a padded call's output `out`: checked against the unpadded
        call (a signature not checked yet, more padding than checked, or a sample), else cut
        back. `sizes`: (n, b) in the policy's terms, then the lengths and buckets as tuples."""
        n, b, ns, bs = sizes
        pads = tuple(y - x for x, y in zip(ns, bs, strict=True))
        checked = self.checked.get(key)
        if checked is None or not (all(map(int.__le__, pads, checked[0])) or
                                   self.policy.masked(kwargs)):
            return self._check(out, args, kwargs, key, (n, b, ns, pads), sampled=False)
        if self.policy.sample and random.random() < self.policy.sample and \
                self._within_share() and self.memory.bound(max(ns)):
            return self._check(out, args, kwargs, key, (n, b, ns, pads), sampled=True)
        try:
            return self._unpad(out, n, b, checked[1])
        except Exception as e:
            self._refuse(f"unpadding failed: {type(e).__name__}: {e}")
            return self.__wrapped__(*args, **kwargs)

    def _unpadded(self, failed: Exception, what: str, key: Any, args: tuple,
                  kwargs: dict) -> Any:
        """`what` raised `failed`: the call runs unpadded. An exception of the same type there
        is the caller's (a token id beyond the vocabulary fails padded or not): raised to the
        caller, padding stays on. An unpadded call that succeeds, or fails otherwise, says
        padding did it: padding goes off for calls of this signature (`key`), or for the model
        where there is none yet, and the caller gets the unpadded outcome."""
        try:
            out = self.__wrapped__(*args, **kwargs)
        except Exception as e:
            if type(e) is type(failed):
                self._caller_error(e)
            else:
                self._off(key, f"{what} failed: {_error(failed)}; unpadded: {_error(e)}")
            raise
        self._off(key, f"{what} failed: {_error(failed)}")
        return out

    def _caller_error(self, e: Exception) -> None:
        """Counted; told once per exception type (bad requests are routine: no event each)."""
        self.caller_errors += 1
        name = type(e).__name__
        if name not in self._told_errors and len(self._told_errors) < MAX_TOLD_ERRORS:
            self._told_errors.add(name)
            self._emit("caller_error", f"{self.name}: a call failed padded and unpadded alike "
                       f"({_error(e)}): the caller's error, raised to it; padding stays on")

    def _off(self, key: Any, why: str) -> None:
        """Padding off for the calls of signature `key` (the whole model where None, or past
        MAX_SIGNATURES such signatures)."""
        if key is None or len(self.off_signatures) >= MAX_SIGNATURES:
            self._refuse(why)
            return
        self.off_signatures[key] = why
        self._emit("signature_off", f"padding off for {self.name}'s calls padded to "
                   f"{_shapes(key)}: {why}")

    def _within_share(self) -> bool:
        """Sampled checks take at most `check_share` of the time since the model was wrapped
        (a check is an eager run: on a GPU, tens of ms); past it they are skipped, counted."""
        if self.sampled_ns < self.policy.check_share * (perf_counter_ns() - self._since):
            return True
        self.memory.skipped += 1
        return False

    def _unpad(self, out: Any, n: Any, b: Any, layout: Any) -> Any:
        return self.policy.unpad(out, n, b) if layout is None else \
            self.policy.unpad(out, n, b, layout)

    # -- bookkeeping (never raises) ----------------------------------------------------------
    def _observe(self, ns: tuple) -> None:
        self.calls += 1
        sizes = self.sizes
        for n in ns:
            if n in sizes:
                sizes[n] += 1
            elif len(sizes) < MAX_SIZES:
                sizes[n] = 1
        if self.calls >= self._plan_at and not self._planning:
            self._plan_at *= 2
            if len(self.plan) < self.policy.max_buckets:
                self._planning = True
                try:  # another serving thread may be adding a length: then plan next time
                    threading.Thread(target=self._replan, args=(dict(sizes), self.plan),
                                     name="torch-watchdog-pad-plan", daemon=True).start()
                except Exception:
                    self._planning = False

    def _served(self, ns: tuple, bs: tuple) -> None:
        self.padded_calls += 1
        self.real_tokens += sum(ns)
        self.padding_tokens += sum(bs) - sum(ns)
        if len(self.served) < MAX_SIZES:
            self.served.add(ns)
        self.used.add(bs)

    def _replan(self, sizes: dict[int, int], plan: tuple[int, ...]) -> None:
        """On a thread of its own: the advisor's plan with the buckets still free (half of
        them, at least one: later traffic refines the rest), swapped in whole."""
        try:
            free = self.policy.max_buckets - len(plan)
            new = advisor.extend(sizes, plan, max(1, free // 2), self.policy.multiple)
            if new != plan and self.on:
                self.plan = new
                self._emit("engaged" if not plan else "plan",
                           f"{len(new)} buckets from {len(sizes)} lengths seen: {list(new)}")
        except Exception:
            pass
        finally:
            self._planning = False

    def _check(self, out: Any, args: tuple, kwargs: dict, key: Any, call: tuple,
               sampled: bool) -> Any:
        """A check of this call: its unpadded run compared with the padded output. Passed,
        it vouches for the call's signature (`_vouch`); failed, padding goes off and the
        caller gets the unpadded output. `call` is (length, bucket) in the policy's terms,
        then the lengths and pads per axis."""
        n, b, ns, pads = call
        t0 = perf_counter_ns()
        ok, errors, problem, served, reference, layout = self._compare(
            out, args, kwargs, n, b, max(ns), sampled)
        if reference is None and not ok:
            self._refuse(problem or "the check did not run")
            return self.__wrapped__(*args, **kwargs)
        self._count(t0, errors, sampled)
        if not ok:
            padded = "/".join(str(x + p) for x, p in zip(ns, pads, strict=True))
            self._refuse(f"length {'/'.join(map(str, ns))} padded to {padded}: {problem}",
                         max(errors.values(), default=None))
            return reference  # the unpadded output: this caller still gets the right answer
        if key not in self.checked and not self.policy.masked(kwargs):
            pads = self._widen(args, kwargs, call, layout)
        self._vouch(key, pads, layout)
        return served

    def _compare(self, out: Any, args: tuple, kwargs: dict, n: Any, b: Any, longest: int,
                 sampled: bool) -> tuple:
        """(ok, errors, problem, served, reference, layout): the unpadded run and the
        comparison, inside CheckMemory's scope (a private CUDA pool where there is one):
        their allocations never mix with the serving ones. `out` is the padded output, or
        the padded arguments (a `Padding`) to run on the uncompiled model in that scope, whose
        output is then dropped in it too. The reference is kept only where the check failed
        (the caller's answer); None where it could not run."""
        ok, errors, problem, served, reference, layout = False, {}, None, None, None, None
        try:
            with self.memory.scope(args, kwargs, longest, sampled):
                inside = isinstance(out, Padding)
                try:
                    if inside:
                        out = self.reference(*out.args, **out.kwargs)
                    reference = self.reference(*args, **kwargs)
                except Exception as e:  # nothing checked: nothing padded goes back
                    problem = (f"the check's unpadded run failed: {type(e).__name__}: "
                               f"{events.clip(str(e), 300)}")
                if problem is None:
                    try:
                        layout = self.policy.learn(out, reference, n, b)
                        served = self._unpad(out, n, b, layout)
                        ok, errors, problem = compare(served, reference, self.policy.tolerance)
                    except Exception as e:
                        ok, errors, problem = False, {}, (
                            str(e) if isinstance(e, Unsupported) else
                            f"comparison failed: {type(e).__name__}: {e}")
                    if ok:
                        reference = None  # freed inside the scope: back to the pool
                if inside:  # the same: an output of the pool must not outlive it
                    out = served = None
        except Exception:  # CheckMemory never raises; this is belt and braces
            pass
        return ok, errors, problem, served, reference, layout

    def _widen(self, args: tuple, kwargs: dict, call: tuple, layout: Any) -> tuple:
        """A signature's first check passed: the same bucket at its most padding is checked
        too (the call's own first axis cut to one more than the bucket below), so that the
        later calls of the bucket need no check of their own. Both runs are the uncompiled
        model's: the first check found the compiled graph equal to it at this shape, and a
        second call of a CUDA-graph model would overwrite the output the caller is about to
        get. Returns the padding covered: the most, or the call's where that check could
        not run."""
        n, b, ns, pads = call
        plan = self.plan
        i = bisect.bisect_left(plan, ns[0] + pads[0])
        short = (plan[i - 1] if i > 0 else 0) + 1
        if short >= ns[0] or not hasattr(self.policy, "shorten"):
            return pads
        t0 = perf_counter_ns()
        try:
            shorter = (short, *ns[1:])
            n2 = shorter if isinstance(n, tuple) else short
            sargs, skwargs = self.policy.shorten(args, kwargs, n2)
            padded = Padding(*self.policy.pad(sargs, skwargs, n2, b))
        except Exception:
            return pads  # the records rule still holds: longer pads are checked when they come
        ok, errors, problem, _, reference, _ = self._compare(padded, sargs, skwargs, n2, b,
                                                             ns[0] + pads[0], False)
        if reference is None and not ok:
            return pads
        self._count(t0, errors, False)
        if not ok:
            self._refuse(f"length {short} padded to {ns[0] + pads[0]} (the bucket's most "
                         f"padding): {problem}", max(errors.values(), default=None))
            return pads
        return (ns[0] + pads[0] - short, *pads[1:])

    def _count(self, t0: int, errors: dict, sampled: bool) -> None:
        spent = perf_counter_ns() - t0
        self.checks += 1
        self.check_ns += spent
        if sampled:
            self.sampled_ns += spent
        for dtype, err in errors.items():
            self.max_error[dtype] = max(self.max_error.get(dtype, 0.0), err)

    def _vouch(self, key: Any, pads: tuple, layout: Any) -> None:
        """A passed check covers its signature's calls up to the padding it had; one whose
        layout was ambiguous covers none (the next call of the signature is checked)."""
        if getattr(layout, "ambiguous", False):
            return
        before = self.checked.get(key)
        if before is not None:
            pads = tuple(map(max, pads, before[0]))
        elif len(self.checked) >= MAX_SIGNATURES:
            self._refuse(f"more than {MAX_SIGNATURES} call signatures: each needs a check")
            return
        self.checked[key] = (pads, layout)

    def _refuse(self, why: str, error: Optional[float] = None) -> None:
        if not self.on:
            return
        self.on = False
        self.refused = why
        self._emit("refused", f"padding off for {self.name}: {why}", error)

    def _emit(self, action: str, detail: str, error: Optional[float] = None) -> None:
        try:
            finite = error if error is not None and error == error and error != float("inf") \
                else None
            settings.current.emit(events.Mitigation(
                t=time.time(), pid=os.getpid(), name="padding", action=action,
                detail=events.clip(detail, 500), model=self.name, error=finite,
                buckets=list(self.plan)))
        except Exception:
            pass

    def stats(self) -> events.Padding:
        """Totals since the model was wrapped, as a `padding` event."""
        return events.Padding(
            t=time.time(), pid=os.getpid(), name=self.name, on=self.on,
            buckets=list(self.plan), calls=self.calls, padded_calls=self.padded_calls,
            real_tokens=self.real_tokens, padding_tokens=self.padding_tokens,
            checks=self.checks, check_seconds=self.check_ns / 1e9,
            max_error={k: v for k, v in self.max_error.items() if v == v and v != float("inf")},
            recordings_saved=max(0, len(self.served) - len(self.used)),
            check_pool=self.memory.mode,
            check_pool_bytes=self.memory.pool_bytes
            if self.memory.mode in ("released", "kept") else None,
            check_left_bytes=self.memory.left if self.memory.mode else None,
            checks_skipped=self.memory.skipped, checks_stopped=self.memory.stopped)


def _after_fork() -> None:
    """A forked child has no planning thread: whatever the parent's was doing, plan again."""
    for p in list(padded_models):
        p._planning = False


def emit_stats(emit: Callable[[events.Event], None]) -> None:
    """A `padding` event per padded model that had calls, a check or a refusal since the last
    (the agent's thread, every heartbeat)."""
    for p in list(padded_models):
        try:
            # calls, and what a call changes after it is counted (its check, a refusal): a
            # heartbeat between the two would otherwise leave `on` and the checks stale
            key = (p.calls, p.on, p.checks)
            if key != p._reported:
                p._reported = key
                emit(p.stats())
        except Exception:
            pass


def wrap(watched: Any, policy: Any, name: str) -> Padded:
    """`watch(..., pad=policy)`: True is `Tokens()` (pad token 0, dimension 1), False none."""
    if isinstance(watched, Padded) or policy is False:
        return watched
    if isinstance(getattr(watched, "__wrapped__", None), Padded):
        return watched.__wrapped__  # watch(padded, pad=...): already padded, once is enough
    if policy is True:
        policy = Tokens()
    if not isinstance(policy, Policy):
        raise TypeError(f"pad= needs a torch_watchdog.agent.pad.Policy (Tokens, Custom) or True, "
                        f"got {type(policy).__name__}")
    return Padded(watched, policy, name)


_AFTER_FORK.append(_after_fork)
