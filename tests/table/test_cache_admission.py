"""The row cache's update kernels equal their plain-torch reference, slot for slot and byte for byte.

:func:`engram.table.kernels.cache_admission.admit_step` (three or four fixed-size launches, no sort) against
:meth:`RowCache.update_with_torch`: after every step of a seeded stream the two caches hold the same tags,
counters, slot bytes (tags included) and stats, for both scores (recency and aged frequency), one to
eight ways, steps with repeats, ids outside the table, empty steps and awkward sizes. On the CPU under
``TRITON_INTERPRET=1`` (small shapes) and on the GPU (a larger stream, and a captured update replayed
with fresh ids).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engram.table.host_memory.rows import pack_rows, row_tags
from engram.table.placements.row_cache import RowCache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


def _rows(rng: np.random.Generator, num_rows: int, head_dim: int, device):
    values = torch.from_numpy(rng.integers(0, 0x7E, (num_rows, head_dim), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(100, 140, (num_rows, head_dim // 32), dtype=np.uint8))
    rows = pack_rows(values, scales)
    return rows.values.to(device), rows.scales.to(device)


def _pair(num_slots, head_dim, device, **options):
    return RowCache(num_slots, head_dim, device, **options), RowCache(num_slots, head_dim, device, **options)


def _assert_same(kernels: RowCache, reference: RowCache, what: str) -> None:
    assert torch.equal(kernels.tags, reference.tags), f"tags differ {what}"
    assert torch.equal(kernels.counters, reference.counters), f"counters differ {what}"
    assert torch.equal(kernels.slot_rows[:-1], reference.slot_rows[:-1]), f"slot bytes differ {what}"
    assert torch.equal(kernels.stats, reference.stats), f"stats differ {what}: {kernels.stats} {reference.stats}"


def _steps(rng: np.random.Generator, num_rows: int, sizes):
    for size in sizes:
        hot = rng.integers(0, max(1, num_rows // 8), size)  # repeats: a hot eighth of the rows
        cold = rng.integers(-3, num_rows + 3, size)  # and a few ids outside the table
        yield np.where(rng.random(size) < 0.5, hot, cold)


CASES = [  # (rows, slots, ways, recency, aging_interval)
    (200, 32, 8, True, 16),
    (200, 32, 8, False, 2),
    (150, 24, 4, False, 3),
    (97, 9, 1, True, 16),
    (300, 64, 2, False, 1),
]


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", CASES, ids=[f"rows{c[0]}-slots{c[1]}-ways{c[2]}-{'recency' if c[3] else 'freq'}"
                                              for c in CASES])
def test_update_kernels_equal_the_torch_reference(case, seed):
    num_rows, num_slots, ways, recency, aging = case
    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, num_rows, 64, "cpu")
    kernels, reference = _pair(num_slots, 64, "cpu", ways=ways, recency=recency, aging_interval=aging)
    sizes = [63, 1, 0, 120, 7, 63, 200, 2, 0, 90]
    for step, ids in enumerate(_steps(rng, num_rows, sizes)):
        dtype = torch.int32 if step % 2 else torch.int64
        kernels.update(torch.from_numpy(ids).to(dtype), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids).to(dtype), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")
    held = kernels.tags.reshape(-1)
    held = held[held >= 0]
    assert held.numel() > 0
    # Every held slot carries its row's bytes and, in its last 4 bytes, the row's own index.
    slots = (kernels.tags.reshape(-1) >= 0).nonzero()[:, 0]
    assert torch.equal(row_tags(kernels.slot_rows[:-1])[slots].to(torch.int64), kernels.tags.reshape(-1)[slots])
    assert torch.equal(kernels.slot_values[slots], back_values[kernels.tags.reshape(-1)[slots]])


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
def test_update_after_a_hot_set_and_a_clear(seed):
    """A hot set loaded, updated, cleared, updated: the kernels follow the reference through each."""
    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, 128, 64, "cpu")
    kernels, reference = _pair(16, 64, "cpu", ways=4, recency=False, aging_interval=2)
    hot = torch.from_numpy(rng.permutation(128)[:20])
    kernels.load_hot(hot, back_values, back_scales)
    reference.load_hot(hot, back_values, back_scales)
    for step, ids in enumerate(_steps(rng, 128, [40, 40, 5])):
        if step == 2:
            kernels.clear()
            reference.clear()
        kernels.update(torch.from_numpy(ids), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
def test_update_buffers_grow_and_a_half_done_step_is_redone_on_fresh_buffers(seed):
    """Buffers made for a small step grow for a larger one; a step whose launches stopped half-way (its
    buffers left dirty) gets fresh buffers, with the device step counter carried over."""
    from engram.table.kernels import cache_admission

    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, 100, 64, "cpu")
    kernels, reference = _pair(16, 64, "cpu", ways=4, recency=True)
    ids = list(_steps(rng, 100, [5, 80, 30]))
    kernels.update(torch.from_numpy(ids[0]), back_values, back_scales)
    reference.update_with_torch(torch.from_numpy(ids[0]), back_values, back_scales)
    small = kernels.admission_buffers(5)
    kernels.update(torch.from_numpy(ids[1]), back_values, back_scales)
    reference.update_with_torch(torch.from_numpy(ids[1]), back_values, back_scales)
    assert kernels.admission_buffers(80) is not small and kernels.admission_buffers(80).capacity >= 80
    _assert_same(kernels, reference, "after growth")
    buffers = kernels.admission_buffers(30)
    buffers.keys[:3] = 7  # what a step stopped after its first launch could leave behind
    buffers.dirty = True
    kernels.update(torch.from_numpy(ids[2]), back_values, back_scales)
    reference.update_with_torch(torch.from_numpy(ids[2]), back_values, back_scales)
    assert kernels.admission_buffers(30) is not buffers
    assert int(kernels.admission_buffers(30).step) == 3
    _assert_same(kernels, reference, "after a dirty step")
    assert cache_admission.AdmissionBuffers is type(buffers)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
def test_small_steps_after_a_large_one_use_their_own_table_prefix(recency, seed):
    """Steps far smaller than the buffers (a decode step after a prefill) count in the table's prefix for
    their own size and leave the whole table empty: each step equals the reference, and after each the
    table holds no key."""
    from engram.table.kernels.cache_admission import table_size_for

    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, 400, 64, "cpu")
    kernels, reference = _pair(32, 64, "cpu", ways=4, recency=recency, aging_interval=2)
    sizes = [300, 7, 1, 40, 300, 3]
    for step, ids in enumerate(_steps(rng, 400, sizes)):
        kernels.update(torch.from_numpy(ids), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} of {sizes[step]} ids (seed {seed})")
        buffers = kernels.admission_buffers(1)
        assert buffers.table_size == table_size_for(300) > table_size_for(sizes[step]) or sizes[step] == 300
        assert bool((buffers.keys == -1).all()) and not bool(buffers.counts.any()), f"table left dirty at step {step}"


def _staging_for(rng: np.random.Generator, ids: np.ndarray, packed_back: torch.Tensor):
    """A lookup's staging for ``ids``: its distinct rows (shuffled) as tagged packed rows, and ``inverse``
    (int32, one per id); a quarter of the rows get a second staging row of garbage whose tag names
    another row, which some of their ids point at. Returns ``(staged, inverse, rows staged right at
    every id)``."""
    num_rows = packed_back.shape[0] - 1
    inside = (ids >= 0) & (ids < num_rows)
    distinct = rng.permutation(np.unique(ids[inside]))
    rows = [packed_back[torch.from_numpy(distinct)]]
    index = {int(row): i for i, row in enumerate(distinct)}
    wrong = distinct[rng.random(distinct.size) < 0.25]
    garbage = rng.integers(0, 256, (wrong.size, packed_back.shape[1]), dtype=np.uint8)
    garbage[:, -4:] = ((wrong + 1) % num_rows).astype("<i4").view(np.uint8).reshape(-1, 4)
    rows.append(torch.from_numpy(garbage))
    wrong_index = {int(row): distinct.size + i for i, row in enumerate(wrong)}
    inverse = np.full(ids.size, -1, dtype=np.int32)
    always_right = set(index)
    for i, row in enumerate(ids):
        if not inside[i]:
            continue
        if int(row) in wrong_index and rng.random() < 0.5:
            inverse[i] = wrong_index[int(row)]
            always_right.discard(int(row))
        else:
            inverse[i] = index[int(row)]
    return torch.cat(rows), torch.from_numpy(inverse), np.array(sorted(always_right), dtype=np.int64)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
def test_admitted_rows_come_from_the_lookups_staging_where_its_tag_matches(recency, seed):
    """Given the step's staging, the kernels copy an admitted row from its staging row when that row's tag is
    the row's own index (the backing rows of those rows are poisoned for the kernels: the slots still hold
    the right bytes) and from the backing rows otherwise (garbage staging rows whose tag names another
    row are never used): slot for slot and byte for byte the reference's."""
    rng = np.random.default_rng(seed)
    num_rows = 150
    back_values, back_scales = _rows(rng, num_rows, 64, "cpu")
    packed_back = pack_rows(back_values, back_scales).packed
    kernels, reference = _pair(32, 64, "cpu", ways=4, recency=recency, aging_interval=2)
    used = 0
    for step, ids in enumerate(_steps(rng, num_rows, [63, 120, 1, 40])):
        staged, inverse, always_right = _staging_for(rng, ids, packed_back)
        if staged.shape[0] == 0:  # no id inside the table: a lookup that staged nothing
            staged = inverse = None
        poisoned_values, poisoned_scales = back_values.clone(), back_scales.clone()
        poisoned_values[torch.from_numpy(always_right)] = 0x7E
        poisoned_scales[torch.from_numpy(always_right)] = 1
        before = kernels.admission_buffers(ids.size).from_staging.clone() if step else torch.zeros(1, dtype=torch.int64)
        kernels.update(torch.from_numpy(ids), poisoned_values, poisoned_scales, staged=staged, inverse=inverse)
        reference.update_with_torch(torch.from_numpy(ids), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")
        used += int(kernels.admission_buffers(ids.size).from_staging - before)
    assert used > 0, "no row was admitted from the staging"


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
def test_a_one_kernel_lookup_stages_its_rows_and_the_update_admits_from_them(recency, seed):
    """A one-kernel lookup given ``staged`` writes each position's bytes there as a tagged packed row (the
    local row, -1 outside the table; rows past the lookup's untouched); the next update given that staging
    and no inverse admits every row from it: with the backing rows poisoned for the kernels, the cache
    still equals the reference's, slot for slot and byte for byte."""
    from engram.table.kernels.cache_gather import cached_gather_rows_packed

    rng = np.random.default_rng(seed)
    num_rows, head_dim = 150, 64
    back_values, back_scales = _rows(rng, num_rows, head_dim, "cpu")
    kernels, reference = _pair(32, head_dim, "cpu", ways=4, recency=recency, aging_interval=2)
    row_bytes = kernels.slot_rows.shape[1]
    for step, ids in enumerate(_steps(rng, num_rows, [63, 120, 1, 40])):
        count = ids.size
        hash_ids = torch.from_numpy(ids).view(count, 1)
        staged = torch.full((count + 3, row_bytes), 0xAB, dtype=torch.uint8)
        values, scales = cached_gather_rows_packed(kernels, back_values, back_scales, hash_ids, 0, staged=staged)
        inside = (ids >= 0) & (ids < num_rows)
        tags = staged[:count, -4:].contiguous().view(torch.int32)[:, 0]
        assert torch.equal(tags, torch.from_numpy(np.where(inside, ids, -1).astype(np.int32))), f"tags, step {step}"
        assert torch.equal(staged[:count, :head_dim], values.view(count, head_dim)), f"values, step {step}"
        assert torch.equal(staged[:count, head_dim: head_dim + head_dim // 32], scales.view(count, -1))
        assert bool((staged[count:] == 0xAB).all()), f"rows past the lookup written, step {step}"
        poisoned_values, poisoned_scales = back_values.clone(), back_scales.clone()
        poisoned_values[torch.from_numpy(ids[inside])] = 0x7E
        poisoned_scales[torch.from_numpy(ids[inside])] = 1
        kernels.update(torch.from_numpy(ids), poisoned_values, poisoned_scales, staged=staged)
        reference.update_with_torch(torch.from_numpy(ids), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")


def test_update_refuses_a_staging_that_does_not_fit():
    cache = RowCache(8, 64, "cpu", ways=4)
    values, scales = torch.zeros(10, 64, dtype=torch.uint8), torch.zeros(10, 2, dtype=torch.uint8)
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="staged, inverse: expected inverse only with staged"):
        cache.update(ids, values, scales, inverse=torch.zeros(3, dtype=torch.int32))
    if INTERPRET:
        with pytest.raises(ValueError, match=r"staged: expected uint8 \[S >= 1, 80\]"):
            cache.update(ids, values, scales, staged=torch.zeros(3, 64, dtype=torch.uint8),
                         inverse=torch.zeros(3, dtype=torch.int32))
        with pytest.raises(ValueError, match=r"staged: expected at least 3 rows \(one per id, no inverse given\)"):
            cache.update(ids, values, scales, staged=torch.zeros(2, 80, dtype=torch.uint8))
        with pytest.raises(ValueError, match=r"inverse: expected int32 \[3\]"):
            cache.update(ids, values, scales, staged=torch.zeros(3, 80, dtype=torch.uint8),
                         inverse=torch.zeros(2, dtype=torch.int32))


def test_update_refuses_float_ids():
    cache = RowCache(8, 64, "cpu", ways=4)
    values, scales = torch.zeros(10, 64, dtype=torch.uint8), torch.zeros(10, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="local_ids: expected int32 or int64 row ids, found torch.float32"):
        cache.update(torch.zeros(3), values, scales)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
@pytest.mark.parametrize("ways", [8, 16])
def test_gpu_update_kernels_equal_the_torch_reference(recency, ways, seed):
    rng = np.random.default_rng(seed)
    num_rows = 200_000
    back_values, back_scales = _rows(rng, num_rows, 256, "cuda")
    kernels, reference = _pair(4000, 256, "cuda", ways=ways, recency=recency, aging_interval=3)
    for step, ids in enumerate(_steps(rng, num_rows, [8192 * 24, 64 * 24, 1, 0, 63 * 24, 8192 * 24, 3000])):
        kernels.update(torch.from_numpy(ids).cuda(), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids).cuda(), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
def test_gpu_captured_update_replayed_with_fresh_ids_equals_eager(recency, seed):
    """The update captured in a CUDA graph, replayed with fresh ids copied into its input each step, leaves
    the cache as the eager reference does after every replay."""
    rng = np.random.default_rng(seed)
    num_rows, tokens = 100_000, 64 * 24
    back_values, back_scales = _rows(rng, num_rows, 256, "cuda")
    captured, reference = _pair(2000, 256, "cuda", ways=8, recency=recency, aging_interval=2)
    static_ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    first = torch.from_numpy(next(_steps(rng, num_rows, [tokens]))).cuda()
    captured.update(first, back_values, back_scales)  # eager: sizes the buffers
    reference.update_with_torch(first, back_values, back_scales)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        captured.update(static_ids, back_values, back_scales)
    torch.cuda.current_stream().wait_stream(side)
    for step, ids in enumerate(_steps(rng, num_rows, [tokens] * 12)):
        static_ids.copy_(torch.from_numpy(ids))
        graph.replay()
        reference.update_with_torch(torch.from_numpy(ids).cuda(), back_values, back_scales)
        _assert_same(captured, reference, f"after replay {step} (seed {seed})")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
def test_gpu_rows_admitted_from_a_staging_over_host_rows_equal_the_reference(recency, seed):
    """Prefill-sized steps (196,608 ids, half of them from a hot set) admitted from the lookup's staging on
    the device, with the backing rows in pinned host memory (the served layout, whose reads make a program's
    warps drift apart): every slot's bytes equal the torch reference's after every step. The race this
    is for (a warp that reads the slot's new tag and skips its share of the row) left 130-140 slots of
    7.68 M wrong a run in bench_cache_update.py on the H200."""
    from engram.table.host_memory.rows import cuda_alias

    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    num_rows, tokens = 8_000_000, 8192 * 24  # 2.2 GB of host rows, a cache of 7.68 M slots (2% of V4.1's rows)
    values = torch.randint(0, 0x7E, (num_rows, 256), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 140, (num_rows, 8), dtype=torch.uint8, generator=generator)
    packed = pack_rows(values, scales).packed.pin_memory()
    del values, scales
    alias = cuda_alias(packed, torch.device("cuda"))
    back_values, back_scales = alias[:-1, :256], alias[:-1, 256:264]
    device_values, device_scales = back_values.clone(), back_scales.clone()
    kernels, reference = _pair(7_680_000, 256, "cuda", ways=8, recency=recency, aging_interval=2)
    hot = rng.integers(0, num_rows, 200_000)
    used = 0
    for step in range(6):
        ids = np.where(rng.random(tokens) < 0.5, hot[rng.integers(0, hot.size, tokens)],
                       rng.integers(0, num_rows, tokens))
        ids = torch.from_numpy(ids).cuda()
        distinct, inverse = torch.unique(ids, return_inverse=True)
        staged = alias[distinct]  # the step's distinct rows, tagged, on the device
        before = kernels.admission_buffers(ids.numel()).from_staging.clone()
        kernels.update(ids, back_values, back_scales, staged=staged, inverse=inverse.to(torch.int32))
        reference.update_with_torch(ids, device_values, device_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")
        used += int(kernels.admission_buffers(ids.numel()).from_staging - before)
    assert used > 0, "no row was admitted from the staging"


def test_update_kernels_compile_for_sm90():
    """The six update kernels compiled for sm90 on the CPU (Triton's own ptxas, no GPU) with the launcher's
    shapes, int32 and int64 ids, with and without a staging, both scores: the interpreter checks what they
    compute, not that they build."""
    pytest.importorskip("triton")
    from engram.table.kernels import cache_admission as launcher
    from engram.table.kernels import cache_admission_kernels as kernels
    from test_wkv_compile import _compile

    step = dict(num_warps=4, num_stages=1)
    _compile(kernels.ages_kernel, dict(counters_ptr="*i32", num_counters="i32", step_ptr="*i64", aging_interval="i32"),
             dict(BLOCK=launcher._AGE_BLOCK), **step)
    for ids in ("*i32", "*i64"):
        for staged, identity in ((False, False), (True, False), (True, True)):
            _compile(kernels.count_rows_kernel,
                     dict(ids_ptr=ids, num_ids="i32", num_rows="i32", keys_ptr="*i32", counts_ptr="*i32",
                          table_size="i32", stats_ptr="*i64", touched_count_ptr="*i32", inverse_ptr="*i32",
                          staged_at_ptr="*i32"), dict(HAS_STAGED=staged, IDENTITY=identity, BLOCK=launcher._ID_BLOCK),
                     **step)
    for recency in (False, True):
        _compile(kernels.rank_candidates_kernel,
                 dict(keys_ptr="*i32", counts_ptr="*i32", table_size="i32", tags_ptr="*i64", counters_ptr="*i32",
                      num_sets="i32", step_ptr="*i64", best_ptr="*i64", stamps_ptr="*i64", touched_ptr="*i64",
                      touched_count_ptr="*i32", stats_ptr="*i64"),
                 dict(RECENCY=recency, WAYS=8, BLOCK=launcher._ENTRY_BLOCK), **step)
    _compile(kernels.admit_kernel,
             dict(touched_ptr="*i64", touched_count_ptr="*i32", best_ptr="*i64", tags_ptr="*i64",
                  counters_ptr="*i32", step_ptr="*i64", num_programs="i32"), dict(WAYS=8), **step)
    for staged in (False, True):
        _compile(kernels.copy_admitted_kernel,
                 dict(touched_ptr="*i64", touched_count_ptr="*i32", tags_ptr="*i64", slot_rows_ptr="*u8",
                      slot_stride="i32", back_values_ptr="*u8", back_scales_ptr="*u8", value_stride="i32",
                      scale_stride="i32", num_programs="i32", keys_ptr="*i32", staged_at_ptr="*i32", table_size="i32",
                      staged_ptr="*u8", staged_stride="i32", num_staged="i32", from_staging_ptr="*i64"),
                 dict(HEAD_DIM=256, GROUPS_PADDED=8, ROW_BYTES=272, WAYS=8, HAS_STAGED=staged), **step)
    _compile(kernels.clear_table_kernel, dict(keys_ptr="*i32", counts_ptr="*i32", staged_at_ptr="*i32", table_size="i32"),
             dict(BLOCK=launcher._ENTRY_BLOCK), **step)
