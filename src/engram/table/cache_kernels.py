"""Triton kernels of lookups through an HBM row cache (placement ``"cached"``).

Only ``@triton.jit`` functions live here; :mod:`engram.table.cache_gather` launches them
and :mod:`engram.table.row_cache` holds the index they read and its plain-torch reference.

The cache is set-associative: local row ``r`` may sit only in set ``r % num_sets``, in
one of its ``WAYS`` slots; ``tags int64 [num_sets, WAYS]`` holds the row id of each slot
(-1: empty). Per row a program reads the set's tags (``WAYS * 8`` contiguous bytes, the
one dependent read a hit adds), then the row: from the slot on a hit, from the backing
rows (host memory through its CUDA alias, on the GPU) on a miss. Both loads are masked
so a lane touches exactly one of them. Dequantization reuses the helpers of
:mod:`engram.table.kernels`, so results equal :func:`engram.table.gather.gather_rows`
bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _decode_e4m3, _scale_factors, _tile_row_ids

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
def _cached_row_bytes(hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
                      total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
                      slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
                      HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      WAYS: tl.constexpr):
    """This program's rows through the cache: ``(row_index, in_bounds, column, column_mask,
    group, group_valid, value_bytes [BLOCK_ROWS, GROUPS_PADDED, 32], scale_bytes [BLOCK_ROWS,
    GROUPS_PADDED])``: each row's bytes from its HBM slot on a hit, else from the backing
    rows, all-zero outside the table (each lane makes exactly one of the two loads)."""
    program = tl.program_id(0)
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)
    hit, slot = _probe(tags_ptr, local_id, inside, num_sets, WAYS)
    miss = inside & ~hit
    hit = inside & hit

    group = tl.arange(0, GROUPS_PADDED)
    lane = tl.arange(0, _SCALE_GROUP)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    column = group[:, None] * _SCALE_GROUP + lane[None, :]  # [GROUPS_PADDED, 32]
    column_mask = group_valid[None, :, None]

    hit_values = tl.load(slot_value_ptr + slot[:, None, None] * slot_value_stride + column[None, :, :],
                         mask=hit[:, None, None] & column_mask, other=0)
    miss_values = tl.load(back_value_ptr + local_id[:, None, None] * back_value_stride + column[None, :, :],
                          mask=miss[:, None, None] & column_mask, other=0)
    hit_scales = tl.load(slot_scale_ptr + slot[:, None] * slot_scale_stride + group[None, :],
                         mask=hit[:, None] & group_valid[None, :], other=0)
    miss_scales = tl.load(back_scale_ptr + local_id[:, None] * back_scale_stride + group[None, :],
                          mask=miss[:, None] & group_valid[None, :], other=0)
    value_bytes = tl.where(hit[:, None, None], hit_values, miss_values)
    scale_bytes = tl.where(hit[:, None], hit_scales, miss_scales)
    return row_index, in_bounds, column, column_mask, group, group_valid, value_bytes, scale_bytes


@triton.jit
def cached_gather_bf16_kernel(
    hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr, out_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
    slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, WAYS: tl.constexpr,
    DECODE: tl.constexpr,
):
    """``out bf16 [T, C_local, D]`` (contiguous) from ``hash_ids [T, C_local]`` through the cache:

    ``out[t, j, d] = bf16(e4m3(v[d]) * 2**(s[d // 32] - 127))`` with ``(v, s)`` the bytes of local
    row ``r = hash_ids[t, j] - row_start``: slot ``(r % num_sets) * WAYS + w`` of
    ``slot_value [slots, D]`` / ``slot_scale [slots, D // 32]`` when ``tags[r % num_sets, w] == r``,
    else row ``r`` of ``back_value [rows, D]`` / ``back_scale [rows, D // 32]``; +0 when ``r`` is
    outside ``[0, num_rows)``. One program per ``BLOCK_ROWS`` rows of the flattened ``[T * C_local]``.
    """
    row_index, in_bounds, column, column_mask, group, group_valid, value_bytes, scale_bytes = _cached_row_bytes(
        hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
        total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
        slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
        HEAD_DIM, GROUPS_PADDED, BLOCK_ROWS, WAYS)
    scale = _scale_factors(scale_bytes)[:, :, None]  # [BLOCK_ROWS, GROUPS_PADDED, 1]
    # fp32 product is exact (4 significant bits times a power of two); one rounding to bf16.
    product = _decode_e4m3(value_bytes, DECODE) * scale
    tl.store(out_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], product.to(tl.bfloat16),
             mask=in_bounds[:, None, None] & column_mask)


@triton.jit
def cached_gather_packed_kernel(
    hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
    out_value_ptr, out_scale_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
    slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, WAYS: tl.constexpr,
):
    """Raw FP8 rows through the cache: ``out_value uint8 [T, C_local, D]``, ``out_scale uint8
    [T, C_local, D // 32]`` (contiguous), the bytes :func:`cached_gather_bf16_kernel` decodes;
    all-zero bytes for ids outside the table's rows."""
    row_index, in_bounds, column, column_mask, group, group_valid, value_bytes, scale_bytes = _cached_row_bytes(
        hash_ids_ptr, tags_ptr, slot_value_ptr, slot_scale_ptr, back_value_ptr, back_scale_ptr,
        total_rows, local_columns, stride_token, stride_column, row_start, num_rows, num_sets,
        slot_value_stride, slot_scale_stride, back_value_stride, back_scale_stride,
        HEAD_DIM, GROUPS_PADDED, BLOCK_ROWS, WAYS)
    tl.store(out_value_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], value_bytes,
             mask=in_bounds[:, None, None] & column_mask)
    tl.store(out_scale_ptr + row_index[:, None] * (HEAD_DIM // _SCALE_GROUP) + group[None, :], scale_bytes,
             mask=in_bounds[:, None] & group_valid[None, :])
