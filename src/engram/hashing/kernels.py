"""Triton kernels of the batch hash (docs/design.md §2). Launched by
:mod:`engram.hashing.launch`; their torch twin is the torch path of
:class:`engram.hashing.batch.NgramHasher`.

Three kernels, ordered by the stream, none waiting on another program:

- :func:`slot_write_kernel` writes the batch's tokens (and known lookback
  entries) into the slot cache, before the hash reads it: another request of
  the batch may hit blocks this step fills.
- :func:`ngram_hash_kernel` hashes every token for every layer from the batch,
  the lookback window and the stores. It reads the stores; it writes them only
  where no other program of the grid can read what it writes (see its docstring).
- :func:`history_write_kernel` writes the per-request history ring after the
  hash has read it (a step reads and writes the same ring cells).

Every index computed from caller data is clamped or masked: malformed metadata
(validation off) gives wrong ids, never an out-of-bounds access or a hang.
"""

import triton
import triton.language as tl

from engram.triton_launch import jit_without_alignment

DEAD_CODE = tl.constexpr(-1)       # engram.hashing.stores.DEAD
UNWRITTEN_CODE = tl.constexpr(-2)  # engram.hashing.stores.UNWRITTEN


@triton.jit
def _remainder(value, prime, barrett):
    """``value % prime`` for int64 ``0 <= value < 2**63`` and ``2 <= prime < 2**32``,
    exact, in integer arithmetic: Barrett reduction with
    ``barrett = floor((2**64 - 1) / prime)`` (uint64 bits in an int64). The quotient
    ``high64(value * barrett)`` is the true one or one less, so one correction lands
    in ``[0, prime)``."""
    x = value.to(tl.uint64, bitcast=True)
    m = barrett.to(tl.uint64, bitcast=True)
    x_low = x.to(tl.uint32).to(tl.uint64)
    x_high = x >> 32
    m_low = m.to(tl.uint32).to(tl.uint64)
    m_high = m >> 32
    low_low = x_low * m_low
    high_low = x_high * m_low
    low_high = x_low * m_high
    middle = (low_low >> 32) + high_low.to(tl.uint32).to(tl.uint64) + low_high.to(tl.uint32).to(tl.uint64)
    quotient = x_high * m_high + (high_low >> 32) + (low_high >> 32) + (middle >> 32)
    remainder = x - quotient * prime.to(tl.uint64, bitcast=True)
    remainder = remainder.to(tl.int64, bitcast=True)
    return tl.where(remainder >= prime, remainder - prime, remainder)


@triton.jit
def _request_ends(query_start_ptr, chunk_start, num_tokens, num_requests, REQUEST_CHUNK: tl.constexpr):
    """int32 ``[REQUEST_CHUNK]``: request ends ``query_start[1 + chunk_start + i]``
    (past the last request: ``num_tokens + 1``, which no token reaches)."""
    chunk = chunk_start + tl.arange(0, REQUEST_CHUNK).to(tl.int64)
    return tl.load(query_start_ptr + 1 + chunk, mask=chunk < num_requests, other=num_tokens + 1).to(tl.int32)


@triton.jit
def _locate_requests(token, query_start_ptr, num_tokens, num_requests, REQUEST_CHUNK: tl.constexpr):
    """Request of each token (how many request ends ``query_start[1:]`` are ``<= token``)
    and that request's first token (the largest end ``<= token``, or 0), int32; for any
    ``query_start``, ``0 <= first <= token``. A count over chunks of independent loads,
    not a binary search: a dependent chain of 7 loads cost ~5 us at 64 requests (H200,
    cold L2)."""
    token = token.to(tl.int32)
    request = tl.zeros(token.shape, dtype=tl.int32)
    start = tl.zeros(token.shape, dtype=tl.int32)
    for chunk_start in range(0, num_requests, REQUEST_CHUNK):
        ends = _request_ends(query_start_ptr, chunk_start, num_tokens, num_requests, REQUEST_CHUNK)
        passed = ends[:, None] <= token[None, :]  # [ends, tokens]: the token axis last (see _hash_block)
        request += tl.sum(passed.to(tl.int32), axis=0)
        start = tl.maximum(start, tl.max(tl.where(passed, ends[:, None], 0), axis=0))
    return request, start


@triton.jit
def _compress(raw, token_map_ptr, vocab_size, mask):
    """Compressed id (int32) of raw token ids (int32), clamped into the vocabulary."""
    return tl.load(token_map_ptr + tl.minimum(tl.maximum(raw, 0), vocab_size - 1), mask=mask, other=0)


@triton.jit
def _request_span(request, has_request, query_start_ptr, num_tokens):
    """First token and one past the last of each request, int64, clamped so that
    ``0 <= first <= after <= num_tokens`` for any ``query_start``."""
    first = tl.load(query_start_ptr + request, mask=has_request, other=0).to(tl.int64)
    after = tl.load(query_start_ptr + 1 + request, mask=has_request, other=0).to(tl.int64)
    first = tl.minimum(tl.maximum(first, 0), num_tokens)
    after = tl.minimum(tl.maximum(after, first), num_tokens)
    return first, after


@triton.jit
def _own_slot_writes(block, batch_end, input_ids_ptr, dead_ptr, token_map_ptr, slot_mapping_ptr,
                     num_tokens, vocab_size, num_slots, HAS_DEAD: tl.constexpr, BLOCK: tl.constexpr):
    """(slot, value, mask) ``[BLOCK]`` of tokens ``block * BLOCK + i``: each batch token's
    slot receives its compressed id, or DEAD; padding (from ``batch_end =
    query_start[R]`` on) and slots outside ``[0, num_slots)`` write nothing."""
    token = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = token < num_tokens
    slot = tl.load(slot_mapping_ptr + token, mask=valid, other=-1).to(tl.int64)
    raw = tl.load(input_ids_ptr + token, mask=valid, other=0).to(tl.int32)
    value = _compress(raw, token_map_ptr, vocab_size, valid)
    if HAS_DEAD:
        value = tl.where(tl.load(dead_ptr + token, mask=valid, other=0) != 0, DEAD_CODE, value)
    return slot, value, valid & (token < batch_end) & (slot >= 0) & (slot < num_slots)


@triton.jit
def _lookback_seeds(block, positions_ptr, query_start_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
                    num_tokens, num_requests, vocab_size,
                    HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Known lookback entries of requests ``block * BLOCK + i``: (request, position,
    value, mask) ``[BLOCK, HISTORY_PAD]``; column ``j`` is position ``first - 1 - j``."""
    request = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    column = tl.arange(0, HISTORY_PAD).to(tl.int64)
    has_request = request < num_requests
    first, after = _request_span(request, has_request, query_start_ptr, num_tokens)
    has_token = has_request & (first < after)
    first_position = tl.load(positions_ptr + first, mask=has_token, other=0).to(tl.int32)
    position = first_position[:, None] - 1 - column[None, :].to(tl.int32)
    cell = request[:, None] * HISTORY + column[None, :]
    in_window = has_token[:, None] & (column < HISTORY)[None, :]
    raw = tl.load(lookback_ids_ptr + cell, mask=in_window, other=-1).to(tl.int32)
    known = in_window & (raw >= 0) & (position >= 0)
    value = _compress(raw, token_map_ptr, vocab_size, known)
    if HAS_LOOKBACK_DEAD:
        value = tl.where(tl.load(lookback_dead_ptr + cell, mask=known, other=0) != 0, DEAD_CODE, value)
    return request, position, value, known


@triton.jit
def _slot_of(request, position, block_table_ptr, block_size, block_table_width, block_table_stride, num_slots,
             mask):
    """int64 slot of ``position`` (int32, >= 0 where ``mask``) through the request's
    block-table row, clamped into ``[0, num_slots)``. Block arithmetic in int32: a
    64-bit division is a ~70-instruction subroutine."""
    block_index = tl.minimum(tl.maximum(position // block_size, 0), block_table_width - 1)
    row_start = request.to(tl.int64) * block_table_stride
    block = tl.load(block_table_ptr + row_start + block_index, mask=mask, other=0).to(tl.int64)
    slot = block * block_size + position % block_size
    return tl.minimum(tl.maximum(slot, 0), num_slots - 1)


@triton.jit
def _write_slots(block, batch_end, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                 lookback_ids_ptr, lookback_dead_ptr, slot_mapping_ptr, block_table_ptr, slot_values_ptr,
                 num_tokens, num_requests, vocab_size, block_size, num_slots, block_table_width,
                 block_table_stride,
                 HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_DEAD: tl.constexpr,
                 HAS_LOOKBACK_DEAD: tl.constexpr, WRITE_SLOTS: tl.constexpr, WRITE_SEEDS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Slot-cache writes of tokens ``block * BLOCK + i`` and of the lookback seeds of
    requests ``block * BLOCK + i`` (seeds first: a batch token of the same slot wins)."""
    if WRITE_SEEDS:
        seed_request, seed_position, seed_value, seed_known = _lookback_seeds(
            block, positions_ptr, query_start_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
            num_tokens, num_requests, vocab_size, HISTORY, HISTORY_PAD, HAS_LOOKBACK_DEAD, BLOCK)
        seed_slot = _slot_of(seed_request[:, None], seed_position, block_table_ptr, block_size,
                             block_table_width, block_table_stride, num_slots, seed_known)
        tl.store(slot_values_ptr + seed_slot, seed_value.to(tl.int32), mask=seed_known)
    if WRITE_SLOTS:
        own_slot, own_value, own_mask = _own_slot_writes(
            block, batch_end, input_ids_ptr, dead_ptr, token_map_ptr, slot_mapping_ptr,
            num_tokens, vocab_size, num_slots, HAS_DEAD, BLOCK)
        tl.store(slot_values_ptr + own_slot, own_value.to(tl.int32), mask=own_mask)


@jit_without_alignment(do_not_specialize=["num_tokens", "num_requests", "vocab_size", "block_size", "num_slots",
                                          "block_table_width", "block_table_stride"])
def slot_write_kernel(
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
    slot_mapping_ptr, block_table_ptr, slot_values_ptr,
    num_tokens, num_requests, vocab_size, block_size, num_slots, block_table_width, block_table_stride,
    HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_DEAD: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    WRITE_SLOTS: tl.constexpr, WRITE_SEEDS: tl.constexpr, BLOCK: tl.constexpr,
):
    """``slot_values[slot_mapping[t]] = id or DEAD`` for every batch token, and the same
    for known lookback entries through the block table. Grid: ``cdiv(max(T, R), BLOCK)``.
    Pointers as in :func:`ngram_hash_kernel`."""
    block = tl.program_id(0).to(tl.int64)
    batch_end = tl.load(query_start_ptr + num_requests).to(tl.int64)
    _write_slots(block, batch_end, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                 lookback_ids_ptr, lookback_dead_ptr, slot_mapping_ptr, block_table_ptr, slot_values_ptr,
                 num_tokens, num_requests, vocab_size, block_size, num_slots, block_table_width,
                 block_table_stride, HISTORY, HISTORY_PAD, HAS_DEAD, HAS_LOOKBACK_DEAD, WRITE_SLOTS, WRITE_SEEDS,
                 BLOCK)


@triton.jit
def _write_history(block, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                   lookback_ids_ptr, lookback_dead_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr,
                   num_tokens, num_requests, vocab_size, history_width, history_rows,
                   HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_DEAD: tl.constexpr,
                   HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr, BLOCK: tl.constexpr,
                   WIDTH_PAD: tl.constexpr):
    """Requests ``block * BLOCK + i``: the ring receives the known lookback entries and
    the last ``width`` tokens of each request (drafts included), position-tagged:
    ``values[row, p % width] = id or DEAD``, ``tags[row, p % width] = p``. Every cell is
    written at most once: a lookback entry whose cell a kept token takes is skipped (the
    later position wins, as in the torch path). A request whose kept tokens are not at
    consecutive positions ending at ``first position + count - 1`` (positions that repeat or
    skip, as token-tree drafts give) would write a cell twice or tag a token with a position
    it does not hold: its row is cleared instead (every later read of it is reported missing).
    Rows are clamped into ``[0, history_rows]`` (the last row is the spare one), negative
    positions skipped."""
    request = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    has_request = request < num_requests
    first, after = _request_span(request, has_request, query_start_ptr, num_tokens)
    count = after - first
    kept = tl.minimum(count, history_width)
    row = tl.load(history_rows_ptr + request, mask=has_request, other=0).to(tl.int64)
    row = tl.minimum(tl.maximum(row, 0), history_rows)
    first_position = tl.load(positions_ptr + first, mask=has_request & (count > 0), other=0).to(tl.int64)

    # The last ``kept`` tokens of each request: [BLOCK, WIDTH_PAD].
    lane = tl.arange(0, WIDTH_PAD).to(tl.int64)
    keep = has_request[:, None] & (lane[None, :] < kept[:, None])
    token = after[:, None] - kept[:, None] + lane[None, :]
    position = tl.load(positions_ptr + token, mask=keep, other=0).to(tl.int64)
    # Kept token i of a consecutive request is at first_position + (count - kept) + i.
    out_of_sequence = keep & (position != (first_position + count - kept)[:, None] + lane[None, :])
    in_sequence = tl.max(out_of_sequence.to(tl.int32), axis=1) == 0  # [BLOCK]
    keep = keep & (position >= 0) & in_sequence[:, None]
    raw = tl.load(input_ids_ptr + token, mask=keep, other=0).to(tl.int32)
    value = _compress(raw, token_map_ptr, vocab_size, keep)
    if HAS_DEAD:
        value = tl.where(tl.load(dead_ptr + token, mask=keep, other=0) != 0, DEAD_CODE, value)
    cell = row[:, None] * history_width + position % history_width
    tl.store(history_values_ptr + cell, value.to(tl.int32), mask=keep)
    tl.store(history_tags_ptr + cell, position, mask=keep)
    clear = (has_request & (count > 0) & ~in_sequence)[:, None] & (lane < history_width)[None, :]
    row_cell = row[:, None] * history_width + lane[None, :]
    tl.store(history_values_ptr + row_cell, tl.full([BLOCK, WIDTH_PAD], UNWRITTEN_CODE, tl.int32), mask=clear)
    tl.store(history_tags_ptr + row_cell, tl.full([BLOCK, WIDTH_PAD], -1, tl.int64), mask=clear)

    if HAS_LOOKBACK:
        column = tl.arange(0, HISTORY_PAD).to(tl.int64)
        in_window = (has_request & (count > 0))[:, None] & (column < HISTORY)[None, :]
        seed_position = first_position[:, None] - 1 - column[None, :]
        lookback_cell = request[:, None] * HISTORY + column[None, :]
        seed_raw = tl.load(lookback_ids_ptr + lookback_cell, mask=in_window, other=-1).to(tl.int32)
        # The first kept position with the seed's residue; the seed stays only if none is kept.
        kept_from = first_position + (count - kept)  # position of the first kept token
        last = first_position + count                # one past the request's last position
        later = seed_position + history_width * ((kept_from[:, None] - seed_position + history_width - 1) // history_width)
        seed_known = (in_window & (seed_raw >= 0) & (seed_position >= 0) & (later >= last[:, None])
                      & in_sequence[:, None])
        seed_value = _compress(seed_raw, token_map_ptr, vocab_size, seed_known)
        if HAS_LOOKBACK_DEAD:
            seed_dead = tl.load(lookback_dead_ptr + lookback_cell, mask=seed_known, other=0) != 0
            seed_value = tl.where(seed_dead, DEAD_CODE, seed_value)
        seed_cell = row[:, None] * history_width + seed_position % history_width
        tl.store(history_values_ptr + seed_cell, seed_value.to(tl.int32), mask=seed_known)
        tl.store(history_tags_ptr + seed_cell, seed_position, mask=seed_known)


@jit_without_alignment(do_not_specialize=["num_tokens", "num_requests", "vocab_size", "history_width",
                                          "history_rows"])
def history_write_kernel(
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
    history_rows_ptr, history_values_ptr, history_tags_ptr,
    num_tokens, num_requests, vocab_size, history_width, history_rows,
    HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr,
    HAS_LOOKBACK_DEAD: tl.constexpr, BLOCK: tl.constexpr, WIDTH_PAD: tl.constexpr,
):
    """The per-request history ring after a step (see :func:`_write_history`).
    Grid: ``cdiv(R, BLOCK)``. ``history_rows``: rows bound (the spare row's index)."""
    _write_history(tl.program_id(0).to(tl.int64), input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr,
                   token_map_ptr, lookback_ids_ptr, lookback_dead_ptr, history_rows_ptr, history_values_ptr,
                   history_tags_ptr, num_tokens, num_requests, vocab_size, history_width, history_rows,
                   HISTORY, HISTORY_PAD, HAS_DEAD, HAS_LOOKBACK, HAS_LOOKBACK_DEAD, BLOCK, WIDTH_PAD)


@triton.jit
def _hash_tokens(
    token, valid, live, request, position, offset_in_request, prime, barrett, first_row, column_shift, layers,
    layer_ok, input_ids_ptr, positions_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
    block_table_ptr, slot_values_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr, multipliers_ptr,
    vocab_size, pad_id, block_size, num_slots, block_table_width, block_table_stride, history_width, history_rows,
    LAYERS_PAD: tl.constexpr, MAX_NGRAM: tl.constexpr, COLUMNS_PAD: tl.constexpr,
    HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    READ_SLOTS: tl.constexpr, READ_HISTORY: tl.constexpr, REPORT_MISSING: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
):
    """Ids int64 ``[L, C, tokens]`` of the tokens, from every history source, and the
    first shift no source knew per token (0 = none). A source earlier in the batch counts only
    if its position is ``position - shift`` (positions that repeat or skip inside a request, as
    token-tree drafts give, make it unknown: hashed as pad, reported as missing); the shifts
    after it are blocked, so history before the request is read only behind consecutive ones."""
    HISTORY: tl.constexpr = MAX_NGRAM - 1
    blocked = ~live
    first_missing = tl.zeros([BLOCK_TOKENS], dtype=tl.int32)
    rolling = tl.zeros([LAYERS_PAD, 1, BLOCK_TOKENS], dtype=tl.int64)
    rolling_by_column = tl.zeros([LAYERS_PAD, COLUMNS_PAD, BLOCK_TOKENS], dtype=tl.int64)
    for shift in tl.static_range(MAX_NGRAM):
        source_position = position - shift
        in_batch = offset_in_request >= shift
        outside = live & ~in_batch & (source_position >= 0)

        # (1) the same request earlier in this batch. The loads do not wait for the
        # request lookup (their masks do not depend on it); the selection does.
        source_token = tl.maximum(token - shift, 0)
        loadable = valid & (token >= shift)
        raw = tl.load(input_ids_ptr + source_token, mask=loadable, other=0).to(tl.int32)
        value = _compress(raw, token_map_ptr, vocab_size, loadable)
        dead = ~in_batch & (source_position < 0)
        if HAS_DEAD:
            dead = dead | (in_batch & (tl.load(dead_ptr + source_token, mask=loadable, other=0) != 0))
        if shift > 0:
            in_batch_position = tl.load(positions_ptr + source_token, mask=loadable & in_batch, other=0).to(tl.int32)
            out_of_sequence = live & in_batch & (in_batch_position != source_position)
            known = tl.zeros([BLOCK_TOKENS], dtype=tl.int1)
            # ``outside`` implies 0 <= offset_in_request < shift: the column is in [0, HISTORY).
            lookback_column = shift - offset_in_request - 1
            # (2) the caller's lookback window
            if HAS_LOOKBACK:
                lookback_raw = tl.load(lookback_ids_ptr + request * HISTORY + lookback_column,
                                       mask=outside, other=-1).to(tl.int32)
                use = outside & (lookback_raw >= 0)
                value = tl.where(use, _compress(lookback_raw, token_map_ptr, vocab_size, use), value)
                if HAS_LOOKBACK_DEAD:
                    lookback_dead = tl.load(lookback_dead_ptr + request * HISTORY + lookback_column,
                                            mask=use, other=0) != 0
                    dead = tl.where(use, lookback_dead, dead)
                known = known | use
            # (3) the slot cache, through the request's block table
            if READ_SLOTS:
                need = outside & ~known
                history_slot = _slot_of(request, source_position, block_table_ptr, block_size,
                                        block_table_width, block_table_stride, num_slots, need)
                cached = tl.load(slot_values_ptr + history_slot, mask=need, other=UNWRITTEN_CODE)
                use = need & (cached != UNWRITTEN_CODE)
                value = tl.where(use, cached, value)
                dead = tl.where(use, cached == DEAD_CODE, dead)
                known = known | use
            # (3') the per-request history ring, position-tagged
            if READ_HISTORY:
                need = outside & ~known
                row = tl.load(history_rows_ptr + request, mask=need, other=0).to(tl.int64)
                row = tl.minimum(tl.maximum(row, 0), history_rows)
                cell = row * history_width + source_position % history_width
                tag = tl.load(history_tags_ptr + cell, mask=need, other=-1)
                remembered = tl.load(history_values_ptr + cell, mask=need, other=UNWRITTEN_CODE)
                use = need & (tag == source_position) & (remembered != UNWRITTEN_CODE)
                value = tl.where(use, remembered, value)
                dead = tl.where(use, remembered == DEAD_CODE, dead)
                known = known | use
            unknown = (outside & ~known) | out_of_sequence
            if REPORT_MISSING:  # only where no earlier shift is blocked already
                first_missing = tl.where(unknown & ~blocked & (first_missing == 0), shift, first_missing)
            dead = dead | unknown  # unknown history hashes as pad (validation reports it)

        blocked = blocked | dead
        value = tl.where(blocked, pad_id, tl.maximum(value, 0))
        multiplier = tl.load(multipliers_ptr + layers * MAX_NGRAM + shift, mask=layer_ok, other=0)
        rolling = rolling ^ (value.to(tl.int64)[None, None, :] * multiplier[:, None, None])
        if shift > 0:
            rolling_by_column = tl.where((column_shift == shift)[None, :, None], rolling, rolling_by_column)
    ids = _remainder(rolling_by_column, prime[:, :, None], barrett[:, :, None]) + first_row[:, :, None]
    return ids, first_missing


@jit_without_alignment(do_not_specialize=["num_tokens", "num_requests", "vocab_size", "pad_id",
                                          "block_size", "num_slots", "block_table_width", "block_table_stride",
                                          "history_width", "history_rows"])
def ngram_hash_kernel(
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
    lookback_ids_ptr, lookback_dead_ptr,
    slot_mapping_ptr, block_table_ptr, slot_values_ptr,
    history_rows_ptr, history_values_ptr, history_tags_ptr,
    multipliers_ptr, primes_ptr, barrett_ptr, offsets_ptr, out_ptr, missing_shift_ptr,
    num_tokens, num_requests, vocab_size, pad_id,
    block_size, num_slots, block_table_width, block_table_stride, history_width, history_rows,
    NUM_LAYERS: tl.constexpr, LAYERS_PAD: tl.constexpr, MAX_NGRAM: tl.constexpr, HISTORY_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr, COLUMNS_PAD: tl.constexpr,
    HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    READ_SLOTS: tl.constexpr, READ_HISTORY: tl.constexpr,
    WRITE_SLOTS_HERE: tl.constexpr, WRITE_SEEDS_HERE: tl.constexpr, SLOTS_BEFORE_READS: tl.constexpr,
    WRITE_HISTORY_AFTER: tl.constexpr,
    WIDTH_PAD: tl.constexpr, REPORT_MISSING: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr, REQUEST_CHUNK: tl.constexpr,
):
    """ids int32 ``[T, L, C]``: column ``(s-1)*H + h`` of layer ``l`` is
    ``(XOR_{k<=s} window[k] * m[l, k]) % prime[l, col] + offset[l, col]``.

    Pointers: input_ids/positions int ``[T]``; query_start int ``[R+1]``; dead bool
    ``[T]``; token_map int32 ``[V]``; lookback ids int64 / dead bool ``[R, N-1]``
    contiguous; slot_mapping int ``[T]``; block_table int ``[R, width]``;
    slot_values int32 ``[slots + 1]``; history rows int ``[R]``, values int32 /
    tags int64 ``[history_rows + 1, width]``; multipliers int64 ``[L, N]``; primes,
    Barrett multipliers and offsets int64 ``[L, C]``; missing_shift int8 ``[T]`` gets
    the first shift whose history no source knew (0 = none; only with
    ``REPORT_MISSING``).

    Grid: ``cdiv(T, BLOCK_TOKENS)`` programs (``cdiv(max(T, R), BLOCK_TOKENS)`` with
    ``WRITE_SEEDS_HERE``). Reads only, except writes the launcher asks for where no
    other program can read them. Slot writes (``WRITE_*_HERE``): in a one-program grid
    before its reads (``SLOTS_BEFORE_READS``, a block barrier between), so a request
    may read blocks another request of the batch fills; else after the program's
    reads, when the batch holds one request (its history positions precede its own
    tokens') or the engine promised no same-step hits (``fused_write``). History writes
    (``WRITE_HISTORY_AFTER``): in a one-program grid, after its reads, for every request.
    """
    HISTORY: tl.constexpr = MAX_NGRAM - 1
    NUM_COLUMNS: tl.constexpr = HISTORY * NUM_HEADS
    block = tl.program_id(0).to(tl.int64)
    # Token indices, positions and requests in int32 (each < 2**31, validated; a 64-bit
    # op is two or more instructions, and the kernel is issue-bound); products that
    # index memory in int64.
    token = (block * BLOCK_TOKENS).to(tl.int32) + tl.arange(0, BLOCK_TOKENS)
    valid = token < num_tokens
    request, start = _locate_requests(token, query_start_ptr, num_tokens, num_requests, REQUEST_CHUNK)
    padding = request >= num_requests
    request = tl.minimum(request, tl.maximum(num_requests - 1, 0))
    live = valid & ~padding
    position = tl.load(positions_ptr + token, mask=valid, other=0).to(tl.int32)
    offset_in_request = token - start

    # Table constants, loaded once as [L, C] tiles. Tiles put the token axis last, so a
    # warp's lanes spread over tokens and each lane keeps one token's scalars.
    layers = tl.arange(0, LAYERS_PAD)
    columns = tl.arange(0, COLUMNS_PAD)
    layer_ok = layers < NUM_LAYERS
    column_ok = layer_ok[:, None] & (columns < NUM_COLUMNS)[None, :]
    table_offset = layers[:, None] * NUM_COLUMNS + columns[None, :]
    prime = tl.load(primes_ptr + table_offset, mask=column_ok, other=3)
    barrett = tl.load(barrett_ptr + table_offset, mask=column_ok, other=0)
    first_row = tl.load(offsets_ptr + table_offset, mask=column_ok, other=0)
    column_shift = columns // NUM_HEADS + 1  # order - 1 of each column

    if SLOTS_BEFORE_READS:
        batch_end = tl.load(query_start_ptr + num_requests).to(tl.int64)
        _write_slots(block, batch_end, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                     lookback_ids_ptr, lookback_dead_ptr, slot_mapping_ptr, block_table_ptr, slot_values_ptr,
                     num_tokens, num_requests, vocab_size, block_size, num_slots, block_table_width,
                     block_table_stride, HISTORY, HISTORY_PAD, HAS_DEAD, HAS_LOOKBACK_DEAD, WRITE_SLOTS_HERE,
                     WRITE_SEEDS_HERE, BLOCK_TOKENS)
        tl.debug_barrier()  # every thread's slot writes before any thread's reads

    ids, first_missing = _hash_tokens(
        token, valid, live, request, position, offset_in_request, prime, barrett, first_row, column_shift, layers,
        layer_ok, input_ids_ptr, positions_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
        block_table_ptr, slot_values_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr, multipliers_ptr,
        vocab_size, pad_id, block_size, num_slots, block_table_width, block_table_stride, history_width,
        history_rows, LAYERS_PAD, MAX_NGRAM, COLUMNS_PAD, HAS_DEAD, HAS_LOOKBACK, HAS_LOOKBACK_DEAD,
        READ_SLOTS, READ_HISTORY, REPORT_MISSING, BLOCK_TOKENS)

    # Stores, after every load of this program.
    if (WRITE_SLOTS_HERE or WRITE_SEEDS_HERE) and not SLOTS_BEFORE_READS:
        batch_end = tl.load(query_start_ptr + num_requests).to(tl.int64)
        _write_slots(block, batch_end, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                     lookback_ids_ptr, lookback_dead_ptr, slot_mapping_ptr, block_table_ptr, slot_values_ptr,
                     num_tokens, num_requests, vocab_size, block_size, num_slots, block_table_width,
                     block_table_stride, HISTORY, HISTORY_PAD, HAS_DEAD, HAS_LOOKBACK_DEAD, WRITE_SLOTS_HERE,
                     WRITE_SEEDS_HERE, BLOCK_TOKENS)
    if WRITE_HISTORY_AFTER:
        # The lone program: every request's ring (its reads are all done).
        for request_block in range(0, tl.cdiv(num_requests, HISTORY_BLOCK)):
            _write_history(request_block, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                           lookback_ids_ptr, lookback_dead_ptr, history_rows_ptr, history_values_ptr,
                           history_tags_ptr, num_tokens, num_requests, vocab_size, history_width, history_rows,
                           HISTORY, HISTORY_PAD, HAS_DEAD, HAS_LOOKBACK, HAS_LOOKBACK_DEAD, HISTORY_BLOCK,
                           WIDTH_PAD)
    out_offset = token.to(tl.int64)[None, None, :] * (NUM_LAYERS * NUM_COLUMNS) + table_offset[:, :, None]
    tl.store(out_ptr + out_offset, ids.to(tl.int32), mask=column_ok[:, :, None] & valid[None, None, :])
    if REPORT_MISSING:
        tl.store(missing_shift_ptr + token, first_missing.to(tl.int8), mask=valid)
