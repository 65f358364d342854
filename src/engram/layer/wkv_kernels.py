"""Triton kernels of the FP8 ``wkv`` projection. Only ``@triton.jit`` functions live
here; :mod:`engram.layer.wkv_gemm` launches them, :class:`engram.layer.wkv.WkvProjection` picks
the path, :mod:`engram.layer.reference` holds their plain-PyTorch twins.

Notation: ``T`` tokens, ``C`` hash columns served, ``D = head_dim``, ``K = C * D`` (the flattened
row of a token: ``k = c * D + d``), ``N = (hc + 1) * hidden`` outputs; ``W`` the FP8 E4M3 weight
``[N, K]`` (row-major) with fp32 block scales ``w_scale[n // BLOCK_N_W, k // BLOCK_K_W]`` (exact
powers of two when the checkpoint's scales are UE8M0).

A token's row for column ``c`` is table row ``local = hash_ids[t, c] - row_start`` (E4M3 bytes,
one UE8M0 byte per 32 values); ``IDS_ARE_ROWS`` instead reads packed rows ``[T, C, D]`` as
row ``t * C + c`` (rows gathered elsewhere, e.g. by a tensor-parallel all-gather). An id outside
``[row_start, row_start + num_rows)`` reads a zero row and is never dereferenced.

Path (a) = :func:`gather_quantize_kernel` + a block-scaled FP8 GEMM (``torch._scaled_mm`` or
:func:`block_scaled_gemm_kernel`); path (b) = :func:`fused_gather_gemm_kernel`.

Offsets are int64 (tables span 98 GB, weights 157 MB); tile indices are int32.
"""

from __future__ import annotations

import triton
import triton.language as tl

_SCALE_GROUP: tl.constexpr = tl.constexpr(32)  # table values per UE8M0 byte
_TWO_POW_120: tl.constexpr = tl.constexpr(2.0**120)
_TWO_POW_23: tl.constexpr = tl.constexpr(8388608.0)


@triton.jit
def _pow2(exponent):
    """int32 ``e`` in ``[-127, 127]`` -> exact fp32 ``2**e`` built from bits (``2**-127`` is subnormal)."""
    field = exponent + 127
    bits = tl.where(field == 0, 0x00400000, field << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_e4m3(value_bytes):
    """E4M3 bytes ``uint8 [...]`` -> exact fp32 (integer decode, exact under the interpreter too;
    0x7F/0xFF give NaN): the 7 magnitude bits shifted into the fp32 fields are ``x * 2**-120``."""
    byte = value_bytes.to(tl.int32)
    magnitude = byte & 0x7F
    shifted = (magnitude << 20).to(tl.float32, bitcast=True) * _TWO_POW_120
    bits = shifted.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)
    bits = tl.where(magnitude == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _encode_e4m3(value):
    """fp32 ``[...]`` with ``|value| <= 448`` -> E4M3 bytes (``uint8``), round to nearest even.

    Normals (``|v| >= 2**-6``): the fp32 pattern rounded to 3 mantissa bits in integer
    arithmetic (a carry moves into the exponent), exponent rebiased 127 -> 7. Subnormals:
    ``|v| * 2**9`` rounded to an integer by adding ``2**23`` (fp32 add, nearest even);
    code 8 is the smallest normal, whose bits are the same. Same bits as torch's cast."""
    bits = value.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    rounded = (magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    subnormal = (magnitude * 512.0 + _TWO_POW_23).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(magnitude_bits >= (121 << 23), normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _row_locations(hash_ids_ptr, token, column, token_mask, stride_token, stride_column,
                   row_start, num_rows, local_columns, IDS_ARE_ROWS: tl.constexpr):
    """``(local row int64, inside)`` of (token, column) pairs (any broadcastable shapes):
    ``hash_ids[t, c] - row_start``, or ``t * C + c`` with ``IDS_ARE_ROWS``; rows outside the
    table are clamped to 0 and flagged ``inside = False`` (never loaded)."""
    if IDS_ARE_ROWS:
        local = token.to(tl.int64) * local_columns + column
        inside = token_mask
    else:
        global_id = tl.load(hash_ids_ptr + token.to(tl.int64) * stride_token + column.to(tl.int64) * stride_column,
                            mask=token_mask, other=-1)
        local = global_id.to(tl.int64) - row_start
        inside = token_mask & (local >= 0) & (local < num_rows)
    local = tl.where(inside, local, 0)
    return local, inside


@triton.jit
def gather_quantize_kernel(
    hash_ids_ptr, value_ptr, scale_ptr, out_ptr, out_scale_ptr,
    tokens, padded_tokens, local_columns, stride_token, stride_column,
    row_start, num_rows, value_row_stride, scale_row_stride,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, IDS_ARE_ROWS: tl.constexpr,
):
    """Path (a), activation side: table rows -> FP8 activations with one power-of-two scale per
    1 x 128 group, no bf16 rows in between.

    ``out uint8 or float8_e4m3fn [padded_T, K]`` (E4M3 bytes, row-major) and ``out_scale fp32 [ceil(K / 128), padded_T]``
    (the ``[padded_T, ceil(K / 128)]`` column-major scale ``torch._scaled_mm`` takes). Per token
    ``t`` and group ``g`` (values ``x`` = the exact fp32 products ``e4m3 * 2**(b - 127)`` of the
    rows, zeros past ``K`` and for tokens ``t >= T``)::

        s = 2**clamp(ceil(log2(amax(|x|) / 448)), -127, 127)   (amax 0 -> s = 1)
        out_scale[g, t] = s;  out[t, k] = e4m3_round_nearest_even(x[k] / s)

    the table codec's rule with groups of 128 instead of 32: exactly the values of quantizing
    the bf16 rows of a lookup, which are these ``x`` rounded to bf16, exact for table scale bytes
    that keep ``x`` a bf16 normal. ``x / s`` is an exact power-of-two rescaling, so the only
    rounding is E4M3's: exact for the 32-value block(s) holding the group's largest scale,
    dropping low bits of the others only where ``x / s < 2**-6`` (E4M3 subnormals).

    Grid ``(max(1, cdiv(T, BLOCK_T)), ceil(K / 128))``: the padding rows past the token blocks are
    written by the same programs (block ``b`` writes padding blocks ``b``, ``b + grid``, ...).
    """
    block = tl.program_id(0)
    group = tl.program_id(1)
    token = block * BLOCK_T + tl.arange(0, BLOCK_T)                   # [BLOCK_T]
    k = group * 128 + tl.arange(0, 128)                                # [128]
    total_k = local_columns * HEAD_DIM
    k_valid = k < total_k
    column = k // HEAD_DIM
    within = k - column * HEAD_DIM
    token_valid = token < tokens
    local, inside = _row_locations(hash_ids_ptr, token[:, None], column[None, :],
                                   token_valid[:, None] & k_valid[None, :], stride_token, stride_column,
                                   row_start, num_rows, local_columns, IDS_ARE_ROWS)
    value_bytes = tl.load(value_ptr + local * value_row_stride + within[None, :], mask=inside, other=0)
    scale_bytes = tl.load(scale_ptr + local * scale_row_stride + (within // _SCALE_GROUP)[None, :],
                          mask=inside, other=127)
    exact = _decode_e4m3(value_bytes) * _pow2(scale_bytes.to(tl.int32) - 127)   # [BLOCK_T, 128]

    amax = tl.max(tl.abs(exact), axis=1)                                # [BLOCK_T]
    bits = amax.to(tl.int32, bitcast=True)
    # least e with amax <= 448 * 2**e = 1.75 * 2**(8 + e): amax = 1.m * 2**(E - 127)
    exponent = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.where(amax == 0, 0, exponent)
    exponent = tl.minimum(tl.maximum(exponent, -127), 127)
    quantized = _encode_e4m3(exact * _pow2(-exponent)[:, None])

    out_rows = token.to(tl.int64)
    row_ok = token < padded_tokens
    # out may be uint8 or float8e4nv: the E4M3 bytes are stored as they are.
    tl.store(out_ptr + out_rows[:, None] * total_k + k[None, :], quantized.to(out_ptr.dtype.element_ty, bitcast=True),
             mask=row_ok[:, None] & k_valid[None, :])
    tl.store(out_scale_ptr + group.to(tl.int64) * padded_tokens + out_rows, _pow2(exponent), mask=row_ok)

    # Padding rows past the token blocks (zeros, scale 1) from these programs, not programs of
    # their own: at T = 64 (128 rows) half the programs, 0.6 us of the layer on the H200.
    zero_bytes = tl.zeros([BLOCK_T, 128], tl.uint8).to(out_ptr.dtype.element_ty, bitcast=True)
    ones = tl.full([BLOCK_T], 1.0, tl.float32)
    token_rows = tl.num_programs(0) * BLOCK_T
    for first in range(token_rows + block * BLOCK_T, padded_tokens, token_rows):
        pad_rows = first + tl.arange(0, BLOCK_T)
        pad_ok = pad_rows < padded_tokens
        pad_rows = pad_rows.to(tl.int64)
        tl.store(out_ptr + pad_rows[:, None] * total_k + k[None, :], zero_bytes, mask=pad_ok[:, None] & k_valid[None, :])
        tl.store(out_scale_ptr + group.to(tl.int64) * padded_tokens + pad_rows, ones, mask=pad_ok)


@triton.jit
def _tile_indices(tokens, out_features, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(rows [BLOCK_M], cols [BLOCK_N])`` of this program's output tile; programs walk
    ``GROUP_M`` row tiles per column sweep, so concurrent tiles share A and W tiles in L2."""
    program = tl.program_id(0)
    tiles_m = tl.cdiv(tokens, BLOCK_M)
    tiles_n = tl.cdiv(out_features, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = program // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (program % per_group) % group_rows
    tile_n = (program % per_group) // group_rows
    return tile_m * BLOCK_M + tl.arange(0, BLOCK_M), tile_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _weight_values(weight_ptr, cols, col_valid, k, k_valid, in_features):
    """``W[cols, k]`` as fp8 ``[BLOCK_N, STEP]`` (zeros outside the weight)."""
    tile = tl.load(weight_ptr + cols.to(tl.int64)[:, None] * in_features + k[None, :],
                   mask=col_valid[:, None] & k_valid[None, :], other=0)
    return tile.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _weight_scale(weight_scale_ptr, cols, col_valid, k0, weight_scale_stride,
                  BLOCK_N_W: tl.constexpr, BLOCK_K_W: tl.constexpr, SCALE_PER_TILE: tl.constexpr):
    """fp32 scale of the weight block holding ``k0`` (``< in_features``) for the tile's columns:
    a scalar when they share one block row (``SCALE_PER_TILE``), else ``[BLOCK_N]``."""
    if SCALE_PER_TILE:
        scale = tl.load(weight_scale_ptr + (tl.min(cols) // BLOCK_N_W) * weight_scale_stride + k0 // BLOCK_K_W)
    else:
        scale = tl.load(weight_scale_ptr + (cols // BLOCK_N_W).to(tl.int64) * weight_scale_stride + k0 // BLOCK_K_W,
                        mask=col_valid, other=0.0)
    return scale


@triton.jit
def _store_kv(out_ptr, acc, rows, cols, tokens, out_features):
    """``kv bf16 [T, N]`` (row-major) <- the fp32 tile, one rounding."""
    mask = (rows < tokens)[:, None] & (cols < out_features)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_features + cols[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _scaled_partial(acc, partial, row_scale, weight_scale, SCALE_PER_TILE: tl.constexpr):
    """``acc + partial * row_scale[:, None] * weight_scale`` (per tile, or per column ``[None, :]``)."""
    if SCALE_PER_TILE:  # (if/else, not an early return: the compiler would still build the other branch)
        result = acc + partial * (row_scale * weight_scale)[:, None]
    else:
        result = acc + partial * row_scale[:, None] * weight_scale[None, :]
    return result


@triton.jit
def _block_row_scale(hash_ids_ptr, scale_ptr, rows, row_valid, k0, local_columns, stride_token,
                     stride_column, row_start, num_rows, scale_row_stride,
                     HEAD_DIM: tl.constexpr, IDS_ARE_ROWS: tl.constexpr):
    """fp32 ``[BLOCK_M]``: ``2**(b - 127)`` of each token's table row at the 32-value block holding
    ``k0`` (1 for rows outside the table, which read zeros)."""
    column = k0 // HEAD_DIM
    within = k0 - column * HEAD_DIM
    local, inside = _row_locations(hash_ids_ptr, rows, column, row_valid, stride_token,
                                   stride_column, row_start, num_rows, local_columns, IDS_ARE_ROWS)
    scale_byte = tl.load(scale_ptr + local * scale_row_stride + within // _SCALE_GROUP, mask=inside, other=127)
    return _pow2(scale_byte.to(tl.int32) - 127)


@triton.jit
def block_scaled_gemm_kernel(
    a_ptr, a_scale_ptr, weight_ptr, weight_scale_ptr, out_ptr,
    tokens, padded_tokens, in_features, out_features, weight_scale_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_N_W: tl.constexpr, BLOCK_K_W: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
):
    """Path (a), GEMM where ``torch._scaled_mm`` has no block-scaled FP8: ``kv bf16 [T, N]``,

    ``kv[t, n] = bf16(sum_g (sum_{k in g} a[t, k] * W[n, k]) * a_scale[g, t] * w_scale[n // BN_W, g * 128 // BK_W])``

    from ``a`` E4M3 ``[padded_T, K]`` with ``a_scale fp32 [ceil(K / 128), padded_T]`` (as
    :func:`gather_quantize_kernel` writes them). Each 128-deep partial sum is one FP8 ``tl.dot``
    (fp32 accumulator), scaled in fp32 and added in ``k`` order; no split-K, so with one tile
    configuration a token's result does not depend on the other tokens. Needs ``BLOCK_K_W % 128 == 0``.
    Grid ``(cdiv(T, BLOCK_M) * cdiv(N, BLOCK_N),)``.
    """
    rows, cols = _tile_indices(tokens, out_features, BLOCK_M, BLOCK_N, GROUP_M)
    row_valid = rows < tokens
    col_valid = cols < out_features
    step = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The scales feed fp32 math, not the dot, so the compiler's pipeline leaves their loads
    # synchronous: load them one step ahead by hand (the last step's "next" wraps to step 0, unused).
    a_scale_next = tl.load(a_scale_ptr + rows, mask=row_valid, other=0.0)
    w_scale_next = _weight_scale(weight_scale_ptr, cols, col_valid, 0, weight_scale_stride,
                                 BLOCK_N_W, BLOCK_K_W, SCALE_PER_TILE)
    for k0 in range(0, in_features, 128):
        a_scale, w_scale = a_scale_next, w_scale_next
        k_next = (k0 + 128) % in_features
        a_scale_next = tl.load(a_scale_ptr + (k_next // 128) * padded_tokens + rows, mask=row_valid, other=0.0)
        w_scale_next = _weight_scale(weight_scale_ptr, cols, col_valid, k_next, weight_scale_stride,
                                     BLOCK_N_W, BLOCK_K_W, SCALE_PER_TILE)
        k = k0 + step
        k_valid = k < in_features
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * in_features + k[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        w = _weight_values(weight_ptr, cols, col_valid, k, k_valid, in_features)
        partial = tl.dot(a, tl.trans(w))
        acc = _scaled_partial(acc, partial, a_scale, w_scale, SCALE_PER_TILE)
    _store_kv(out_ptr, acc, rows, cols, tokens, out_features)


@triton.jit
def fused_gather_gemm_kernel(
    hash_ids_ptr, value_ptr, scale_ptr, weight_ptr, weight_scale_ptr, out_ptr,
    tokens, local_columns, stride_token, stride_column, row_start, num_rows, value_row_stride, scale_row_stride,
    in_features, out_features, weight_scale_stride,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_N_W: tl.constexpr, BLOCK_K_W: tl.constexpr, SCALE_PER_TILE: tl.constexpr, IDS_ARE_ROWS: tl.constexpr,
):
    """Path (b): table rows read by hash id straight into the GEMM; ``kv bf16 [T, N]``.

    Numerics: with ``x[t, k] = e4m3(row[k]) * 2**(b - 127)`` the table's exact values (no
    re-quantization) and ``W`` the checkpoint's FP8 weight::

        kv[t, n] = bf16( sum over 32-value blocks j, in k order, of
                         (sum_{k in j} e4m3_row[t, k] * W[n, k]) * 2**(b[t, j] - 127) * w_scale[n // BN_W, k // BK_W] )

    Each 32-deep partial sum is one FP8 ``tl.dot`` into a fresh fp32 accumulator: its products
    are exact (two E4M3 values), its adds are the tensor core's (on sm90 an fp32 accumulator
    whose internal alignment keeps fewer bits than IEEE fp32 for 32 terms); the partial is then
    multiplied by the row's and the weight's scales (an exact power-of-two product for UE8M0
    weight scales) and added to an fp32 accumulator; one rounding to bf16 at the end. No
    ``[T, K]`` rows tensor exists in memory. No split-K: with one tile configuration a token's
    result does not depend on the other tokens. Needs ``BLOCK_K_W % 32 == 0`` and ``HEAD_DIM % 32 == 0``.
    Grid ``(cdiv(T, BLOCK_M) * cdiv(N, BLOCK_N),)``.
    """
    rows, cols = _tile_indices(tokens, out_features, BLOCK_M, BLOCK_N, GROUP_M)
    row_valid = rows < tokens
    col_valid = cols < out_features
    lane = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Scales are loaded one step ahead by hand (the compiler pipelines only the dot's operands;
    # the last step's "next" wraps to step 0, unused).
    row_scale_next = _block_row_scale(hash_ids_ptr, scale_ptr, rows, row_valid, 0, local_columns,
                                      stride_token, stride_column, row_start, num_rows, scale_row_stride,
                                      HEAD_DIM, IDS_ARE_ROWS)
    w_scale_next = _weight_scale(weight_scale_ptr, cols, col_valid, 0, weight_scale_stride,
                                 BLOCK_N_W, BLOCK_K_W, SCALE_PER_TILE)
    for k0 in range(0, in_features, 32):
        row_scale, w_scale = row_scale_next, w_scale_next
        k_next = (k0 + 32) % in_features
        row_scale_next = _block_row_scale(hash_ids_ptr, scale_ptr, rows, row_valid, k_next,
                                          local_columns, stride_token, stride_column, row_start, num_rows,
                                          scale_row_stride, HEAD_DIM, IDS_ARE_ROWS)
        w_scale_next = _weight_scale(weight_scale_ptr, cols, col_valid, k_next, weight_scale_stride,
                                     BLOCK_N_W, BLOCK_K_W, SCALE_PER_TILE)
        column = k0 // HEAD_DIM                      # a 32-value block lies inside one row
        within = k0 - column * HEAD_DIM
        local, inside = _row_locations(hash_ids_ptr, rows, column, row_valid, stride_token, stride_column,
                                       row_start, num_rows, local_columns, IDS_ARE_ROWS)
        a = tl.load(value_ptr + local[:, None] * value_row_stride + within + lane[None, :],
                    mask=inside[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        k = k0 + lane
        w = _weight_values(weight_ptr, cols, col_valid, k, k < in_features, in_features)
        partial = tl.dot(a, tl.trans(w))
        acc = _scaled_partial(acc, partial, row_scale, w_scale, SCALE_PER_TILE)
    _store_kv(out_ptr, acc, rows, cols, tokens, out_features)
