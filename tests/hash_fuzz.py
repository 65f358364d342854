"""Malformed batch metadata for the hash kernels: a fuzz that the interpreter test
(with every memory access bounds-checked) and ``benchmarks/kernels/memcheck_kernels.py``
(under compute-sanitizer on a GPU) both run. With validation off a malformed batch
may give wrong ids; it must never hang, fault, or touch memory out of bounds."""

from __future__ import annotations

import numpy as np
import torch

import engram

# The reproducer of the hang an earlier, spinning kernel had: query_start_loc
# [3, 100, 0] at T = 100, validation off.
HANG_REPRODUCER = dict(num_tokens=100, query_start_loc=[3, 100, 0])


def _wild_integers(rng: np.random.Generator, size, low: int, high: int) -> np.ndarray:
    """Mostly in ``[low, high)``, some far outside either end, some at the edges."""
    values = rng.integers(low, max(high, low + 1), size)
    pick = rng.random(size)
    values = np.where(pick < 0.1, rng.integers(-2**40, 0, size), values)
    values = np.where((pick >= 0.1) & (pick < 0.2), rng.integers(high, high + 2**40, size), values)
    values = np.where((pick >= 0.2) & (pick < 0.25), -1, values)
    values = np.where((pick >= 0.25) & (pick < 0.3), high, values)
    return values


def malformed_batch(rng: np.random.Generator, hasher: engram.NgramHasher, num_slots: int, block_size: int,
                    history_rows: int, fixed: dict | None = None) -> dict:
    """Keyword arguments of one hasher call, each field malformed with some probability."""
    num_tokens = int(fixed["num_tokens"]) if fixed else int(rng.integers(1, 14))
    num_requests = len(fixed["query_start_loc"]) - 1 if fixed else int(rng.integers(0, 5))
    history = hasher.history_length
    if fixed:
        starts = np.array(fixed["query_start_loc"])
    elif rng.random() < 0.6:
        starts = _wild_integers(rng, num_requests + 1, 0, num_tokens + 1)
    else:
        starts = np.sort(rng.integers(0, num_tokens + 1, num_requests + 1))
        starts[0] = 0
    positions = (_wild_integers(rng, num_tokens, 0, 2**31 + 5) if rng.random() < 0.5
                 else np.arange(num_tokens) + int(rng.integers(0, 9)))
    input_ids = (_wild_integers(rng, num_tokens, 0, hasher.vocab.vocab_size) if rng.random() < 0.3
                 else rng.integers(0, hasher.vocab.vocab_size, num_tokens))
    device = hasher.device
    dtype = torch.int32 if rng.random() < 0.5 else torch.int64  # both widths the kernels read

    def tensor(values, dtype=dtype):
        array = np.asarray(values, dtype=np.int64)
        if dtype == torch.int32:
            array = array.astype(np.int32)  # wraps, like a caller's careless cast
        return torch.from_numpy(array).to(device)

    batch = dict(input_ids=tensor(input_ids, torch.int64), positions=tensor(positions),
                 query_start_loc=tensor(starts))
    if rng.random() < 0.5:
        batch["dead_mask"] = torch.from_numpy(rng.random(num_tokens) < 0.3).to(device)
    if rng.random() < 0.5:
        batch["lookback_token_ids"] = tensor(_wild_integers(rng, (num_requests, history), -1,
                                                            hasher.vocab.vocab_size), torch.int64)
        if rng.random() < 0.5:
            batch["lookback_dead_mask"] = torch.from_numpy(rng.random((num_requests, history)) < 0.3).to(device)
    if hasher.slot_cache is not None:
        if rng.random() < 0.7:
            batch["slot_mapping"] = tensor(_wild_integers(rng, num_tokens, -1, num_slots))
        if rng.random() < 0.8:
            width = int(rng.integers(1, 5))
            table = _wild_integers(rng, (num_requests + int(rng.integers(0, 2)), width), 0, num_slots // block_size)
            batch["block_table"] = tensor(table, torch.int32)
    if hasher.request_history is not None and rng.random() < 0.8:
        batch["request_rows"] = tensor(_wild_integers(rng, num_requests, 0, history_rows), torch.int64)
    return batch


def run_fuzz(hasher_factory, seed: int, cases: int, before_call=None, after_call=None) -> int:
    """``cases`` malformed calls (the hang reproducer first) on fresh hashers with random
    stores bound; ``before_call(hasher, batch)`` and ``after_call(hasher, batch, ids)``
    wrap each call. Returns the number of calls made."""
    rng = np.random.default_rng(seed)
    calls = 0
    for case in range(cases):
        hasher = hasher_factory(int(rng.integers(2**31)))
        num_slots, block_size, history_rows = 0, 1, 0
        if rng.random() < 0.6:
            block_size = int(rng.integers(1, 5))
            num_slots = block_size * int(rng.integers(1, 9))
            hasher.bind_slot_cache(num_slots, block_size, fused_write=bool(rng.random() < 0.3))
        if rng.random() < 0.6:
            history_rows = int(rng.integers(1, 5))
            hasher.bind_request_history(history_rows, max_draft_tokens=int(rng.integers(0, 3)))
        batch = malformed_batch(rng, hasher, num_slots, block_size, history_rows,
                                fixed=HANG_REPRODUCER if case == 0 else None)
        if before_call is not None:
            before_call(hasher, batch)
        ids = hasher(**batch)
        calls += 1
        if after_call is not None:
            after_call(hasher, batch, ids)
    return calls
