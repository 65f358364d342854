"""Triton kernel of the batch hash (DESIGN §2): one launch hashes every token of
a batch for every Engram layer, reading history from the batch itself, the
lookback window, the slot cache (which it also writes) and the per-request
history. Launched by :mod:`engram.hashing.launch`; its torch twin is
:class:`engram.hashing.batch.NgramHasher`'s torch path.
"""

import triton
import triton.language as tl

DEAD_CODE = tl.constexpr(-1)       # engram.hashing.stores.DEAD
UNWRITTEN_CODE = tl.constexpr(-2)  # engram.hashing.stores.UNWRITTEN


@triton.jit
def _remainder(value, prime, inverse_prime):
    """``value % prime`` for int64 ``0 <= value < 2**63`` and ``2 <= prime < 2**31``, exact,
    without a 64-bit division (a ~100-instruction subroutine per id; 12.4 us for one
    token on an H200). Two float64 quotient estimates: the first leaves ``|r| < 2**43``
    (wrapping int64 arithmetic keeps it exact), the second is off by at most one, and
    one correction each way lands in ``[0, prime)``."""
    quotient = (value.to(tl.float64) * inverse_prime).to(tl.int64)
    remainder = value - quotient * prime
    quotient = (remainder.to(tl.float64) * inverse_prime).to(tl.int64)
    remainder = remainder - quotient * prime
    remainder = tl.where(remainder < 0, remainder + prime, remainder)
    return tl.where(remainder >= prime, remainder - prime, remainder)


@triton.jit(do_not_specialize=["num_tokens", "num_requests", "vocab_size", "pad_id",
                               "block_size", "num_slots", "block_table_width", "block_table_stride",
                               "history_width"])
def ngram_hash_kernel(
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
    lookback_ids_ptr, lookback_dead_ptr,
    slot_mapping_ptr, block_table_ptr, slot_values_ptr,
    history_rows_ptr, history_values_ptr, history_tags_ptr,
    multipliers_ptr, primes_ptr, inverse_primes_ptr, offsets_ptr, out_ptr, missing_shift_ptr,
    num_tokens, num_requests, vocab_size, pad_id,
    block_size, num_slots, block_table_width, block_table_stride, history_width,
    NUM_LAYERS: tl.constexpr, LAYERS_PAD: tl.constexpr, MAX_NGRAM: tl.constexpr,
    NUM_HEADS: tl.constexpr, COLUMNS_PAD: tl.constexpr,
    HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    COMPUTE_IDS: tl.constexpr, WRITE_SLOTS: tl.constexpr, WRITE_SEEDS: tl.constexpr,
    READ_SLOTS: tl.constexpr, READ_HISTORY: tl.constexpr,
    REPORT_MISSING: tl.constexpr, BLOCK_TOKENS: tl.constexpr, REQUEST_CHUNK: tl.constexpr,
):
    """ids int32 ``[T, L, C]``: column ``(s-1)*H + h`` of layer ``l`` is
    ``(XOR_{k<=s} window[k] * m[l, k]) % prime[l, col] + offset[l, col]``.

    Pointers: input_ids/positions int ``[T]``; query_start int ``[R+1]``; dead bool
    ``[T]``; token_map int32 ``[V]``; lookback ids int64 / dead bool ``[R, N-1]``
    contiguous; slot_mapping int64 ``[T]``; block_table int ``[R, width]``;
    slot_values int32 ``[slots + 1]``; history rows int64 ``[R]``, values int32 /
    tags int64 ``[rows + 1, width]``; multipliers int64 ``[L, N]``; primes/offsets
    int64 ``[L, C]``; missing_shift int8 ``[T]`` gets the first shift whose history
    no source knew (0 = none; only with ``REPORT_MISSING``). One program hashes
    ``BLOCK_TOKENS`` tokens.
    """
    HISTORY: tl.constexpr = MAX_NGRAM - 1
    NUM_COLUMNS: tl.constexpr = HISTORY * NUM_HEADS
    token = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    valid = token < num_tokens

    # Request of each token = how many request ends (query_start[1:]) are <= token.
    # A count over chunks of independent loads, not a binary search: a dependent
    # chain of 7 loads cost ~5 us at 64 requests (H200, cold L2).
    # The request's first token is the largest end <= token (or 0): no second load.
    request = tl.zeros([BLOCK_TOKENS], dtype=tl.int64)
    start = tl.zeros([BLOCK_TOKENS], dtype=tl.int64)
    chunk = tl.arange(0, REQUEST_CHUNK).to(tl.int64)
    for chunk_start in range(0, num_requests, REQUEST_CHUNK):
        ends = tl.load(query_start_ptr + 1 + chunk_start + chunk, mask=chunk_start + chunk < num_requests,
                       other=num_tokens + 1).to(tl.int64)
        passed = ends[None, :] <= token[:, None]
        request += tl.sum(passed.to(tl.int64), axis=1)
        start = tl.maximum(start, tl.max(tl.where(passed, ends[None, :], 0), axis=1))
    padding = request >= num_requests
    request = tl.minimum(request, tl.maximum(num_requests - 1, 0))
    live = valid & ~padding
    position = tl.load(positions_ptr + token, mask=valid, other=0).to(tl.int64)
    offset_in_request = token - start

    # Every load is issued before any store: a store to ``out`` or the slot cache may
    # alias later loads, so loads after it wait (per-shift stores cost ~9 us at T = 1,
    # H200, cold L2). Table constants are loaded once as [L, C] tiles.
    layers = tl.arange(0, LAYERS_PAD)
    columns = tl.arange(0, COLUMNS_PAD)
    layer_ok = layers < NUM_LAYERS
    column_ok = layer_ok[:, None] & (columns < NUM_COLUMNS)[None, :]
    table_offset = layers[:, None] * NUM_COLUMNS + columns[None, :]
    prime = tl.load(primes_ptr + table_offset, mask=column_ok, other=1)
    inverse_prime = tl.load(inverse_primes_ptr + table_offset, mask=column_ok, other=1.0)
    first_row = tl.load(offsets_ptr + table_offset, mask=column_ok, other=0)
    column_shift = columns // NUM_HEADS + 1  # order - 1 of each column

    if WRITE_SLOTS:
        # What the token's own slot receives: its compressed id, or DEAD.
        own_slot = tl.load(slot_mapping_ptr + token, mask=live, other=-1).to(tl.int64)
        own_raw = tl.load(input_ids_ptr + token, mask=live, other=0).to(tl.int64)
        stored = tl.load(token_map_ptr + tl.minimum(tl.maximum(own_raw, 0), vocab_size - 1), mask=live, other=0).to(tl.int64)
        if HAS_DEAD:
            stored = tl.where(tl.load(dead_ptr + token, mask=live, other=0) != 0, DEAD_CODE, stored)
    blocked = ~live
    first_missing = tl.zeros([BLOCK_TOKENS], dtype=tl.int32)
    rolling = tl.zeros([BLOCK_TOKENS, LAYERS_PAD], dtype=tl.int64)
    rolling_by_column = tl.zeros([BLOCK_TOKENS, LAYERS_PAD, COLUMNS_PAD], dtype=tl.int64)
    if COMPUTE_IDS:
        for shift in tl.static_range(MAX_NGRAM):
            source_position = position - shift
            in_batch = offset_in_request >= shift
            outside = live & ~in_batch & (source_position >= 0)

            # (1) the same request earlier in this batch. The loads do not wait for the
            # request lookup (their masks do not depend on it); the selection does.
            source_token = tl.maximum(token - shift, 0)
            loadable = valid & (token >= shift)
            raw = tl.load(input_ids_ptr + source_token, mask=loadable, other=0).to(tl.int64)
            raw = tl.minimum(tl.maximum(raw, 0), vocab_size - 1)
            value = tl.load(token_map_ptr + raw, mask=loadable, other=0).to(tl.int64)
            dead = ~in_batch & (source_position < 0)
            if HAS_DEAD:
                dead = dead | (in_batch & (tl.load(dead_ptr + source_token, mask=loadable, other=0) != 0))
            if shift > 0:
                known = tl.zeros([BLOCK_TOKENS], dtype=tl.int1)
                lookback_column = shift - offset_in_request - 1
                # (2) the caller's lookback window
                if HAS_LOOKBACK:
                    lookback_raw = tl.load(lookback_ids_ptr + request * HISTORY + lookback_column,
                                           mask=outside, other=-1).to(tl.int64)
                    use = outside & (lookback_raw >= 0)
                    lookback_value = tl.load(token_map_ptr + tl.minimum(tl.maximum(lookback_raw, 0), vocab_size - 1),
                                             mask=use, other=0).to(tl.int64)
                    value = tl.where(use, lookback_value, value)
                    if HAS_LOOKBACK_DEAD:
                        lookback_dead = tl.load(lookback_dead_ptr + request * HISTORY + lookback_column,
                                                mask=use, other=0) != 0
                        dead = tl.where(use, lookback_dead, dead)
                    known = known | use
                # (3) the slot cache, through the request's block table
                if READ_SLOTS:
                    need = outside & ~known
                    block_index = tl.minimum(source_position // block_size, block_table_width - 1)
                    block = tl.load(block_table_ptr + request * block_table_stride + block_index, mask=need, other=0).to(tl.int64)
                    history_slot = tl.minimum(tl.maximum(block * block_size + source_position % block_size, 0), num_slots - 1)
                    cached = tl.load(slot_values_ptr + history_slot, mask=need, other=UNWRITTEN_CODE).to(tl.int64)
                    use = need & (cached != UNWRITTEN_CODE)
                    value = tl.where(use, cached, value)
                    dead = tl.where(use, cached == DEAD_CODE, dead)
                    known = known | use
                # (3') the per-request history ring, position-tagged
                if READ_HISTORY:
                    need = outside & ~known
                    row = tl.load(history_rows_ptr + request, mask=need, other=0).to(tl.int64)
                    cell = row * history_width + source_position % history_width
                    tag = tl.load(history_tags_ptr + cell, mask=need, other=-1)
                    remembered = tl.load(history_values_ptr + cell, mask=need, other=UNWRITTEN_CODE).to(tl.int64)
                    use = need & (tag == source_position) & (remembered != UNWRITTEN_CODE)
                    value = tl.where(use, remembered, value)
                    dead = tl.where(use, remembered == DEAD_CODE, dead)
                    known = known | use
                unknown = outside & ~known
                if REPORT_MISSING:  # only where no earlier shift is blocked already
                    first_missing = tl.where(unknown & ~blocked & (first_missing == 0), shift, first_missing)
                dead = dead | unknown  # unknown history hashes as pad (validation reports it)

            blocked = blocked | dead
            value = tl.where(blocked, pad_id, tl.maximum(value, 0))
            multiplier = tl.load(multipliers_ptr + layers * MAX_NGRAM + shift, mask=layer_ok, other=0)
            rolling = rolling ^ (value[:, None] * multiplier[None, :])
            if shift > 0:
                rolling_by_column = tl.where((column_shift == shift)[None, None, :], rolling[:, :, None], rolling_by_column)

    # Stores, after every load (the rare lookback seeds excepted).
    if WRITE_SLOTS:
        tl.store(slot_values_ptr + own_slot, stored.to(tl.int32), mask=live & (own_slot >= 0) & (own_slot < num_slots))
    if WRITE_SEEDS:
        # Seed the slot cache with the known lookback entries (first token of each request).
        first = live & (offset_in_request == 0)
        for column in tl.static_range(HISTORY):
            seed_position = position - 1 - column
            seed_raw = tl.load(lookback_ids_ptr + request * HISTORY + column, mask=first, other=-1).to(tl.int64)
            seed_known = first & (seed_raw >= 0) & (seed_position >= 0)
            seed_value = tl.load(token_map_ptr + tl.minimum(tl.maximum(seed_raw, 0), vocab_size - 1),
                                 mask=seed_known, other=0).to(tl.int64)
            if HAS_LOOKBACK_DEAD:
                seed_dead = tl.load(lookback_dead_ptr + request * HISTORY + column, mask=seed_known, other=0) != 0
                seed_value = tl.where(seed_dead, DEAD_CODE, seed_value)
            seed_block_index = tl.minimum(seed_position // block_size, block_table_width - 1)
            seed_block = tl.load(block_table_ptr + request * block_table_stride + seed_block_index,
                                 mask=seed_known, other=0).to(tl.int64)
            seed_slot = seed_block * block_size + seed_position % block_size
            tl.store(slot_values_ptr + seed_slot, seed_value.to(tl.int32),
                     mask=seed_known & (seed_slot >= 0) & (seed_slot < num_slots))
    if COMPUTE_IDS:
        ids = _remainder(rolling_by_column, prime[None, :, :], inverse_prime[None, :, :]) + first_row[None, :, :]
        out_offset = token[:, None, None] * (NUM_LAYERS * NUM_COLUMNS) + table_offset[None, :, :]
        tl.store(out_ptr + out_offset, ids.to(tl.int32), mask=valid[:, None, None] & column_ok[None, :, :])
    if REPORT_MISSING:
        tl.store(missing_shift_ptr + token, first_missing.to(tl.int8), mask=valid)


@triton.jit(do_not_specialize=["num_tokens", "num_requests", "vocab_size", "history_width"])
def history_write_kernel(
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
    lookback_ids_ptr, lookback_dead_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr,
    num_tokens, num_requests, vocab_size, history_width,
    MAX_NGRAM: tl.constexpr, HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr,
    HAS_LOOKBACK_DEAD: tl.constexpr, BLOCK_TOKENS: tl.constexpr, REQUEST_CHUNK: tl.constexpr,
):
    """After the hash: the per-request history ring receives the known lookback entries
    and the last ``width`` tokens of each request (drafts included), position-tagged:
    ``values[row, p % width] = id or DEAD``, ``tags[row, p % width] = p``.

    Every cell is written at most once per launch: a lookback entry whose cell a later
    batch token takes is skipped (the later position wins, as in the torch path).
    """
    HISTORY: tl.constexpr = MAX_NGRAM - 1
    token = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    valid = token < num_tokens
    request = tl.zeros([BLOCK_TOKENS], dtype=tl.int64)
    start = tl.zeros([BLOCK_TOKENS], dtype=tl.int64)
    end = tl.zeros([BLOCK_TOKENS], dtype=tl.int64) + num_tokens
    chunk = tl.arange(0, REQUEST_CHUNK).to(tl.int64)
    for chunk_start in range(0, num_requests, REQUEST_CHUNK):
        in_range = chunk_start + chunk < num_requests
        ends = tl.load(query_start_ptr + 1 + chunk_start + chunk, mask=in_range, other=num_tokens + 1).to(tl.int64)
        passed = ends[None, :] <= token[:, None]
        request += tl.sum(passed.to(tl.int64), axis=1)
        start = tl.maximum(start, tl.max(tl.where(passed, ends[None, :], 0), axis=1))
        end = tl.minimum(end, tl.min(tl.where(passed | ~in_range[None, :], num_tokens, ends[None, :]), axis=1))
    live = valid & (request < num_requests)
    request = tl.minimum(request, tl.maximum(num_requests - 1, 0))
    position = tl.load(positions_ptr + token, mask=live, other=0).to(tl.int64)
    row = tl.load(history_rows_ptr + request, mask=live, other=0).to(tl.int64)
    raw = tl.load(input_ids_ptr + token, mask=live, other=0).to(tl.int64)
    value = tl.load(token_map_ptr + tl.minimum(tl.maximum(raw, 0), vocab_size - 1), mask=live, other=0)
    if HAS_DEAD:
        value = tl.where(tl.load(dead_ptr + token, mask=live, other=0) != 0, DEAD_CODE, value)
    first_kept = tl.maximum(start, end - history_width)  # batch index of the first kept token
    keep = live & (token >= first_kept)
    cell = row * history_width + position % history_width
    tl.store(history_values_ptr + cell, value.to(tl.int32), mask=keep)
    tl.store(history_tags_ptr + cell, position, mask=keep)
    if HAS_LOOKBACK:
        first = live & (token == start)
        kept_from = position + (first_kept - start)  # position of the first kept token
        last = position + (end - start)              # one past the request's last position
        for column in tl.static_range(HISTORY):
            seed_position = position - 1 - column
            seed_raw = tl.load(lookback_ids_ptr + request * HISTORY + column, mask=first, other=-1).to(tl.int64)
            # The first kept position with the seed's residue; the seed stays only if none is kept.
            later = seed_position + history_width * ((kept_from - seed_position + history_width - 1) // history_width)
            seed_known = first & (seed_raw >= 0) & (seed_position >= 0) & (later >= last)
            seed_value = tl.load(token_map_ptr + tl.minimum(tl.maximum(seed_raw, 0), vocab_size - 1),
                                 mask=seed_known, other=0)
            if HAS_LOOKBACK_DEAD:
                seed_dead = tl.load(lookback_dead_ptr + request * HISTORY + column, mask=seed_known, other=0) != 0
                seed_value = tl.where(seed_dead, DEAD_CODE, seed_value)
            seed_cell = row * history_width + seed_position % history_width
            tl.store(history_values_ptr + seed_cell, seed_value.to(tl.int32), mask=seed_known)
            tl.store(history_tags_ptr + seed_cell, seed_position, mask=seed_known)
