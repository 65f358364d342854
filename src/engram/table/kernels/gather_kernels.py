"""Triton kernels of table lookups: gather FP8 rows named by hash ids (docs/design.md §2 "FP8 table rows").

Only ``@triton.jit`` functions live here; :mod:`engram.table.kernels.gather` launches them.

Work split: the ``T * C_local`` rows of a lookup are flattened in (token, column)
order, and each program gathers ``BLOCK_ROWS`` of them as one tile of
``BLOCK_ROWS x D`` bytes. The value bytes of a row are contiguous, so each thread
loads 8 or 16 bytes at a time, and every row load of the tile is issued before the
first use: many independent rows in flight per SM, which is what a random gather
from HBM needs.

Memory offsets are int64 (a 384M-row table of 256-byte rows spans 98 GB); the
flattened row index is int32, since an int64 division costs a subroutine call per
row (measured: ``benchmarks/NOTES.md``, "Gather launch shapes").
"""

from __future__ import annotations

import triton
import triton.language as tl

_SCALE_GROUP: tl.constexpr = tl.constexpr(32)  # values per UE8M0 scale byte
_TWO_POW_120: tl.constexpr = tl.constexpr(2.0**120)  # exact in fp32


@triton.jit
def _tile_row_ids(hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
                  row_start, num_rows, BLOCK_ROWS: tl.constexpr):
    """Rows ``program * BLOCK_ROWS + [0, BLOCK_ROWS)`` of the flattened ``[T, C_local]`` ids ->
    ``(row_index int64, in_bounds, inside, local_id int64)``, each ``[BLOCK_ROWS]``.

    ``local_id = hash_ids[t, j] - row_start``; ``inside`` is ``0 <= local_id < num_rows``
    (rows outside it read zeros; their ``local_id`` is clamped to 0 and never loaded).
    The flattened row index is int32 (the launcher checks ``T * C_local < 2**31 - BLOCK_ROWS``):
    an int64 division costs a subroutine call per row.
    """
    row = program * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_bounds = row < total_rows
    token = row // local_columns
    column = row - token * local_columns
    global_id = tl.load(hash_ids_ptr + token.to(tl.int64) * stride_token + column.to(tl.int64) * stride_column,
                        mask=in_bounds, other=-1)
    local_id = global_id.to(tl.int64) - row_start
    inside = in_bounds & (local_id >= 0) & (local_id < num_rows)
    local_id = tl.where(inside, local_id, 0)
    return row.to(tl.int64), in_bounds, inside, local_id


@triton.jit
def _scale_factors(scale_bytes):
    """UE8M0 bytes ``uint8 [...]`` -> exact fp32 ``2**(b - 127)`` built from bits
    (byte 0: the subnormal ``2**-127``; byte 255: NaN)."""
    exponent_field = scale_bytes.to(tl.int32)
    bits = exponent_field << 23
    bits = tl.where(exponent_field == 0, 0x00400000, bits)
    bits = tl.where(exponent_field == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_e4m3(value_bytes, DECODE: tl.constexpr):
    """E4M3 bytes ``uint8 [...]`` -> exact fp32 values; 0x7F/0xFF give NaN.

    ``DECODE`` 1: bitcast to ``tl.float8e4nv`` and convert (Hopper's fp8 converter,
    ``cvt.rn.f16x2.e4m3x2``); 2: the same, then NaN selected explicitly for 0x7F/0xFF
    (the interpreter's fp8 cast knows no E4M3 NaN); 0: integer bit manipulation: the 7
    magnitude bits shifted into the fp32 exponent/mantissa fields give ``x * 2**-120``
    for normals and subnormals alike, so one multiply by ``2**120`` (exact) decodes.
    """
    if DECODE == 1:
        decoded = value_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif DECODE == 2:
        decoded = value_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        decoded = tl.where((value_bytes & 0x7F) == 0x7F, float("nan"), decoded)
    else:
        byte = value_bytes.to(tl.int32)
        magnitude = byte & 0x7F
        shifted = (magnitude << 20).to(tl.float32, bitcast=True) * _TWO_POW_120
        bits = shifted.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)
        bits = tl.where(magnitude == 0x7F, 0x7FC00000, bits)
        decoded = bits.to(tl.float32, bitcast=True)
    return decoded


@triton.jit
def gather_rows_bf16_kernel(
    hash_ids_ptr, value_ptr, scale_ptr, out_ptr,
    total_rows, local_columns, stride_token, stride_column,
    row_start, num_rows, value_row_stride, scale_row_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, VECTOR: tl.constexpr,
    CHUNK_OUTER: tl.constexpr, DECODE: tl.constexpr, VALUE_EVICTION: tl.constexpr, OUT_CACHE: tl.constexpr,
):
    """Gather and dequantize: ``out bf16 [T, C_local, D]`` (contiguous) from
    ``hash_ids int32/int64 [T, C_local]`` (strides ``stride_token``, ``stride_column``),
    ``value_ptr uint8 [rows, D]``, ``scale_ptr uint8 [rows, D // 32]``:

    ``out[t, j, d] = bf16(e4m3(values[id - row_start, d]) * 2**(scales[id - row_start, d // 32] - 127))``,
    ``id = hash_ids[t, j]``, and +0 when ``id`` is outside ``[row_start, row_start + num_rows)``.

    One program per ``BLOCK_ROWS`` rows of the flattened ``[T * C_local]``. Each thread holds
    ``VECTOR`` consecutive bytes of a row: with ``VECTOR = 8`` the byte loads (8 B) and the bf16
    stores (16 B) share one register layout (no shared-memory round trip); 16 loads 16 B and
    re-lays the tile out through shared memory. ``CHUNK_OUTER`` orders the tile
    ``[32 // VECTOR, BLOCK_ROWS, GROUPS_PADDED, VECTOR]`` instead of ``[BLOCK_ROWS, GROUPS_PADDED,
    32 // VECTOR, VECTOR]``; with Triton 3.6 (16 rows, 4 warps) that gives each thread 32 values of
    one row instead of 8 values of each of 4 rows, so the per-row index arithmetic is paid once.
    Timings of these layouts: ``benchmarks/NOTES.md`` ("Gather launch shapes").
    """
    program = tl.program_id(0)
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)

    group = tl.arange(0, GROUPS_PADDED)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    chunk = tl.arange(0, _SCALE_GROUP // VECTOR)
    lane = tl.arange(0, VECTOR)
    if CHUNK_OUTER:
        # [32 // VECTOR, 1, GROUPS_PADDED, VECTOR]
        column = (chunk[:, None, None, None] * VECTOR + group[None, None, :, None] * _SCALE_GROUP
                  + lane[None, None, None, :])
        group_mask = group_valid[None, None, :, None]
        value_offsets = local_id[None, :, None, None] * value_row_stride + column
        value_mask = inside[None, :, None, None] & group_mask
        out_offsets = row_index[None, :, None, None] * HEAD_DIM + column
        out_mask = in_bounds[None, :, None, None] & group_mask
    else:
        # [1, GROUPS_PADDED, 32 // VECTOR, VECTOR]
        column = (group[:, None, None] * _SCALE_GROUP + chunk[None, :, None] * VECTOR
                  + lane[None, None, :])[None, :, :, :]
        group_mask = group_valid[None, :, None, None]
        value_offsets = local_id[:, None, None, None] * value_row_stride + column
        value_mask = inside[:, None, None, None] & group_mask
        out_offsets = row_index[:, None, None, None] * HEAD_DIM + column
        out_mask = in_bounds[:, None, None, None] & group_mask

    value_bytes = tl.load(value_ptr + value_offsets, mask=value_mask, other=0, eviction_policy=VALUE_EVICTION)
    scale_bytes = tl.load(scale_ptr + local_id[:, None] * scale_row_stride + group[None, :],
                          mask=inside[:, None] & group_valid[None, :], other=0, eviction_policy=VALUE_EVICTION)
    scale = _scale_factors(scale_bytes)  # [BLOCK_ROWS, GROUPS_PADDED]
    if CHUNK_OUTER:
        scale = scale[None, :, :, None]
    else:
        scale = scale[:, :, None, None]
    # fp32 product is exact (4 significant bits times a power of two); one rounding to bf16.
    product = _decode_e4m3(value_bytes, DECODE) * scale
    tl.store(out_ptr + out_offsets, product.to(tl.bfloat16), mask=out_mask, cache_modifier=OUT_CACHE)


@triton.jit
def gather_rows_packed_kernel(
    hash_ids_ptr, value_ptr, scale_ptr, out_value_ptr, out_scale_ptr,
    total_rows, local_columns, stride_token, stride_column,
    row_start, num_rows, value_row_stride, scale_row_stride,
    HEAD_DIM: tl.constexpr, GROUPS_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    VALUE_EVICTION: tl.constexpr, OUT_CACHE: tl.constexpr,
):
    """Gather raw FP8 rows: ``out_value uint8 [T, C_local, D]`` and ``out_scale uint8
    [T, C_local, D // 32]`` (contiguous) from the same inputs as :func:`gather_rows_bf16_kernel`:

    ``out_value[t, j] = values[id - row_start]``, ``out_scale[t, j] = scales[id - row_start]``,
    all-zero bytes when ``id`` is outside ``[row_start, row_start + num_rows)``.
    """
    program = tl.program_id(0)
    row_index, in_bounds, inside, local_id = _tile_row_ids(
        hash_ids_ptr, program, total_rows, local_columns, stride_token, stride_column,
        row_start, num_rows, BLOCK_ROWS)

    group = tl.arange(0, GROUPS_PADDED)
    lane = tl.arange(0, _SCALE_GROUP)
    group_valid = group < HEAD_DIM // _SCALE_GROUP
    column = group[:, None] * _SCALE_GROUP + lane[None, :]  # [GROUPS_PADDED, 32]

    value_bytes = tl.load(value_ptr + local_id[:, None, None] * value_row_stride + column[None, :, :],
                          mask=inside[:, None, None] & group_valid[None, :, None], other=0,
                          eviction_policy=VALUE_EVICTION)
    scale_bytes = tl.load(scale_ptr + local_id[:, None] * scale_row_stride + group[None, :],
                          mask=inside[:, None] & group_valid[None, :], other=0, eviction_policy=VALUE_EVICTION)

    tl.store(out_value_ptr + row_index[:, None, None] * HEAD_DIM + column[None, :, :], value_bytes,
             mask=in_bounds[:, None, None] & group_valid[None, :, None], cache_modifier=OUT_CACHE)
    tl.store(out_scale_ptr + row_index[:, None] * (HEAD_DIM // _SCALE_GROUP) + group[None, :], scale_bytes,
             mask=in_bounds[:, None] & group_valid[None, :], cache_modifier=OUT_CACHE)
