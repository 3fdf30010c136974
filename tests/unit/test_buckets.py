import itertools
import math
import random

import pytest

from torch_watchdog.sidecar.offline.buckets import Advice, advise, size_counts, varying_dimension

MB = 1_000_000


def padded(counts, boundaries):
    """Independent of the module: pad each request to the smallest boundary >= its size."""
    return sum((min(b for b in boundaries if b >= s) - s) * n for s, n in counts.items())


def brute_force(counts, k):
    sizes = sorted(counts)
    top, rest = sizes[-1], sizes[:-1]
    return min(padded(counts, chosen + (top,))
               for r in range(min(k, len(sizes)))
               for chosen in itertools.combinations(rest, r))


def plain_dp(counts, k):
    """The O(k n^2) recurrence the module speeds up, written the obvious way."""
    sizes = sorted(counts)
    n = len(sizes)

    def cost(i, j):
        return sum((sizes[j] - sizes[t]) * counts[sizes[t]] for t in range(i, j + 1))

    best = [cost(0, j) for j in range(n)]
    for m in range(1, min(k, n)):
        best = [min((best[i] + cost(i + 1, j) for i in range(m - 1, j)), default=math.inf)
                for j in range(n)]
    return best[-1]


def random_counts(rng, max_distinct, max_size=60):
    sizes = rng.sample(range(1, max_size + 1), rng.randint(1, max_distinct))
    return {s: rng.choice([1, 1, 2, 3, 7, 40]) for s in sizes}


def test_padding_matches_brute_force_on_random_inputs():
    rng = random.Random(20240601)
    for case in range(200):
        counts = random_counts(rng, 9)
        k = rng.randint(1, len(counts))
        advice = advise(counts, k)
        expected = brute_force(counts, k)
        assert advice.padding_tokens == expected, (case, counts, k)
        assert padded(counts, advice.boundaries) == expected, (case, counts, k)
        assert len(advice.boundaries) <= k
        assert advice.boundaries[-1] == max(counts)
        assert list(advice.boundaries) == sorted(set(advice.boundaries))
        assert set(advice.boundaries) <= set(counts)


def test_padding_matches_plain_dp_on_larger_inputs():
    # Deep enough for the divide-and-conquer recursion to prune split points many times.
    rng = random.Random(7)
    for case in range(25):
        counts = random_counts(rng, 70, max_size=400)
        k = rng.randint(1, 12)
        advice = advise(counts, k)
        assert advice.padding_tokens == plain_dp(counts, k), (case, k)
        assert padded(counts, advice.boundaries) == advice.padding_tokens


@pytest.mark.parametrize("counts, k, boundaries, padding", [
    ({10: 5, 11: 5, 100: 1}, 2, (11, 100), 5),          # pad the five 10s to 11
    ({10: 5, 11: 5, 100: 1}, 1, (100,), 90 * 5 + 89 * 5),
    ({10: 1, 11: 1, 100: 50}, 2, (11, 100), 1),
    ({1: 1, 50: 1, 51: 100, 100: 1}, 2, (51, 100), 50 + 1),  # the heavy size sets the bucket
    ({8: 3, 16: 2, 32: 1}, 3, (8, 16, 32), 0),
    ({8: 3, 16: 2, 32: 1}, 64, (8, 16, 32), 0),
    ({7: 4}, 1, (7,), 0),
])
def test_worked_examples(counts, k, boundaries, padding):
    advice = advise(counts, k)
    assert advice.boundaries == boundaries
    assert advice.padding_tokens == padding


def test_enough_buckets_keeps_every_size_and_no_padding():
    counts = {s: 1 + s % 3 for s in range(32, 64)}
    advice = advise(counts, len(counts))
    assert advice.boundaries == tuple(range(32, 64))
    assert advice.padding_tokens == 0 and advice.padding_ratio == 0.0
    assert advice.graphs_before == advice.graphs_after == 32


def test_one_bucket_is_the_largest_size():
    counts = {3: 2, 9: 1, 5: 4}
    advice = advise(counts, 1)
    assert advice.boundaries == (9,)
    assert advice.padding_tokens == 6 * 2 + 4 * 4
    assert advice.graphs_after == 1


def test_memory_saved_and_padding_ratio():
    counts = {10: 5, 11: 5, 100: 1}
    advice = advise(counts, 2, bytes_per_graph=0.47 * MB)
    assert advice.graphs_before == 3 and advice.graphs_after == 2
    assert advice.memory_saved_bytes == 470_000
    assert advice.real_tokens == 50 + 55 + 100
    assert advice.padding_ratio == pytest.approx(5 / 205)
    assert advise(counts, 2).memory_saved_bytes is None
    assert advise(counts, 3, bytes_per_graph=0.47 * MB).memory_saved_bytes == 0


def test_zero_counts_are_ignored():
    advice = advise({10: 5, 11: 5, 100: 1, 500: 0, 0: 0}, 2)
    assert advice.boundaries == (11, 100)
    assert advice.graphs_before == 3


def test_empty_counts_give_empty_advice():
    advice = advise({}, 4, bytes_per_graph=MB)
    assert advice == Advice(boundaries=(), padding_tokens=0, real_tokens=0, padding_ratio=0.0,
                            graphs_before=0, graphs_after=0, memory_saved_bytes=0)


def test_as_dict_is_plain_data():
    d = advise({10: 5, 11: 5, 100: 1}, 2, bytes_per_graph=MB).as_dict()
    assert d == {"boundaries": [11, 100], "padding_tokens": 5, "real_tokens": 205,
                 "padding_ratio": pytest.approx(5 / 205), "graphs_before": 3,
                 "graphs_after": 2, "memory_saved_bytes": MB}


@pytest.mark.parametrize("counts, k, bytes_per_graph, message", [
    ({10: -1}, 2, None, "negative"),
    ({0: 3}, 2, None, "not positive"),
    ({-4: 3}, 2, None, "not positive"),
    ({10: 1}, 0, None, "max_buckets"),
    ({}, -3, None, "max_buckets"),
    ({10: 1}, 2.5, None, "max_buckets"),
    ({10: 1}, 2, -1.0, "bytes_per_graph"),
])
def test_bad_input_is_refused_with_a_reason(counts, k, bytes_per_graph, message):
    with pytest.raises(ValueError, match=message):
        advise(counts, k, bytes_per_graph)


def test_two_thousand_sizes_make_sixteen_buckets():
    """The seed scenario's shape space (benchmarks/bucket_advisor.py times it)."""
    rng = random.Random(0)
    counts = {s: rng.randint(1, 50) for s in range(32, 2049)}
    advice = advise(counts, 16, bytes_per_graph=0.47 * MB)
    assert advice.graphs_after == 16 and advice.boundaries[-1] == 2048
    assert advice.memory_saved_bytes == round((2017 - 16) * 0.47 * MB)


@pytest.mark.parametrize("shapes, dim", [
    ([(1, 12), (1, 40), (1, 12), (1, 7)], 1),                 # one sequence per request
    ([(2, 12), (4, 40), (2, 13), (4, 7)], 1),                 # seq has more distinct values
    ([(1, 12), (2, 12), (3, 12), (4, 40)], 0),                # batch has more
    ([(1, 12), (2, 40)], 1),                                  # tie: the last dimension
    ([(1, 12), (1, 12)], None),                               # nothing varies
    ([(3,), (3,)], None),
    ([(), ()], None),
    ([], None),
    ([(1, 12), (1, 12, 4)], None),                            # ragged
])
def test_varying_dimension(shapes, dim):
    assert varying_dimension(shapes) == dim
    assert varying_dimension(iter(shapes)) == dim


def test_size_counts_along_a_dimension():
    shapes = [(1, 12), (1, 40), (2, 12), (1, 7)]
    assert size_counts(shapes, 1) == {12: 2, 40: 1, 7: 1}
    assert size_counts(iter(shapes), 0) == {1: 3, 2: 1}
    assert size_counts([], 1) == {}
    with pytest.raises(ValueError, match="no dimension 2"):
        size_counts(shapes, 2)


def test_shapes_to_advice_end_to_end():
    shapes = [(1, n) for n in [10] * 5 + [11] * 5 + [100]]
    dim = varying_dimension(shapes)
    advice = advise(size_counts(shapes, dim), 2)
    assert (dim, advice.boundaries, advice.padding_tokens) == (1, (11, 100), 5)
