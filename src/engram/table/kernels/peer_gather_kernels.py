"""Triton kernels of peer lookups: a table's rows split over shards that live anywhere the kernel can
address (this GPU's HBM or, mapped, other GPUs' HBM over NVLink), found through a pointer table.

Only ``@triton.jit`` functions live here; :mod:`engram.table.kernels.peer_gather` launches them.

Shard ``s`` holds the table's local rows ``[s * rows_per_shard, (s + 1) * rows_per_shard)`` packed,
``uint8 [owned, ROW_BYTES]`` (values ``[:D]``, scales ``[D:D + D // 32]``, ``ROW_BYTES`` a multiple of
16), and ``shard_bases[s]`` is its address. The kernel cannot tell a peer's address from a local one.
Work split and layout as :func:`~engram.table.kernels.gather_kernels.gather_rows_bf16_kernel`; the
per-row extra is one load of the shard's base from the ``[W]`` table (cached) and an int32 division.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engram.table.kernels.gather_kernels import _decode_e4m3, _scale_factors, _tile_row_ids

_SCALE_GROUP: tl.constexpr = tl.constexpr(32)  # values per UE8M0 scale byte


@triton.jit
def _peer_row_pointers(hash_ids_ptr, shard_bases_ptr, program, total_rows, local_columns, stride_token,
                       stride_column, row_start, num_rows, rows_per_shard,
                       ROW_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows ``program * BLOCK_ROWS + [0, BLOCK_ROWS)`` of the flattened ``[T, C_local]`` ids ->
    ``(row_index int64, in_bounds, inside, row_pointer)``, each ``[BLOCK_ROWS]``: ``row_pointer``
    addresses the packed row of local row ``id - row_start`` in its shard (never dereferenced where
    not ``inside``; the launcher checks ``num_rows < 2**31``, so the division is int32)."""
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)
    local_row = local_id.to(tl.int32)
    shard = local_row // rows_per_shard
    within = (local_row - shard * rows_per_shard).to(tl.int64)
    base = tl.load(shard_bases_ptr + shard, mask=inside, other=0)  # int64 addresses, 16-byte aligned
    # The hint keeps the row loads 16 bytes wide: without it Triton knows nothing of a loaded address's
    # alignment and loads single bytes (sm_90 PTX, tests/table/test_peer_gather_ptx.py).
    row_pointer = tl.multiple_of((base + within * ROW_BYTES).to(tl.pointer_type(tl.uint8)), 16)
    return row_index, in_bounds, inside, row_pointer


@triton.jit
def peer_gather_rows_bf16_kernel(
    hash_ids_ptr, shard_bases_ptr, out_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, rows_per_shard,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    VECTOR: tl.constexpr, DECODE: tl.constexpr,
):
    """Gather and dequantize from shards: ``out bf16 [T, C_local, D]`` (contiguous) from
    ``hash_ids int32/int64 [T, C_local]`` (strides ``stride_token``, ``stride_column``) and
    ``shard_bases int64 [W]``:

    ``out[t, j, d] = bf16(e4m3(row[d]) * 2**(row[D + d // 32] - 127))`` with ``row`` the packed row of
    local row ``id - row_start`` (``id = hash_ids[t, j]``), and +0 for ids outside ``[row_start,
    row_start + num_rows)``: the same bits as the one-table gather.
    """
    program = tl.program_id(0)
    row_index, in_bounds, inside, row_pointer = _peer_row_pointers(
        hash_ids_ptr, shard_bases_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, rows_per_shard, ROW_BYTES, BLOCK_ROWS)

    group = tl.arange(0, GROUPS_PADDED)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    chunk = tl.arange(0, _SCALE_GROUP // VECTOR)
    lane = tl.arange(0, VECTOR)
    # [1, GROUPS_PADDED, 32 // VECTOR, VECTOR]
    column = (group[:, None, None] * _SCALE_GROUP + chunk[None, :, None] * VECTOR + lane[None, None, :])[None, :, :, :]
    group_mask = group_valid[None, :, None, None]
    value_bytes = tl.load(row_pointer[:, None, None, None] + column,
                          mask=inside[:, None, None, None] & group_mask, other=0)
    scale_bytes = tl.load(row_pointer[:, None] + HEAD_DIM + group[None, :],
                          mask=inside[:, None] & group_valid[None, :], other=0)
    scale = _scale_factors(scale_bytes)[:, :, None, None]
    # fp32 product is exact (4 significant bits times a power of two); one rounding to bf16.
    product = _decode_e4m3(value_bytes, DECODE) * scale
    out_offsets = row_index[:, None, None, None] * HEAD_DIM + column
    tl.store(out_ptr + out_offsets, product.to(tl.bfloat16), mask=in_bounds[:, None, None, None] & group_mask)


@triton.jit
def peer_gather_rows_packed_kernel(
    hash_ids_ptr, shard_bases_ptr, out_value_ptr, out_scale_ptr,
    total_rows, local_columns, stride_token, stride_column, row_start, num_rows, rows_per_shard,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Gather raw FP8 rows from shards: ``out_value uint8 [T, C_local, D]`` and ``out_scale uint8
    [T, C_local, D // 32]`` (contiguous), from the inputs of :func:`peer_gather_rows_bf16_kernel`:
    the packed row's bytes, all zeros for ids outside the table."""
    program = tl.program_id(0)
    row_index, in_bounds, inside, row_pointer = _peer_row_pointers(
        hash_ids_ptr, shard_bases_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, rows_per_shard, ROW_BYTES, BLOCK_ROWS)

    group = tl.arange(0, GROUPS_PADDED)
    lane = tl.arange(0, _SCALE_GROUP)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    column = group[:, None] * _SCALE_GROUP + lane[None, :]  # [GROUPS_PADDED, 32]
    value_bytes = tl.load(row_pointer[:, None, None] + column[None, :, :],
                          mask=inside[:, None, None] & group_valid[None, :, None], other=0)
    scale_bytes = tl.load(row_pointer[:, None] + HEAD_DIM + group[None, :],
                          mask=inside[:, None] & group_valid[None, :], other=0)
    tl.store(out_value_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], value_bytes,
             mask=in_bounds[:, None, None] & group_valid[None, :, None])
    tl.store(out_scale_ptr + row_index[:, None] * (HEAD_DIM // _SCALE_GROUP) + group[None, :], scale_bytes,
             mask=in_bounds[:, None] & group_valid[None, :])
