"""Triton kernel of the fused Engram gate (docs/design.md §2 "Gate"): gate, token mask
and residual add in one pass, reading the stream and ``kv`` once and writing the
output once. Launched by :func:`engram.layer.gate.engram_gate_kv` /
:func:`engram.layer.gate.engram_gate`; its torch twin is
:func:`engram.layer.gate.engram_gate_torch`.

Layout: one program per (token, group of ``COPIES_PER_PROGRAM`` copies); the
programs of one token are adjacent, so its value row, shared by the ``hc``
copies, is read from HBM once and then hit in L2. The whole ``D`` row of a copy
stays in registers (one read of ``h``, one write of ``out``), held as a
power-of-two head block plus a power-of-two tail block (5120 = 4096 + 1024:
no masked-off lanes for V4.1, where one masked 8192 block would waste 37.5% of
the registers and lanes). Masked tokens are read like the others (no load waits
on the mask) and their ``h`` is selected for the store.

Measurements of its launch shapes: ``benchmarks/NOTES.md`` ("Gate launch shapes").

``w = q_weight * k_weight`` is formed here in fp32 (exact: a product of two
bf16 has 16 significant bits) rather than precomputed by the launcher: the bf16
pair is the same 4 bytes per element as an fp32 ``w``, both L2-resident, and it
saves a launch (and any cache of ``w``) per call.
"""

import triton
import triton.language as tl


@triton.jit
def _add_three(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _row_sums(hidden, weight_q, weight_k, key):
    """fp32 scalars ``(sum(h * w * key), sum(h^2), sum(key^2))`` of one block, ``w = q * k``."""
    weight = weight_q * weight_k
    return tl.reduce((hidden * weight * key, hidden * hidden, key * key), 0, _add_three)


@triton.jit
def engram_gate_kernel(
    hidden_ptr, key_ptr, value_ptr, q_weight_ptr, k_weight_ptr, token_mask_ptr, out_ptr,
    hidden_token_stride, hidden_copy_stride,
    key_token_stride, key_copy_stride,
    value_offset, value_token_stride,
    q_weight_copy_stride, k_weight_copy_stride,
    out_token_stride, out_copy_stride,
    eps, sqrt_hidden,
    HIDDEN: tl.constexpr, HC_MULT: tl.constexpr, COPIES_PER_PROGRAM: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
    EARLY_VALUE: tl.constexpr, STREAM_EVICTION: tl.constexpr, SHARED_EVICTION: tl.constexpr,
):
    """``out[t, c] = h + g * value[t]``, ``g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))``,
    ``dot = sum(h * q[c] * k[c] * key[t, c]) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D)``.

    Pointers (last dimension contiguous, any float dtype, math in fp32, one rounding
    to ``out``'s dtype): hidden ``[T, hc, D]``; key ``[T, hc, D]`` (in ``kv``: token
    stride ``(hc + 1) * D``, copy stride ``D``); value ``[T, D]`` from element
    ``value_offset`` (``hc * D`` in ``kv``, 0 for a value tensor); q_weight, k_weight
    ``[hc, D]``; token_mask bool ``[T]`` (False = masked: ``out = h`` bit for bit;
    read only if ``HAS_MASK``); out ``[T, hc, D]``.
    Grid: ``T * HC_MULT // COPIES_PER_PROGRAM`` programs. ``HEAD_BLOCK`` is the largest
    power of two <= ``HIDDEN``; ``TAIL_BLOCK`` a power of two >= ``HIDDEN - HEAD_BLOCK``
    (0 when ``HIDDEN`` is a power of two). ``EARLY_VALUE``: load the value row before
    the sums (more bytes in flight) or after (fewer live registers). ``STREAM_EVICTION``
    (h, key: read once) and ``SHARED_EVICTION`` (value, weights: read by several
    programs): L2 eviction hints, ``""``, ``"evict_first"`` or ``"evict_last"``.
    """
    program = tl.program_id(0).to(tl.int64)
    token = program // (HC_MULT // COPIES_PER_PROGRAM)
    first_copy = (program % (HC_MULT // COPIES_PER_PROGRAM)) * COPIES_PER_PROGRAM

    head = tl.arange(0, HEAD_BLOCK)
    if TAIL_BLOCK > 0:
        tail = HEAD_BLOCK + tl.arange(0, TAIL_BLOCK)
        tail_in = tail < HIDDEN
    value_row = value_ptr + value_offset + token * value_token_stride
    if EARLY_VALUE:
        value_head = tl.load(value_row + head, eviction_policy=SHARED_EVICTION).to(tl.float32)
        if TAIL_BLOCK > 0:
            value_tail = tl.load(value_row + tail, mask=tail_in, other=0.0,
                                 eviction_policy=SHARED_EVICTION).to(tl.float32)
    if HAS_MASK:
        keep = tl.load(token_mask_ptr + token) != 0

    for index in tl.static_range(COPIES_PER_PROGRAM):
        copy = first_copy + index
        hidden_row = hidden_ptr + token * hidden_token_stride + copy * hidden_copy_stride
        key_row = key_ptr + token * key_token_stride + copy * key_copy_stride
        q_row = q_weight_ptr + copy * q_weight_copy_stride
        k_row = k_weight_ptr + copy * k_weight_copy_stride
        out_row = out_ptr + token * out_token_stride + copy * out_copy_stride

        # All loads of the copy are issued before the first use (bytes in flight).
        hidden_head_raw = tl.load(hidden_row + head, eviction_policy=STREAM_EVICTION)
        key_head = tl.load(key_row + head, eviction_policy=STREAM_EVICTION).to(tl.float32)
        q_head = tl.load(q_row + head, eviction_policy=SHARED_EVICTION).to(tl.float32)
        k_head = tl.load(k_row + head, eviction_policy=SHARED_EVICTION).to(tl.float32)
        if TAIL_BLOCK > 0:
            hidden_tail_raw = tl.load(hidden_row + tail, mask=tail_in, other=0.0, eviction_policy=STREAM_EVICTION)
            key_tail = tl.load(key_row + tail, mask=tail_in, other=0.0,
                               eviction_policy=STREAM_EVICTION).to(tl.float32)
            q_tail = tl.load(q_row + tail, mask=tail_in, other=0.0, eviction_policy=SHARED_EVICTION).to(tl.float32)
            k_tail = tl.load(k_row + tail, mask=tail_in, other=0.0, eviction_policy=SHARED_EVICTION).to(tl.float32)

        hidden_head = hidden_head_raw.to(tl.float32)
        raw_dot, hidden_squares, key_squares = _row_sums(hidden_head, q_head, k_head, key_head)
        if TAIL_BLOCK > 0:
            hidden_tail = hidden_tail_raw.to(tl.float32)
            tail_dot, tail_hidden_squares, tail_key_squares = _row_sums(hidden_tail, q_tail, k_tail, key_tail)
            raw_dot += tail_dot
            hidden_squares += tail_hidden_squares
            key_squares += tail_key_squares

        hidden_scale = tl.math.rsqrt(hidden_squares / HIDDEN + eps)
        key_scale = tl.math.rsqrt(key_squares / HIDDEN + eps)
        dot = raw_dot * hidden_scale * key_scale / sqrt_hidden
        root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
        # sign(dot) * root; dot * 0 keeps sign(0) = 0 and lets a NaN dot through.
        signed_root = tl.where(dot > 0, root, tl.where(dot < 0, -root, dot * 0.0))
        gate = tl.sigmoid(signed_root)

        if not EARLY_VALUE:  # an L2 hit after the first copy of the token; frees registers during the sums
            value_head = tl.load(value_row + head, eviction_policy=SHARED_EVICTION).to(tl.float32)
            if TAIL_BLOCK > 0:
                value_tail = tl.load(value_row + tail, mask=tail_in, other=0.0,
                                     eviction_policy=SHARED_EVICTION).to(tl.float32)
        out_head = (hidden_head + gate * value_head).to(out_ptr.dtype.element_ty)
        if HAS_MASK:
            out_head = tl.where(keep, out_head, hidden_head_raw.to(out_ptr.dtype.element_ty))
        tl.store(out_row + head, out_head)
        if TAIL_BLOCK > 0:
            out_tail = (hidden_tail + gate * value_tail).to(out_ptr.dtype.element_ty)
            if HAS_MASK:
                out_tail = tl.where(keep, out_tail, hidden_tail_raw.to(out_ptr.dtype.element_ty))
            tl.store(out_row + tail, out_tail, mask=tail_in)
