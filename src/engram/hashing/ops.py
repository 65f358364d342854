"""Torch ops shared by the batch hasher: n-gram windows -> hash ids.

The Triton hash kernel (:mod:`engram.hashing.kernels`) gives the same ids; these
are its torch twin (the hasher's CPU path), vectorized over tokens, layers and heads.
"""

from __future__ import annotations

import torch

__all__ = ["block_windows", "hash_windows"]


def block_windows(values: torch.Tensor, dead: torch.Tensor, pad_id: int) -> torch.Tensor:
    """int64 ``[T, N]``: ``values`` with every blocked shift set to ``pad_id``.

    ``dead [T, N]`` bool marks shifts whose source is dead or unavailable;
    blocking spreads to every larger shift (a cumulative OR along N).
    """
    blocked = torch.cummax(dead.to(torch.int8), dim=1).values.bool()
    return torch.where(blocked, torch.full_like(values, pad_id), values)


def hash_windows(
    windows: torch.Tensor,
    multipliers: torch.Tensor,
    column_primes: torch.Tensor,
    column_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """Hash ids ``[T, L, C]`` of n-gram windows ``[T, N]`` int64.

    ``rolling_s = XOR_{k<=s} windows[:, k] * multipliers[l, k]`` (int64, no
    overflow by construction); column ``(s-1)*H + h`` is
    ``rolling_s % prime + offset``. ``multipliers`` int64 ``[L, N]``;
    ``column_primes``/``column_offsets`` int64 ``[L, C]``.
    """
    num_tokens, max_ngram_size = windows.shape
    num_layers, num_columns = column_primes.shape
    heads = num_columns // (max_ngram_size - 1)
    products = windows[:, None, :] * multipliers[None, :, :]  # [T, L, N]
    rolling = products[..., 0]
    per_order = []
    for shift in range(1, max_ngram_size):
        rolling = rolling ^ products[..., shift]
        per_order.append(rolling)
    rolling_by_column = torch.stack(per_order, dim=-1).repeat_interleave(heads, dim=-1)  # [T, L, C]
    ids = torch.remainder(rolling_by_column, column_primes) + column_offsets
    return ids.to(out_dtype)
