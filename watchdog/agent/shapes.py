"""The shape memory of a watched callable: the signatures seen, where the GC never walks them."""
from __future__ import annotations

import collections
import gc
from time import perf_counter_ns
from typing import Any, Callable

from torch_watchdog.agent import settings

# new_shape events are rationed per watched callable: a burst of NEW_SHAPE_BURST, then
# NEW_SHAPE_PER_S a second. Why: queued events are tracked objects until the sender's next
# tick, and a burst of them set off long collections inside watched calls. Shapes past the
# ration are still remembered and counted (`distinct`, `distinct_shapes`), and a stall on one
# still says new_shape.
NEW_SHAPE_BURST = 256
NEW_SHAPE_PER_S = 1000
# The first HOT_SHAPES shapes stay in the one set every call looks in (a 2,048-slot table holds
# up to 1,228 entries); later ones go to the cold memory, looked in only when that set misses:
# shards of ~COLD_SHARD_SHAPES keys, picked by hash. Why: a set or dict is rehashed as it grows,
# inside the call that added the shape, and small tables keep that short.
HOT_SHAPES = 1228
COLD_SHARD_SHAPES = 1024
# Fresh keys moved to the cold dicts per add. Why: a collection untracks a whole young
# generation of them at once; a few per add keep `fresh` drained and each add's share small.
SETTLE_PER_ADD = 4

_MASK = (1 << 64) - 1


def _probe(slot: int) -> int:
    """The next slot of the cold dict after `slot` (only ever needed on a hash collision)."""
    return (slot * 5 + 1) & _MASK


def cold_unseen(h: "_Hot", sig: Any) -> bool:
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
    serving threads): signature.memory_key()s, at most max_shapes, HOT_SHAPES of them in
    `seen`, the rest in the `cold` shards or, until a collection has untracked them, in `fresh`.

    Each cold shard is a dict from hash(key) to the key holding only untracked objects, so the
    dict stays untracked too and no collection ever walks it (a set is always tracked). A
    fresh key is still tracked and would track the dict again, so it waits in `fresh` (and in
    `arrival`, oldest first) until the first young collection untracks it. Hash collisions
    are resolved by probing (`_probe`): equal shapes are one key, distinct shapes two, as in a
    set. Two serving threads adding at once may move a still-tracked key: the dict is then
    tracked again (slower collections, never a wrong answer). With the GC disabled nothing is
    untracked and `fresh` holds the keys past the hot set (bounded by max_shapes).
    max_shapes: settings.current.max_shapes, read as each shape is added."""

    __slots__ = ("fn", "tensor", "seen", "cold", "fresh", "arrival", "spill", "count", "full",
                 "stall_calls", "stall_ns", "ration", "ration_ns")

    def __init__(self, fn: Callable[..., Any], tensor_type: type[Any]):
        self.fn = fn
        self.tensor = tensor_type
        self.seen: set[tuple[Any, ...]] = set()
        self.cold: list[dict[int, tuple[Any, ...]]] = []  # made when `seen` is full; see HOT_SHAPES
        self.fresh: set[tuple[Any, ...]] = set()
        # `fresh`, oldest first
        self.arrival: collections.deque[tuple[Any, ...]] = collections.deque()
        self.spill = False  # `seen` is full: look in the cold memory on a miss
        self.count = 0
        self.full = False
        # the Watched's stall totals and new_shape ration (here, not on the Watched: its
        # attributes are set through Watched.__setattr__, a Python call)
        self.stall_calls = self.stall_ns = 0
        self.ration, self.ration_ns = float(NEW_SHAPE_BURST), perf_counter_ns()

    def unseen(self, sig: Any) -> bool:
        return sig not in self.seen and (not self.spill or cold_unseen(self, sig))

    def add(self, key: tuple[Any, ...]) -> None:
        max_shapes = settings.current.max_shapes
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

    def keys(self) -> list[tuple[Any, ...]]:
        return [*self.seen, *(k for shard in self.cold for k in shard.values()), *self.arrival]
