"""Triton kernels of path (a)'s block-scaled FP8 GEMM for few tokens (decode, short prefill).

With ``M = T <= 128`` tokens the GEMM ``kv [M, N] = a [M, K] @ W[N, K].T`` is a read of the
FP8 weight (V4.1: ``N = 25600``, ``K = 6144``, 157 MB): its speed is the weight's streaming
rate, so the grid is cut along N *and* K (split-K) until every SM holds several programs, each
streaming its ``BLOCK_N x k_per_split`` slice of ``W`` once.

* :func:`small_m_gemm_kernel`: one program per (BLOCK_N columns, K split, BLOCK_M rows);
  writes bf16 directly (one split), or fp32 partial sums (one slice per split, or
  ``atomic_add`` into one zeroed fp32 buffer).
* :func:`split_k_reduce_kernel`: fp32 partial sums -> bf16, splits added in order.

No program waits on another: splits meet only in the second launch (or in fp32 atomics).
:mod:`engram.layer.wkv_gemm` launches both (``small_m_gemm``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engram.layer.wkv_kernels import _weight_scale, _weight_values

_GROUP: tl.constexpr = tl.constexpr(128)  # values per activation scale (1 x 128 groups)


@triton.jit
def _scaled_group_product(a, w, a_scale, w_scale, SWAP_AB: tl.constexpr, SCALE_PER_TILE: tl.constexpr):
    """One 128-deep FP8 dot in fp32, times the activation and weight scales (in that order).

    ``a`` fp8 ``[BLOCK_M, 128]``, ``w`` fp8 ``[BLOCK_N, 128]``, ``a_scale`` fp32 ``[BLOCK_M]``,
    ``w_scale`` fp32 scalar (``SCALE_PER_TILE``) or ``[BLOCK_N]``. Returns ``[BLOCK_M, BLOCK_N]``,
    or ``[BLOCK_N, BLOCK_M]`` with ``SWAP_AB`` (``W @ a.T``: the weight tile is the MMA's M side,
    so a few tokens still fill a wgmma)."""
    if SWAP_AB:
        partial = tl.dot(w, tl.trans(a))
        if SCALE_PER_TILE:
            result = partial * (a_scale * w_scale)[None, :]
        else:
            result = partial * a_scale[None, :] * w_scale[:, None]
    else:
        partial = tl.dot(a, tl.trans(w))
        if SCALE_PER_TILE:
            result = partial * (a_scale * w_scale)[:, None]
        else:
            result = partial * a_scale[:, None] * w_scale[None, :]
    return result


@triton.jit
def _tile_offsets(rows, cols, tokens, out_features, SWAP_AB: tl.constexpr):
    """int64 offsets and mask of the tile in a row-major ``[T, N]`` matrix, in the accumulator's
    orientation (``[BLOCK_M, BLOCK_N]``, or ``[BLOCK_N, BLOCK_M]`` with ``SWAP_AB``)."""
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    if SWAP_AB:
        offsets = rows64[None, :] * out_features + cols64[:, None]
        mask = (cols < out_features)[:, None] & (rows < tokens)[None, :]
    else:
        offsets = rows64[:, None] * out_features + cols64[None, :]
        mask = (rows < tokens)[:, None] & (cols < out_features)[None, :]
    return offsets, mask


@triton.jit
def small_m_gemm_kernel(
    a_ptr, a_scale_ptr, weight_ptr, weight_scale_ptr, out_ptr,
    tokens, padded_tokens, in_features, out_features, weight_scale_stride, groups_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_W: tl.constexpr, BLOCK_K_W: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr, SWAP_AB: tl.constexpr, OUTPUT: tl.constexpr,
):
    """Split-K block-scaled FP8 GEMM for few tokens.

    Inputs (as for ``block_scaled_gemm_kernel``): ``a`` E4M3 bytes ``[padded_T, K]`` (row-major),
    ``a_scale`` fp32 ``[ceil(K / 128), padded_T]``, ``W`` E4M3 bytes ``[N, K]``, ``w_scale`` fp32
    ``[ceil(N / BN_W), >= ceil(K / BK_W)]`` (row stride ``weight_scale_stride``), ``BK_W % 128 == 0``.
    Program ``(j, s, i)`` owns columns ``[j * BLOCK_N, (j + 1) * BLOCK_N)``, rows
    ``[i * BLOCK_M, (i + 1) * BLOCK_M)`` and the 128-groups ``g`` of split ``s``
    (``k in [s * k_per_split, (s + 1) * k_per_split)``, ``k_per_split = 128 * groups_per_split``)::

        P_s[t, n] = sum_{g in split s, in k order} (sum_{k in g} a[t, k] * W[n, k]) * a_scale[g, t] * w_scale[n // BN_W, g * 128 // BK_W]

    each inner sum one FP8 ``tl.dot`` into a fresh fp32 tile, scaled and added in fp32 -- the
    numerics of ``block_scaled_gemm_kernel`` and ``torch._scaled_mm`` up to fp32 summation order.

    ``OUTPUT``: ``"bf16"`` (one split): ``out bf16 [T, N] = bf16(P_0)``; ``"partials"``: ``out``
    fp32 ``[splits, T, N]``, slice ``s`` = ``P_s`` (:func:`split_k_reduce_kernel` adds them);
    ``"atomic"``: ``out`` fp32 ``[T, N]`` (zeroed) ``+= P_s`` by relaxed fp32 atomics (order of
    the adds not fixed). Grid ``(cdiv(N, BLOCK_N), splits, cdiv(T, BLOCK_M))``.
    """
    tile_n = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)                                            # K offsets stay int32 (K < 2**31)
    tile_m = tl.program_id(2).to(tl.int64)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # int64 [BLOCK_M]
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)                     # int64 [BLOCK_N]
    row_valid = rows < tokens
    col_valid = cols < out_features
    k_per_split = groups_per_split * _GROUP      # a visible multiple of 128 keeps the loads vectorized and pipelined
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, in_features)
    step = tl.arange(0, _GROUP)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Scales feed fp32 math, not the dot, so the pipeliner leaves their loads synchronous: load
    # them one group ahead by hand (the last group's "next" re-reads the last group, unused).
    a_scale_next = tl.load(a_scale_ptr + (k_start // _GROUP) * padded_tokens + rows, mask=row_valid, other=0.0)
    w_scale_next = _weight_scale(weight_scale_ptr, cols, col_valid, k_start, weight_scale_stride,
                                 BLOCK_N_W, BLOCK_K_W, SCALE_PER_TILE)
    for k0 in range(k_start, k_stop, _GROUP):
        a_scale, w_scale = a_scale_next, w_scale_next
        k_next = tl.minimum(k0 + _GROUP, in_features - 1)
        a_scale_next = tl.load(a_scale_ptr + (k_next // _GROUP) * padded_tokens + rows, mask=row_valid, other=0.0)
        w_scale_next = _weight_scale(weight_scale_ptr, cols, col_valid, k_next, weight_scale_stride,
                                     BLOCK_N_W, BLOCK_K_W, SCALE_PER_TILE)
        k = k0 + step
        k_valid = k < in_features
        a = tl.load(a_ptr + rows[:, None] * in_features + k[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        w = _weight_values(weight_ptr, cols, col_valid, k, k_valid, in_features)
        acc += _scaled_group_product(a, w, a_scale, w_scale, SWAP_AB, SCALE_PER_TILE)
    offsets, mask = _tile_offsets(rows, cols, tokens, out_features, SWAP_AB)
    if OUTPUT == "bf16":
        tl.store(out_ptr + offsets, acc.to(tl.bfloat16), mask=mask)
    elif OUTPUT == "partials":
        tl.store(out_ptr + split.to(tl.int64) * tokens * out_features + offsets, acc, mask=mask)
    else:
        tl.static_assert(OUTPUT == "atomic", "OUTPUT: 'bf16', 'partials' or 'atomic'")
        tl.atomic_add(out_ptr + offsets, acc, mask=mask, sem="relaxed")


@triton.jit
def split_k_reduce_kernel(partial_ptr, out_ptr, splits, elements, BLOCK: tl.constexpr):
    """``out bf16 [elements] = bf16(P_0 + P_1 + ... + P_{splits-1})`` from fp32 ``partial
    [splits, elements]`` (contiguous), added in split order in fp32, one rounding. Grid
    ``(cdiv(elements, BLOCK),)``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    pointers = partial_ptr + offsets
    total = tl.load(pointers, mask=mask, other=0.0)
    for _ in range(1, splits):
        pointers += elements
        total += tl.load(pointers, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, total.to(tl.bfloat16), mask=mask)
