"""Triton kernels of the HBM row cache's between-steps update (placement ``"cached"``).

Only ``@triton.jit`` functions live here; :mod:`engram.table.kernels.cache_admission` launches
them and :meth:`RowCache.update_with_torch <engram.table.placements.row_cache.RowCache.update_with_torch>`
is their plain-torch reference (the rules: :mod:`engram.table.placements.row_cache`).

One step is five fixed-size launches on the step's stream, with no sort, no host sync and no
program waiting on another (``ages_kernel`` first, for the frequency score only):

1. :func:`count_rows_kernel` counts the step's reads per distinct row in an open-addressing
   table (``keys int32 [P + 1]``, ``counts int32 [P + 1]``, ``P`` a power of two at least four times
   the ids; entry ``P`` is a trash entry for masked lanes). Each id probes linearly from its hash;
   ``atomic_cas`` claims an empty entry. A table at most a quarter full bounds the probes; the loop
   stops after ``P`` probes whatever the memory holds.
2. :func:`rank_candidates_kernel`, per table entry: looks the row up in its set; a held row
   takes its new score (recency: the step + 1; frequency: ``+ count``, saturated); a missed row
   is a candidate with key ``score * 2**31 + (2**31 - 1 - row)`` and is inserted into its set's
   top-``WAYS`` list ``best int64 [sets, WAYS]`` (descending): at each position ``atomic_max``
   keeps the larger key and the smaller one moves on, so whatever the order of the programs
   the list ends holding the set's ``WAYS`` largest keys, sorted. The first candidate of a set
   in this step (``atomic_xchg`` of the set's step stamp) appends the set to ``touched``. The
   entry is cleared for the next step.
3. :func:`admit_kernel`, per touched set (a fixed grid striding over the count): ranks the
   set's ways by score (empty first, ties by way), pairs the ``k``-th candidate with the
   ``k``-th way and admits it when its score is at least that way's (its tag and score into
   the way), then clears the set's list. Program 0 advances the device step counter.
4. :func:`copy_admitted_kernel`, per touched set: copies the row of every way admitted
   in step 3 from the backing rows (host memory, on the GPU) into the slot with its tag. Given
   the staging of the step's lookup (its missed rows, copied to the device by the host gather),
   a row is copied from its staging row when that row's tag is the row's own index (found
   through step 1's table), else from the backing rows.
5. :func:`clear_table_kernel` empties the table for the next step.

Sets are disjoint between programs of steps 3 and 4; every other shared word is written only by
atomics whose result does not depend on their order, so the update is deterministic. The atomics are
relaxed: each needs only its own word's atomicity (the launches order everything else), and the default
acquire-release form fences every one of them.
"""

from __future__ import annotations

import triton
import triton.language as tl

_ID_BITS: tl.constexpr = tl.constexpr(31)
_ID_MASK: tl.constexpr = tl.constexpr(2**31 - 1)
_COUNTER_MAX: tl.constexpr = tl.constexpr(2**30)
_SCALE_GROUP: tl.constexpr = tl.constexpr(32)


@triton.jit
def _table_position(row, table_mask):
    """The open-addressing table's first probe for ``row int64``: a multiplicative hash."""
    return ((row * 2654435761) >> 11) & table_mask


@triton.jit
def ages_kernel(counters_ptr, num_counters, step_ptr, aging_interval, BLOCK: tl.constexpr):
    """Frequency score: halve every counter when the device step ``k > 0`` is a multiple of
    ``aging_interval`` (a fixed grid; every program returns at once on the other steps)."""
    step = tl.load(step_ptr)
    if (step > 0) & (step % aging_interval == 0):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < num_counters
        counters = tl.load(counters_ptr + offsets, mask=inside, other=0)
        tl.store(counters_ptr + offsets, counters >> 1, mask=inside)


@triton.jit
def count_rows_kernel(ids_ptr, num_ids, num_rows, keys_ptr, counts_ptr, table_size, stats_ptr,
                      touched_count_ptr, inverse_ptr, staged_at_ptr, HAS_STAGED: tl.constexpr,
                      IDENTITY: tl.constexpr, BLOCK: tl.constexpr):
    """Step 1 (module docstring): ``ids int32/int64 [num_ids]`` (local rows; those outside
    ``[0, num_rows)`` ignored) into the table; ``stats[0] +=`` reads, ``stats[2] +=`` distinct rows.
    With ``HAS_STAGED``: ``staged_at[entry] = inverse[i]`` for some id ``i`` of the entry's row (the staging
    row the step's lookup read it into; step 4 checks that row's tag before using it), ``i`` itself with
    ``IDENTITY`` (a one-kernel lookup's staging: row ``i`` for id ``i``)."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(touched_count_ptr, 0)  # step 2 appends to it
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < num_ids
    row = tl.load(ids_ptr + offsets, mask=inside, other=-1).to(tl.int64)
    valid = inside & (row >= 0) & (row < num_rows)
    table_mask = table_size - 1
    position = tl.where(valid, _table_position(row, table_mask), table_size)
    key = row.to(tl.int32)
    pending = valid
    first = tl.zeros([BLOCK], dtype=tl.int1)
    probes = 0
    # Lanes not pending compare against -2 (never stored) at an entry of their own: their CAS writes nothing.
    # (All of them at the one trash entry serialized there: 806 us of 850 for T = 8192 on the H200.)
    idle_position = offsets & table_mask
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (probes < table_size):
        target = tl.where(pending, position, idle_position)
        old = tl.atomic_cas(keys_ptr + target, tl.where(pending, -1, -2), tl.where(pending, key, -2), sem="relaxed")
        won = pending & (old == -1)
        found = won | (pending & (old == key))
        tl.atomic_add(counts_ptr + target, 1, mask=found, sem="relaxed")
        if HAS_STAGED:  # any id's staging row will do: they all hold the row's bytes, or fail the tag check
            if IDENTITY:
                staged = tl.where(found, offsets, -1).to(tl.int32)
            else:
                staged = tl.load(inverse_ptr + offsets, mask=found, other=-1)
            tl.store(staged_at_ptr + target, staged, mask=found & (staged >= 0))
        first = first | won
        pending = pending & ~found
        position = tl.where(pending, (position + 1) & table_mask, position)
        probes += 1
    tl.atomic_add(stats_ptr + 0, tl.sum(valid.to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_add(stats_ptr + 2, tl.sum(first.to(tl.int64), axis=0), sem="relaxed")


@triton.jit
def rank_candidates_kernel(keys_ptr, counts_ptr, table_size, tags_ptr, counters_ptr, num_sets, step_ptr,
                           best_ptr, stamps_ptr, touched_ptr, touched_count_ptr, stats_ptr,
                           RECENCY: tl.constexpr, WAYS: tl.constexpr, BLOCK: tl.constexpr):
    """Step 2 (module docstring) over table entries ``[pid * BLOCK, (pid + 1) * BLOCK)``; ``stats[1] +=``
    reads that hit, ``stats[3] +=`` distinct missed rows."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < table_size
    row = tl.load(keys_ptr + offsets, mask=inside, other=-1).to(tl.int64)
    count = tl.load(counts_ptr + offsets, mask=inside, other=0)
    present = inside & (row >= 0)
    way = tl.arange(0, WAYS)
    row_set = tl.where(present, row, 0) % num_sets
    tags = tl.load(tags_ptr + row_set[:, None] * WAYS + way[None, :], mask=present[:, None], other=-1)
    hit_way = tl.max(tl.where((tags == row[:, None]) & present[:, None], way[None, :], -1), axis=1)
    hit = hit_way >= 0
    slot = row_set * WAYS + tl.where(hit, hit_way, 0).to(tl.int64)
    step = tl.load(step_ptr)
    if RECENCY:
        score = tl.minimum(step + 1, _COUNTER_MAX)
        tl.store(counters_ptr + slot, tl.full([BLOCK], 0, tl.int32) + score.to(tl.int32), mask=hit)
        candidate_score = tl.zeros([BLOCK], dtype=tl.int64) + score
    else:
        # Saturating add: every add is followed by its own min, so the last word is min(sum, max).
        tl.atomic_add(counters_ptr + slot, count, mask=hit, sem="relaxed")
        tl.atomic_min(counters_ptr + slot, tl.full([BLOCK], _COUNTER_MAX, tl.int32), mask=hit, sem="relaxed")
        candidate_score = count.to(tl.int64)
    candidate = present & ~hit
    tl.atomic_add(stats_ptr + 1, tl.sum(tl.where(hit, count, 0).to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_add(stats_ptr + 3, tl.sum(candidate.to(tl.int64), axis=0), sem="relaxed")
    # The set's top-WAYS list: the larger key stays, the smaller moves on (a key met again stops).
    key = tl.where(candidate, (candidate_score << _ID_BITS) + (_ID_MASK - row), -1)
    # Each atomic waits for the one before (about 1 us on the H200): the loop ends once no key moves on, after
    # one position where the list was empty, as most are at decode sizes.
    moving = key >= 0
    position = 0
    while (position < WAYS) & (tl.max(moving.to(tl.int32), axis=0) > 0):
        old = tl.atomic_max(best_ptr + row_set * WAYS + position, key, mask=moving, sem="relaxed")
        key = tl.where(moving & (old != key), tl.minimum(old, key), -1)
        moving = key >= 0
        position += 1
    # The set's first candidate of this step lists it for step 3: one atomic per program reserves the block's
    # places (one per candidate at a single word serialized there).
    stamp = tl.zeros([BLOCK], dtype=tl.int64) + (step + 1)
    previous = tl.atomic_xchg(stamps_ptr + row_set, stamp, mask=candidate, sem="relaxed")
    first_of_set = candidate & (previous != stamp)
    first_count = first_of_set.to(tl.int32)
    base = tl.atomic_add(touched_count_ptr, tl.sum(first_count, axis=0), sem="relaxed")
    index = base + tl.cumsum(first_count, axis=0) - first_count
    tl.store(touched_ptr + index.to(tl.int64), row_set, mask=first_of_set)


@triton.jit
def admit_kernel(touched_ptr, touched_count_ptr, best_ptr, tags_ptr, counters_ptr, step_ptr, num_programs,
                 WAYS: tl.constexpr):
    """Step 3 (module docstring): program ``pid`` decides the admissions of touched sets ``pid, pid +
    num_programs, ...`` (of ``touched_count``): each admitted candidate's tag and score into its way; the
    bytes follow in step 4 (:func:`copy_admitted_kernel`)."""
    pid = tl.program_id(0)
    touched_count = tl.load(touched_count_ptr)
    if pid == 0:
        tl.store(step_ptr, tl.load(step_ptr) + 1)  # read by steps 1-2 only, which ran before
    way = tl.arange(0, WAYS)
    for index in range(pid, touched_count, num_programs):
        row_set = tl.load(touched_ptr + index).to(tl.int64)
        list_offsets = row_set * WAYS + way
        key = tl.load(best_ptr + list_offsets)
        tl.store(best_ptr + list_offsets, tl.full([WAYS], -1, tl.int64))  # empty for the next step
        tags = tl.load(tags_ptr + list_offsets)
        held_score = tl.where(tags >= 0, tl.load(counters_ptr + list_offsets).to(tl.int64), -1)
        # Way w's rank: ways of a lower score, or the same score and a lower index, go first.
        earlier = ((held_score[None, :] < held_score[:, None])
                   | ((held_score[None, :] == held_score[:, None]) & (way[None, :] < way[:, None])))
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        paired = rank[None, :] == way[:, None]  # [candidate k, way w]: way w is the k-th victim
        victim_score = tl.sum(tl.where(paired, held_score[None, :], 0), axis=1)
        victim_way = tl.sum(tl.where(paired, way[None, :], 0), axis=1)
        score = key >> _ID_BITS
        row = _ID_MASK - (key & _ID_MASK)
        admit = (key >= 0) & (score >= victim_score)
        slot = row_set * WAYS + victim_way.to(tl.int64)
        tl.store(tags_ptr + slot, row, mask=admit)
        tl.store(counters_ptr + slot, tl.minimum(score, _COUNTER_MAX).to(tl.int32), mask=admit)


@triton.jit
def copy_admitted_kernel(touched_ptr, touched_count_ptr, tags_ptr, slot_rows_ptr, slot_stride, back_values_ptr,
                         back_scales_ptr, value_stride, scale_stride, num_programs, keys_ptr, staged_at_ptr, table_size,
                         staged_ptr, staged_stride, num_staged, from_staging_ptr, HEAD_DIM: tl.constexpr,
                         GROUPS_PADDED: tl.constexpr, ROW_BYTES: tl.constexpr, WAYS: tl.constexpr,
                         HAS_STAGED: tl.constexpr):
    """Step 4 (module docstring): program ``pid`` copies the admitted ways of touched sets ``pid, pid +
    num_programs, ...``, all ``WAYS`` of a set as one ``[WAYS, row]`` block: where a slot's tag (step 3's, a
    launch before) differs from the tag in its slot row's last 4 bytes (written with the slot's bytes by every
    writer, -1 at first), the row was admitted now, and its bytes and tag go into the slot row. Sets are
    disjoint between programs and every input was written by an earlier launch, so no program reads what
    another writes. Within a program, every warp reads the slots' old tags before one writes the new ones (a
    barrier between; without it, on the H200 with Triton 3.6, a warp that started late read a new tag and
    left its share of the row unwritten, tags right). With ``HAS_STAGED``, a row whose staging row (``staged
    uint8 [num_staged, ROW_BYTES]``, found through the table's ``staged_at``) carries its own index in its tag
    is copied from there; ``from_staging[0] +=`` those rows. One program per set rather than per slot: at
    decode sizes (1,536 ids) the per-slot grid took 45 us, six waves of programs each waiting on a host read."""
    pid = tl.program_id(0)
    touched_count = tl.load(touched_count_ptr)
    way = tl.arange(0, WAYS)
    group = tl.arange(0, GROUPS_PADDED)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    column = tl.arange(0, GROUPS_PADDED * _SCALE_GROUP)
    column_valid = column < HEAD_DIM
    from_staging = tl.zeros([WAYS], dtype=tl.int32)
    for index in range(pid, touched_count, num_programs):
        slot = tl.load(touched_ptr + index).to(tl.int64) * WAYS + way  # [WAYS]
        row = tl.load(tags_ptr + slot)
        slot_base = slot_rows_ptr + slot * slot_stride
        slot_tag_ptr = (slot_base + (ROW_BYTES - 4)).to(tl.pointer_type(tl.int32))
        admit = (row >= 0) & (row != tl.load(slot_tag_ptr).to(tl.int64))
        row = tl.maximum(row, 0)
        value_mask = admit[:, None] & column_valid[None, :]
        scale_mask = admit[:, None] & group_valid[None, :]
        if HAS_STAGED:
            staged_row = _staged_rows(row, admit, keys_ptr, staged_at_ptr, table_size, staged_ptr, staged_stride,
                                      num_staged, ROW_BYTES)
            staged = staged_row >= 0
            from_staging += staged.to(tl.int32)
            staged_base = staged_ptr + tl.maximum(staged_row, 0) * staged_stride
            value_bytes = tl.load(staged_base[:, None] + column[None, :], mask=value_mask & staged[:, None], other=0)
            value_bytes += tl.load(back_values_ptr + row[:, None] * value_stride + column[None, :],
                                   mask=value_mask & ~staged[:, None], other=0)
            scale_bytes = tl.load(staged_base[:, None] + HEAD_DIM + group[None, :], mask=scale_mask & staged[:, None],
                                  other=0)
            scale_bytes += tl.load(back_scales_ptr + row[:, None] * scale_stride + group[None, :],
                                   mask=scale_mask & ~staged[:, None], other=0)
        else:
            value_bytes = tl.load(back_values_ptr + row[:, None] * value_stride + column[None, :], mask=value_mask,
                                  other=0)
            scale_bytes = tl.load(back_scales_ptr + row[:, None] * scale_stride + group[None, :], mask=scale_mask,
                                  other=0)
        tl.store(slot_base[:, None] + column[None, :], value_bytes, mask=value_mask)
        tl.store(slot_base[:, None] + HEAD_DIM + group[None, :], scale_bytes, mask=scale_mask)
        tl.debug_barrier()  # every warp has read the old tags (admit) before the new ones are written
        tl.store(slot_tag_ptr, row.to(tl.int32), mask=admit)
    if HAS_STAGED:
        tl.atomic_add(from_staging_ptr, tl.sum(from_staging, axis=0).to(tl.int64), sem="relaxed")


@triton.jit
def _staged_rows(row, admit, keys_ptr, staged_at_ptr, table_size, staged_ptr, staged_stride, num_staged,
                 ROW_BYTES: tl.constexpr):
    """The staging rows holding ``row`` (int64 ``[WAYS]``, where ``admit``): each one's table entry's
    ``staged_at`` when that staging row's tag (its last 4 bytes, little-endian) is the row; else -1 (read
    the backing row)."""
    table_mask = table_size - 1
    key_wanted = row.to(tl.int32)
    position = tl.where(admit, _table_position(row, table_mask), 0)
    key = tl.load(keys_ptr + position, mask=admit, other=-1)
    probes = 1
    searching = admit & (key != key_wanted) & (key != -1)
    while (tl.max(searching.to(tl.int32), axis=0) > 0) & (probes < table_size):
        position = tl.where(searching, (position + 1) & table_mask, position)
        key = tl.where(searching, tl.load(keys_ptr + position, mask=searching, other=-1), key)
        searching = searching & (key != key_wanted) & (key != -1)
        probes += 1
    found = admit & (key == key_wanted)
    staged_row = tl.load(staged_at_ptr + position, mask=found, other=-1).to(tl.int64)  # position < table_size
    inside = found & (staged_row >= 0) & (staged_row < num_staged)
    tag_ptr = (staged_ptr + tl.where(inside, staged_row, 0) * staged_stride + (ROW_BYTES - 4)).to(tl.pointer_type(tl.int32))
    tag = tl.load(tag_ptr, mask=inside, other=-1).to(tl.int64)  # rows are 4-byte aligned (row_tags)
    return tl.where(inside & (tag == row), staged_row, -1)


@triton.jit
def clear_table_kernel(keys_ptr, counts_ptr, staged_at_ptr, table_size, BLOCK: tl.constexpr):
    """Step 5: empty the table's entries ``[pid * BLOCK, (pid + 1) * BLOCK)`` for the next step."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < table_size
    tl.store(keys_ptr + offsets, tl.full([BLOCK], -1, tl.int32), mask=inside)
    tl.store(counts_ptr + offsets, tl.zeros([BLOCK], dtype=tl.int32), mask=inside)
    tl.store(staged_at_ptr + offsets, tl.full([BLOCK], -1, tl.int32), mask=inside)
