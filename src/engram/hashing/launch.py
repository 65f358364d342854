"""Launcher of the Triton hash kernel: one launch per batch for every layer.

Safe under CUDA-graph capture: no host sync, no host-to-device copies, and the
batch size is not a specialization key (no recompiling per batch size).
"""

from __future__ import annotations

import torch

__all__ = ["triton_available", "launch_hash_kernel"]

# 16 tokens per program and one warp at every batch size: one compiled variant, and
# the fastest shape measured (H200, graph replay, cold L2): T = 1 10.6 us, 8192 10.6 us,
# 32768 16.4 us; 64 tokens x 4 warps took 15.8 / 17.0 / 33.0 us.
_BLOCK_TOKENS, _NUM_WARPS = 16, 1
# Request ends compared per loop step ([64 tokens, 128 ends] per program).
_REQUEST_CHUNK = 128


# Launch-shape overrides for benchmark sweeps ({"block_tokens": 32, "num_warps": 2}).
LAUNCH_OVERRIDE: dict[str, int] = {}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_hash_kernel(hasher, batch, missing_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Hash ids int32 ``[T, L, C]`` of ``batch`` (a validated
    :class:`~engram.hashing.validation.BatchMetadata`) with ``hasher``'s tables and stores.

    Writes the slot cache (batch tokens and lookback seeds) like the torch path;
    the request history is written by the caller. ``missing_shift`` (int8 ``[T]``),
    if given, receives per token the first shift whose history was unknown (0 = none).
    """
    from .kernels import ngram_hash_kernel

    spec = hasher.layout.spec
    num_tokens, num_requests = batch.num_tokens, batch.num_requests
    out = torch.empty((num_tokens, spec.num_layers, spec.num_columns), dtype=torch.int32, device=hasher.device)
    if num_tokens == 0:
        return out
    placeholder = hasher.token_map  # any device tensor stands in for an absent input (never read)
    slot_cache, history = hasher.slot_cache, hasher.request_history
    read_slots = slot_cache is not None and batch.block_table is not None
    read_history = history is not None and batch.request_rows is not None
    lookback = batch.lookback_token_ids.contiguous() if batch.lookback_token_ids is not None else None
    lookback_dead = batch.lookback_dead_mask.contiguous() if batch.lookback_dead_mask is not None else None
    block_table = batch.block_table
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    block_tokens = LAUNCH_OVERRIDE.get("block_tokens", _BLOCK_TOKENS)
    num_warps = LAUNCH_OVERRIDE.get("num_warps", _NUM_WARPS)
    grid = (triton_cdiv(num_tokens, block_tokens),)
    ngram_hash_kernel[grid](
        batch.input_ids, batch.positions, batch.query_start_loc,
        batch.dead_mask if batch.dead_mask is not None else placeholder, hasher.token_map,
        lookback if lookback is not None else placeholder,
        lookback_dead if lookback_dead is not None else placeholder,
        batch.slot_mapping if batch.slot_mapping is not None else placeholder,
        block_table if block_table is not None else placeholder,
        slot_cache.values if slot_cache is not None else placeholder,
        batch.request_rows if read_history else placeholder,
        history.values if read_history else placeholder,
        history.tags if read_history else placeholder,
        hasher.multipliers, hasher.column_primes, hasher.inverse_primes, hasher.column_offsets, out,
        missing_shift if missing_shift is not None else placeholder,
        num_tokens, num_requests, hasher.vocab.vocab_size, hasher.pad_id,
        slot_cache.block_size if slot_cache is not None else 1,
        slot_cache.num_slots if slot_cache is not None else 1,
        block_table.shape[1] if block_table is not None else 1,
        block_table.stride(0) if block_table is not None else 0,
        history.width if read_history else 1,
        NUM_LAYERS=spec.num_layers, LAYERS_PAD=_next_power_of_2(spec.num_layers),
        MAX_NGRAM=spec.max_ngram_size, NUM_HEADS=spec.n_heads, COLUMNS_PAD=_next_power_of_2(spec.num_columns),
        HAS_DEAD=batch.dead_mask is not None, HAS_LOOKBACK=lookback is not None,
        HAS_LOOKBACK_DEAD=lookback_dead is not None,
        WRITE_SLOTS=batch.slot_mapping is not None and slot_cache is not None,
        READ_SLOTS=read_slots, READ_HISTORY=read_history, REPORT_MISSING=missing_shift is not None,
        BLOCK_TOKENS=block_tokens, REQUEST_CHUNK=_REQUEST_CHUNK,
        num_warps=num_warps,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
