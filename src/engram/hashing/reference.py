"""Whole-sequence reference of the n-gram hash (docs/design.md §2), written for clarity.

Every other way of computing hash ids (batched, chunked, streamed from
history stores, Triton kernels) is tested against :func:`hash_ngrams`.
"""

from __future__ import annotations

import numpy as np

from engram.layout import EngramLayout
from engram.vocab import TokenCompressor

__all__ = ["hash_ngrams", "ngram_windows"]


def ngram_windows(compressed_ids: np.ndarray, dead_mask: np.ndarray, max_ngram_size: int, pad_id: int) -> np.ndarray:
    """int64 ``[T, N]``: column ``s`` is the compressed id at ``t - s``, or ``pad_id``
    when shift ``s`` is blocked (``t - s < 0``, a dead token, or shift ``s - 1`` blocked)."""
    length = compressed_ids.shape[0]
    windows = np.full((length, max_ngram_size), pad_id, dtype=np.int64)
    blocked = np.zeros(length, dtype=bool)
    positions = np.arange(length)
    for shift in range(max_ngram_size):
        source = positions - shift
        in_range = source >= 0
        source_dead = np.ones(length, dtype=bool)
        source_dead[in_range] = dead_mask[source[in_range]]
        blocked = blocked | ~in_range | source_dead  # blocking spreads to every larger shift
        windows[~blocked, shift] = compressed_ids[source[~blocked]]
    return windows


def _as_1d(values, name: str, *, integer: bool) -> np.ndarray:
    """``values`` as a 1-D int64 (``integer``) or bool numpy array; ValueError naming ``name``."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence [T], found shape {list(array.shape)}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64 if integer else bool)
    if integer and (array.dtype == bool or not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{name}: expected integer token ids, found dtype {array.dtype}")
    if not integer and array.dtype != bool:
        raise ValueError(f"{name}: expected bools, found dtype {array.dtype}")
    return array.astype(np.int64 if integer else bool)


def hash_ngrams(
    token_ids,
    layout: EngramLayout,
    vocab: TokenCompressor,
    dead_mask=None,
) -> np.ndarray:
    """Hash ids of one whole sequence: a numpy int64 array ``[T, L, C]`` (the reference;
    :class:`~engram.hashing.NgramHasher` gives the same ids as an int32 tensor).

    ``token_ids``: ``T`` integer token ids, 1-D (a list, numpy array or CPU tensor);
    ``dead_mask``: ``T`` bools or None. Float, bool or n-D ids are refused, as
    :class:`~engram.hashing.NgramHasher` refuses them.

    ``ids[t, l, (s-1)*H + h] = rolling_s % prime[l][s-1][h] + offset[l][(s-1)*H + h]``
    with ``rolling_s = XOR_{k<=s} window[t, k] * multiplier[l][k]``.
    """
    spec = layout.spec
    token_ids = _as_1d(token_ids, "token_ids", integer=True)
    dead = np.zeros(token_ids.shape, dtype=bool) if dead_mask is None else _as_1d(dead_mask, "dead_mask", integer=False)
    if dead.shape != token_ids.shape:
        raise ValueError(f"dead_mask: expected shape {list(token_ids.shape)}, found {list(dead.shape)}")
    pad_id = int(vocab.token_map[spec.pad_token_id])
    windows = ngram_windows(vocab.compress(token_ids), dead, spec.max_ngram_size, pad_id)

    heads = spec.n_heads
    ids = np.empty((token_ids.shape[0], spec.num_layers, spec.num_columns), dtype=np.int64)
    for layer in range(spec.num_layers):
        multipliers = layout.multipliers[layer]
        rolling = windows[:, 0] * multipliers[0]
        for shift in range(1, spec.max_ngram_size):
            rolling = rolling ^ (windows[:, shift] * multipliers[shift])
            for head in range(heads):
                column = (shift - 1) * heads + head
                ids[:, layer, column] = rolling % layout.column_primes[layer, column] + layout.column_offsets[layer, column]
    return ids
