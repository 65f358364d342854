"""The vectorized cache replay (engram.tools.cache_policy) against plain per-read loops that
follow the policies' written rules, on small seeded streams."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from engram.tools.cache_policy import CompactStream, DynamicParams, best_static_hits, capacity_for, replay


def _steps(reads, step_reads):
    return [reads[i:i + step_reads] for i in range(0, len(reads), step_reads)]


def _count(step, cached):
    hits = sum(1 for r in step if r in cached)
    unique = set(step)
    return hits, len(unique), sum(1 for r in unique if r in cached)


def reference_lru(reads, step_reads, capacity, hot):
    cache = collections.OrderedDict((r, None) for r in reversed(hot[:capacity]))  # hottest most recent
    totals = np.zeros(3, dtype=np.int64)
    for step in _steps(reads, step_reads):
        totals += _count(step, cache)
        for r in step:
            cache.pop(r, None)
            cache[r] = None
            while len(cache) > capacity:
                cache.popitem(last=False)
    return totals


def reference_dynamic(reads, step_reads, capacity, hot, hot_counts, profile_steps, ways, age_steps, admit_ties,
                      recency=False):
    ways = min(ways, capacity)
    num_sets = max(1, capacity // ways)
    sets = [dict() for _ in range(num_sets)]  # row -> score, at most `ways` rows each
    for row, count in zip(hot[:capacity], hot_counts[:capacity]):
        if len(sets[row % num_sets]) < ways:
            sets[row % num_sets][row] = 0 if recency else max(1, -(-count // profile_steps))
    totals = np.zeros(3, dtype=np.int64)
    for k, step in enumerate(_steps(reads, step_reads)):
        cached = {r for s in sets for r in s}
        totals += _count(step, cached)
        if k > 0 and k % age_steps == 0 and not recency:
            for s in sets:
                for r in s:
                    s[r] //= 2
        counts = collections.Counter(step)
        candidates = []
        for row, c in counts.items():
            if row in cached:
                sets[row % num_sets][row] = k + 1 if recency else sets[row % num_sets][row] + c
            else:
                candidates.append((row % num_sets, -(k + 1) if recency else -c, row))
        inserted = set()
        for set_index, negative, row in sorted(candidates):
            s = sets[set_index]
            if len(s) < ways:
                s[row] = -negative
                inserted.add(row)
                continue
            # lowest score among rows not inserted in this step; ties: the way filled first (dicts
            # keep insertion order, and a replaced way's new row takes its place)
            old = [r for r in s if r not in inserted]
            if not old:
                continue
            victim = min(old, key=lambda r: s[r])
            if -negative > s[victim] or (admit_ties and -negative == s[victim]):
                inserted.add(row)
                sets[set_index] = {(row if r == victim else r): (-negative if r == victim else v) for r, v in s.items()}
    return totals


def _stream(rng, num_reads, num_rows, skew=1.3):
    return (rng.zipf(skew, num_reads) * 7919 % num_rows).astype(np.int64)


def _result_totals(result):
    return np.array([result.hits, result.fetches, result.fetch_hits])


@pytest.mark.parametrize("capacity", [1, 3, 17, 64])
def test_lru_matches_a_per_read_loop(rng, capacity):
    reads = _stream(rng, 3000, 500)
    step_reads = int(rng.integers(1, 200))
    hot = rng.permutation(500)[:int(rng.integers(0, 40))]
    stream = CompactStream(reads, step_reads, extra_rows=hot)
    got = replay(stream, capacity, "lru", initial=True)
    assert got.reads == len(reads)
    np.testing.assert_array_equal(_result_totals(got), reference_lru(list(reads), step_reads, capacity, list(hot)))


@pytest.mark.parametrize("admit_ties", [True, False])
@pytest.mark.parametrize("capacity,ways,age_steps", [(1, 8, 1), (5, 2, 1), (16, 4, 3), (50, 8, 2), (64, 64, 5)])
def test_dynamic_matches_a_per_read_loop(rng, capacity, ways, age_steps, admit_ties):
    reads = _stream(rng, 3000, 400)
    step_reads = int(rng.integers(20, 300))
    hot = rng.permutation(400)[:int(rng.integers(0, 60))]
    hot_counts = rng.integers(1, 50, len(hot))
    stream = CompactStream(reads, step_reads, extra_rows=hot)
    got = replay(stream, capacity, "dynamic", initial=True, initial_counts=hot_counts, profile_steps=3,
                 params=DynamicParams(ways=ways, age_steps=age_steps, admit_ties=admit_ties))
    expected = reference_dynamic(list(reads), step_reads, capacity, list(hot), list(hot_counts), 3, ways, age_steps,
                                 admit_ties)
    np.testing.assert_array_equal(_result_totals(got), expected)


@pytest.mark.parametrize("capacity,ways", [(1, 8), (6, 2), (40, 8)])
def test_set_associative_lru_matches_a_per_read_loop(rng, capacity, ways):
    reads = _stream(rng, 3000, 400)
    step_reads = int(rng.integers(20, 300))
    hot = rng.permutation(400)[:int(rng.integers(0, 60))]
    stream = CompactStream(reads, step_reads, extra_rows=hot)
    got = replay(stream, capacity, "dynamic", initial=True, params=DynamicParams(ways=ways, recency=True))
    expected = reference_dynamic(list(reads), step_reads, capacity, list(hot), [1] * len(hot), 1, ways, 1, True,
                                 recency=True)
    np.testing.assert_array_equal(_result_totals(got), expected)


def test_static_and_best_static(rng):
    reads = _stream(rng, 2000, 300)
    hot = rng.permutation(300)[:30]
    stream = CompactStream(reads, 100, extra_rows=hot)
    got = replay(stream, 20, "static", initial=True)
    cached = set(hot[:20].tolist())
    assert got.hits == sum(1 for r in reads if r in cached)
    counts = sorted(collections.Counter(reads.tolist()).values(), reverse=True)
    assert best_static_hits(stream, 20) == sum(counts[:20])
    assert got.hits <= best_static_hits(stream, 20)


def test_stream_ceiling_counts_first_touches(rng):
    reads = _stream(rng, 1000, 200)
    stream = CompactStream(reads, 64)
    assert stream.first_touches == len(set(reads.tolist()))
    # An LRU as large as the stream's distinct rows reaches the ceiling but for in-step first reads.
    result = replay(stream, len(stream.rows), "lru")
    assert result.hits <= stream.num_reads - stream.first_touches


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), "0.1"])
def test_fraction_outside_range_is_named(fraction):
    with pytest.raises(ValueError, match="fraction"):
        capacity_for(fraction, 1000)


def test_bad_policy_is_named(rng):
    stream = CompactStream(_stream(rng, 100, 50), 10)
    with pytest.raises(ValueError, match="policy.*'mru'"):
        replay(stream, 5, "mru")


@pytest.mark.parametrize("policy, params", [("set-lru", DynamicParams()), ("dynamic", DynamicParams(ways=4)),
                                            ("lru", DynamicParams())])
def test_replay_memory_follows_the_stream_not_the_capacity(rng, policy, params):
    """A cache of 20M rows (fraction 1.0 of a large table) over a stream of 20k reads: the replay's
    arrays stay the stream's size (tracemalloc sees numpy's allocations)."""
    import tracemalloc

    reads = (rng.zipf(1.2, 20_000) * 104_729 % 300_000_000).astype(np.int64)
    hot = np.unique(rng.integers(0, 300_000_000, 600))[:500]
    stream = CompactStream(reads, 1000, extra_rows=rng.permutation(hot))
    tracemalloc.start()
    try:
        replay(stream, 20_000_000, policy, initial=True, params=params)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 30 * 2**20, f"replay of {len(reads)} reads peaked at {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("recency", [False, True])
def test_sparse_sets_match_a_per_read_loop(rng, recency):
    """Rows spread over many more sets than the stream touches: the same hits as the plain loop."""
    reads = (rng.zipf(1.3, 4000) * 7919 % 1_000_000).astype(np.int64)
    hot = rng.permutation(np.unique(rng.integers(0, 1_000_000, 60)))[:50]
    hot_counts = rng.integers(1, 40, len(hot))
    stream = CompactStream(reads, 250, extra_rows=hot)
    capacity, ways = 40_000, 8
    got = replay(stream, capacity, "dynamic", initial=True, initial_counts=hot_counts, profile_steps=2,
                 params=DynamicParams(ways=ways, age_steps=3, recency=recency))
    expected = reference_dynamic(list(reads), 250, capacity, list(hot), list(hot_counts), 2, ways, 3, True,
                                 recency=recency)
    np.testing.assert_array_equal(_result_totals(got), expected)


def test_replay_reports_its_steps():
    steps = []

    class Bar:
        def update(self, n):
            steps.append(n)

    stream = CompactStream(np.arange(100) % 7, 10)
    for policy in ("static", "lru", "dynamic", "set-lru"):
        steps.clear()
        replay(stream, 3, policy, progress=Bar())
        assert sum(steps) == stream.num_steps == 10


def test_sorted_unique_equals_numpys(rng):
    from engram.tools.cache_policy import sorted_unique

    for size in (0, 1, 2, 1000, 100_000):
        values = rng.integers(0, max(1, size // 3), size=size, dtype=np.int64)
        assert np.array_equal(sorted_unique(values), np.unique(values))


def test_set_layout_numbers_the_occupied_sets_in_table_order(rng):
    """Both ways of numbering sets (a presence map for a few sets per row, a sort for very many) give
    each compact id its set's rank among the occupied sets, and the initial content is each set's
    hottest rows while it has ways; a second replay of one capacity reuses it."""
    from engram.tools.cache_policy import _set_layout

    reads = rng.integers(0, 10**9, size=3000, dtype=np.int64)
    hot = rng.permutation(np.unique(reads))[:500]
    stream = CompactStream(reads, 64, extra_rows=hot)
    for num_sets in (7, 1000, 8 * len(stream.rows) + (1 << 20) + 1):
        ways = 4
        set_of, used, keep, slots = _set_layout(stream, num_sets, ways, stream.extra_ids)
        table_sets = stream.rows % num_sets
        occupied = np.unique(table_sets)
        assert used == len(occupied) and np.array_equal(set_of, np.searchsorted(occupied, table_sets))
        taken = collections.Counter()
        expected_keep = []
        for position, compact in enumerate(stream.extra_ids):
            if taken[set_of[compact]] < ways:
                expected_keep.append(position)
                taken[set_of[compact]] += 1
        assert sorted(keep.tolist()) == expected_keep
        assert len(set(slots.tolist())) == len(slots) and (slots // ways == set_of[stream.extra_ids[keep]]).all()
        assert _set_layout(stream, num_sets, ways, stream.extra_ids)[0] is set_of
