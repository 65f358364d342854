"""Launcher of the Triton hash kernel: one launch per batch for every layer and
every store.

Safe under CUDA-graph capture: no host sync, no host-to-device copies, persistent
counters that the launch leaves at zero. Sizes are not specialization keys: the
compiled variants are bounded (tokens per program: 3 batch-size bands; request ends
per compare chunk: powers of two up to 128), not one per batch size.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["triton_available", "launch_hash_kernel"]

# One warp per program; tokens per program by batch size (a few compiled variants,
# each captured once per graph). Measured on the H200, graph replay, cold L2, slot
# writers in the launch (v3 kernel, 64 requests):
#   tokens/program   T=64   T=1024  T=8192  T=32768
#        1           9.4    9.9     15.9    33.7   us
#        4           8.8    9.2     11.4    18.8
#        8           9.4    9.7      9.5    15.8
#    16 (2 warps)   10.1   10.0     10.5    17.6
_BLOCK_TOKENS_BY_BATCH = ((64, 1), (2048, 4))
_BLOCK_TOKENS_LARGEST, _NUM_WARPS = 8, 1


def block_tokens_for(num_tokens: int) -> int:
    """Tokens per program for a batch of ``num_tokens`` (see the table above)."""
    for limit, block_tokens in _BLOCK_TOKENS_BY_BATCH:
        if num_tokens <= limit:
            return block_tokens
    return _BLOCK_TOKENS_LARGEST


# Request ends compared per loop step: up to [16 tokens, 128 ends] per program.
_REQUEST_CHUNK_LARGEST = 128
# Tokens (and requests, for lookback seeds) per slot-writer program; requests per
# history-writer program (each a row of up to 16 ring cells).
_WRITE_BLOCK = 64
_HISTORY_BLOCK = 8


# Launch-shape overrides for benchmark sweeps ({"block_tokens": 32, "num_warps": 2});
# tests set "distrust_speculation" to force the re-hash of speculative slot reads.
LAUNCH_OVERRIDE: dict[str, int] = {}


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_hash_kernel(hasher, batch, missing_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Hash ids int32 ``[T, L, C]`` of ``batch`` (a validated
    :class:`~engram.hashing.validation.BatchMetadata`) in one launch, which also
    writes the slot cache (before any read of it) and the request history (after
    every read of it). ``missing_shift`` (int8 ``[T]``), if given, receives per token
    the first shift whose history no source knew (0 = none).

    The slot writes need ordering only when another request of the batch may read
    them (a prefix-cache hit on blocks this step fills): not with one request, nor
    with a cache bound ``fused_write=True`` (the engine promises no such hits;
    validation checks it). Then the hashers write the cache themselves.
    """
    from .kernels import ngram_hash_kernel

    spec = hasher.layout.spec
    num_tokens, num_requests = batch.num_tokens, batch.num_requests
    out = torch.empty((num_tokens, spec.num_layers, spec.num_columns), dtype=torch.int32, device=hasher.device)
    if num_tokens == 0:
        return out
    placeholder = hasher.token_map  # any device tensor stands in for an absent input (never read)
    slot_cache, history = hasher.slot_cache, hasher.request_history
    lookback = batch.lookback_token_ids.contiguous() if batch.lookback_token_ids is not None else None
    lookback_dead = batch.lookback_dead_mask.contiguous() if batch.lookback_dead_mask is not None else None
    block_table = batch.block_table
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    write_slots = slot_cache is not None and batch.slot_mapping is not None
    write_seeds = slot_cache is not None and lookback is not None and block_table is not None
    read_slots = slot_cache is not None and block_table is not None
    uses_history = history is not None and batch.request_rows is not None
    slot_phase = (write_slots or write_seeds) and read_slots and num_requests > 1 and not slot_cache.fused_write

    # Seeds are written per request, tokens per token: writer grids cover both.
    write_items = max(num_tokens, num_requests) if write_seeds else num_tokens
    block_tokens = LAUNCH_OVERRIDE.get("block_tokens", block_tokens_for(num_tokens))
    num_warps = LAUNCH_OVERRIDE.get("num_warps", _NUM_WARPS)
    num_slot_programs = triton_cdiv(write_items, _WRITE_BLOCK) if slot_phase else 0
    num_hash_programs = triton_cdiv(num_tokens if slot_phase else write_items, block_tokens)
    num_history_programs = triton_cdiv(num_requests, _HISTORY_BLOCK) if uses_history and num_requests else 0
    finisher = 1 if slot_phase or num_history_programs else 0
    ngram_hash_kernel[(num_slot_programs + num_hash_programs + num_history_programs + finisher,)](
        batch.input_ids, batch.positions, batch.query_start_loc,
        batch.dead_mask if batch.dead_mask is not None else placeholder, hasher.token_map,
        lookback if lookback is not None else placeholder,
        lookback_dead if lookback_dead is not None else placeholder,
        batch.slot_mapping if batch.slot_mapping is not None else placeholder,
        block_table if block_table is not None else placeholder,
        slot_cache.values if slot_cache is not None else placeholder,
        batch.request_rows if uses_history else placeholder,
        history.values if uses_history else placeholder,
        history.tags if uses_history else placeholder,
        hasher.multipliers, hasher.column_primes, hasher.barrett_multipliers, hasher.column_offsets, out,
        missing_shift if missing_shift is not None else placeholder, hasher.kernel_sync,
        num_tokens, num_requests, hasher.vocab.vocab_size, hasher.pad_id,
        slot_cache.block_size if slot_cache is not None else 1,
        slot_cache.num_slots if slot_cache is not None else 1,
        block_table.shape[1] if block_table is not None else 1,
        block_table.stride(0) if block_table is not None else 0,
        history.width if uses_history else 1,
        num_slot_programs, num_hash_programs, num_history_programs,
        NUM_LAYERS=spec.num_layers, LAYERS_PAD=_next_power_of_2(spec.num_layers),
        MAX_NGRAM=spec.max_ngram_size, HISTORY_PAD=_next_power_of_2(spec.max_ngram_size - 1),
        NUM_HEADS=spec.n_heads, COLUMNS_PAD=_next_power_of_2(spec.num_columns),
        HAS_DEAD=batch.dead_mask is not None, HAS_LOOKBACK=lookback is not None,
        HAS_LOOKBACK_DEAD=lookback_dead is not None,
        WRITE_SLOTS=write_slots, WRITE_SEEDS=write_seeds, SLOT_PHASE=slot_phase,
        READ_SLOTS=read_slots, READ_HISTORY=uses_history, HISTORY_PHASE=uses_history and num_history_programs > 0,
        WIDTH_PAD=_next_power_of_2(history.width) if uses_history else 1,
        REPORT_MISSING=missing_shift is not None, BLOCK_TOKENS=block_tokens, WRITE_BLOCK=_WRITE_BLOCK,
        HISTORY_BLOCK=_HISTORY_BLOCK,
        REQUEST_CHUNK=min(_REQUEST_CHUNK_LARGEST, _next_power_of_2(max(num_requests, 2))),
        DISTRUST_SPECULATION=bool(LAUNCH_OVERRIDE.get("distrust_speculation", False)),
        num_warps=num_warps,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
