"""The disk tier's RAM row cache: the rows it serves, its hits against engram.tools.cache_policy's set-lru
replay of the same stream (what `engram profile tiers` predicts), a failed read leaving it unchanged, and
calls from several threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engram.table.disk.ram_cache import EMPTY, RamRowCache
from engram.tools.cache_policy import CompactStream, DynamicParams, capacity_for, replay

ROW_BYTES = 16


def rows_of(ids: np.ndarray) -> torch.Tensor:
    """``uint8 [N, ROW_BYTES]``: a row that names its id (its int64 bytes, twice)."""
    ids = np.asarray(ids, dtype=np.int64)
    return torch.from_numpy(np.repeat(ids[:, None], 2, axis=1).copy()).view(torch.uint8).reshape(-1, ROW_BYTES)


def disk_read(calls: list):
    def read(ids: np.ndarray, out: torch.Tensor) -> None:
        calls.append(ids.copy())
        out.copy_(rows_of(ids))
    return read


def skewed_steps(rng, steps: int, rows: int, per_step: int) -> list[np.ndarray]:
    """Each step's distinct ids, ascending: half from a hot range, half uniform."""
    hot = rng.integers(0, rows, 40)
    out = []
    for _ in range(steps):
        ids = np.concatenate([rng.choice(hot, per_step // 2), rng.integers(0, rows, per_step - per_step // 2)])
        out.append(np.unique(ids))
    return out


@pytest.mark.parametrize("capacity, ways", [(100, 8), (3, 8), (64, 16), (1, 1)])
def test_hits_and_misses_equal_the_set_lru_replay(capacity, ways, rng):
    rows, calls = 500, []
    steps = skewed_steps(rng, 60, rows, 50)
    cache = RamRowCache(capacity, ROW_BYTES, ways)
    live_hits, live_misses = 0, []
    for ids in steps:
        out = torch.full((ids.size, ROW_BYTES), 0xAA, dtype=torch.uint8)
        before = cache.cached(ids)
        calls.clear()
        hits = cache.serve(ids, out, disk_read(calls))
        assert torch.equal(out, rows_of(ids)), "served rows are not the rows of their ids"
        assert hits == int(before.sum())
        missed = calls[0] if calls else np.zeros(0, dtype=np.int64)
        assert np.array_equal(missed, ids[~before]), "the disk read is not exactly the misses"
        live_hits += hits
        live_misses.append(missed)
    replayed_misses = []
    result = replay(CompactStream.from_steps(steps), capacity, "set-lru", params=DynamicParams(ways=ways),
                    misses=replayed_misses)
    assert live_hits == result.hits > 0
    for k, (live, replayed) in enumerate(zip(live_misses, replayed_misses)):
        assert np.array_equal(live, replayed), f"step {k}: misses differ"
    assert cache.stats["hits"] == live_hits and cache.stats["calls"] == len(steps)


def test_sizing_follows_the_replay_and_zero_keeps_nothing():
    for fraction, rows in ((0.1, 1000), (0.001, 50), (1.0, 7), (0.37, 12345)):
        cache = RamRowCache.for_fraction(fraction, rows, ROW_BYTES)
        capacity = capacity_for(fraction, rows)
        assert cache.ways == min(8, capacity) and cache.num_sets == max(1, capacity // cache.ways)
    empty = RamRowCache.for_fraction(0, 1000, ROW_BYTES)
    assert empty.num_slots == 0 and empty.nbytes == 0
    calls = []
    out = torch.empty(3, ROW_BYTES, dtype=torch.uint8)
    ids = np.array([2, 5, 9])
    assert empty.serve(ids, out, disk_read(calls)) == 0 and empty.serve(ids, out, disk_read(calls)) == 0
    assert torch.equal(out, rows_of(ids)) and len(calls) == 2


def test_failed_read_admits_nothing(rng):
    cache = RamRowCache(40, ROW_BYTES, 4)
    first = np.unique(rng.integers(0, 300, 30))
    cache.serve(first, torch.empty(first.size, ROW_BYTES, dtype=torch.uint8), disk_read([]))
    tags, scores, step, stats = cache.tags.copy(), cache.scores.copy(), cache.step, dict(cache.stats)
    rows = cache.rows.clone()

    def failing(ids, out):
        out[: ids.size // 2] = 0x55   # a part written, then the failure
        raise OSError("disk gone")

    second = np.unique(np.concatenate([first[:5], rng.integers(300, 600, 20)]))
    with pytest.raises(OSError, match="disk gone"):
        cache.serve(second, torch.empty(second.size, ROW_BYTES, dtype=torch.uint8), failing)
    assert np.array_equal(cache.tags, tags) and np.array_equal(cache.scores, scores) and cache.step == step
    assert torch.equal(cache.rows, rows) and cache.stats == stats
    cached = cache.tags[cache.tags != EMPTY]
    slots = np.flatnonzero((cache.tags != EMPTY).reshape(-1))
    assert torch.equal(cache.rows[torch.from_numpy(slots)], rows_of(cached)), "a slot holds another id's row"


def test_calls_from_several_threads_serve_their_rows(rng):
    cache = RamRowCache(64, ROW_BYTES, 8)
    streams = [skewed_steps(np.random.default_rng(rng.integers(2**32)), 40, 400, 30) for _ in range(3)]
    failures = []

    def run(steps):
        for ids in steps:
            out = torch.empty(ids.size, ROW_BYTES, dtype=torch.uint8)
            cache.serve(ids, out, disk_read([]))
            if not torch.equal(out, rows_of(ids)):
                failures.append(ids)

    threads = [threading.Thread(target=run, args=(steps,)) for steps in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures and cache.stats["calls"] == 120
    held = cache.tags[cache.tags != EMPTY]
    assert held.size == np.unique(held).size and np.all(held % cache.num_sets ==
                                                        np.nonzero(cache.tags != EMPTY)[0])
