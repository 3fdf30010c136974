"""Opt-in bucketed padding of a watched model: `watch(model, "llm", pad=pad.Tokens(value=0))`.

Why: under `mode="reduce-overhead"` every distinct input length records its own CUDA graph (a
warm-up, a recording, memory). Padding lengths up to a few buckets keeps that to one graph per
bucket (the figures are in benchmarks/results/agent-internals.md). This module does
the padding for the user, and checks that it is exact.

- **What is padded** is a `Policy` (pad_policies.py): `Tokens` right-pads one dimension of
  the token ids, the masks (0) and the other sequence keywords (`position_ids`: the last
  repeated; `token_type_ids`: 0), an encoder-decoder's decoder inputs to a bucket of their own,
  then slices the outputs back to the real length (pad_outputs.py: tensors, containers,
  ModelOutput objects, HF cache objects; anything else is refused); a subclass (or `Custom`)
  brings its own length/pad/unpad.
- **The plan** (`buckets.extend`): the bucket advisor over the lengths seen, under
  `max_buckets`, starting from the configured `buckets`, refined at 32, 64, 128, ... calls (each
  time using half the buckets still free) on a short-lived thread, never on the request. A plan
  only ever adds buckets (a recorded graph is never thrown away); a length above the largest
  bucket runs unpadded.
- **Exact or off.** A padded output reaches the caller only where a check covers the call: the
  same `signature` (padded shapes, keywords, flag values: another output structure is another
  check) with no more padding than the check had, or masked padding. Else the call is checked
  first: also run unpadded on the uncompiled model, the outputs compared at the real positions
  with a tolerance for the dtype (`TOLERANCE`, relative to the reference's largest magnitude).
  A signature's first check (unmasked) also checks its bucket at the most padding, so that the
  bucket's later calls are covered; a `sample` fraction is checked again, within `check_share`
  of the time. A mismatch turns padding off for that model for good, returns the unpadded
  (correct) output, and emits a `mitigation` event (`padding`, `refused`) with the error seen.
  Checks cost one or two eager calls each, on the calls that are checked only; `padding`
  events report their count and time.
- **Memory** (`CheckMemory`): flat after warm-up. The checks' eager runs at ever new lengths
  grow the shared caching allocator, and `torch.cuda.empty_cache()` after each check would give
  that back only by making every later call cudaMalloc again (and cudaFree synchronises). So,
  three bounds, each reported in the `padding` event:
  1. A check's unpadded run and its comparison allocate in a private pool
     (`torch.cuda.MemPool` + `use_mem_pool`, which routes the calling thread's allocations only,
     on any stream: other serving threads keep the shared allocator). Where deleting a pool
     gives its segments back (~MemPool empties that pool alone, torch 2.8+; probed once, one
     2 MiB segment), each check gets a fresh pool, deleted after it ("released"): the serving
     allocations are never touched and nothing stays behind; the cost is the check's own
     cudaMalloc/cudaFree, on the checked calls only. Where it does not, one pool is kept
     for every check ("kept"): bounded by the largest check's footprint plus its own
     fragmentation. Without a thread-scoped pool (torch < 2.8, or the pool failing), checks run
     in the shared allocator ("shared", with a `check_pool_off` event).
  2. A sampled check runs only at a length no longer than one already checked (a bucket's first
     check is always run, and sets that mark): its footprint is covered, so the high-water mark
     only moves with a new bucket's first check. The trade-off: lengths above the longest
     checked are covered by their bucket's first check (the same graph, the same padding), not
     sampled again; the skipped ones are counted (`checks_skipped`).
  3. A cap, `check_memory_bytes` (256 MiB): the reserved memory sampled checks left behind,
     summed; past it sampled checks stop (a `checks_capped` event, `checks_stopped`), never
     silently. With a released pool they leave nothing; the cap bounds "kept" and "shared".
  Bucket-first checks stay: they are what makes padding exact or off. Why the pool and not the
  bounds alone: the allocator gives a large block a segment of its own size, so a later, longer
  check cannot reuse a shorter one's segments, and the shared allocator mixes them with serving
  blocks; only a pool of their own can be given back without touching the rest. Why bound 2
  still: while a check runs, memory is up by its footprint (`check_pool_bytes`); the bound keeps
  that peak at the longest warm-up check's. A refused check returns its reference output from
  the pool: that block outlives the pool until the caller drops it (once per model).

Nothing here raises into the server: a policy that fails, a padded call that fails, outputs that
cannot be sliced, all run the call unpadded; the model's own exception from that unpadded call
is the caller's, as without padding. Where the unpadded call fails the same way (an exception
of the same type: a token id beyond the vocabulary, a bad request), the error is the caller's
and padding stays on (counted, a `caller_error` event once per exception type); where it does
not, padding did it, and padding goes off for that call signature (`signature_off`) or, with
no signature yet (the policy could not read or pad the call), for the model (`refused`).
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import os
import random
import threading
import time
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from torch_watchdog import buckets as advisor
from torch_watchdog import events
from torch_watchdog.agent import settings
from torch_watchdog.agent.forks import _AFTER_FORK
from torch_watchdog.agent.pad_outputs import (  # noqa: F401 (the module's API)
    DEFAULT_TOLERANCE, TOLERANCE, Unsupported, compare, leaves, rebuild)
from torch_watchdog.agent.pad_policies import (  # noqa: F401 (the module's API)
    CHECK_MEMORY_BYTES, EDGE, STATEFUL, Custom, Policy, Tokens)

MAX_SIZES = 16_384            # distinct lengths remembered per model (the plan's input)
MAX_SIGNATURES = 4_096        # call signatures whose check is remembered per model
MAX_TOLD_ERRORS = 16          # exception types of the caller's told in an event, per model
PLAN_FIRST_AT = 32            # calls before the first plan; then at 2x, 4x, ... calls


# -- where a check's unpadded run allocates ---------------------------------------------------
def pool_unavailable() -> Optional[str]:
    """None when this torch has a private CUDA memory pool scoped to the calling thread
    (`torch.cuda.MemPool` + `use_mem_pool`, torch 2.8 or so and later), else why not. Before
    that, use_mem_pool (2.5-2.7) routed a *stream's* allocations to the pool, every thread's
    on that stream: another serving thread's allocations would land in the checks' pool."""
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not hasattr(cuda, "MemPool") or not hasattr(cuda, "use_mem_pool"):
        return "torch.cuda.MemPool is not in this torch"
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    if begin is None or isinstance(begin, type):  # a build without CUDA has a dummy class
        return "this torch's use_mem_pool is not scoped to the calling thread"
    return None


_released: dict = {}  # device index -> does deleting a MemPool give its memory back (probed)


def _release_works(device: int) -> bool:
    """Whether deleting a MemPool frees its cached segments on this torch (~MemPool calls
    emptyCache(pool id) since about 2.8; before, a pool without users waits for a process-wide
    empty_cache()). Probed once per device: at worst one 2 MiB segment stays cached."""
    if device not in _released:
        cuda = torch.cuda
        before = cuda.memory_reserved(device)
        pool = cuda.MemPool()
        with cuda.use_mem_pool(pool, device):
            # 512 bytes: one 2 MiB small-block segment (a 2 MiB tensor would take 20 MiB)
            probe = torch.empty(512, dtype=torch.uint8, device=f"cuda:{device}")
        held = cuda.memory_reserved(device)
        del probe, pool
        _released[device] = held > before and cuda.memory_reserved(device) <= before
    return _released[device]


class CheckMemory:
    """Keeps the checks' eager runs from growing the serving process's CUDA memory after
    warm-up (module docstring, "Memory"). One per padded model; `scope` wraps a check, `bound`
    says whether a sampled check may run. Never raises: a pool that fails is reported
    (`check_pool_off`) and the checks run in the shared allocator, under the same bounds."""

    def __init__(self, cap: int, emit: Callable[[str, str], None]):
        self.cap = cap
        self.emit = emit
        self.mode: Optional[str] = None   # "released" | "kept" | "shared"; None: no CUDA check
        self.pool: Any = None             # mode "kept": the one pool every check reuses
        self.longest = 0                  # the longest length checked
        self.pool_bytes = 0               # the most one check's pool reserved (its footprint)
        self.left = 0                     # reserved growth that sampled checks left behind
        self.skipped = 0
        self.stopped: Optional[str] = None

    def bound(self, n: int) -> bool:
        """May a sampled check run at length n? Only at a length no longer than one already
        checked (its footprint is covered), and while under the cap; else it is counted."""
        if self.stopped is None and n <= self.longest:
            return True
        self.skipped += 1
        return False

    @staticmethod
    def _device(args: tuple, kwargs: dict) -> Optional[int]:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor):
                return v.device.index if v.device.type == "cuda" else None
        return None

    def _off(self, why: str) -> None:
        if self.mode != "shared":
            self.mode = "shared"
            self.pool = None
            self.emit("check_pool_off", f"checks run in the shared allocator: {why}")

    @contextlib.contextmanager
    def scope(self, args: tuple, kwargs: dict, n: int, sampled: bool) -> Iterator[None]:
        self.longest = max(self.longest, n)
        device = self._device(args, kwargs)
        if device is None:  # a CPU check: no caching allocator to fragment
            yield
            return
        cuda, pool, context, before = torch.cuda, None, None, None
        try:
            before = cuda.memory_reserved(device)
            if self.mode is None:
                why = pool_unavailable()
                if why is not None:
                    self._off(why)
                else:
                    with cuda.device(device):
                        self.mode = "released" if _release_works(device) else "kept"
            if self.mode == "kept" and self.pool is None:
                with cuda.device(device):
                    self.pool = cuda.MemPool()
            if self.mode in ("released", "kept"):
                with cuda.device(device):
                    pool = self.pool if self.mode == "kept" else cuda.MemPool()
                context = cuda.use_mem_pool(pool, device)
                context.__enter__()
        except Exception as e:
            pool = None
            self._off(f"{type(e).__name__}: {events.clip(str(e), 200)}")
        try:
            yield
        finally:
            try:
                if pool is not None:
                    context.__exit__(None, None, None)
                    self.pool_bytes = max(self.pool_bytes, cuda.memory_reserved(device) - before)
                    # mode "released": the last references (the context keeps its arguments);
                    # ~MemPool gives the pool's segments back, before _account measures
                    context = pool = None
            except Exception as e:
                self._off(f"{type(e).__name__}: {events.clip(str(e), 200)}")
            self._account(device, before, sampled)

    def _account(self, device: int, before: Optional[int], sampled: bool) -> None:
        try:
            grown = torch.cuda.memory_reserved(device) - before
        except Exception:
            return
        self.charge(grown, sampled)

    def charge(self, grown: int, sampled: bool) -> None:
        """Charge what a check left reserved: a sampled check's growth counts against the cap
        (a bucket's first check is warm-up: the footprint the bounds are measured against).
        Past the cap, sampled checks stop, with a `checks_capped` event, once."""
        if not sampled or grown <= 0:
            return
        self.left += grown
        if self.left > self.cap and self.stopped is None:
            self.stopped = (f"sampled checks left {self.left} bytes reserved, over "
                            f"check_memory_bytes={self.cap}: no more sampled checks")
            self.emit("checks_capped", self.stopped)


# -- the wrapper ----------------------------------------------------------------------------
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
