"""Bucket advisor: the padding buckets that cover observed input sizes with fewest padding tokens.

Pure and stdlib only: the sidecar's report and the agent's padding (agent/pad/) both use it
(it lives beside events.py so that the agent imports nothing of the sidecar's).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Advice:
    boundaries: tuple[int, ...]          # ascending bucket sizes; the last = the largest size seen
    padding_tokens: int                  # sum over requests of (bucket - size)
    real_tokens: int                     # sum over requests of size
    padding_ratio: float                 # padding_tokens / real_tokens (0.0 when real_tokens == 0)
    graphs_before: int                   # distinct sizes observed (one CUDA graph each today)
    graphs_after: int                    # len(boundaries)
    memory_saved_bytes: Optional[int]    # graphs saved * bytes_per_graph; None if unknown

    def as_dict(self) -> dict[str, Any]:
        return {
            "boundaries": list(self.boundaries),
            "padding_tokens": self.padding_tokens,
            "real_tokens": self.real_tokens,
            "padding_ratio": self.padding_ratio,
            "graphs_before": self.graphs_before,
            "graphs_after": self.graphs_after,
            "memory_saved_bytes": self.memory_saved_bytes,
        }


def advise(counts: Mapping[int, int], max_buckets: int,
           bytes_per_graph: Optional[float] = None) -> Advice:
    """The at most `max_buckets` boundaries that minimise padding when each request of size s
    is padded to the smallest boundary >= s (exact: an optimum only ever uses observed sizes)."""
    _check_arguments(counts, max_buckets, bytes_per_graph)
    observed = sorted((size, n) for size, n in counts.items() if n > 0)
    sizes = [size for size, _ in observed]
    weights = [n for _, n in observed]
    if len(sizes) <= max_buckets:
        boundaries = tuple(sizes)
    else:
        boundaries = tuple(sizes[j] for j in _optimal_group_ends(sizes, weights, max_buckets))
    return _advice(sizes, weights, boundaries, bytes_per_graph)


def padding(counts: Mapping[int, int], boundaries: Sequence[int]) -> int:
    """Padding tokens when every request is padded up to the smallest boundary >= its size."""
    ordered = sorted(boundaries)
    total = 0
    for size, n in counts.items():
        bucket = next((b for b in ordered if b >= size), None)
        if bucket is None:
            raise ValueError(f"size {size} is larger than every boundary {ordered}")
        total += (bucket - size) * n
    return total


def varying_dimension(shapes: Iterable[Sequence[int]]) -> Optional[int]:
    """Index of the dimension with the most distinct values (ties: the last index);
    None when no dimension varies or the shapes are empty or of different ranks."""
    shapes = [tuple(shape) for shape in shapes]
    if not shapes or len({len(shape) for shape in shapes}) != 1:
        return None
    distinct = [len(set(column)) for column in zip(*shapes, strict=True)]  # one rank: checked
    best = max(distinct, default=1)
    if best <= 1:
        return None
    return len(distinct) - 1 - distinct[::-1].index(best)


def size_counts(shapes: Iterable[Sequence[int]], dim: int) -> collections.Counter[int]:
    """How many shapes have each size along dimension `dim`."""
    counter: collections.Counter[int] = collections.Counter()
    for shape in shapes:
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"shape {tuple(shape)} has no dimension {dim}")
        counter[shape[dim]] += 1
    return counter


def _check_arguments(counts: Mapping[int, int], max_buckets: int,
                     bytes_per_graph: Optional[float]) -> None:
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise ValueError(f"max_buckets must be an integer >= 1, got {max_buckets!r}")
    if bytes_per_graph is not None and not bytes_per_graph >= 0:
        raise ValueError(f"bytes_per_graph must be >= 0 or None, got {bytes_per_graph!r}")
    for size, n in counts.items():
        if n < 0:
            raise ValueError(f"count for size {size} is negative ({n}); counts must be >= 0")
        if n > 0 and size <= 0:
            raise ValueError(f"size {size} is not positive; sizes must be >= 1")


def _advice(sizes: list[int], weights: list[int], boundaries: tuple[int, ...],
            bytes_per_graph: Optional[float]) -> Advice:
    real = sum(s * n for s, n in zip(sizes, weights, strict=True))
    pad = padding(dict(zip(sizes, weights, strict=True)), boundaries) if sizes else 0
    saved = None
    if bytes_per_graph is not None:
        saved = int(round((len(sizes) - len(boundaries)) * bytes_per_graph))
    return Advice(boundaries=boundaries, padding_tokens=pad, real_tokens=real,
                  padding_ratio=pad / real if real else 0.0, graphs_before=len(sizes),
                  graphs_after=len(boundaries), memory_saved_bytes=saved)


def _optimal_group_ends(sizes: list[int], weights: list[int], k: int) -> list[int]:
    """Indices ending each of k contiguous groups of the sorted sizes, minimising padding.

    best[m][j] = min over i < j of best[m-1][i] + cost(i+1, j), with cost(i, j) =
    s_j * C(i..j) - S(i..j) in O(1) from prefix sums. The cost is Monge, so the best split
    point is non-decreasing in j and each layer is solved by divide and conquer: O(k n log n)
    instead of O(k n^2) (benchmarks/bucket_advisor.py).
    """
    n = len(sizes)
    count_prefix, token_prefix = [0], [0]
    for s, c in zip(sizes, weights, strict=True):
        count_prefix.append(count_prefix[-1] + c)
        token_prefix.append(token_prefix[-1] + s * c)
    best = [sizes[j] * count_prefix[j + 1] - token_prefix[j + 1] for j in range(n)]
    splits: list[list[int]] = []
    for layer in range(1, k):
        best, split = _next_layer(best, sizes, count_prefix, token_prefix, layer)
        splits.append(split)
    ends, j = [n - 1], n - 1
    for split in reversed(splits):
        j = split[j]
        ends.append(j)
    return ends[::-1]


def _next_layer(prev: list[Any], sizes: list[int], count_prefix: list[int],
                token_prefix: list[int], layer: int) -> tuple[list[Any], list[int]]:
    """One more group: for each end j >= layer, the best previous end i in [layer-1, j-1]."""
    n = len(sizes)
    cur: list[Any] = [math.inf] * n
    split = [0] * n
    # a[i] - s_j * b[i] + (s_j * C[j+1] - S[j+1]) is prev[i] + cost(i+1, j)
    a = [prev[i] + token_prefix[i + 1] for i in range(n)]
    b = count_prefix[1:]
    stack = [(layer, n - 1, layer - 1, n - 2)]
    while stack:
        lo, hi, opt_lo, opt_hi = stack.pop()
        if lo > hi:
            continue
        mid = (lo + hi) // 2
        s = sizes[mid]
        best_i, best_v = opt_lo, a[opt_lo] - s * b[opt_lo]
        for i in range(opt_lo + 1, min(mid - 1, opt_hi) + 1):
            v = a[i] - s * b[i]
            if v < best_v:
                best_i, best_v = i, v
        cur[mid] = best_v + s * count_prefix[mid + 1] - token_prefix[mid + 1]
        split[mid] = best_i
        stack.append((lo, mid - 1, opt_lo, best_i))
        stack.append((mid + 1, hi, best_i, opt_hi))
    return cur, split


# over the complexity bound: the search's layers and its divide and conquer in one place
def extend(counts: Mapping[int, int], fixed: Sequence[int], add: int,  # noqa: C901
           multiple: int = 1) -> tuple[int, ...]:
    """`fixed` plus at most `add` boundaries that minimise padding of `counts` given `fixed`
    (a plan only ever grows: each bucket is a recorded CUDA graph). Sizes above the largest
    boundary are covered first (each would run unpadded, a graph of its own); the rest of the
    new boundaries go where they save the most padding. Within the gaps of `fixed` the
    advisor's optimum is exact (a gap keeps its top boundary: it is given as one more request
    of that size, which pads nothing); across gaps the allocation is a small knapsack. New
    boundaries are rounded up to a multiple of `multiple`, never past the next boundary."""
    fixed = sorted({int(b) for b in fixed})
    if add <= 0:
        return tuple(fixed)
    edges = [0, *fixed]
    gaps: list[tuple[dict[int, int], Optional[int]]] = []
    for lo, hi in zip(edges, [*fixed, None], strict=True):
        sub = {s: n for s, n in counts.items() if n > 0 and s > lo and (hi is None or s <= hi)}
        if sub:
            gaps.append((sub, hi))
    # per gap: (padding, new boundaries) with j = 0..add new boundaries
    options: list[list[tuple[float, tuple[int, ...]]]] = []
    for sub, hi in gaps:
        row: list[tuple[float, tuple[int, ...]]] = []
        for j in range(min(add, len(sub)) + 1):
            if hi is None:
                if j == 0:
                    row.append((math.inf, ()))  # uncovered: not an option while slots remain
                    continue
                a = advise(sub, j)
                row.append((a.padding_tokens, a.boundaries))
            elif j == 0:
                row.append((sum((hi - s) * n for s, n in sub.items()), ()))
            else:
                a = advise({**sub, hi: sub.get(hi, 0) + 1}, j + 1)
                row.append((a.padding_tokens, tuple(b for b in a.boundaries if b != hi)))
        options.append(row)
    # knapsack over gaps: best[r] = (padding, boundaries) using r new boundaries so far
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for row in options:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (cost, chosen) in best.items():
            for j, (c, bs) in enumerate(row):
                r = used + len(bs) if j else used
                if r > add:
                    continue
                total = cost + c
                if r not in nxt or total < nxt[r][0]:
                    nxt[r] = (total, chosen + bs)
        best = nxt
    finite = {r: v for r, v in best.items() if v[0] < math.inf}
    if finite:
        _, chosen = min(finite.values(), key=lambda v: (v[0], len(v[1])))
    else:  # fewer slots than needed to cover the top: cover it with what there is
        top = {s: n for s, n in counts.items() if n > 0 and s > (fixed[-1] if fixed else 0)}
        chosen = advise(top, add).boundaries if top else ()
    out = set(fixed)
    for b in chosen:
        above = [f for f in fixed if f >= b]
        rounded = -(-b // multiple) * multiple
        out.add(min(rounded, above[0]) if above else rounded)
    return tuple(sorted(out))
