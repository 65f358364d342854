"""Triton kernel of the batch hash (DESIGN §2): one launch hashes every token of
a batch for every Engram layer, reading history from the batch itself, the
lookback window, the slot cache and the per-request history, and writing both
stores. Launched by :mod:`engram.hashing.launch`; its torch twin is
:class:`engram.hashing.batch.NgramHasher`'s torch path.

Phases in one launch. Stores a step both writes and reads need an order: the
slot cache is written before it is read (another request of the batch may hit
blocks this step fills), the request history after it is read (a step reads and
writes the same ring cells). The grid is laid out by phase: slot writers, hashers,
history writers, then one finisher that zeroes the counters for the next launch.
Only the hash programs that read a store (those holding one of the first N - 1
tokens of a request: the "readers") wait or signal; the other hashers touch no
counter. Readers hash on speculative slot reads and check them once the writers are
done (:func:`_hash_block`), so ordering costs ~1 us at T = 8192 (9.8 against 8.8 us,
H200) instead of the ~2.5 us of waiting first. A program waits only on programs
with smaller ids, which the GPU dispatches first, as single-pass scans (CUB's
decoupled look-back) rely on: they are resident and never wait on it. One launch
at a time per sync buffer (one hasher, one stream).
"""

import triton
import triton.language as tl

DEAD_CODE = tl.constexpr(-1)       # engram.hashing.stores.DEAD
UNWRITTEN_CODE = tl.constexpr(-2)  # engram.hashing.stores.UNWRITTEN

# Counters of the int32 [4] sync buffer, zero between launches.
SLOTS_WRITTEN = tl.constexpr(0)    # slot-writer programs done
READS_DONE = tl.constexpr(1)       # reader hash programs past their store reads
HISTORY_WRITTEN = tl.constexpr(2)  # history-writer programs past their wait


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
def _wait_for(counter_ptr, target):
    """Spin until the counter reaches ``target`` (acquire: later loads see what the
    counted programs wrote before their release)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _signal(counter_ptr):
    """Count this program done (release: every thread's earlier loads and stores first)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _request_ends(query_start_ptr, chunk_start, num_tokens, num_requests, REQUEST_CHUNK: tl.constexpr):
    """int32 ``[REQUEST_CHUNK]``: request ends ``query_start[1 + chunk_start + i]``
    (past the last request: ``num_tokens + 1``, which no token reaches)."""
    chunk = chunk_start + tl.arange(0, REQUEST_CHUNK).to(tl.int64)
    return tl.load(query_start_ptr + 1 + chunk, mask=chunk < num_requests, other=num_tokens + 1).to(tl.int32)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _count_readers(query_start_ptr, num_tokens, num_requests,
                   HISTORY: tl.constexpr, BLOCK_TOKENS: tl.constexpr, REQUEST_CHUNK: tl.constexpr):
    """How many hash programs hold one of the first ``HISTORY`` tokens of a request (the
    programs that read a store; int32 scalar): the union of each request's block
    interval ``[first // B, (first + k - 1) // B]``, intervals sorted by both ends, so
    request ``r`` adds ``last - max(first - 1, last of every earlier request)`` blocks."""
    count = tl.full([], 0, tl.int32)
    carried = tl.full([], -1, tl.int32)  # last block of the requests of earlier chunks
    for chunk_start in range(0, num_requests, REQUEST_CHUNK):
        request = chunk_start + tl.arange(0, REQUEST_CHUNK).to(tl.int64)
        in_range = request < num_requests
        first = tl.load(query_start_ptr + request, mask=in_range, other=0).to(tl.int32)
        after = tl.load(query_start_ptr + 1 + request, mask=in_range, other=0).to(tl.int32)
        last_block = tl.where(in_range & (first < tl.minimum(after, num_tokens)),
                              (tl.minimum(first + HISTORY, tl.minimum(after, num_tokens)) - 1) // BLOCK_TOKENS, -1)
        # The same for request r - 1, scanned: the last block of every earlier request.
        has_previous = in_range & (request >= 1)
        previous_first = tl.load(query_start_ptr + request - 1, mask=has_previous, other=0).to(tl.int32)
        previous_after = tl.minimum(first, num_tokens)
        previous_last = tl.where(has_previous & (previous_first < previous_after),
                                 (tl.minimum(previous_first + HISTORY, previous_after) - 1) // BLOCK_TOKENS, -1)
        before = tl.maximum(tl.associative_scan(previous_last, 0, _maximum), carried)
        fresh = tl.where(last_block >= 0, tl.maximum(last_block - tl.maximum(first // BLOCK_TOKENS - 1, before), 0), 0)
        count += tl.sum(fresh, axis=0)
        carried = tl.maximum(carried, tl.max(last_block, axis=0))
    return count


@triton.jit
def _locate_requests(token, first_ends, query_start_ptr, num_tokens, num_requests, REQUEST_CHUNK: tl.constexpr):
    """Request of each token (how many request ends ``query_start[1:]`` are ``<= token``)
    and that request's first token (the largest end ``<= token``, or 0), int32. A count
    over chunks of independent loads, not a binary search: a dependent chain of 7 loads
    cost ~5 us at 64 requests (H200, cold L2). ``first_ends``: the first chunk, loaded
    by the caller early."""
    token = token.to(tl.int32)
    passed = first_ends[:, None] <= token[None, :]  # [ends, tokens]: tokens last (see _hash_block)
    request = tl.sum(passed.to(tl.int32), axis=0)
    start = tl.max(tl.where(passed, first_ends[:, None], 0), axis=0)
    for chunk_start in range(REQUEST_CHUNK, num_requests, REQUEST_CHUNK):
        ends = _request_ends(query_start_ptr, chunk_start, num_tokens, num_requests, REQUEST_CHUNK)
        passed = ends[:, None] <= token[None, :]
        request += tl.sum(passed.to(tl.int32), axis=0)
        start = tl.maximum(start, tl.max(tl.where(passed, ends[:, None], 0), axis=0))
    return request, start


@triton.jit
def _compress(raw, token_map_ptr, vocab_size, mask):
    """Compressed id (int32) of raw token ids (int32), clamped into the vocabulary."""
    return tl.load(token_map_ptr + tl.minimum(tl.maximum(raw, 0), vocab_size - 1), mask=mask, other=0)


@triton.jit
def _own_slot_writes(block, batch_end, input_ids_ptr, dead_ptr, token_map_ptr, slot_mapping_ptr,
                     num_tokens, vocab_size, num_slots, HAS_DEAD: tl.constexpr, BLOCK: tl.constexpr):
    """(slot, value, mask) ``[BLOCK]`` of tokens ``block * BLOCK + i``: each batch token's
    slot receives its compressed id, or DEAD; padding (from ``batch_end =
    query_start[R]`` on) and ``-1`` slots write nothing. The loads do not wait for
    ``batch_end``; only the mask does."""
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
    first = tl.load(query_start_ptr + request, mask=has_request, other=0).to(tl.int64)
    after = tl.load(query_start_ptr + 1 + request, mask=has_request, other=0).to(tl.int64)
    has_token = has_request & (first < after) & (first < num_tokens)
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
def _slot_of(request, position, block_table_ptr, block_size, block_table_width, block_table_stride, mask):
    """int64 slot of ``position`` (int32) through the request's block-table row (block
    index clamped). Block arithmetic in int32: a 64-bit division is a ~70-instruction
    subroutine."""
    block_index = tl.minimum(position // block_size, block_table_width - 1)
    row_start = request.to(tl.int64) * block_table_stride
    block = tl.load(block_table_ptr + row_start + block_index, mask=mask, other=0).to(tl.int64)
    return block * block_size + position % block_size


@triton.jit(do_not_specialize=["num_tokens", "num_requests", "vocab_size", "pad_id",
                               "block_size", "num_slots", "block_table_width", "block_table_stride",
                               "history_width", "num_slot_programs", "num_hash_programs", "num_history_programs"])
def ngram_hash_kernel(
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
    lookback_ids_ptr, lookback_dead_ptr,
    slot_mapping_ptr, block_table_ptr, slot_values_ptr,
    history_rows_ptr, history_values_ptr, history_tags_ptr,
    multipliers_ptr, primes_ptr, barrett_ptr, offsets_ptr, out_ptr, missing_shift_ptr, sync_ptr,
    num_tokens, num_requests, vocab_size, pad_id,
    block_size, num_slots, block_table_width, block_table_stride, history_width,
    num_slot_programs, num_hash_programs, num_history_programs,
    NUM_LAYERS: tl.constexpr, LAYERS_PAD: tl.constexpr, MAX_NGRAM: tl.constexpr, HISTORY_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr, COLUMNS_PAD: tl.constexpr,
    HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    WRITE_SLOTS: tl.constexpr, WRITE_SEEDS: tl.constexpr, SLOT_PHASE: tl.constexpr,
    READ_SLOTS: tl.constexpr, READ_HISTORY: tl.constexpr, HISTORY_PHASE: tl.constexpr, WIDTH_PAD: tl.constexpr,
    REPORT_MISSING: tl.constexpr, BLOCK_TOKENS: tl.constexpr, WRITE_BLOCK: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr, REQUEST_CHUNK: tl.constexpr, DISTRUST_SPECULATION: tl.constexpr = False,
):
    """ids int32 ``[T, L, C]``: column ``(s-1)*H + h`` of layer ``l`` is
    ``(XOR_{k<=s} window[k] * m[l, k]) % prime[l, col] + offset[l, col]``.

    Pointers: input_ids/positions int ``[T]``; query_start int ``[R+1]``; dead bool
    ``[T]``; token_map int32 ``[V]``; lookback ids int64 / dead bool ``[R, N-1]``
    contiguous; slot_mapping int64 ``[T]``; block_table int ``[R, width]``;
    slot_values int32 ``[slots + 1]``; history rows int64 ``[R]``, values int32 /
    tags int64 ``[rows + 1, width]``; multipliers int64 ``[L, N]``; primes, Barrett
    multipliers and offsets int64 ``[L, C]``; missing_shift int8 ``[T]`` gets the
    first shift whose history no source knew (0 = none; only with
    ``REPORT_MISSING``); sync int32 ``[4]``, zero between launches.

    Grid: ``num_slot_programs`` slot writers (``SLOT_PHASE``; else the hashers write
    the slot cache themselves, unordered), ``num_hash_programs`` hashers of
    ``BLOCK_TOKENS`` tokens, ``num_history_programs`` history writers
    (``HISTORY_PHASE``), and with either phase one finisher.
    """
    SYNCED: tl.constexpr = SLOT_PHASE or HISTORY_PHASE
    program = tl.program_id(0).to(tl.int64)
    first_ends = _request_ends(query_start_ptr, 0, num_tokens, num_requests, REQUEST_CHUNK)
    batch_end = tl.load(query_start_ptr + num_requests).to(tl.int64)
    hash_begin = num_slot_programs
    history_begin = num_slot_programs + num_hash_programs
    finisher = history_begin + num_history_programs  # the last program, when SYNCED

    if program < hash_begin:
        if SLOT_PHASE:
            own_slot, own_value, own_mask = _own_slot_writes(
                program, batch_end, input_ids_ptr, dead_ptr, token_map_ptr, slot_mapping_ptr,
                num_tokens, vocab_size, num_slots, HAS_DEAD, WRITE_BLOCK)
            tl.store(slot_values_ptr + own_slot, own_value.to(tl.int32), mask=own_mask)
            if WRITE_SEEDS:
                seed_request, seed_position, seed_value, seed_known = _lookback_seeds(
                    program, positions_ptr, query_start_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
                    num_tokens, num_requests, vocab_size, MAX_NGRAM - 1, HISTORY_PAD, HAS_LOOKBACK_DEAD, WRITE_BLOCK)
                seed_slot = _slot_of(seed_request[:, None], seed_position, block_table_ptr, block_size,
                                     block_table_width, block_table_stride, seed_known)
                tl.store(slot_values_ptr + seed_slot, seed_value.to(tl.int32),
                         mask=seed_known & (seed_slot >= 0) & (seed_slot < num_slots))
            _signal(sync_ptr + SLOTS_WRITTEN)
    elif program < history_begin:
        _hash_block(
            program - hash_begin, first_ends, batch_end, sync_ptr,
            input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
            lookback_ids_ptr, lookback_dead_ptr, slot_mapping_ptr, block_table_ptr, slot_values_ptr,
            history_rows_ptr, history_values_ptr, history_tags_ptr,
            multipliers_ptr, primes_ptr, barrett_ptr, offsets_ptr, out_ptr, missing_shift_ptr,
            num_tokens, num_requests, vocab_size, pad_id,
            block_size, num_slots, block_table_width, block_table_stride, history_width, num_slot_programs,
            NUM_LAYERS, LAYERS_PAD, MAX_NGRAM, HISTORY_PAD, NUM_HEADS, COLUMNS_PAD,
            HAS_DEAD, HAS_LOOKBACK, HAS_LOOKBACK_DEAD, WRITE_SLOTS, WRITE_SEEDS, SLOT_PHASE,
            READ_SLOTS, READ_HISTORY, HISTORY_PHASE, REPORT_MISSING, BLOCK_TOKENS, REQUEST_CHUNK,
            DISTRUST_SPECULATION)
    elif program < finisher:
        if HISTORY_PHASE:
            readers = _count_readers(query_start_ptr, num_tokens, num_requests, MAX_NGRAM - 1, BLOCK_TOKENS,
                                     REQUEST_CHUNK)
            _history_block(
                program - history_begin, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
                lookback_ids_ptr, lookback_dead_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr,
                sync_ptr, readers, num_tokens, num_requests, vocab_size, history_width,
                MAX_NGRAM - 1, HISTORY_PAD, HAS_DEAD, HAS_LOOKBACK, HAS_LOOKBACK_DEAD, HISTORY_BLOCK, WIDTH_PAD)
    else:
        if SYNCED:
            # The finisher: once every counter has reached its count (no program reads
            # one any more), zero them for the next launch.
            readers = _count_readers(query_start_ptr, num_tokens, num_requests, MAX_NGRAM - 1, BLOCK_TOKENS,
                                     REQUEST_CHUNK)
            if SLOT_PHASE:
                _wait_for(sync_ptr + SLOTS_WRITTEN, num_slot_programs)
            _wait_for(sync_ptr + READS_DONE, readers)
            if HISTORY_PHASE:
                _wait_for(sync_ptr + HISTORY_WRITTEN, num_history_programs)
            tl.atomic_xchg(sync_ptr + SLOTS_WRITTEN, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + READS_DONE, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + HISTORY_WRITTEN, 0, sem="relaxed", scope="gpu")


@triton.jit
def _hash_tokens(
    token, valid, live, request, position, offset_in_request, prime, barrett, first_row, column_shift, layers,
    layer_ok, input_ids_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr, block_table_ptr,
    slot_values_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr, multipliers_ptr,
    vocab_size, pad_id, block_size, num_slots, block_table_width, block_table_stride, history_width,
    LAYERS_PAD: tl.constexpr, MAX_NGRAM: tl.constexpr, HISTORY_PAD: tl.constexpr, COLUMNS_PAD: tl.constexpr,
    HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    READ_SLOTS: tl.constexpr, READ_HISTORY: tl.constexpr, REPORT_MISSING: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
):
    """Ids int64 ``[L, C, tokens]`` of the tokens, from every history source; also the
    first shift no source knew per token, and the slot-cache reads ``[N - 1, tokens]``
    (slot, value read, mask) for a later check."""
    HISTORY: tl.constexpr = MAX_NGRAM - 1
    history_index = tl.arange(0, HISTORY_PAD)
    slot_read = tl.zeros([HISTORY_PAD, BLOCK_TOKENS], dtype=tl.int64)
    slot_value = tl.zeros([HISTORY_PAD, BLOCK_TOKENS], dtype=tl.int32)
    slot_used = tl.zeros([HISTORY_PAD, BLOCK_TOKENS], dtype=tl.int1)
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
            known = tl.zeros([BLOCK_TOKENS], dtype=tl.int1)
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
            # (3) the slot cache, through the request's block table (L2 reads: the
            # slot writers of this launch may have just written them)
            if READ_SLOTS:
                need = outside & ~known
                history_slot = _slot_of(request, source_position, block_table_ptr, block_size,
                                        block_table_width, block_table_stride, need)
                history_slot = tl.minimum(tl.maximum(history_slot, 0), num_slots - 1)
                cached = tl.load(slot_values_ptr + history_slot, mask=need, other=UNWRITTEN_CODE,
                                 cache_modifier=".cg")
                use = need & (cached != UNWRITTEN_CODE)
                value = tl.where(use, cached, value)
                dead = tl.where(use, cached == DEAD_CODE, dead)
                known = known | use
                row_of_shift = (history_index == shift - 1)[:, None]
                slot_read = tl.where(row_of_shift, history_slot[None, :], slot_read)
                slot_value = tl.where(row_of_shift, cached[None, :], slot_value)
                slot_used = tl.where(row_of_shift, need[None, :], slot_used)
            # (3') the per-request history ring, position-tagged
            if READ_HISTORY:
                need = outside & ~known
                row = tl.load(history_rows_ptr + request, mask=need, other=0).to(tl.int64)
                cell = row * history_width + source_position % history_width
                tag = tl.load(history_tags_ptr + cell, mask=need, other=-1)
                remembered = tl.load(history_values_ptr + cell, mask=need, other=UNWRITTEN_CODE)
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
        rolling = rolling ^ (value.to(tl.int64)[None, None, :] * multiplier[:, None, None])
        if shift > 0:
            rolling_by_column = tl.where((column_shift == shift)[None, :, None], rolling, rolling_by_column)
    ids = _remainder(rolling_by_column, prime[:, :, None], barrett[:, :, None]) + first_row[:, :, None]
    return ids, first_missing, slot_read, slot_value, slot_used


@triton.jit
def _hash_block(
    block, first_ends, batch_end, sync_ptr,
    input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
    lookback_ids_ptr, lookback_dead_ptr, slot_mapping_ptr, block_table_ptr, slot_values_ptr,
    history_rows_ptr, history_values_ptr, history_tags_ptr,
    multipliers_ptr, primes_ptr, barrett_ptr, offsets_ptr, out_ptr, missing_shift_ptr,
    num_tokens, num_requests, vocab_size, pad_id,
    block_size, num_slots, block_table_width, block_table_stride, history_width, num_slot_programs,
    NUM_LAYERS: tl.constexpr, LAYERS_PAD: tl.constexpr, MAX_NGRAM: tl.constexpr, HISTORY_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr, COLUMNS_PAD: tl.constexpr,
    HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr, HAS_LOOKBACK_DEAD: tl.constexpr,
    WRITE_SLOTS: tl.constexpr, WRITE_SEEDS: tl.constexpr, SLOT_PHASE: tl.constexpr,
    READ_SLOTS: tl.constexpr, READ_HISTORY: tl.constexpr, HISTORY_PHASE: tl.constexpr,
    REPORT_MISSING: tl.constexpr, BLOCK_TOKENS: tl.constexpr, REQUEST_CHUNK: tl.constexpr,
    DISTRUST_SPECULATION: tl.constexpr,
):
    """Hash ids of tokens ``block * BLOCK_TOKENS + i`` (see :func:`ngram_hash_kernel`).

    With slot writers in the launch (``SLOT_PHASE``) the slot reads are speculative:
    a writer may not have written them yet. A reader hashes at once, then waits for
    every writer, reads its slots again and hashes again only if one changed (a
    request hit blocks this step fills), so the wait overlaps the hash instead of
    preceding it. ``DISTRUST_SPECULATION`` (tests) takes that second pass every time.
    The second pass is inlined: as a loop it measured 10.4-10.8 us at T = 8192
    against 9.5 (H200).
    """
    HISTORY: tl.constexpr = MAX_NGRAM - 1
    NUM_COLUMNS: tl.constexpr = HISTORY * NUM_HEADS
    # Token indices, positions and requests in int32 (each < 2**31, validated; a 64-bit
    # op is two or more instructions, and the kernel is issue-bound: ncu on the H200
    # counted ~900 instructions per 4-token warp at 19% occupancy); products that
    # index memory in int64.
    token = (block * BLOCK_TOKENS).to(tl.int32) + tl.arange(0, BLOCK_TOKENS)
    valid = token < num_tokens
    request, start = _locate_requests(token, first_ends, query_start_ptr, num_tokens, num_requests, REQUEST_CHUNK)
    padding = request >= num_requests
    request = tl.minimum(request, tl.maximum(num_requests - 1, 0))
    live = valid & ~padding
    position = tl.load(positions_ptr + token, mask=valid, other=0).to(tl.int32)
    offset_in_request = token - start

    # Every load is issued before any store: a store to ``out`` or a store may alias
    # later loads, so loads after it wait (per-shift stores cost ~9 us at T = 1,
    # H200, cold L2). Table constants are loaded once as [L, C] tiles. Tiles put the
    # token axis last, so a warp's lanes spread over tokens and each lane keeps one
    # token's scalars (token-first tiles gave every lane all of them: 816 -> 720
    # SASS instructions per 4-token program).
    layers = tl.arange(0, LAYERS_PAD)
    columns = tl.arange(0, COLUMNS_PAD)
    layer_ok = layers < NUM_LAYERS
    column_ok = layer_ok[:, None] & (columns < NUM_COLUMNS)[None, :]
    table_offset = layers[:, None] * NUM_COLUMNS + columns[None, :]
    prime = tl.load(primes_ptr + table_offset, mask=column_ok, other=3)
    barrett = tl.load(barrett_ptr + table_offset, mask=column_ok, other=0)
    first_row = tl.load(offsets_ptr + table_offset, mask=column_ok, other=0)
    column_shift = columns // NUM_HEADS + 1  # order - 1 of each column

    if not SLOT_PHASE:
        # Unordered writes (one request, or an engine that promised no same-step
        # hits): loaded now, stored after every read.
        if WRITE_SLOTS:
            own_slot, own_value, own_mask = _own_slot_writes(
                block, batch_end, input_ids_ptr, dead_ptr, token_map_ptr, slot_mapping_ptr,
                num_tokens, vocab_size, num_slots, HAS_DEAD, BLOCK_TOKENS)
        if WRITE_SEEDS:
            seed_request, seed_position, seed_value, seed_known = _lookback_seeds(
                block, positions_ptr, query_start_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr,
                num_tokens, num_requests, vocab_size, HISTORY, HISTORY_PAD, HAS_LOOKBACK_DEAD, BLOCK_TOKENS)
            seed_slot = _slot_of(seed_request[:, None], seed_position, block_table_ptr, block_size,
                                 block_table_width, block_table_stride, seed_known)
    # A reader: a program holding one of the first N - 1 tokens of a request, whose
    # history may come from a store (the rule _count_readers counts).
    reader = tl.max((live & (offset_in_request < HISTORY)).to(tl.int32), axis=0) > 0
    ids, first_missing, slot_read, slot_value, slot_used = _hash_tokens(
        token, valid, live, request, position, offset_in_request, prime, barrett, first_row, column_shift, layers,
        layer_ok, input_ids_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr, lookback_dead_ptr, block_table_ptr,
        slot_values_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr, multipliers_ptr,
        vocab_size, pad_id, block_size, num_slots, block_table_width, block_table_stride, history_width,
        LAYERS_PAD, MAX_NGRAM, HISTORY_PAD, COLUMNS_PAD, HAS_DEAD, HAS_LOOKBACK, HAS_LOOKBACK_DEAD,
        READ_SLOTS, READ_HISTORY, REPORT_MISSING, BLOCK_TOKENS)
    if SLOT_PHASE and READ_SLOTS:
        # Check the speculative slot reads once every writer is done (see above).
        if reader:
            _wait_for(sync_ptr + SLOTS_WRITTEN, num_slot_programs)
            settled = tl.load(slot_values_ptr + slot_read, mask=slot_used, other=UNWRITTEN_CODE, cache_modifier=".cg")
            if DISTRUST_SPECULATION:  # tests: take the path of a changed slot every time
                slot_value = ~settled
            changed = tl.max(tl.max(((settled != slot_value) & slot_used).to(tl.int32), axis=1), axis=0)
            if changed > 0:
                ids, first_missing, slot_read, slot_value, slot_used = _hash_tokens(
                    token, valid, live, request, position, offset_in_request, prime, barrett, first_row,
                    column_shift, layers, layer_ok, input_ids_ptr, dead_ptr, token_map_ptr, lookback_ids_ptr,
                    lookback_dead_ptr, block_table_ptr, slot_values_ptr, history_rows_ptr, history_values_ptr,
                    history_tags_ptr, multipliers_ptr, vocab_size, pad_id, block_size, num_slots, block_table_width,
                    block_table_stride, history_width, LAYERS_PAD, MAX_NGRAM, HISTORY_PAD, COLUMNS_PAD, HAS_DEAD,
                    HAS_LOOKBACK, HAS_LOOKBACK_DEAD, READ_SLOTS, READ_HISTORY, REPORT_MISSING, BLOCK_TOKENS)

    if SLOT_PHASE or HISTORY_PHASE:
        if reader:
            _signal(sync_ptr + READS_DONE)  # the history writers may now overwrite what was read
    # Stores, after every load.
    if not SLOT_PHASE:
        if WRITE_SLOTS:
            tl.store(slot_values_ptr + own_slot, own_value.to(tl.int32), mask=own_mask)
        if WRITE_SEEDS:
            tl.store(slot_values_ptr + seed_slot, seed_value.to(tl.int32),
                     mask=seed_known & (seed_slot >= 0) & (seed_slot < num_slots))
    out_offset = token.to(tl.int64)[None, None, :] * (NUM_LAYERS * NUM_COLUMNS) + table_offset[:, :, None]
    tl.store(out_ptr + out_offset, ids.to(tl.int32), mask=column_ok[:, :, None] & valid[None, None, :])
    if REPORT_MISSING:
        tl.store(missing_shift_ptr + token, first_missing.to(tl.int8), mask=valid)


@triton.jit
def _history_block(
    block, input_ids_ptr, positions_ptr, query_start_ptr, dead_ptr, token_map_ptr,
    lookback_ids_ptr, lookback_dead_ptr, history_rows_ptr, history_values_ptr, history_tags_ptr,
    sync_ptr, readers, num_tokens, num_requests, vocab_size, history_width,
    HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_DEAD: tl.constexpr, HAS_LOOKBACK: tl.constexpr,
    HAS_LOOKBACK_DEAD: tl.constexpr, BLOCK: tl.constexpr, WIDTH_PAD: tl.constexpr,
):
    """Requests ``block * BLOCK + i``: the ring receives the known lookback entries and
    the last ``width`` tokens of each request (drafts included), position-tagged:
    ``values[row, p % width] = id or DEAD``, ``tags[row, p % width] = p``. Loads first,
    then a wait for every reader hash program (``readers`` of them), then the stores.

    Every cell is written at most once: a lookback entry whose cell a kept token
    takes is skipped (the later position wins, as in the torch path).
    """
    request = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    has_request = request < num_requests
    first = tl.load(query_start_ptr + request, mask=has_request, other=0).to(tl.int64)
    after = tl.load(query_start_ptr + 1 + request, mask=has_request, other=0).to(tl.int64)
    after = tl.minimum(after, num_tokens)
    count = tl.maximum(after - first, 0)
    kept = tl.minimum(count, history_width)
    row = tl.load(history_rows_ptr + request, mask=has_request, other=0).to(tl.int64)
    first_position = tl.load(positions_ptr + first, mask=has_request & (count > 0), other=0).to(tl.int64)

    # The last ``kept`` tokens of each request: [BLOCK, WIDTH_PAD].
    lane = tl.arange(0, WIDTH_PAD).to(tl.int64)
    keep = has_request[:, None] & (lane[None, :] < kept[:, None])
    token = after[:, None] - kept[:, None] + lane[None, :]
    position = tl.load(positions_ptr + token, mask=keep, other=0).to(tl.int64)
    raw = tl.load(input_ids_ptr + token, mask=keep, other=0).to(tl.int32)
    value = _compress(raw, token_map_ptr, vocab_size, keep)
    if HAS_DEAD:
        value = tl.where(tl.load(dead_ptr + token, mask=keep, other=0) != 0, DEAD_CODE, value)
    cell = row[:, None] * history_width + position % history_width

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
        seed_known = in_window & (seed_raw >= 0) & (seed_position >= 0) & (later >= last[:, None])
        seed_value = _compress(seed_raw, token_map_ptr, vocab_size, seed_known)
        if HAS_LOOKBACK_DEAD:
            seed_dead = tl.load(lookback_dead_ptr + lookback_cell, mask=seed_known, other=0) != 0
            seed_value = tl.where(seed_dead, DEAD_CODE, seed_value)
        seed_cell = row[:, None] * history_width + seed_position % history_width

    _wait_for(sync_ptr + READS_DONE, readers)
    _signal(sync_ptr + HISTORY_WRITTEN)  # past the wait: the finisher may zero READS_DONE
    tl.store(history_values_ptr + cell, value.to(tl.int32), mask=keep)
    tl.store(history_tags_ptr + cell, position, mask=keep)
    if HAS_LOOKBACK:
        tl.store(history_values_ptr + seed_cell, seed_value.to(tl.int32), mask=seed_known)
        tl.store(history_tags_ptr + seed_cell, seed_position, mask=seed_known)
