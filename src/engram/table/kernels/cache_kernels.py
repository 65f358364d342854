"""Triton kernels of lookups through an HBM row cache (placement ``"cached"``).

Only ``@triton.jit`` functions live here; :mod:`engram.table.kernels.cache_gather` launches them
and :mod:`engram.table.placements.row_cache` holds the index they read and its plain-torch reference.

The cache is set-associative: local row ``r`` may sit only in set ``r % num_sets``, in
one of its ``WAYS`` slots; ``tags int64 [num_sets, WAYS]`` holds the row id of each slot
(-1: empty). Per row a program reads the set's tags (``WAYS * 8`` contiguous bytes, the
one dependent read a hit adds), then the row: from the slot on a hit, from the backing
rows (host memory through its CUDA alias, on the GPU) on a miss. Both loads are masked
so a lane touches exactly one of them. Dequantization reuses the helpers of
:mod:`engram.table.kernels.gather_kernels`, so results equal :func:`engram.table.kernels.gather.gather_rows`
bit for bit.

Large lookups split the same work in two launches around the host placement's host gather
(path (b), :mod:`engram.table.placements.cached`): :func:`cached_probe_kernel` writes each row's slot
(-1 on a miss) and the miss ids the host gather deduplicates and fetches;
:func:`checked_merge_bf16_kernel` / :func:`checked_merge_packed_kernel` then read a hit from its
slot and anything else from the gathered rows through the dedup's ``inverse``. Optionally a
share of the misses (a hash class of row ids) is read directly from host memory instead, by
:func:`cached_direct_kernel` while the host gathers the rest (probe slot ``-2 - row``).

The merge trusts no copy: it takes the lookup's ids again and serves a slot, a direct read or a
staged row only where the id that copy was read for (the slot's tag, the probe's ``-2 - row``, the
staged row's own tag: :mod:`engram.table.host_memory.rows`) equals the lookup's row at that
position; every other position reads the backing row itself, in the same launch. The host
placement's staged lookups run the same merge without a cache (``HAS_CACHE`` off). An edit of
the ids after the prefetch, a stale or never-written staging, or a cache changed since the probe
then costs reads, never rows (docs/design.md, "Rows exact by construction").
"""

from __future__ import annotations

import triton
import triton.language as tl

from engram.table.kernels.gather_kernels import _decode_e4m3, _scale_factors, _tile_row_ids

_SCALE_GROUP: tl.constexpr = tl.constexpr(32)


@triton.jit
def _probe(tags_ptr, local_id, inside, num_sets, WAYS: tl.constexpr):
    """Look ``local_id int64 [BLOCK_ROWS]`` up in its set -> ``(hit, slot int64)``.

    ``set = local_id % num_sets`` (int32 arithmetic: the launcher checks rows < 2**31);
    ``hit`` where ``tags[set, w] == local_id`` for some way ``w`` (the index keeps a row in
    at most one way), ``slot = set * WAYS + w`` (0 on a miss, never loaded)."""
    way = tl.arange(0, WAYS)
    row_set = (local_id.to(tl.int32) % num_sets).to(tl.int64)
    tags = tl.load(tags_ptr + row_set[:, None] * WAYS + way[None, :], mask=inside[:, None], other=-1)
    match = (tags == local_id[:, None]) & inside[:, None]
    hit_way = tl.max(tl.where(match, way[None, :], -1), axis=1)
    hit = hit_way >= 0
    slot = tl.where(hit, row_set * WAYS + hit_way.to(tl.int64), 0)
    return hit, slot


@triton.jit
def _row_layout(HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr):
    """A row's byte layout: ``group int32 [GROUPS_PADDED]``, ``group_valid = group < HEAD_DIM // 32``, ``column
    = group * 32 + lane int32 [GROUPS_PADDED, 32]`` and ``column_mask = group_valid [1, GROUPS_PADDED, 1]``."""
    group = tl.arange(0, GROUPS_PADDED)
    lane = tl.arange(0, _SCALE_GROUP)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    column = group[:, None] * _SCALE_GROUP + lane[None, :]
    column_mask = group_valid[None, :, None]
    return group, group_valid, column, column_mask


@triton.jit
def _load_row_bytes(value_ptr, scale_ptr, row, value_stride, scale_stride, take, group, group_valid, column):
    """Rows ``row int64 [BLOCK_ROWS]`` of one source -> ``value_bytes uint8 [BLOCK_ROWS, GROUPS_PADDED, 32]``,
    ``scale_bytes uint8 [BLOCK_ROWS, GROUPS_PADDED]``: ``value[row * value_stride + column]``, ``scale[row *
    scale_stride + group]`` where ``take`` and ``group_valid``, else 0 (those lanes load nothing)."""
    value_bytes = tl.load(value_ptr + row[:, None, None] * value_stride + column[None, :, :],
                          mask=take[:, None, None] & group_valid[None, :, None], other=0)
    scale_bytes = tl.load(scale_ptr + row[:, None] * scale_stride + group[None, :],
                          mask=take[:, None] & group_valid[None, :], other=0)
    return value_bytes, scale_bytes


@triton.jit
def _cached_row_bytes(hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
                      total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
                      slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
                      HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      WAYS: tl.constexpr, READ_AHEAD: tl.constexpr):
    """This program's rows through the cache: ``(row_index, in_bounds, inside, local_id, column,
    column_mask, group, group_valid, value_bytes [BLOCK_ROWS, GROUPS_PADDED, 32], scale_bytes [BLOCK_ROWS,
    GROUPS_PADDED])``: each row's bytes from its HBM slot on a hit, else from the backing
    rows, all-zero outside the table. Each lane makes exactly one of the two loads, except with
    ``READ_AHEAD``: every row's backing read is issued before the tags are read, so a miss pays no
    dependent round trip (latency-bound decode lookups; a hit then also moves its host row)."""
    program = tl.program_id(0)
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)
    group, group_valid, column, column_mask = _row_layout(HEAD_DIM, GROUPS_PADDED)
    if READ_AHEAD:
        miss_values, miss_scales = _load_row_bytes(back_value_ptr, back_scale_ptr, local_id, back_value_stride,
                                                   back_scale_stride, inside, group, group_valid, column)
    hit, slot = _probe(tags_ptr, local_id, inside, num_sets, WAYS)
    miss = inside & ~hit
    hit = inside & hit
    hit_values, hit_scales = _load_row_bytes(slot_value_ptr, slot_scale_ptr, slot, slot_value_stride,
                                             slot_scale_stride, hit, group, group_valid, column)
    if not READ_AHEAD:
        miss_values, miss_scales = _load_row_bytes(back_value_ptr, back_scale_ptr, local_id, back_value_stride,
                                                   back_scale_stride, miss, group, group_valid, column)
    value_bytes = tl.where(hit[:, None, None], hit_values, miss_values)
    scale_bytes = tl.where(hit[:, None], hit_scales, miss_scales)
    return row_index, in_bounds, inside, local_id, column, column_mask, group, group_valid, value_bytes, scale_bytes


@triton.jit
def _stage_rows(staged_ptr, staged_stride, row_index, in_bounds, inside, local_id, value_bytes, scale_bytes,
                column, column_mask, group, group_valid, HEAD_DIM: tl.constexpr, STAGED_ROW_BYTES: tl.constexpr):
    """With ``STAGED_ROW_BYTES`` (else nothing): each row's bytes as a tagged packed row of ``staged uint8
    [T * C_local, STAGED_ROW_BYTES]`` at its flattened index, the tag (last 4 bytes) its local id, -1 outside
    the table. The cache's next update copies the rows it admits from there (their tags checked) instead of
    reading host memory again."""
    if STAGED_ROW_BYTES > 0:
        base = staged_ptr + row_index * staged_stride
        tl.store(base[:, None, None] + column[None, :, :], value_bytes, mask=in_bounds[:, None, None] & column_mask)
        tl.store(base[:, None] + HEAD_DIM + group[None, :], scale_bytes, mask=in_bounds[:, None] & group_valid[None, :])
        tag_ptr = (base + (STAGED_ROW_BYTES - 4)).to(tl.pointer_type(tl.int32))
        tl.store(tag_ptr, tl.where(inside, local_id, -1).to(tl.int32), mask=in_bounds)


@triton.jit
def cached_gather_bf16_kernel(
    hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr, out_ptr, staged_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
    slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride, staged_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, WAYS: tl.constexpr,
    READ_AHEAD: tl.constexpr, STAGED_ROW_BYTES: tl.constexpr, DECODE: tl.constexpr,
):
    """``out bf16 [T, C_local, D]`` (contiguous) from ``hash_ids [T, C_local]`` through the cache:

    ``out[t, j, d] = bf16(e4m3(v[d]) * 2**(s[d // 32] - 127))`` with ``(v, s)`` the bytes of local
    row ``r = hash_ids[t, j] - row_start``: slot ``(r % num_sets) * WAYS + w`` of
    ``slot_value [slots, D]`` / ``slot_scale [slots, D // 32]`` when ``tags[r % num_sets, w] == r``,
    else row ``r`` of ``back_value [rows, D]`` / ``back_scale [rows, D // 32]``; +0 when ``r`` is
    outside ``[0, num_rows)``. One program per ``BLOCK_ROWS`` rows of the flattened ``[T * C_local]``.
    With ``STAGED_ROW_BYTES``, also the rows' bytes tagged in ``staged`` (:func:`_stage_rows`).
    """
    (row_index, in_bounds, inside, local_id, column, column_mask, group, group_valid, value_bytes,
     scale_bytes) = _cached_row_bytes(
        hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
        total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
        slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
        HEAD_DIM, GROUPS_PADDED, BLOCK_ROWS, WAYS, READ_AHEAD)
    _stage_rows(staged_ptr, staged_stride, row_index, in_bounds, inside, local_id, value_bytes, scale_bytes,
                column, column_mask, group, group_valid, HEAD_DIM, STAGED_ROW_BYTES)
    scale = _scale_factors(scale_bytes)[:, :, None]  # [BLOCK_ROWS, GROUPS_PADDED, 1]
    # fp32 product is exact (4 significant bits times a power of two); one rounding to bf16.
    product = _decode_e4m3(value_bytes, DECODE) * scale
    tl.store(out_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], product.to(tl.bfloat16),
             mask=in_bounds[:, None, None] & column_mask)


@triton.jit
def cached_gather_packed_kernel(
    hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
    out_value_ptr, out_scale_ptr, staged_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
    slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride, staged_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, WAYS: tl.constexpr,
    READ_AHEAD: tl.constexpr, STAGED_ROW_BYTES: tl.constexpr,
):
    """Raw FP8 rows through the cache: ``out_value uint8 [T, C_local, D]``, ``out_scale uint8
    [T, C_local, D // 32]`` (contiguous), the bytes :func:`cached_gather_bf16_kernel` decodes;
    all-zero bytes for ids outside the table's rows. With ``STAGED_ROW_BYTES``, also tagged in ``staged``."""
    (row_index, in_bounds, inside, local_id, column, column_mask, group, group_valid, value_bytes,
     scale_bytes) = _cached_row_bytes(
        hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
        total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
        slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
        HEAD_DIM, GROUPS_PADDED, BLOCK_ROWS, WAYS, READ_AHEAD)
    _stage_rows(staged_ptr, staged_stride, row_index, in_bounds, inside, local_id, value_bytes, scale_bytes,
                column, column_mask, group, group_valid, HEAD_DIM, STAGED_ROW_BYTES)
    tl.store(out_value_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], value_bytes,
             mask=in_bounds[:, None, None] & column_mask)
    tl.store(out_scale_ptr + row_index[:, None] * (HEAD_DIM // _SCALE_GROUP) + group[None, :], scale_bytes,
             mask=in_bounds[:, None] & group_valid[None, :])


@triton.jit
def _direct_class(local_id, direct_threshold):
    """Whether local row ``local_id int64 [...]`` (``< 2**31``) is read directly when missed: a byte of
    ``local_id * 0x9E3779B1`` (a multiplicative hash, so classes do not follow sets or id ranges) below
    ``direct_threshold`` (0..256: none..all)."""
    return ((local_id * 0x9E3779B1) >> 16) % 256 < direct_threshold


@triton.jit
def cached_probe_kernel(
    hash_ids_ptr, tags_ptr, slot_ptr, miss_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets, direct_threshold,
    BLOCK_ROWS: tl.constexpr, WAYS: tl.constexpr,
):
    """Probe only: ``slot int32 [T * C_local]`` and ``miss int32 [T * C_local]`` (contiguous) from
    ``hash_ids [T, C_local]`` (strides ``stride_token``, ``stride_column``):

    with ``r = hash_ids[t, j] - row_start``: ``slot = (r % num_sets) * WAYS + w`` when
    ``tags[r % num_sets, w] == r``; for a miss (``0 <= r < num_rows``, not held) of the direct class
    (:func:`_direct_class` below ``direct_threshold``) ``slot = -2 - r``; else -1. ``miss = r`` for the
    other misses, else -1 (hits, direct misses and ids outside the table: the host gather reads -1 as its
    zero row). One program per ``BLOCK_ROWS`` rows of the flattened ``[T * C_local]``; reads only the ids
    and the set's tags.
    """
    program = tl.program_id(0)
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)
    hit, slot = _probe(tags_ptr, local_id, inside, num_sets, WAYS)
    hit = inside & hit
    missed = inside & ~hit
    direct = missed & _direct_class(local_id, direct_threshold)
    slot = tl.where(hit, slot, tl.where(direct, -2 - local_id, -1))
    tl.store(slot_ptr + row_index, slot.to(tl.int32), mask=in_bounds)
    tl.store(miss_ptr + row_index, tl.where(missed & ~direct, local_id, -1).to(tl.int32), mask=in_bounds)


@triton.jit
def cached_direct_kernel(
    slot_ptr, back_value_ptr, back_scale_ptr, direct_ptr,
    total_rows, num_rows, back_value_stride, back_scale_stride, direct_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """The direct misses of a probe, read from the backing rows (host memory, on the GPU): for each ``i``
    with ``slot[i] <= -2`` (``slot int32 [N]``), ``direct[i, :D] = back_value[r]`` and ``direct[i, D:D + D // 32]
    = back_scale[r]``, ``r = -2 - slot[i]`` (zeros when ``r`` is outside ``[0, num_rows)``); ``direct uint8
    [N, >= D + D // 32]`` rows of the other ``i`` are not written. One program per ``BLOCK_ROWS`` rows."""
    program = tl.program_id(0).to(tl.int64)
    row_index = program * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_bounds = row_index < total_rows
    slot = tl.load(slot_ptr + row_index, mask=in_bounds, other=-1).to(tl.int64)
    wanted = in_bounds & (slot <= -2)
    local_id = -2 - slot
    read = wanted & (local_id >= 0) & (local_id < num_rows)
    local_id = tl.where(read, local_id, 0)

    group, group_valid, column, column_mask = _row_layout(HEAD_DIM, GROUPS_PADDED)
    values, scales = _load_row_bytes(back_value_ptr, back_scale_ptr, local_id, back_value_stride, back_scale_stride,
                                     read, group, group_valid, column)
    tl.store(direct_ptr + row_index[:, None, None] * direct_stride + column[None, :, :], values,
             mask=wanted[:, None, None] & column_mask)
    tl.store(direct_ptr + row_index[:, None] * direct_stride + HEAD_DIM + group[None, :], scales,
             mask=wanted[:, None] & group_valid[None, :])


@triton.jit
def _checked_source(ptr, row, stride, take, other):
    """``ptr[row * stride]`` where ``take``, else ``other`` (those lanes load nothing); ``row int64 [BLOCK_ROWS]``."""
    return tl.load(ptr + row * stride, mask=take, other=other).to(tl.int64)


@triton.jit
def _merged_row_bytes(hash_ids_ptr, inverse_ptr, staged_value_ptr, staged_scale_ptr, staged_tag_ptr,
                      back_value_ptr, back_scale_ptr, slot_ptr, cache_tag_ptr, slot_value_ptr, slot_scale_ptr,
                      direct_ptr, total_rows, local_columns, stride_token, stride_column, row_start, num_rows,
                      staged_rows, staged_value_stride, staged_scale_stride, staged_tag_stride, back_value_stride,
                      back_scale_stride, num_slots, slot_value_stride, slot_scale_stride, direct_stride,
                      HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      HAS_CACHE: tl.constexpr, HAS_DIRECT: tl.constexpr):
    """This program's rows, each from the first source that holds the lookup's own row ``r = hash_ids[t, j] -
    row_start`` (a copy is served only where the id it was read for equals ``r``, checked here):
    ``(row_index, in_bounds, column, column_mask, group, group_valid, value_bytes [BLOCK_ROWS, GROUPS_PADDED, 32],
    scale_bytes [BLOCK_ROWS, GROUPS_PADDED])``.

    Sources, in order: with ``HAS_CACHE`` cache slot ``s = slot[i]`` when ``cache_tags[s] == r``; with
    ``HAS_DIRECT`` row ``i`` of the direct reads when ``s == -2 - r``; row ``k = inverse[i]`` (clamped into
    ``[0, staged_rows)``) of the staged rows when its tag ``staged_tag[k] == r``; else the backing row ``r``
    itself. All-zero bytes when ``r`` is outside ``[0, num_rows)``. Each lane makes exactly one row load."""
    program = tl.program_id(0)
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)
    never = row_index < 0
    hit = never
    from_direct = never
    slot = tl.zeros_like(local_id)
    if HAS_CACHE:
        probed = _checked_source(slot_ptr, row_index, 1, in_bounds, -1)
        held = inside & (probed >= 0) & (probed < num_slots)
        slot = tl.where(held, probed, 0)
        hit = held & (_checked_source(cache_tag_ptr, slot, 1, held, -1) == local_id)
        if HAS_DIRECT:
            from_direct = inside & ~hit & (probed == -2 - local_id)
    staged = tl.minimum(tl.maximum(_checked_source(inverse_ptr, row_index, 1, in_bounds, 0), 0), staged_rows - 1)
    wanted = inside & ~hit & ~from_direct
    from_staging = wanted & (_checked_source(staged_tag_ptr, staged, staged_tag_stride, wanted, -1) == local_id)
    from_back = wanted & ~from_staging

    group, group_valid, column, column_mask = _row_layout(HEAD_DIM, GROUPS_PADDED)
    value_bytes, scale_bytes = _load_row_bytes(staged_value_ptr, staged_scale_ptr, staged, staged_value_stride,
                                               staged_scale_stride, from_staging, group, group_valid, column)
    back_values, back_scales = _load_row_bytes(back_value_ptr, back_scale_ptr, local_id, back_value_stride,
                                               back_scale_stride, from_back, group, group_valid, column)
    value_bytes = value_bytes | back_values  # masked loads give 0: at most one source is nonzero per lane
    scale_bytes = scale_bytes | back_scales
    if HAS_CACHE:
        hit_values, hit_scales = _load_row_bytes(slot_value_ptr, slot_scale_ptr, slot, slot_value_stride,
                                                 slot_scale_stride, hit, group, group_valid, column)
        value_bytes = value_bytes | hit_values
        scale_bytes = scale_bytes | hit_scales
        if HAS_DIRECT:
            # A direct row holds its values, then its scales: row i at direct + i * direct_stride.
            direct_values, direct_scales = _load_row_bytes(direct_ptr, direct_ptr + HEAD_DIM, row_index,
                                                           direct_stride, direct_stride, from_direct, group,
                                                           group_valid, column)
            value_bytes = value_bytes | direct_values
            scale_bytes = scale_bytes | direct_scales
    return row_index, in_bounds, column, column_mask, group, group_valid, value_bytes, scale_bytes


@triton.jit
def checked_merge_bf16_kernel(
    hash_ids_ptr, inverse_ptr, staged_value_ptr, staged_scale_ptr, staged_tag_ptr, back_value_ptr, back_scale_ptr,
    slot_ptr, cache_tag_ptr, slot_value_ptr, slot_scale_ptr, direct_ptr, out_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, staged_rows, staged_value_stride,
    staged_scale_stride, staged_tag_stride, back_value_stride, back_scale_stride, num_slots, slot_value_stride,
    slot_scale_stride, direct_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_CACHE: tl.constexpr,
    HAS_DIRECT: tl.constexpr, DECODE: tl.constexpr,
):
    """``out bf16 [T, C_local, D]`` (contiguous) for ``hash_ids [T, C_local]`` from copies checked row by row
    (:func:`_merged_row_bytes`): ``out[t, j, d] = bf16(e4m3(v[d]) * 2**(s[d // 32] - 127))`` with ``(v, s)`` the
    bytes of row ``hash_ids[t, j] - row_start``, from a cache slot, a direct read or the staged rows where their
    tag names that row, else from the backing rows; +0 outside the table. One program per ``BLOCK_ROWS`` rows.
    """
    row_index, in_bounds, column, column_mask, group, group_valid, value_bytes, scale_bytes = _merged_row_bytes(
        hash_ids_ptr, inverse_ptr, staged_value_ptr, staged_scale_ptr, staged_tag_ptr, back_value_ptr,
        back_scale_ptr, slot_ptr, cache_tag_ptr, slot_value_ptr, slot_scale_ptr, direct_ptr,
        total_rows, local_columns, stride_token, stride_column, row_start, num_rows, staged_rows, staged_value_stride,
        staged_scale_stride, staged_tag_stride, back_value_stride, back_scale_stride, num_slots, slot_value_stride,
        slot_scale_stride, direct_stride, HEAD_DIM, GROUPS_PADDED, BLOCK_ROWS, HAS_CACHE, HAS_DIRECT)
    scale = _scale_factors(scale_bytes)[:, :, None]  # [BLOCK_ROWS, GROUPS_PADDED, 1]
    product = _decode_e4m3(value_bytes, DECODE) * scale  # exact in fp32; one rounding to bf16
    tl.store(out_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], product.to(tl.bfloat16),
             mask=in_bounds[:, None, None] & column_mask)


@triton.jit
def checked_merge_packed_kernel(
    hash_ids_ptr, inverse_ptr, staged_value_ptr, staged_scale_ptr, staged_tag_ptr, back_value_ptr, back_scale_ptr,
    slot_ptr, cache_tag_ptr, slot_value_ptr, slot_scale_ptr, direct_ptr, out_value_ptr, out_scale_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, staged_rows, staged_value_stride,
    staged_scale_stride, staged_tag_stride, back_value_stride, back_scale_stride, num_slots, slot_value_stride,
    slot_scale_stride, direct_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_CACHE: tl.constexpr,
    HAS_DIRECT: tl.constexpr,
):
    """Raw FP8 bytes of :func:`checked_merge_bf16_kernel`'s rows: ``out_value uint8 [T, C_local, D]``,
    ``out_scale uint8 [T, C_local, D // 32]`` (contiguous); all-zero bytes outside the table."""
    row_index, in_bounds, column, column_mask, group, group_valid, value_bytes, scale_bytes = _merged_row_bytes(
        hash_ids_ptr, inverse_ptr, staged_value_ptr, staged_scale_ptr, staged_tag_ptr, back_value_ptr,
        back_scale_ptr, slot_ptr, cache_tag_ptr, slot_value_ptr, slot_scale_ptr, direct_ptr,
        total_rows, local_columns, stride_token, stride_column, row_start, num_rows, staged_rows, staged_value_stride,
        staged_scale_stride, staged_tag_stride, back_value_stride, back_scale_stride, num_slots, slot_value_stride,
        slot_scale_stride, direct_stride, HEAD_DIM, GROUPS_PADDED, BLOCK_ROWS, HAS_CACHE, HAS_DIRECT)
    tl.store(out_value_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], value_bytes,
             mask=in_bounds[:, None, None] & column_mask)
    tl.store(out_scale_ptr + row_index[:, None] * (HEAD_DIM // _SCALE_GROUP) + group[None, :], scale_bytes,
             mask=in_bounds[:, None] & group_valid[None, :])
