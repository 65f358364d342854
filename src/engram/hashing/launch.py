"""Launcher of the Triton hash kernel: one launch per batch for every layer.

Safe under CUDA-graph capture: no host sync, no host-to-device copies, and the
batch size is not a specialization key (no recompiling per batch size).
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["triton_available", "launch_hash_kernel", "launch_history_write"]

# One warp per program; tokens per program by batch size (a few compiled variants,
# each captured once per graph). Measured on the H200, graph replay, cold L2:
#   tokens/program   T=1    T=64   T=8192  T=32768
#        1           7.3    8.1    13.9    35.8   us
#        4           8.9    8.8     9.7    19.6
#       16          11.0   11.0    11.0    16.6
_BLOCK_TOKENS_BY_BATCH = ((64, 1), (8192, 4))
_BLOCK_TOKENS_LARGEST, _NUM_WARPS = 16, 1


def block_tokens_for(num_tokens: int) -> int:
    """Tokens per program for a batch of ``num_tokens`` (see the table above)."""
    for limit, block_tokens in _BLOCK_TOKENS_BY_BATCH:
        if num_tokens <= limit:
            return block_tokens
    return _BLOCK_TOKENS_LARGEST


# Request ends compared per loop step ([64 tokens, 128 ends] per program).
_REQUEST_CHUNK = 128


# Launch-shape overrides for benchmark sweeps ({"block_tokens": 32, "num_warps": 2}).
LAUNCH_OVERRIDE: dict[str, int] = {}


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_hash_kernel(hasher, batch, missing_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Hash ids int32 ``[T, L, C]`` of ``batch``; writes the slot cache first.

    The slot cache's writes (batch tokens, lookback seeds) must land before any
    history read: another request of the same batch may read them (a prefix-cache
    hit on blocks this step fills). So by default a write-only launch precedes the
    hash launch; a cache bound with ``fused_write=True`` (the engine promises no such
    same-step hits; validation checks it) does both in one launch.
    """
    slot_cache = hasher.slot_cache
    writes = slot_cache is not None and (batch.slot_mapping is not None or
                                         (batch.lookback_token_ids is not None and batch.block_table is not None))
    if writes and not slot_cache.fused_write:
        _launch(hasher, batch, None, compute_ids=False, write=True, read=False)
        return _launch(hasher, batch, missing_shift, compute_ids=True, write=False, read=True)
    return _launch(hasher, batch, missing_shift, compute_ids=True, write=True, read=True)


def _launch(hasher, batch, missing_shift, *, compute_ids: bool, write: bool, read: bool) -> torch.Tensor:
    """One launch of the hash kernel over ``batch`` (a validated
    :class:`~engram.hashing.validation.BatchMetadata`): ``compute_ids`` reads the
    sources (the stores only with ``read``) and writes ids; ``write`` stores the slot
    cache's writes. The request history is written by :func:`launch_history_write`.
    ``missing_shift`` (int8 ``[T]``), if given, receives per token the first shift
    whose history no source knew (0 = none).
    """
    from .kernels import ngram_hash_kernel

    spec = hasher.layout.spec
    num_tokens, num_requests = batch.num_tokens, batch.num_requests
    out = torch.empty((num_tokens, spec.num_layers, spec.num_columns), dtype=torch.int32, device=hasher.device)
    if num_tokens == 0:
        return out
    placeholder = hasher.token_map  # any device tensor stands in for an absent input (never read)
    slot_cache, history = hasher.slot_cache, hasher.request_history
    read_slots = read and slot_cache is not None and batch.block_table is not None
    read_history = read and history is not None and batch.request_rows is not None
    lookback = batch.lookback_token_ids.contiguous() if batch.lookback_token_ids is not None else None
    lookback_dead = batch.lookback_dead_mask.contiguous() if batch.lookback_dead_mask is not None else None
    block_table = batch.block_table
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    block_tokens = LAUNCH_OVERRIDE.get("block_tokens", block_tokens_for(num_tokens))
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
        COMPUTE_IDS=compute_ids,
        WRITE_SLOTS=write and batch.slot_mapping is not None and slot_cache is not None,
        WRITE_SEEDS=write and slot_cache is not None and lookback is not None and block_table is not None,
        READ_SLOTS=read_slots, READ_HISTORY=read_history, REPORT_MISSING=missing_shift is not None,
        BLOCK_TOKENS=block_tokens, REQUEST_CHUNK=_REQUEST_CHUNK,
        num_warps=num_warps,
    )
    return out


def launch_history_write(hasher, batch) -> None:
    """Write the batch into the bound per-request history (one launch, after the hash)."""
    from .kernels import history_write_kernel

    if batch.num_tokens == 0:
        return
    history, placeholder = hasher.request_history, hasher.token_map
    lookback = batch.lookback_token_ids.contiguous() if batch.lookback_token_ids is not None else None
    lookback_dead = batch.lookback_dead_mask.contiguous() if batch.lookback_dead_mask is not None else None
    block_tokens = 16
    history_write_kernel[(triton_cdiv(batch.num_tokens, block_tokens),)](
        batch.input_ids, batch.positions, batch.query_start_loc,
        batch.dead_mask if batch.dead_mask is not None else placeholder, hasher.token_map,
        lookback if lookback is not None else placeholder,
        lookback_dead if lookback_dead is not None else placeholder,
        batch.request_rows, history.values, history.tags,
        batch.num_tokens, batch.num_requests, hasher.vocab.vocab_size, history.width,
        MAX_NGRAM=hasher.layout.spec.max_ngram_size, HAS_DEAD=batch.dead_mask is not None,
        HAS_LOOKBACK=lookback is not None, HAS_LOOKBACK_DEAD=lookback_dead is not None,
        BLOCK_TOKENS=block_tokens, REQUEST_CHUNK=_REQUEST_CHUNK, num_warps=1,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
