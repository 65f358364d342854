"""Placement "cached": the row cache's index and update rule, the cached-lookup kernels and the placement.

* unmarked tests: the index invariants and the update rule (plain torch on the CPU), argument errors;
* ``interpreter`` tests (``TRITON_INTERPRET=1``): the kernels through the cache equal the plain gather
  kernel on the whole table bit for bit, empty, hot-loaded and after updates that replaced rows, with ids
  outside the table, every access bounds-checked; a fuzz of update / lookup sequences; the placement
  through ``EngramTable`` on CPU tensors;
* ``gpu`` tests (seeded: a failure names its seed, ``ENGRAM_TEST_SEED`` replays it): ``cached`` equals
  ``device`` bit for bit at T in {1, 63, 1000} after the set-lru and dynamic policies replaced rows, with a static hot set
  (``load_hot_rows``, int32 and int64 ids), and through lookups captured in a CUDA graph that keep serving
  the right rows across updates and hot-set loads.

Outputs are poisoned before each launch; tables hold every E4M3 byte (NaN patterns too) and every finite
scale byte, so a byte taken from the wrong row or slot shows.
"""

from __future__ import annotations

import os

import pytest
import torch

import engram
from conftest import (POISON_BYTE, assert_layers_equal, assert_lookups_equal, capture_cuda_graph, memory_on_cuda,
                      replay_poisoned)
from engram.table.host_memory.rows import pack_rows
from engram.table.placements.row_cache import COUNTER_MAX, RowCache, cached_lookup_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


def _table(num_rows: int, head_dim: int, generator: torch.Generator):
    """``PackedRows`` of ``num_rows`` random rows: every E4M3 byte and every scale byte 0..254, shuffled (NaN
    and infinite rows included: tables over them are raw bytes, ``check_values=False``)."""
    value_count, scale_count = num_rows * head_dim, num_rows * (head_dim // 32)
    values = (torch.arange(value_count) % 256)[torch.randperm(value_count, generator=generator)].to(torch.uint8)
    scales = (torch.arange(scale_count) % 255)[torch.randperm(scale_count, generator=generator)].to(torch.uint8)
    return pack_rows(values.view(num_rows, head_dim), scales.view(num_rows, head_dim // 32))


def _ids(tokens: int, columns: int, num_rows: int, row_start: int, generator: torch.Generator,
         dtype=torch.int64, hot: int | None = None, hot_start: int = 0) -> torch.Tensor:
    """``[T, C]`` global ids, skewed (half from the ``hot`` rows from local row ``hot_start`` on,
    wrapping), about 1 in 8 outside the table."""
    hot = max(1, num_rows // 8) if hot is None else hot
    count = tokens * columns
    local = torch.randint(0, num_rows, (count,), generator=generator)
    skewed = torch.rand(count, generator=generator) < 0.5
    local = torch.where(skewed, (hot_start + torch.randint(0, hot, (count,), generator=generator)) % num_rows, local)
    outside = torch.rand(count, generator=generator) < 0.125
    far = torch.where(torch.rand(count, generator=generator) < 0.5,
                      -1 - torch.randint(0, 50, (count,), generator=generator),
                      num_rows + torch.randint(0, 50, (count,), generator=generator))
    local = torch.where(outside, far, local)
    return (local + row_start).clamp(min=0).view(tokens, columns).to(dtype)


def _check_invariants(cache: RowCache, rows) -> None:
    """Each held row in its own set, in at most one way, its bytes those of the table; empty slots count 0."""
    tags, counters = cache.tags, cache.counters
    held = tags >= 0
    sets = torch.arange(cache.num_sets)[:, None].expand_as(tags)
    assert bool((tags[held] % cache.num_sets == sets[held]).all()), "a row outside its set"
    assert tags[held].unique().numel() == int(held.sum()), "a row in two ways"
    assert bool((tags[held] < rows.num_rows).all())
    assert int(counters[~held].abs().sum()) == 0 and bool((counters >= 0).all())
    assert bool((counters <= COUNTER_MAX).all())
    slots = torch.nonzero(held.reshape(-1)).squeeze(1)
    assert torch.equal(cache.slot_values[slots], rows.values[tags.reshape(-1)[slots]])
    assert torch.equal(cache.slot_scales[slots], rows.scales[tags.reshape(-1)[slots]])
    assert int(cache._tags[-1]) == -1 and int(cache._counters[-1]) == 0  # the trash entry


# ---------------------------------------------------------------------------
# the index and the update rule (plain torch)
# ---------------------------------------------------------------------------
def test_update_admits_misses_and_keeps_the_invariants(seed):
    generator = torch.Generator().manual_seed(seed)
    rows = _table(300, 64, generator)
    cache = RowCache(48, 64, "cpu", ways=4)
    assert (cache.num_sets, cache.num_slots) == (12, 48)
    for _ in range(12):
        ids = _ids(17, 5, 300, 0, generator)
        cache.update(ids, rows.values, rows.scales)
        _check_invariants(cache, rows)
        hit, _ = cache.probe(ids.reshape(-1), 300)
        # After its update every hot, read row of a set with room is held: hits exist.
    assert int(hit.sum()) > 0
    assert 0 < cache.held_rows().numel() <= 48


def test_replacement_rule_and_aging():
    rows = _table(64, 32, torch.Generator().manual_seed(0))
    cache = RowCache(2, 32, "cpu", ways=2, aging_interval=3)  # one set of two ways
    assert cache.num_sets == 1
    cache.update(torch.tensor([5, 5, 5, 7]), rows.values, rows.scales)  # both admitted (empty ways)
    assert sorted(cache.held_rows().tolist()) == [5, 7]
    assert sorted(cache.counters.reshape(-1).tolist()) == [1, 3]
    # Row 11 (read twice) takes the lowest way (row 7, counter 1); row 9 (once) then meets row 5's 4: dropped.
    cache.update(torch.tensor([9, 11, 11, 5]), rows.values, rows.scales)
    assert sorted(cache.held_rows().tolist()) == [5, 11]
    counts = dict(zip(cache.tags.reshape(-1).tolist(), cache.counters.reshape(-1).tolist()))
    assert counts == {5: 4, 11: 2}
    cache.update(torch.tensor([-1, 64, 1000]), rows.values, rows.scales)  # step 2: ids outside the table ignored
    counts = dict(zip(cache.tags.reshape(-1).tolist(), cache.counters.reshape(-1).tolist()))
    assert counts == {5: 4, 11: 2}
    cache.update(torch.tensor([11]), rows.values, rows.scales)  # step 3 (a multiple of 3): halved, then counted
    counts = dict(zip(cache.tags.reshape(-1).tolist(), cache.counters.reshape(-1).tolist()))
    assert counts == {5: 2, 11: 2}
    _check_invariants(cache, rows)
    # A tie admits: row 13 read twice replaces a way of counter 2 (the lower way index first).
    cache.update(torch.tensor([13, 13]), rows.values, rows.scales)
    assert len({5, 11} & set(cache.held_rows().tolist())) == 1 and 13 in cache.held_rows().tolist()
    # Two candidates for one set: the more read one takes the weaker way first.
    cache.update(torch.tensor([20, 20, 20, 22, 22, 22, 22]), rows.values, rows.scales)
    assert sorted(cache.held_rows().tolist()) == [20, 22]
    _check_invariants(cache, rows)


def test_recency_keeps_the_rows_read_last():
    """``recency=True`` (set-associative LRU): a row read in step ``k`` scores ``k + 1``; a missed row
    takes its set's least recently read way, however often the way's row was read before."""
    rows = _table(64, 32, torch.Generator().manual_seed(3))
    cache = RowCache(2, 32, "cpu", ways=2, recency=True)  # one set of two ways
    cache.update(torch.tensor([5, 5, 5, 5, 7]), rows.values, rows.scales)  # step 0: both admitted
    cache.update(torch.tensor([7]), rows.values, rows.scales)  # step 1: row 7 read last
    counts = dict(zip(cache.tags.reshape(-1).tolist(), cache.counters.reshape(-1).tolist()))
    assert counts == {5: 1, 7: 2}
    cache.update(torch.tensor([9]), rows.values, rows.scales)  # step 2: row 9 replaces row 5 (read 4 times)
    counts = dict(zip(cache.tags.reshape(-1).tolist(), cache.counters.reshape(-1).tolist()))
    assert counts == {9: 3, 7: 2}
    _check_invariants(cache, rows)
    with pytest.raises(ValueError, match="recency: expected True or False"):
        RowCache(2, 32, "cpu", recency="yes")


@pytest.mark.parametrize("policy", ["set-lru", "dynamic"])
def test_row_cache_serves_the_hits_the_policy_replay_counts(policy, seed):
    """The device index follows engram.tools.cache_policy's rules exactly: over a drifting, skewed
    stream (steps of a prime size, a cache of 8 sets of 8 ways, aging every 4 steps), RowCache's
    update statistics equal the replay's reads, hits, per-step distinct rows and their hits."""
    import numpy as np

    from engram.tools.cache_policy import CompactStream, DynamicParams, replay

    rng = np.random.default_rng(seed)
    num_rows, capacity, step_reads, steps = 700, 64, 97, 40
    hot = (np.arange(steps * step_reads) // (step_reads * 5)) * 37  # the hot rows drift every 5 steps
    reads = np.where(rng.random(steps * step_reads) < 0.6, (hot + rng.integers(0, 30, steps * step_reads)) % num_rows,
                     rng.integers(0, num_rows, steps * step_reads))
    rows = _table(num_rows, 32, torch.Generator().manual_seed(seed % 2**31))
    cache = RowCache(capacity, 32, "cpu", ways=8, aging_interval=4, recency=policy == "set-lru")
    for k in range(steps):
        cache.update(torch.from_numpy(reads[k * step_reads:(k + 1) * step_reads]), rows.values, rows.scales)
    _check_invariants(cache, rows)
    result = replay(CompactStream(reads, step_reads), capacity, policy, params=DynamicParams(ways=8, age_steps=4))
    valid, hits, distinct, missed = (int(x) for x in cache.stats)
    assert (valid, hits, distinct, distinct - missed) == (result.reads, result.hits, result.fetches,
                                                         result.fetch_hits), f"seed {seed}"
    assert 0 < hits < valid


def test_load_hot_keeps_the_first_rows_of_each_set():
    rows = _table(100, 32, torch.Generator().manual_seed(1))
    cache = RowCache(8, 32, "cpu", ways=2)  # 4 sets
    held = cache.load_hot(torch.tensor([0, 4, 8, 1, 5, 2, 3, 99, 100, -3]), rows.values, rows.scales, counter=7)
    assert held == 7
    assert sorted(cache.held_rows().tolist()) == [0, 1, 2, 3, 4, 5, 99]  # 8 (set 0's third) dropped; 100, -3 outside
    assert bool((cache.counters[cache.tags >= 0] == 7).all())
    _check_invariants(cache, rows)
    with pytest.raises(ValueError, match="local_row_ids: expected distinct row ids"):
        cache.load_hot(torch.tensor([1, 1]), rows.values, rows.scales)


def test_counters_age_to_zero_and_saturate():
    rows = _table(16, 32, torch.Generator().manual_seed(2))
    cache = RowCache(4, 32, "cpu", ways=4, aging_interval=2)
    cache.load_hot(torch.tensor([1, 2]), rows.values, rows.scales, counter=COUNTER_MAX)
    cache.update(torch.full((10,), 1), rows.values, rows.scales)  # step 0: no aging
    assert int(cache.counters.max()) == COUNTER_MAX  # 10 reads added: saturated, no overflow
    cache.update(torch.empty(0, dtype=torch.int64), rows.values, rows.scales)  # step 1: none either
    assert int(cache.counters.max()) == COUNTER_MAX
    cache.update(torch.empty(0, dtype=torch.int64), rows.values, rows.scales)  # step 2: halved
    assert sorted(cache.counters.reshape(-1).tolist()) == [0, 0, COUNTER_MAX // 2, COUNTER_MAX // 2]
    for _ in range(80):
        cache.update(torch.empty(0, dtype=torch.int64), rows.values, rows.scales)
    assert int(cache.counters.abs().sum()) == 0
    assert sorted(cache.held_rows().tolist()) == [1, 2]  # aged rows stay until replaced


def test_reference_lookup_reads_slots_on_hits():
    """The torch reference really reads the slot on a hit (a slot overwritten shows)."""
    rows = _table(32, 64, torch.Generator().manual_seed(3))
    cache = RowCache(4, 64, "cpu", ways=4)
    cache.load_hot(torch.tensor([3]), rows.values, rows.scales)
    ids = torch.tensor([[3, 4, 40]])
    values, scales = cached_lookup_reference(cache, rows.values, rows.scales, ids)
    assert torch.equal(values[0, 0], rows.values[3]) and torch.equal(values[0, 1], rows.values[4])
    assert int(values[0, 2].abs().sum()) == 0 and int(scales[0, 2].abs().sum()) == 0
    slot = int(cache.probe(torch.tensor([3]), 32)[1])
    cache.slot_rows[slot, :64] = rows.values[5]
    assert torch.equal(cached_lookup_reference(cache, rows.values, rows.scales, ids)[0][0, 0], rows.values[5])


def test_argument_errors():
    with pytest.raises(ValueError, match="ways: expected a power of two at most 64, found 3"):
        RowCache(8, 32, "cpu", ways=3)
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 32, found 48"):
        RowCache(8, 48, "cpu")
    with pytest.raises(ValueError, match="num_slots: expected an integer >= 1, found 0"):
        RowCache(0, 32, "cpu")
    values = torch.zeros(10, 64, dtype=torch.uint8)
    scales = torch.zeros(10, 2, dtype=torch.uint8)
    table = engram.EngramTable(values, scales)
    with pytest.raises(ValueError, match="load_hot_rows: placement 'cpu' has no row cache"):
        table.load_hot_rows(torch.tensor([1]))
    table.update_cache(torch.zeros(2, 3, dtype=torch.int64))  # a no-op for placements without a cache
    with pytest.raises(ValueError, match="placement_options: placement 'cpu' takes no option 'cache_fraction'"):
        engram.EngramTable(values, scales, placement="cpu", placement_options={"cache_fraction": 0.1})
    if not HAS_CUDA and not INTERPRET:
        with pytest.raises(ValueError, match="placement 'cached' .* no CUDA device; use placement='cpu'"):
            engram.EngramTable(values, scales, placement="cached")
    if HAS_CUDA or INTERPRET:
        device = "cuda" if HAS_CUDA else "cpu"
        with pytest.raises(ValueError, match=r"cache_fraction: expected a number in \(0, 1\], found 0"):
            engram.EngramTable(values, scales, placement="cached", device=device,
                               placement_options={"cache_fraction": 0})
        with pytest.raises(ValueError, match="policy: expected one of"):
            engram.EngramTable(values, scales, placement="cached", device=device,
                               placement_options={"policy": "lru"})


def test_cached_is_available():
    assert "cached" in engram.table.available_placements()


# ---------------------------------------------------------------------------
# kernels under the interpreter (or on a GPU)
# ---------------------------------------------------------------------------
def _kernel_device() -> str:
    if not INTERPRET and not HAS_CUDA:
        pytest.skip("the cached-lookup kernels need TRITON_INTERPRET=1 or a CUDA device")
    try:
        import triton  # noqa: F401
    except ImportError:
        from conftest import missing_dependency
        missing_dependency("triton is not installed (pip install -e '.[triton]')")
    return "cpu" if INTERPRET else "cuda"


def _strided(ids: torch.Tensor, layout: int) -> torch.Tensor:
    if layout == 0:
        return ids
    if layout == 1:  # one layer of the hasher's [T, L, C]
        stacked = torch.full((ids.shape[0], 2, ids.shape[1]), -7, dtype=ids.dtype, device=ids.device)
        stacked[:, 1] = ids
        return stacked[:, 1]
    return ids.t().contiguous().t()


def _assert_lookups_equal(cache, rows, hash_ids, row_start, device) -> None:
    """Cached kernels == the plain gather kernels on the whole table, bit for bit (outputs poisoned)."""
    from engram.table.kernels import gather
    from engram.table.kernels.cache_gather import cached_gather_rows, cached_gather_rows_packed

    back_values, back_scales = rows.values.to(device), rows.scales.to(device)
    tokens, columns = hash_ids.shape
    out = torch.full((tokens, columns, cache.head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    assert cached_gather_rows(cache, back_values, back_scales, hash_ids, row_start, out=out) is out
    expected = gather.gather_rows(back_values, back_scales, hash_ids, row_start)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    values = torch.full((tokens, columns, cache.head_dim), POISON_BYTE, dtype=torch.uint8, device=device)
    scales = torch.full((tokens, columns, cache.head_dim // 32), POISON_BYTE, dtype=torch.uint8, device=device)
    returned = cached_gather_rows_packed(cache, back_values, back_scales, hash_ids, row_start, out=(values, scales))
    assert returned[0] is values and returned[1] is scales
    expected_values, expected_scales = gather.gather_rows_packed(back_values, back_scales, hash_ids, row_start)
    assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)
    reference_values, reference_scales = cached_lookup_reference(cache, back_values, back_scales, hash_ids, row_start)
    assert torch.equal(values, reference_values) and torch.equal(scales, reference_scales)
    # The float reference (engram.table.kernels.reference): bit for bit on the GPU; under the interpreter, whose
    # fp32 -> bf16 cast truncates, within one ulp of the same sign for normal values
    # (tests/table/test_gather_kernel.py).
    reference = engram.table.lookup_reference(back_values, back_scales, hash_ids, row_start)
    assert torch.equal(torch.isnan(out), torch.isnan(reference))
    found_bits = out.view(torch.int16).to(torch.int32) & 0xFFFF
    expected_bits = reference.view(torch.int16).to(torch.int32) & 0xFFFF
    if device == "cpu":
        exact = engram.table.dequantize_rows(expected_values, expected_scales, torch.float32).abs()
        compared = ~torch.isnan(reference) & ((exact >= 2.0**-126) | (exact == 0))
        close = ((found_bits >> 15) == (expected_bits >> 15)) & ((found_bits - expected_bits).abs() <= 1)
        assert bool(close[compared].all())
    else:
        assert torch.equal(found_bits[~torch.isnan(reference)], expected_bits[~torch.isnan(reference)])


# (tokens, columns, head_dim, rows, row_start, slots, ways)
CASES = [
    (1, 3, 64, 40, 0, 8, 4),
    (63, 5, 96, 90, 1000, 24, 8),    # D = 96: three scale groups (padded to four); C = 5
    (63, 7, 32, 50, 7, 16, 2),       # D = 32: one scale group; C = 7
    (9, 3, 256, 30, 3_000_000_000, 8, 8),  # a shard past 2**31 rows
]


def _case_id(case) -> str:
    return f"T{case[0]}-C{case[1]}-D{case[2]}-r{case[4]}-w{case[6]}"


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "tags-first"])
def test_cached_lookup_equals_the_gather(case, id_dtype, read_ahead, seed, monkeypatch):
    from interpreter_bounds import bounds_checked
    from engram.table.kernels import cache_gather

    # Both forms of the one-kernel lookup: every row's host read issued first, or only a miss's after the tags.
    monkeypatch.setattr(cache_gather, "READ_AHEAD_MAX_ROWS", 2**31 if read_ahead else -1)
    device = _kernel_device()
    tokens, columns, head_dim, num_rows, row_start, slots, ways = case
    if row_start >= 2**31:
        id_dtype = torch.int64  # int32 ids cannot name rows past 2**31
    generator = torch.Generator().manual_seed(seed)
    rows = _table(num_rows, head_dim, generator)
    cache = RowCache(slots, head_dim, device, ways=ways, aging_interval=2)
    back_values, back_scales = rows.values.to(device), rows.scales.to(device)
    hits = 0
    with bounds_checked() if device == "cpu" else _no_check() as memory:
        for step in range(4):
            hash_ids = _strided(_ids(tokens, columns, num_rows, row_start, generator, id_dtype), step % 3).to(device)
            if step == 1:
                held = cache.load_hot(torch.randperm(num_rows, generator=generator)[:slots].to(device),
                                      back_values, back_scales)
                assert held > 0
            _assert_lookups_equal(cache, rows, hash_ids, row_start, device)
            before = cache.tags.clone()
            cache.update(hash_ids.to(torch.int64) - row_start, back_values, back_scales)
            _check_invariants(_on_cpu(cache), rows)
            _assert_lookups_equal(cache, rows, hash_ids, row_start, device)
            hits += int(cache.probe(hash_ids.reshape(-1).to(torch.int64) - row_start, num_rows)[0].sum())
            if step == 3:
                assert not torch.equal(before, cache.tags) or cache.held_rows().numel() == cache.num_slots
    assert hits > 0, "no lookup hit the cache"
    if device == "cpu":
        assert memory.accesses > 0


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_update_replaces_rows_and_lookups_follow(seed):
    """A cache full of rows that are then never read: a new hot set of rows replaces them (after aging)."""
    from interpreter_bounds import bounds_checked

    device = _kernel_device()
    generator = torch.Generator().manual_seed(seed)
    rows = _table(64, 64, generator)
    back_values, back_scales = rows.values.to(device), rows.scales.to(device)
    cache = RowCache(8, 64, device, ways=2, aging_interval=1)  # 4 sets
    cache.load_hot(torch.arange(8, device=device), back_values, back_scales, counter=4)
    new = torch.arange(32, 40, device=device)
    hash_ids = new.repeat(3).view(6, 4)
    with bounds_checked() if device == "cpu" else _no_check():
        for _ in range(4):
            cache.update(hash_ids, back_values, back_scales)
            _assert_lookups_equal(cache, rows, hash_ids, 0, device)
    assert sorted(cache.held_rows().tolist()) == list(range(32, 40))
    hit, _ = cache.probe(hash_ids.reshape(-1), 64)
    assert bool(hit.all())


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fuzz_update_and_lookup_sequences(seed):
    """Random sequences of updates, hot-set loads, clears and lookups; every access bounds-checked."""
    from interpreter_bounds import bounds_checked

    device = _kernel_device()
    generator = torch.Generator().manual_seed(seed)
    with bounds_checked() if device == "cpu" else _no_check():
        for case in range(6):
            head_dim = (32, 64, 96)[case % 3]
            num_rows = int(torch.randint(5, 120, (1,), generator=generator))
            ways = (1, 2, 4, 8)[case % 4]
            slots = int(torch.randint(1, 40, (1,), generator=generator))
            row_start = int(torch.randint(0, 3, (1,), generator=generator)) * 100
            rows = _table(num_rows, head_dim, generator)
            back_values, back_scales = rows.values.to(device), rows.scales.to(device)
            cache = RowCache(slots, head_dim, device, ways=ways,
                             aging_interval=int(torch.randint(1, 4, (1,), generator=generator)))
            for _ in range(5):
                action = int(torch.randint(0, 5, (1,), generator=generator))
                tokens = int(torch.randint(1, 9, (1,), generator=generator))
                columns = int(torch.randint(1, 6, (1,), generator=generator))
                hash_ids = _ids(tokens, columns, num_rows, row_start, generator,
                                hot=int(torch.randint(1, num_rows + 1, (1,), generator=generator))).to(device)
                if action <= 2:
                    cache.update(hash_ids - row_start, back_values, back_scales)
                elif action == 3:
                    count = int(torch.randint(0, num_rows + 1, (1,), generator=generator))
                    cache.load_hot(torch.randperm(num_rows, generator=generator)[:count].to(device),
                                   back_values, back_scales)
                else:
                    cache.clear()
                _check_invariants(_on_cpu(cache), rows)
                _assert_lookups_equal(cache, rows, hash_ids, row_start, device)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cached_table_equals_the_cpu_table(backend, seed):
    """The placement through EngramTable (CPU tensors under the interpreter): lookup and lookup_packed
    equal placement 'cpu', with a hot set, after updates, with a column shard."""
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    generator = torch.Generator().manual_seed(seed)
    rows = _table(80, 64, generator)
    common = dict(column_start=1, column_end=4, row_start=500, validate=False, check_values=False)
    plain = engram.EngramTable(rows.values.clone(), rows.scales.clone(), **common)
    cached = engram.EngramTable(rows.values.clone(), rows.scales.clone(), placement="cached", device="cpu",
                                backend=backend, placement_options={"cache_fraction": 0.25, "ways": 4}, **common)
    assert cached.placement == "cached" and cached.backend == backend
    assert cached.storage.cache.num_slots == 20
    assert cached.load_hot_rows(torch.arange(500, 520)) == 20
    for _ in range(3):
        hash_ids = _ids(11, 5, 80, 500, generator)
        for table in (cached, plain):
            table.prefetch(hash_ids)  # a no-op for both
        assert torch.equal(cached.lookup(hash_ids).view(torch.int16), _expected_bf16(plain, rows, hash_ids, backend))
        got, expected = cached.lookup_packed(hash_ids), plain.lookup_packed(hash_ids)
        assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
        assert torch.equal(got[1], expected[1])
        cached.update_cache(hash_ids)
        _check_invariants(cached.storage.cache, pack_rows(rows.values, rows.scales))
    static = engram.EngramTable(rows.values.clone(), rows.scales.clone(), placement="cached", device="cpu",
                                backend=backend, placement_options={"policy": "static", "cache_fraction": 0.1,
                                                                    "hot_rows": torch.arange(8)}, **common)
    before = static.storage.cache.tags.clone()
    static.update_cache(hash_ids)
    assert torch.equal(before, static.storage.cache.tags)  # the static policy never changes the content
    assert torch.equal(static.lookup(hash_ids).view(torch.int16), _expected_bf16(plain, rows, hash_ids, backend))


def _expected_bf16(plain, rows, hash_ids, backend: str) -> torch.Tensor:
    """Placement 'cpu''s rows as int16 bits; for the Triton backend through the plain gather kernel (under
    the interpreter its bf16 cast truncates: it is compared with the same kernel's decode)."""
    if backend == "torch":
        return plain.lookup(hash_ids).view(torch.int16)
    from engram.table.kernels.gather import gather_rows

    return gather_rows(rows.values, rows.scales, hash_ids, plain.row_start, plain.column_start,
                       plain.column_end).view(torch.int16)


class _no_check:
    """Stands in for bounds_checked() on a GPU."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _on_cpu(cache: RowCache) -> RowCache:
    """A CPU copy of the cache's state (for the invariant checks)."""
    if cache.device.type == "cpu":
        return cache
    copy = RowCache(cache.num_slots, cache.head_dim, "cpu", ways=cache.ways)
    for mine, theirs in ((copy.slot_rows, cache.slot_rows), (copy._tags, cache._tags), (copy._counters, cache._counters)):
        mine.copy_(theirs)  # in place: the cache's views (tags, slot values) stay on its tensors
    return copy


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def _device_and_cached(rows: int, head_dim: int, generator, row_start=0, **options):
    table = _table(rows, head_dim, generator)
    common = dict(row_start=row_start, validate=False, check_values=False)
    device = engram.EngramTable(table.values.clone(), table.scales.clone(), placement="device", device="cuda",
                                **common)
    cached = engram.EngramTable(table.values.clone(), table.scales.clone(), placement="cached", device="cuda",
                                placement_options=options, **common)
    return device, cached


def _device_and_cached_memories(model_dir):
    """The synthetic model on the GPU with placement "device" and with placement "cached" (5% of the rows)."""
    on_device = memory_on_cuda(model_dir, "device")
    cached = memory_on_cuda(model_dir, "cached", placement_options={"cache_fraction": 0.05, "aging_interval": 1})
    return on_device, cached


def _layer_inputs(on_device, tokens: int, generator):
    """``hash_ids [T, L, C]`` (half from 50 hot rows of each table), ``hidden bf16 [T, hc_mult, hidden_size]``,
    on the GPU."""
    spec = on_device.spec
    hash_ids = torch.stack([_ids(tokens, spec.num_columns, on_device.layout.num_embeddings[i], 0, generator,
                                 hot=50).cuda() for i in range(spec.num_layers)], dim=1)
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16().cuda()
    return hash_ids, hidden


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["set-lru", "dynamic"])
@pytest.mark.parametrize("tokens", [1, 63, 1000])
def test_gpu_cached_equals_device_after_replacements(tokens, policy, seed):
    generator = torch.Generator().manual_seed(seed)
    device, cached = _device_and_cached(5000, 256, generator, row_start=777, cache_fraction=0.02, aging_interval=2,
                                        policy=policy)
    assert cached.backend == "triton"
    cache = cached.storage.cache
    replaced = hits = 0
    # At least six steps, then on (up to 60) until the lookups have read cached rows and, with more than
    # one token, rows were replaced: at T = 1 a step reads 24 ids, and some seeds see no hit in six.
    for step in range(60):
        if step >= 6 and hits > 0 and (tokens == 1 or replaced > 0):
            break
        # The hot rows move every other step, so new rows outscore aged ones and replace them.
        hash_ids = _ids(tokens, 24, 5000, 777, generator, hot=200, hot_start=700 * (step // 2)).cuda()
        before = cache.tags.clone()
        for layout, table_ids in enumerate((hash_ids, _strided(hash_ids, 1))):
            assert_lookups_equal(cached, device, table_ids, f"step {step}, ids layout {layout}, seed {seed}")
        hits += int(cache.probe(hash_ids.reshape(-1).to(torch.int64) - 777, 5000)[0].sum())  # the lookups' hits
        cached.update_cache(hash_ids)
        replaced += int(((before >= 0) & (cache.tags != before)).sum())
        _check_invariants(_on_cpu(cache), pack_rows(device.storage.value_bytes.cpu(), device.storage.scale_bytes.cpu()))
    assert int((cache.tags >= 0).sum()) > 0
    assert hits > 0, "no lookup read a cached row: the test did not test hits"
    if tokens > 1:
        assert replaced > 0, f"the {policy} policy replaced no row: the test did not test replacement"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 63, 1000])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_gpu_static_hot_set_equals_device(tokens, id_dtype, seed):
    """Policy "static": a hot set loaded with load_hot_rows serves hits equal to "device"; update_cache
    leaves it alone; a second load_hot_rows replaces it (also seen by a lookup captured before it)."""
    generator = torch.Generator().manual_seed(seed)
    device, cached = _device_and_cached(4000, 256, generator, row_start=123, policy="static",
                                        cache_fraction=0.05)
    cache = cached.storage.cache
    reference_rows = pack_rows(device.storage.value_bytes.cpu(), device.storage.scale_bytes.cpu())
    first_hot = torch.randperm(4000, generator=generator)[:150] + 123
    assert cached.load_hot_rows(first_hot.cuda()) > 0
    _check_invariants(_on_cpu(cache), reference_rows)
    static_ids = _ids(tokens, 24, 4000, 123, generator, dtype=id_dtype, hot=4000).cuda()
    static_ids.view(-1)[: static_ids.numel() // 2] = first_hot[torch.randint(0, 150, (static_ids.numel() // 2,),
                                                                            generator=generator)].to(id_dtype).cuda()
    graph, static_out = capture_cuda_graph(lambda: cached.lookup(static_ids))
    held = cache.tags.clone()
    for step in range(3):
        if step == 2:
            second_hot = torch.randperm(4000, generator=generator)[:150] + 123
            assert cached.load_hot_rows(second_hot.cuda()) > 0
            assert not torch.equal(held, cache.tags)
            _check_invariants(_on_cpu(cache), reference_rows)
            hot = second_hot
        else:
            hot = first_hot
        ids = _ids(tokens, 24, 4000, 123, generator, dtype=id_dtype, hot=4000)
        ids.view(-1)[: ids.numel() // 2] = hot[torch.randint(0, 150, (ids.numel() // 2,), generator=generator)].to(id_dtype)
        static_ids.copy_(ids.cuda())
        assert int(cache.probe(static_ids.reshape(-1).to(torch.int64) - 123, 4000)[0].sum()) > 0
        assert_lookups_equal(cached, device, static_ids, f"step {step}")
        replay_poisoned(graph, static_out)
        assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))
        if step < 2:
            cached.update_cache(static_ids)
            assert torch.equal(held, cache.tags), "the static policy changed the cache"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 63, 1000])
def test_gpu_lookup_captured_in_a_cuda_graph_follows_updates(tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    device, cached = _device_and_cached(3000, 256, generator, cache_fraction=0.05, aging_interval=1)
    static_ids = _ids(tokens, 24, 3000, 0, generator, hot=100).cuda()
    cached.lookup(static_ids)
    graph, (static_out, (static_values, static_scales)) = capture_cuda_graph(
        lambda: (cached.lookup(static_ids), cached.lookup_packed(static_ids)))
    cache = cached.storage.cache
    for step in range(5):
        static_ids.copy_(_ids(tokens, 24, 3000, 0, generator, hot=100).cuda())
        before = cache.tags.clone()
        torch.cuda.set_sync_debug_mode("error")  # the update never waits for the GPU
        try:
            cached.update_cache(static_ids)  # between replays: the index changes in place
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert step == 0 or not torch.equal(before, cache.tags) or bool((cache.tags >= 0).all())
        replay_poisoned(graph, static_out, static_values, static_scales)
        assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))
        expected = device.lookup_packed(static_ids)
        assert torch.equal(static_values.view(torch.uint8), expected[0].view(torch.uint8))
        assert torch.equal(static_scales, expected[1])
    hit, _ = cache.probe(static_ids.reshape(-1), 3000)
    assert int(hit.sum()) > 0


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_memory_placement_cached_without_cuda_names_cpu():
    from engram.memory import resolve_placement

    with pytest.raises(ValueError, match="placement: 'cached' keeps the tables in host memory .* use placement='cpu'"):
        resolve_placement("cached")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_memory_from_pretrained_cached_equals_device(synthetic_model_dir, seed):
    generator = torch.Generator().manual_seed(seed)
    on_device, cached = _device_and_cached_memories(synthetic_model_dir)
    assert cached.placement == "cached"
    for tokens in (5, 3000, 64, 3000):
        hash_ids, hidden = _layer_inputs(on_device, tokens, generator)
        assert_layers_equal(cached, on_device, hidden, hash_ids)
        cached.update_cache(hash_ids)
    assert all(int((cached.table(layer_id).storage.cache.tags >= 0).sum()) > 0 for layer_id in cached.spec.layer_ids)


def test_launcher_argument_errors():
    """Checked before any kernel runs (CPU tensors, no interpreter needed)."""
    try:
        from engram.table.kernels.cache_gather import cached_gather_rows, cached_gather_rows_packed
    except ImportError:
        from conftest import missing_dependency
        missing_dependency("triton is not installed (pip install -e '.[triton]')")
    rows = _table(10, 64, torch.Generator().manual_seed(4))
    cache = RowCache(4, 64, "cpu")
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"back_values: expected uint8 \[rows, 64\]"):
        cached_gather_rows(cache, rows.values.float(), rows.scales, ids)
    with pytest.raises(ValueError, match=r"back_scales: expected uint8 \[rows, 2\]"):
        cached_gather_rows(cache, rows.values, rows.values, ids)
    with pytest.raises(ValueError, match="hash_ids: expected an int32 or int64 tensor"):
        cached_gather_rows(cache, rows.values, rows.scales, ids.float())
    with pytest.raises(ValueError, match="row_start: expected an integer >= 0, found -1"):
        cached_gather_rows(cache, rows.values, rows.scales, ids, -1)
    with pytest.raises(ValueError, match=r"out: expected a contiguous bfloat16 tensor \[3, 2, 64\]"):
        cached_gather_rows(cache, rows.values, rows.scales, ids, out=torch.empty(3, 2, 64))
    with pytest.raises(ValueError, match=r"out\[1\]: expected a contiguous uint8 tensor \[3, 2, 2\]"):
        cached_gather_rows_packed(cache, rows.values, rows.scales, ids,
                                  out=(torch.empty(3, 2, 64, dtype=torch.uint8), torch.empty(3, 2, 3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="cache: expected a RowCache"):
        cached_gather_rows(object(), rows.values, rows.scales, ids)


def test_fuzz_update_invariants_and_reference(seed):
    """Many random steps in plain torch: the invariants hold, the reference lookup returns the table's
    bytes, and the statistics count what the lookups saw."""
    generator = torch.Generator().manual_seed(seed)
    for case in range(8):
        head_dim = (32, 64, 96, 256)[case % 4]
        num_rows = int(torch.randint(1, 300, (1,), generator=generator))
        rows = _table(num_rows, head_dim, generator)
        cache = RowCache(int(torch.randint(1, 64, (1,), generator=generator)), head_dim, "cpu",
                         ways=(1, 2, 4, 8, 16)[case % 5], aging_interval=int(torch.randint(1, 5, (1,), generator=generator)))
        reads = hits = 0
        for _ in range(25):
            ids = _ids(int(torch.randint(1, 40, (1,), generator=generator)), 3, num_rows, 0, generator,
                       hot=int(torch.randint(1, num_rows + 1, (1,), generator=generator)))
            values, scales = cached_lookup_reference(cache, rows.values, rows.scales, ids)
            local = ids.reshape(-1)
            inside = local < num_rows
            assert torch.equal(values.reshape(-1, head_dim)[inside], rows.values[local[inside]])
            assert torch.equal(scales.reshape(-1, head_dim // 32)[inside], rows.scales[local[inside]])
            assert int(values.reshape(-1, head_dim)[~inside].abs().sum()) == 0
            reads += int(inside.sum())
            hits += int(cache.probe(local, num_rows)[0].sum())
            if bool(torch.rand(1, generator=generator) < 0.1):
                cache.load_hot(torch.randperm(num_rows, generator=generator)[:cache.num_slots], rows.values,
                               rows.scales)
            else:
                cache.update(ids, rows.values, rows.scales)
            _check_invariants(cache, rows)
        assert int(cache.stats[0]) <= reads and int(cache.stats[1]) <= hits
        assert int(cache.stats[1]) <= int(cache.stats[0]) and int(cache.stats[3]) <= int(cache.stats[2])


def test_dynamic_policy_holds_a_stationary_hot_set():
    """Reads half from 24 hot rows (which fit: 32 slots), half spread over 4000 rows: after a few
    steps nearly every hot read hits, and the cold rows do not push the hot ones out."""
    generator = torch.Generator().manual_seed(5)
    rows = _table(4000, 32, generator)
    cache = RowCache(32, 32, "cpu", ways=8, aging_interval=4)
    hot = torch.randperm(4000, generator=generator)[:24]
    for step in range(30):
        ids = torch.cat([hot[torch.randint(0, 24, (200,), generator=generator)],
                         torch.randint(0, 4000, (200,), generator=generator)])
        if step == 20:
            cache.stats.zero_()
        cache.update(ids, rows.values, rows.scales)
    reads, hit_reads, distinct, distinct_missed = cache.stats.tolist()
    assert reads == 10 * 400
    assert hit_reads >= 0.45 * reads  # the hot half (a 24-row set may still lose a row to a set conflict)
    assert distinct_missed < distinct
