"""Placement "cached", large lookups: the misses go through the host placement's host gather.

* unmarked tests: the plain-torch references of the probe and the merge, the cache's version counter, and
  the launchers' argument errors (before any kernel runs);
* ``interpreter`` tests (``TRITON_INTERPRET=1``): the probe kernel and both merge kernels equal their
  references bit for bit at awkward shapes (T = 1 and 63, C = 3, 5, 7, D = 32, 96, 256, a shard past 2**31
  rows, int32 and int64 ids, strided ids, malformed ids, slots and inverse entries), outputs poisoned
  before each launch, every access bounds-checked; the placement's large-lookup path through
  ``EngramTable`` on CPU tensors (probe, the host gather's dedup and gather done synchronously, merge)
  equals placement "cpu", with prefetch, with a prefetch made stale by an update, with a column shard;
* ``gpu`` tests (seeded: a failure names its seed, ``ENGRAM_TEST_SEED`` replays it): the large-lookup path
  equals ``device`` bit for bit (bf16 and packed FP8, strided ids) after the dynamic policy replaced rows,
  with prefetch (also from another stream, also made stale by an update) under torch's sync debug mode
  (no host sync on the caller's thread), through ``EngramMemory.prefetch``; CUDA-graph capture takes the
  one-kernel path.
"""

from __future__ import annotations

import os

import pytest
import torch

import engram
from conftest import POISON_BYTE, assert_layers_equal, assert_lookups_equal, capture_cuda_graph, replay_poisoned
from engram.table.placements import cached as cached_placement
from engram.table.host_memory.rows import pack_rows, packed_row_bytes
from engram.table.placements.row_cache import (RowCache, cached_direct_reference, checked_merge_reference, cached_probe_reference,
                                    direct_class)
from test_cached_placement import (CASES, _case_id, _check_invariants, _device_and_cached, _device_and_cached_memories,
                                   _expected_bf16, _ids, _kernel_device, _layer_inputs, _no_check, _on_cpu, _strided,
                                   _table)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
POISON_INT = 0x5A5A5A5A


def _launchers():
    try:
        from engram.table.kernels import cache_gather
    except ImportError:
        from conftest import missing_dependency
        missing_dependency("triton is not installed (pip install -e '.[triton]')")
    return cache_gather


def _malformed(hash_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``hash_ids`` with about 1 in 6 entries replaced by extreme values of its dtype (never in a table)."""
    info = torch.iinfo(hash_ids.dtype)
    extremes = torch.tensor([info.min, info.max, info.min + 1, info.max - 1, -1, -(2**20)], dtype=hash_ids.dtype)
    pick = extremes[torch.randint(0, extremes.numel(), hash_ids.shape, generator=generator)]
    where = torch.rand(hash_ids.shape, generator=generator) < 1 / 6
    return torch.where(where, pick, hash_ids)


# ---------------------------------------------------------------------------
# references, version, argument errors (plain torch)
# ---------------------------------------------------------------------------
def test_probe_and_merge_references_on_a_small_cache():
    rows = _table(40, 32, torch.Generator().manual_seed(11))
    cache = RowCache(4, 32, "cpu", ways=2)  # 2 sets
    cache.load_hot(torch.tensor([4, 7]), rows.values, rows.scales)
    ids = torch.tensor([[104, 105, 107], [99, 140, 104]])  # row_start 100: rows 4 (held), 5, 7 (held); -1; 40; 4
    slot, miss = cached_probe_reference(cache, 40, ids, 100)
    _, slot4 = cache.probe(torch.tensor([4]), 40)
    _, slot7 = cache.probe(torch.tensor([7]), 40)
    assert slot.tolist() == [[int(slot4), -1, int(slot7)], [-1, -1, int(slot4)]]
    assert miss.tolist() == [[-1, 5, -1], [-1, -1, -1]]
    assert slot.dtype == miss.dtype == torch.int32
    # The merge: hits from their slots; row 5 from the staged rows; ids outside the table read zeros.
    staged = torch.cat([rows.packed[5:6], rows.packed[-1:]])
    inverse = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.int32)
    values, scales = checked_merge_reference(ids, 100, rows.values, rows.scales, staged, inverse, cache, slot)
    for (t, j), row in {(0, 0): 4, (0, 1): 5, (0, 2): 7, (1, 2): 4}.items():
        assert torch.equal(values[t, j], rows.values[row]) and torch.equal(scales[t, j], rows.scales[row])
    assert int(values[1, :2].sum()) == 0 and int(scales[1, :2].sum()) == 0
    # A copy read for another row is never served: a slot or staged row whose tag names another row (ids
    # edited after the probe), a malformed slot or inverse entry: the lookup's own row, read from the backing.
    edited = torch.tensor([[106, 104, 108]])  # slot4 now at row 6, staged row 5 at row 4, slot7 at row 8
    values, scales = checked_merge_reference(edited, 100, rows.values, rows.scales, staged,
                                             torch.tensor([[0, 0, 7]], dtype=torch.int32), cache,
                                             torch.tensor([[int(slot4), -5, int(slot7)]], dtype=torch.int32))
    for j, row in enumerate([6, 4, 8]):
        assert torch.equal(values[0, j], rows.values[row]) and torch.equal(scales[0, j], rows.scales[row])


def test_version_counts_content_changes():
    rows = _table(30, 32, torch.Generator().manual_seed(12))
    cache = RowCache(4, 32, "cpu", ways=2)
    versions = [cache.version]
    cache.update(torch.tensor([1, 2, 2]), rows.values, rows.scales)
    versions.append(cache.version)
    cache.load_hot(torch.tensor([3]), rows.values, rows.scales)
    versions.append(cache.version)
    cache.clear()
    versions.append(cache.version)
    cache.probe(torch.tensor([3]), 30)  # reading changes nothing
    versions.append(cache.version)
    assert versions[0] < versions[1] < versions[2] < versions[3] == versions[4]


def test_probe_and_merge_argument_errors():
    cache_gather = _launchers()
    cache = RowCache(4, 64, "cpu")
    ids = torch.zeros(3, 2, dtype=torch.int64)
    slot = torch.zeros(3, 2, dtype=torch.int32)
    staged = torch.zeros(5, packed_row_bytes(64), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"num_rows: expected an integer in \[1, 2\*\*31\), found 0"):
        cache_gather.cached_probe(cache, 0, ids)
    with pytest.raises(ValueError, match="hash_ids: expected an int32 or int64 tensor"):
        cache_gather.cached_probe(cache, 10, ids.float())
    with pytest.raises(ValueError, match="row_start: expected an integer >= 0, found -1"):
        cache_gather.cached_probe(cache, 10, ids, -1)
    with pytest.raises(ValueError, match=r"out\[1\]: expected a contiguous int32 tensor \[3, 2\]"):
        cache_gather.cached_probe(cache, 10, ids, out=(slot, torch.zeros(3, 2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="cache: expected a RowCache"):
        cache_gather.cached_probe(object(), 10, ids)
    with pytest.raises(ValueError, match=r"direct_share: expected a number in \[0, 1\], found 1.5"):
        cache_gather.cached_probe(cache, 10, ids, direct_share=1.5)
    back_values, back_scales = torch.zeros(10, 64, dtype=torch.uint8), torch.zeros(10, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out: expected uint8 \[3, 2, >= 66\]"):
        cache_gather.cached_direct_reads(slot, back_values, back_scales, out=torch.zeros(3, 2, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"back_scales: expected uint8 \[rows, D\] / \[rows, D // 32\]"):
        cache_gather.cached_direct_reads(slot, back_values, back_values)
    merge = cache_gather.checked_merge_rows
    back = (back_values, back_scales)
    with pytest.raises(ValueError, match=r"direct: expected uint8 \[3, 2, >= 66\]"):
        merge(ids, 0, *back, staged, slot, cache=cache, slot=slot, direct=torch.zeros(3, 2, 65, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"slot: expected a contiguous int32 tensor \[T, C\]"):
        merge(ids, 0, *back, staged, slot, cache=cache, slot=slot.long())
    with pytest.raises(ValueError, match=r"slot: expected the probe's contiguous int32 tensor"):
        merge(ids, 0, *back, staged, slot, cache=cache)
    with pytest.raises(ValueError, match=r"slot, direct: given without a cache"):
        merge(ids, 0, *back, staged, slot, slot=slot)
    with pytest.raises(ValueError, match=r"inverse: expected a contiguous int32 tensor \[T, C\]"):
        merge(ids, 0, *back, staged, slot.t())
    with pytest.raises(ValueError, match=r"inverse: expected the shape of hash_ids \[3, 2\]"):
        merge(ids, 0, *back, staged, slot[:2])
    with pytest.raises(ValueError, match=r"staged: expected uint8 packed rows \[>= 1, 80\]"):
        merge(ids, 0, *back, staged[:, :64], slot)
    with pytest.raises(ValueError, match=r"staged: expected uint8 packed rows \[>= 1, 80\]"):
        merge(ids, 0, *back, staged[:0], slot)
    with pytest.raises(ValueError, match=r"hash_ids: expected an int32 or int64 tensor"):
        merge(ids.float(), 0, *back, staged, slot)
    with pytest.raises(ValueError, match=r"row_start: expected an integer >= 0, found -3"):
        merge(ids, -3, *back, staged, slot)
    with pytest.raises(ValueError, match=r"back_scales: expected shape \[10, 2\]"):
        merge(ids, 0, back_values, back_scales[:, :1], staged, slot)
    with pytest.raises(ValueError, match=r"out: expected a contiguous bfloat16 tensor \[3, 2, 64\]"):
        merge(ids, 0, *back, staged, slot, out=torch.empty(3, 2, 64))
    with pytest.raises(ValueError, match=r"out\[1\]: expected a contiguous uint8 tensor \[3, 2, 2\]"):
        cache_gather.checked_merge_rows_packed(ids, 0, *back, staged, slot,
                                               out=(torch.empty(3, 2, 64, dtype=torch.uint8), None))


# ---------------------------------------------------------------------------
# kernels under the interpreter (or on a GPU), at test_cached_placement's CASES
# ---------------------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_probe_kernel_equals_the_reference(case, id_dtype, seed):
    """Slots and miss ids of the kernel == the reference's, empty, hot-loaded and after updates, with ids
    outside the table and extreme ids, with direct shares 0, 0.5 and 1; the host gather's dedup reads hits
    (and direct misses) as its zero row (at most one distinct row more than the distinct misses)."""
    from engram.table.kernels.dedup import distinct_rows
    from interpreter_bounds import bounds_checked

    cache_gather = _launchers()
    device = _kernel_device()
    tokens, columns, head_dim, num_rows, row_start, slots, ways = case
    if row_start >= 2**31:
        id_dtype = torch.int64  # int32 ids cannot name rows past 2**31
    generator = torch.Generator().manual_seed(seed)
    rows = _table(num_rows, head_dim, generator)
    back_values, back_scales = rows.values.to(device), rows.scales.to(device)
    cache = RowCache(slots, head_dim, device, ways=ways, aging_interval=2)
    hits = misses = directs = 0
    with bounds_checked() if device == "cpu" else _no_check() as memory:
        # Six steps at least; tiny cases (T = 1, C = 3) go on until hits, misses and direct misses were all
        # seen (a seed can draw six steps without a hit: about 7% at T = 1), up to 60 steps.
        step = 0
        while step < 6 or (min(hits, misses, directs) == 0 and step < 60):
            share = (0.0, 0.5, 0.0, 1.0, 0.5, 1.0)[step % 6]
            hash_ids = _ids(tokens, columns, num_rows, row_start, generator, id_dtype)
            if step % 6 == 3:
                hash_ids = _malformed(hash_ids, generator)
            hash_ids = _strided(hash_ids.to(device), step % 3)
            if step == 1:
                assert cache.load_hot(torch.randperm(num_rows, generator=generator)[:slots].to(device),
                                      back_values, back_scales) > 0
            slot = torch.full((tokens, columns), POISON_INT, dtype=torch.int32, device=device)
            miss = torch.full((tokens, columns), POISON_INT, dtype=torch.int32, device=device)
            returned = cache_gather.cached_probe(cache, num_rows, hash_ids, row_start, direct_share=share,
                                                 out=(slot, miss))
            assert returned[0] is slot and returned[1] is miss
            threshold = cache_gather.direct_threshold(share)
            expected_slot, expected_miss = cached_probe_reference(cache, num_rows, hash_ids, row_start, threshold)
            assert torch.equal(slot, expected_slot) and torch.equal(miss, expected_miss)
            fresh = cache_gather.cached_probe(cache, num_rows, hash_ids, row_start, direct_share=share)  # allocating
            assert torch.equal(fresh[0], slot) and torch.equal(fresh[1], miss)
            hits += int((slot >= 0).sum())
            misses += int((miss >= 0).sum())
            directs += int((slot <= -2).sum())
            if share == 1.0:
                assert int((miss >= 0).sum()) == 0  # every miss read directly
            if share == 0.0:
                assert int((slot <= -2).sum()) == 0
            # Hits and ids outside the table cost the host gather one zero row in all.
            distinct = distinct_rows(miss, 0, num_rows)
            missed_rows = miss[miss >= 0].unique().numel()
            extra = int(bool((miss < 0).any()))
            assert int(distinct.rows_and_count[-1]) == missed_rows + extra
            hit_rows = distinct.rows_and_count[distinct.inverse.reshape(-1)[slot.reshape(-1) >= 0].long()]
            assert bool((hit_rows == num_rows).all())
            cache.update(hash_ids.to(torch.int64) - row_start, back_values, back_scales)
            step += 1
    assert hits > 0 and misses > 0 and directs > 0, "the test did not see hits, misses and direct misses"
    if device == "cpu":
        assert memory.accesses > 0


def test_direct_class_takes_about_its_share():
    rows = torch.arange(100_000)
    for threshold in (0, 64, 128, 256):
        share = float(direct_class(rows, threshold).float().mean())
        assert abs(share - threshold / 256) < 0.01
    # Not a function of the set: among rows of one set (stride 1000) the share holds too.
    assert abs(float(direct_class(rows[::1000] * 1, 128).float().mean()) - 0.5) < 0.15


def _slots_and_inverse(tokens: int, columns: int, num_slots: int, staged_rows: int, num_rows: int, generator):
    """``slot, inverse int32 [T, C]``: valid slots (30%), -1 (30%), direct misses ``-2 - r`` of rows ``r`` in
    ``[0, num_rows)`` (20%), malformed slots (20%: at or past ``num_slots``, direct misses of rows outside the
    table, int32 extremes); ``inverse`` mostly in ``[0, staged_rows)``, 1 in 8 malformed."""
    shape = (tokens, columns)
    kind = torch.rand(shape, generator=generator)
    valid = torch.randint(0, num_slots, shape, generator=generator)
    direct = -2 - torch.randint(0, num_rows, shape, generator=generator)
    bad = torch.tensor([num_slots, num_slots + 1, 2**31 - 1, -2 - num_rows, -(2**31)])
    bad = bad[torch.randint(0, bad.numel(), shape, generator=generator)]
    slot = torch.where(kind < 0.3, valid, torch.where(kind < 0.6, torch.full_like(valid, -1),
                                                      torch.where(kind < 0.8, direct, bad)))
    inverse = torch.randint(0, staged_rows, shape, generator=generator)
    bad_inverse = torch.tensor([staged_rows, staged_rows + 7, -1, 2**31 - 1, -(2**31)])
    bad_inverse = bad_inverse[torch.randint(0, bad_inverse.numel(), shape, generator=generator)]
    inverse = torch.where(torch.rand(shape, generator=generator) < 0.125, bad_inverse, inverse)
    return slot.to(torch.int32), inverse.to(torch.int32)


def _copies(hash_ids, row_start, rows, cache, num_rows, generator, lying: bool):
    """The copies a merge may be given for ``hash_ids`` (CPU): ``(slot, staged, inverse)`` where about half the
    positions point to a copy read for their own row (the slot holding it, a staged row of it) and the others to
    copies of other rows, never-written staged rows (tag -1), malformed slots and inverse entries. With ``lying``
    a few staged rows carry a tag that names a row their bytes are not (which only a broken worker could make):
    the merge serves them, which shows it uses the copies."""
    tokens, columns = hash_ids.shape
    slot, _ = cached_probe_reference(cache, num_rows, hash_ids, row_start)
    local = hash_ids.to(torch.int64) - row_start
    inside = (local >= 0) & (local < num_rows)
    wanted = torch.where(inside, local, 0).reshape(-1)
    count = wanted.numel()
    others = torch.randint(0, num_rows, (count,), generator=generator)
    staged_of = torch.where(torch.rand(count, generator=generator) < 0.5, wanted, others)
    staged = rows.packed[staged_of].clone()
    unwritten = torch.rand(count, generator=generator) < 0.15
    staged[unwritten] = POISON_BYTE
    staged[unwritten, -4:] = 0xFF  # tag -1
    inverse = torch.randperm(count, generator=generator).to(torch.int32)
    inverse = torch.where(torch.rand(count, generator=generator) < 0.6, torch.arange(count, dtype=torch.int32), inverse)
    bad_inverse = torch.tensor([count, count + 7, -1, 2**31 - 1, -(2**31)], dtype=torch.int32)
    malformed = torch.rand(count, generator=generator) < 0.1
    inverse = torch.where(malformed, bad_inverse[torch.randint(0, 5, (count,), generator=generator)], inverse)
    bad_slot = torch.tensor([cache.num_slots, 2**31 - 1, -(2**31), 0, 1], dtype=torch.int32)
    slot = torch.where(torch.rand(slot.shape, generator=generator) < 0.15,
                       bad_slot[torch.randint(0, 5, slot.shape, generator=generator)], slot).reshape(-1)
    if lying and bool(inside.any()):  # the first position inside the table: a lying staged row, no cache slot
        liar = int(torch.nonzero(inside.reshape(-1))[0, 0])
        staged[liar] = rows.packed[wanted[liar]]
        staged[liar, :-4] = POISON_BYTE  # the tag still names the row
        inverse[liar], slot[liar] = liar, -1
    return slot.view(tokens, columns).contiguous(), staged, inverse.view(tokens, columns).contiguous()


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_merge_kernels_equal_the_reference(case, seed):
    """The direct reads and both merge kernels (without a cache, with one, with direct reads) == the references
    (bytes; bf16 through the plain gather kernel's decode), for ids whose copies are partly right, partly of other
    rows, never written or malformed, outputs poisoned: with honest copies, the rows of a plain lookup of the
    backing rows bit for bit, whatever the copies; with a lying staged row, its bytes (the copies are used)."""
    from engram.table.kernels import gather
    from interpreter_bounds import bounds_checked

    cache_gather = _launchers()
    device = _kernel_device()
    tokens, columns, head_dim, num_rows, row_start, slots, ways = case
    generator = torch.Generator().manual_seed(seed)
    rows = _table(num_rows, head_dim, generator)
    cache = RowCache(slots, head_dim, "cpu", ways=ways)
    cache.load_hot(torch.randperm(num_rows, generator=generator)[:slots], rows.values, rows.scales)
    groups = head_dim // 32
    back_values, back_scales = rows.values.to(device), rows.scales.to(device)
    width = packed_row_bytes(head_dim)
    device_cache = RowCache(slots, head_dim, device, ways=ways)
    device_cache.load_hot(cache.tags[cache.tags >= 0].to(device), back_values, back_scales)
    with bounds_checked() if device == "cpu" else _no_check() as memory:
        for step in range(6):
            hash_ids = _malformed(_ids(tokens, columns, num_rows, row_start, generator), generator)
            lying = step == 5 and bool(((hash_ids >= row_start) & (hash_ids < row_start + num_rows)).any())
            slot, staged, inverse = _copies(hash_ids, row_start, rows, device_cache if device == "cpu" else cache,
                                            num_rows, generator, lying)
            hash_ids, slot, staged, inverse = (t.to(device) for t in (hash_ids, slot, staged, inverse))
            with_cache = step >= 2
            direct = None
            if step >= 4:
                direct = torch.full((tokens, columns, width), POISON_BYTE, dtype=torch.uint8, device=device)
                expected_direct = cached_direct_reference(slot, back_values, back_scales, direct)
                assert cache_gather.cached_direct_reads(slot, back_values, back_scales, out=direct) is direct
                assert torch.equal(direct, expected_direct)  # rows of the other slots untouched (poison)
                fresh = cache_gather.cached_direct_reads(slot, back_values, back_scales)  # allocating form
                used = head_dim + groups  # the padding after the scales is not written
                assert torch.equal(fresh[slot <= -2][:, :used], direct[slot <= -2][:, :used])
            copies = dict(cache=device_cache, slot=slot, direct=direct) if with_cache else {}
            expected_values, expected_scales = checked_merge_reference(
                hash_ids, row_start, back_values, back_scales, staged, inverse, **copies)
            plain_values, plain_scales = gather.gather_rows_packed(back_values, back_scales, hash_ids, row_start)
            if lying:
                assert not torch.equal(expected_values, plain_values)
            else:
                assert torch.equal(expected_values, plain_values) and torch.equal(expected_scales, plain_scales)
            values = torch.full((tokens, columns, head_dim), POISON_BYTE, dtype=torch.uint8, device=device)
            scales = torch.full((tokens, columns, groups), POISON_BYTE, dtype=torch.uint8, device=device)
            returned = cache_gather.checked_merge_rows_packed(hash_ids, row_start, back_values, back_scales, staged,
                                                              inverse, **copies, out=(values, scales))
            assert returned[0] is values and returned[1] is scales
            assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)
            out = torch.full((tokens, columns, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
            assert cache_gather.checked_merge_rows(hash_ids, row_start, back_values, back_scales, staged, inverse,
                                                   **copies, out=out) is out
            flat_ids = torch.arange(tokens * columns, device=device).view(tokens, columns)
            expected = gather.gather_rows(expected_values.view(-1, head_dim), expected_scales.view(-1, groups),
                                          flat_ids)
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    if device == "cpu":
        assert memory.accesses > 0


class _CountingStarts:
    """Wraps a placement's ``_start_misses`` to count the probes + host gathers it starts."""

    def __init__(self, storage):
        self.calls = 0
        self._inner = storage._start_misses
        storage._start_misses = self

    def __call__(self, *args):
        self.calls += 1
        return self._inner(*args)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_cached_table_large_lookups_equal_the_cpu_table(seed):
    """The placement's large-lookup path through EngramTable (CPU tensors under the interpreter; every
    lookup sent there with direct_max_rows = 0): lookup and lookup_packed equal placement 'cpu' with a hot
    set, after updates, with prefetch (used once), with a prefetch made stale by an update (discarded:
    the lookup probes again), with a column shard past row 0, with and without a direct share of the
    misses."""
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    from interpreter_bounds import bounds_checked

    generator = torch.Generator().manual_seed(seed)
    rows = _table(80, 64, generator)
    common = dict(column_start=1, column_end=4, row_start=500, validate=False, check_values=False)
    plain = engram.EngramTable(rows.values.clone(), rows.scales.clone(), **common)
    cached = engram.EngramTable(rows.values.clone(), rows.scales.clone(), placement="cached", device="cpu",
                                backend="triton", placement_options={"cache_fraction": 0.25, "ways": 4}, **common)
    storage = cached.storage
    storage.direct_max_rows = 0
    starts = _CountingStarts(storage)
    assert cached.load_hot_rows(torch.arange(500, 520)) == 20
    hits = 0
    with bounds_checked():
        for step in range(4):
            hash_ids = _ids((1, 11, 7, 13)[step], 5, 80, 500, generator, hot=30)
            storage.direct_share = (0.0, 0.5, 0.0, 0.7)[step]
            expected_bf16 = _expected_bf16(plain, rows, hash_ids, "triton")
            expected = plain.lookup_packed(hash_ids)
            before = starts.calls
            handle = None
            if step == 1:
                handle = cached.prefetch(hash_ids)
            if step == 2:
                handle = cached.prefetch(hash_ids)
                cached.update_cache(hash_ids)  # the prefetch's probe may name replaced slots: discarded
            assert torch.equal(cached.lookup(hash_ids, prefetch=handle).view(torch.int16), expected_bf16)
            got = cached.lookup_packed(hash_ids)
            assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
            assert torch.equal(got[1], expected[1])
            # Two lookups, two probes; on step 1 the prefetch's serves the first; on step 2 it is discarded.
            assert starts.calls - before == (3 if step == 2 else 2)
            local = hash_ids[:, 1:4].reshape(-1).to(torch.int64) - 500
            hits += int(storage.cache.probe(local, 80)[0].sum())
            if step != 2:
                cached.update_cache(hash_ids)
            _check_invariants(storage.cache, pack_rows(rows.values, rows.scales))
    assert storage.lookups == {"one_kernel": 0, "host_gather": 8}
    # The updates after a lookup of the same ids admit rows from its staging (each checked by its tag), where on.
    from_staging = int(storage.cache.admission_buffers(1).from_staging)
    assert from_staging > 0 if cached_placement.ADMIT_FROM_STAGING else from_staging == 0
    assert hits > 0, "no lookup hit the cache"
    storage.direct_max_rows = 10**9
    handle = cached.prefetch(hash_ids)  # the one-kernel path: nothing started
    assert not handle.started
    cached.lookup(hash_ids, prefetch=handle)
    assert storage.lookups["one_kernel"] == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("change", ["update", "load_hot"])
def test_content_change_between_prefetch_and_lookup_is_safe(change, seed):
    """A cache of one set of two ways holding rows 3 and 5; the prefetch's probe finds row 3 in its slot;
    the change then puts other rows in both ways (the update: rows 9 and 11, read three times each, beat
    the counters; load_hot: rows 9 and 11): the lookup must not read row 3's old slot."""
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    generator = torch.Generator().manual_seed(seed)
    rows = _table(80, 64, generator)
    plain = engram.EngramTable(rows.values.clone(), rows.scales.clone(), validate=False, check_values=False)
    cached = engram.EngramTable(rows.values.clone(), rows.scales.clone(), placement="cached", device="cpu",
                                backend="triton", validate=False, check_values=False,
                                placement_options={"cache_fraction": 2 / 80, "ways": 2, "aging_interval": 100})
    storage = cached.storage
    storage.direct_max_rows = 0
    assert (storage.cache.num_sets, storage.cache.num_slots) == (1, 2)
    assert cached.load_hot_rows(torch.tensor([5, 3])) == 2
    hash_ids = torch.tensor([[3], [9], [9], [9], [11], [11], [11]])
    handle = cached.prefetch(hash_ids)
    if change == "update":
        cached.update_cache(hash_ids)
    else:
        cached.load_hot_rows(torch.tensor([9, 11]))
    assert sorted(storage.cache.held_rows().tolist()) == [9, 11]
    got = cached.lookup_packed(hash_ids, prefetch=handle)
    assert cached.prefetches == {"served": 0, "dropped": 1}
    expected = plain.lookup_packed(hash_ids)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(got[1], expected[1])
    assert storage.lookups == {"one_kernel": 0, "host_gather": 1}


@pytest.mark.interpreter
@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_one_kernel_lookups_stage_their_rows_for_the_update(inference, seed):
    """Decode-sized lookups (the one-kernel path) stage the rows they read, and the update after them admits
    from there rather than from host memory: the cache then holds the same tags and bytes as one updated
    from the backing rows, lookups equal placement 'cpu', also where the ids were edited in place between
    the lookup and the update (the staging rows' tags then name other rows: those are read from the backing
    rows) and where an update follows no lookup of its size."""
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    generator = torch.Generator().manual_seed(seed)
    rows = _table(80, 64, generator)
    common = dict(row_start=500, validate=False, check_values=False)
    plain = engram.EngramTable(rows.values.clone(), rows.scales.clone(), **common)
    options = {"cache_fraction": 0.25, "ways": 4}
    staged, unstaged = (engram.EngramTable(rows.values.clone(), rows.scales.clone(), placement="cached", device="cpu",
                                           backend="triton", placement_options=options, **common) for _ in range(2))
    context = torch.inference_mode() if inference else torch.no_grad()
    with context:
        for step in range(6):
            hash_ids = _ids((1, 9, 5, 13, 2, 7)[step], 5, 80, 500, generator, hot=30)
            expected = plain.lookup_packed(hash_ids)
            got = staged.lookup_packed(hash_ids)
            assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(got[1], expected[1])
            if step == 2:  # an edit after the lookup: the update sees other ids than the staging holds
                hash_ids[0].copy_(_ids(1, 5, 80, 500, generator, hot=30)[0])
            if step == 4:  # an update of another size than the lookup's: nothing staged for it
                hash_ids = torch.cat([hash_ids, hash_ids])
            staged.update_cache(hash_ids)
            unstaged.storage.cache.update(hash_ids.reshape(-1).to(torch.int64) - 500, *unstaged.storage.backing)
            assert torch.equal(staged.storage.cache.tags, unstaged.storage.cache.tags), f"tags differ, step {step}"
            assert torch.equal(staged.storage.cache.slot_rows[:-1], unstaged.storage.cache.slot_rows[:-1]), \
                f"slot bytes differ, step {step}"
    assert staged.storage.lookups["host_gather"] == 0
    assert int(staged.storage.cache.admission_buffers(1).from_staging) > 0, "no row was admitted from a staging"


@pytest.mark.interpreter
def test_a_staging_that_cannot_be_allocated_costs_reads_not_the_lookup(seed, monkeypatch):
    """Where a one-kernel lookup's staging cannot be allocated, the lookup still serves exact rows, stages
    nothing, and the update reads host memory; once allocations succeed again, lookups stage again."""
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    generator = torch.Generator().manual_seed(seed)
    rows = _table(80, 64, generator)
    common = dict(row_start=500, validate=False, check_values=False)
    plain = engram.EngramTable(rows.values.clone(), rows.scales.clone(), **common)
    cached = engram.EngramTable(rows.values.clone(), rows.scales.clone(), placement="cached", device="cpu",
                                backend="triton", placement_options={"cache_fraction": 0.25, "ways": 4}, **common)
    storage = cached.storage
    real_empty = torch.empty

    row_bytes = packed_row_bytes(64)

    def failing_empty(*args, **kwargs):  # fails the stagings' allocations ([N, row_bytes]) alone
        shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
        if len(shape) == 2 and shape[1] == row_bytes:
            raise torch.OutOfMemoryError("injected: out of memory")
        return real_empty(*args, **kwargs)

    with torch.inference_mode():
        for step in range(4):
            hash_ids = _ids(7, 5, 80, 500, generator, hot=30)
            monkeypatch.setattr(torch, "empty", failing_empty if step < 2 else real_empty)
            try:
                got = cached.lookup_packed(hash_ids)
            finally:
                monkeypatch.setattr(torch, "empty", real_empty)
            expected = plain.lookup_packed(hash_ids)
            assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(got[1], expected[1])
            assert (storage._last_staging is None) == (step < 2), f"step {step}"
            cached.update_cache(hash_ids)
            _check_invariants(storage.cache, pack_rows(rows.values, rows.scales))
    assert int(storage.cache.admission_buffers(1).from_staging) > 0


def test_kernels_compile_for_sm90():
    """The probe, direct-read, merge and one-kernel lookup kernels compiled for sm90 on the CPU (Triton's own ptxas, no GPU)
    with the launchers' shapes, int32 and int64 ids, with and without direct reads: the interpreter
    checks what they compute, not that they build. The class hash's constant stays an int64 2654435761."""
    pytest.importorskip("triton")
    from engram.table.kernels import cache_kernels as kernels
    from test_wkv_compile import _compile

    launchers = _launchers()
    probe_types = dict(tags_ptr="*i64", slot_ptr="*i32", miss_ptr="*i32", total_rows="i32", local_columns="i32",
                       stride_token="i32", stride_column="i32", row_start="i64", num_rows="i32", num_sets="i32",
                       direct_threshold="i32")
    for ids in ("*i32", "*i64"):
        compiled = _compile(kernels.cached_probe_kernel, dict(hash_ids_ptr=ids, **probe_types),
                            dict(BLOCK_ROWS=launchers._PROBE_BLOCK_ROWS, WAYS=8), num_warps=4, num_stages=1)
        assert "dense<2654435761> : tensor<128xi64>" in compiled.asm["ttir"]
    block = 16  # launchers.block_rows() on the GPU
    _compile(kernels.cached_direct_kernel,
             dict(slot_ptr="*i32", back_value_ptr="*u8", back_scale_ptr="*u8", direct_ptr="*u8", total_rows="i32",
                  num_rows="i32", back_value_stride="i32", back_scale_stride="i32", direct_stride="i32"),
             dict(HEAD_DIM=256, GROUPS_PADDED=8, BLOCK_ROWS=block), num_warps=4, num_stages=1)
    merge_types = dict(inverse_ptr="*i32", staged_value_ptr="*u8", staged_scale_ptr="*u8", staged_tag_ptr="*i32",
                       back_value_ptr="*u8", back_scale_ptr="*u8", slot_ptr="*i32", cache_tag_ptr="*i64",
                       slot_value_ptr="*u8", slot_scale_ptr="*u8", direct_ptr="*u8")
    merge_ints = {name: "i32" for name in (
        "total_rows", "local_columns", "stride_token", "stride_column", "num_rows", "staged_rows",
        "staged_value_stride", "staged_scale_stride", "staged_tag_stride", "back_value_stride", "back_scale_stride",
        "num_slots", "slot_value_stride", "slot_scale_stride", "direct_stride")}
    merge_ints["row_start"] = "i64"
    for ids in ("*i32", "*i64"):
        for has_cache, has_direct in ((False, False), (True, False), (True, True)):
            shape = dict(HEAD_DIM=256, GROUPS_PADDED=8, BLOCK_ROWS=block, HAS_CACHE=has_cache, HAS_DIRECT=has_direct)
            types = dict(hash_ids_ptr=ids, **merge_types)
            _compile(kernels.checked_merge_bf16_kernel, dict(**types, out_ptr="*bf16", **merge_ints),
                     dict(**shape, DECODE=0), num_warps=4, num_stages=1)
            _compile(kernels.checked_merge_packed_kernel,
                     dict(**types, out_value_ptr="*u8", out_scale_ptr="*u8", **merge_ints), shape, num_warps=4,
                     num_stages=1)
    # The one-kernel lookups, with and without the tagged staging of their rows, with and without read-ahead.
    gather_types = dict(tags_ptr="*i64", slot_value_ptr="*u8", slot_scale_ptr="*u8", back_value_ptr="*u8",
                        back_scale_ptr="*u8")
    gather_ints = {name: "i32" for name in (
        "total_rows", "local_columns", "stride_token", "stride_column", "num_rows", "num_sets", "slot_value_stride",
        "slot_scale_stride", "back_value_stride", "back_scale_stride", "staged_stride")}
    gather_ints["row_start"] = "i64"
    for ids in ("*i32", "*i64"):
        for staged_row_bytes, read_ahead in ((0, True), (272, True), (272, False)):
            shape = dict(HEAD_DIM=256, GROUPS_PADDED=8, BLOCK_ROWS=block, WAYS=8, READ_AHEAD=read_ahead,
                         STAGED_ROW_BYTES=staged_row_bytes)
            _compile(kernels.cached_gather_bf16_kernel,
                     dict(hash_ids_ptr=ids, **gather_types, out_ptr="*bf16", staged_ptr="*u8", **gather_ints),
                     dict(**shape, DECODE=0), num_warps=4, num_stages=1)
            _compile(kernels.cached_gather_packed_kernel,
                     dict(hash_ids_ptr=ids, **gather_types, out_value_ptr="*u8", out_scale_ptr="*u8", staged_ptr="*u8",
                          **gather_ints), shape, num_warps=4, num_stages=1)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens,direct_max_rows", [(1, 0), (63, 0), (1000, 0), (4097, None)],
                         ids=["T1-forced", "T63-forced", "T1000-forced", "T4097-default"])
@pytest.mark.parametrize("direct_share", [0.0, 0.4], ids=["gather-all-misses", "direct-share-0.4"])
def test_gpu_large_lookups_equal_device_after_replacements(tokens, direct_max_rows, direct_share, seed):
    generator = torch.Generator().manual_seed(seed)
    device, cached = _device_and_cached(20000, 256, generator, row_start=777, cache_fraction=0.02, aging_interval=2)
    storage = cached.storage
    storage.direct_share = direct_share
    if direct_max_rows is not None:
        storage.direct_max_rows = direct_max_rows
    cache = storage.cache
    replaced = hits = 0
    for step in range(6):
        # The hot rows move every other step, so new rows outscore aged ones and replace them.
        hash_ids = _ids(tokens, 24, 20000, 777, generator, hot=20 if tokens == 1 else 300,
                        hot_start=2000 * (step // 2)).cuda()
        if step == 5:
            hash_ids = _malformed(hash_ids.cpu(), generator).cuda()
        before = cache.tags.clone()
        for layout, table_ids in enumerate((hash_ids, _strided(hash_ids, 1), hash_ids.to(torch.int32))):
            assert_lookups_equal(cached, device, table_ids, f"step {step}, ids layout {layout}")
        hits += int(cache.probe(hash_ids.reshape(-1).to(torch.int64) - 777, 20000)[0].sum())
        cached.update_cache(hash_ids)
        replaced += int(((before >= 0) & (cache.tags != before)).sum())
    _check_invariants(_on_cpu(cache), pack_rows(device.storage.value_bytes.cpu(), device.storage.scale_bytes.cpu()))
    assert storage.lookups == {"one_kernel": 0, "host_gather": 6 * 3 * 2}
    # Each update follows a large lookup of its ids: its admitted rows come from that lookup's staging, where on.
    from_staging = int(cache.admission_buffers(1).from_staging)
    assert from_staging > 0 if cached_placement.ADMIT_FROM_STAGING else from_staging == 0
    assert hits > 0, "no lookup read a cached row: the test did not test hits"
    if tokens > 1:
        assert replaced > 0, "the dynamic policy replaced no row: the test did not test replacement"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_prefetch_of_large_lookups_without_host_sync(seed):
    """Two layers: prefetch both, then their lookups and the update, over steps of varying size, with
    torch's sync debug mode raising on any host sync in the caller's calls; one step prefetches from a side
    stream, one calls update_cache between prefetch and lookup (the prefetch is discarded, still equal); the
    second layer reads a share of its misses directly on a side stream."""
    generator = torch.Generator().manual_seed(seed)
    tables = [_device_and_cached(20000, 256, generator, cache_fraction=0.05, aging_interval=2) for _ in range(2)]
    tables[1][1].storage.direct_share = 0.4  # the second layer reads a share of its misses directly (side stream)
    for _, cached in tables:
        cached.storage.direct_max_rows = 64
        warm = _ids(4096, 24, 20000, 0, generator, hot=500).cuda()
        cached.lookup(warm)  # grow the staging buffers outside the checked region
        cached.lookup_packed(warm)
        cached.update_cache(warm)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    for step, tokens in enumerate((4096, 1000, 4096, 3, 2000)):
        hash_ids = torch.stack([_ids(tokens, 24, 20000, 0, generator, hot=500) for _ in range(2)], dim=1).cuda()
        expected = [device.lookup(hash_ids[:, index, :]) for index, (device, _) in enumerate(tables)]
        expected_packed = [device.lookup_packed(hash_ids[:, index, :]) for index, (device, _) in enumerate(tables)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if step == 1:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    handles = [cached.prefetch(hash_ids[:, index, :]) for index, (_, cached) in enumerate(tables)]
            else:
                handles = [cached.prefetch(hash_ids[:, index, :]) for index, (_, cached) in enumerate(tables)]
            if step == 3:
                for index, (_, cached) in enumerate(tables):
                    cached.update_cache(hash_ids[:, index, :])
            got = [cached.lookup(hash_ids[:, index, :], prefetch=handle)
                   for index, ((_, cached), handle) in enumerate(zip(tables, handles))]
            got_packed = [cached.lookup_packed(hash_ids[:, index, :]) for index, (_, cached) in enumerate(tables)]
            if step != 3:
                for index, (_, cached) in enumerate(tables):
                    cached.update_cache(hash_ids[:, index, :])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b in zip(got, expected):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for (a_values, a_scales), (b_values, b_scales) in zip(got_packed, expected_packed):
            assert torch.equal(a_values.view(torch.uint8), b_values.view(torch.uint8))
            assert torch.equal(a_scales, b_scales)
    for _, cached in tables:
        assert cached.storage.lookups["host_gather"] == 2 + 5 * 2
        assert int(cached.storage.cache.stats[1]) > 0, "no read hit the cache"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_capture_takes_the_one_kernel_path(seed):
    generator = torch.Generator().manual_seed(seed)
    device, cached = _device_and_cached(3000, 256, generator, cache_fraction=0.05)
    cached.storage.direct_max_rows = 0  # every eager lookup takes the host gather; captured ones cannot
    static_ids = _ids(64, 24, 3000, 0, generator, hot=100).cuda()
    cached.update_cache(static_ids)

    def warm_up():
        cached.lookup(static_ids)  # the host gather
        cached.storage.direct_max_rows = 10**9
        cached.lookup(static_ids)  # the one kernel, compiled before the capture
        cached.storage.direct_max_rows = 0

    def capture():
        handle = cached.prefetch(static_ids)  # nothing started under capture
        assert not handle.started
        return cached.lookup(static_ids, prefetch=handle)

    graph, static_out = capture_cuda_graph(capture, warm_up)
    assert cached.storage.lookups == {"one_kernel": 2, "host_gather": 1}
    for _ in range(3):
        static_ids.copy_(_ids(64, 24, 3000, 0, generator, hot=100).cuda())
        cached.update_cache(static_ids)
        replay_poisoned(graph, static_out)
        assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_memory_prefetch_cached_equals_device(synthetic_model_dir, seed):
    generator = torch.Generator().manual_seed(seed)
    on_device, cached = _device_and_cached_memories(synthetic_model_dir)
    starts = {}
    for layer_id in cached.spec.layer_ids:
        cached.table(layer_id).storage.direct_max_rows = 1000  # 6 columns: T = 5 and 64 one kernel, 3000 not
        cached.table(layer_id).storage.direct_share = 0.3 * (layer_id == cached.spec.layer_ids[-1])
        starts[layer_id] = _CountingStarts(cached.table(layer_id).storage)
    for tokens in (5, 3000, 64, 3000):
        hash_ids, hidden = _layer_inputs(on_device, tokens, generator)
        handle = cached.prefetch(hash_ids)
        assert_layers_equal(cached, on_device, hidden, hash_ids, prefetch=handle)
        cached.update_cache(hash_ids)
    for layer_id in on_device.spec.layer_ids:
        lookups = cached.table(layer_id).storage.lookups
        assert lookups["host_gather"] == 2 and lookups["one_kernel"] == 2
        assert starts[layer_id].calls == 2, "a lookup did not use its layer's prefetch"
