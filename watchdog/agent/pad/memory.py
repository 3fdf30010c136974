"""Where a padding check's unpadded run allocates, and what it may leave behind: `CheckMemory`,
one per padded model (padded.py), keeps the serving process's CUDA memory flat after warm-up.

The checks' eager runs at ever new lengths grow the shared caching allocator, and
`torch.cuda.empty_cache()` after each check would give that back only by making every later
call cudaMalloc again (and cudaFree synchronises). So, three bounds, each reported in the
`padding` event:
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
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from torch_watchdog import events


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
    warm-up (the module docstring). One per padded model; `scope` wraps a check, `bound`
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

