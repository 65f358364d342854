"""Plain-PyTorch reference of a table lookup, written for clarity.

The Triton gather kernels and every placement's lookups are tested against
:func:`lookup_reference`, bit for bit.
"""

from __future__ import annotations

import torch

from engram.table.fp8 import as_scale_bytes, as_value_bytes, dequantize_rows

__all__ = ["lookup_reference", "peer_lookup_reference", "distinct_rows_reference", "rows_in_lookup_order_reference"]


def lookup_reference(
    values: torch.Tensor,
    scales: torch.Tensor,
    hash_ids: torch.Tensor,
    row_start: int = 0,
    column_start: int = 0,
    column_end: int | None = None,
) -> torch.Tensor:
    """Read and dequantize the rows named by hash ids.

    ``out[t, j] = dequantize(values[id - row_start], scales[id - row_start])`` with
    ``id = hash_ids[t, column_start + j]`` when ``row_start <= id < row_start + rows``, else 0.

    Args:
        values: ``float8_e4m3fn [rows, D]``, the table rows ``[row_start, row_start + rows)``.
        scales: ``uint8 [rows, D // 32]`` UE8M0 bytes (``float8_e8m0fnu`` accepted).
        hash_ids: integer ``[T, C]`` global row ids of the layer's table.
        row_start: global row id of ``values[0]``.
        column_start, column_end: the hash columns to read (``column_end`` defaults to ``C``).

    Returns:
        ``bfloat16 [T, column_end - column_start, D]``; ids outside the rows read +0.
    """
    value_bytes = as_value_bytes(values, "values")
    scale_bytes = as_scale_bytes(scales, "scales")
    if hash_ids.dim() != 2:
        raise ValueError(f"hash_ids: expected shape [T, C], found {list(hash_ids.shape)}")
    if column_end is None:
        column_end = hash_ids.shape[1]
    num_rows, head_dim = value_bytes.shape

    global_ids = hash_ids[:, column_start:column_end].to(torch.int64)  # [T, C_local]
    local_ids = global_ids - row_start
    inside = (local_ids >= 0) & (local_ids < num_rows)  # [T, C_local]
    safe_ids = torch.where(inside, local_ids, torch.zeros_like(local_ids))

    gathered_values = value_bytes[safe_ids]  # [T, C_local, D] uint8
    gathered_scales = scale_bytes[safe_ids]  # [T, C_local, D // 32] uint8
    rows = dequantize_rows(gathered_values, gathered_scales, torch.bfloat16)  # [T, C_local, D]

    zeros = torch.zeros((), dtype=torch.bfloat16, device=rows.device)
    return torch.where(inside.unsqueeze(-1), rows, zeros)


def peer_lookup_reference(
    shards: list[torch.Tensor],
    head_dim: int,
    hash_ids: torch.Tensor,
    row_start: int = 0,
    column_start: int = 0,
    column_end: int | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A lookup of a table whose rows are split over packed shards (the peer gather's input).

    ``shards``: ``uint8 [owned_s, row_bytes]`` in row order (values ``[:D]``, scales ``[D:D + D // 32]``);
    the table is their concatenation. Returns ``(bfloat16 [T, C_local, D], (uint8 [T, C_local, D],
    uint8 [T, C_local, D // 32]))``: :func:`lookup_reference` of it, and the raw bytes (zeros for ids
    outside ``[row_start, row_start + rows)``).
    """
    table = torch.cat([shard.cpu() for shard in shards])
    groups = head_dim // 32
    value_bytes, scale_bytes = table[:, :head_dim], table[:, head_dim:head_dim + groups]
    rows = lookup_reference(value_bytes.view(torch.float8_e4m3fn), scale_bytes, hash_ids.cpu(), row_start,
                            column_start, column_end)
    column_end = hash_ids.shape[1] if column_end is None else column_end
    local = hash_ids[:, column_start:column_end].cpu().to(torch.int64) - row_start
    inside = ((local >= 0) & (local < table.shape[0])).unsqueeze(-1)
    safe = torch.where(inside.squeeze(-1), local, torch.zeros_like(local))
    packed_values = torch.where(inside, value_bytes[safe], torch.zeros((), dtype=torch.uint8))
    packed_scales = torch.where(inside, scale_bytes[safe], torch.zeros((), dtype=torch.uint8))
    return rows, (packed_values, packed_scales)


def distinct_rows_reference(global_ids: torch.Tensor, row_start: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of a lookup (:func:`engram.table.kernels.dedup.distinct_rows`).

    ``local = id - row_start`` if ``0 <= id - row_start < num_rows`` else ``num_rows``;
    returns ``(rows_and_count int32 [N + 1], inverse int32 [N])``: ``rows = sorted(set(local))``
    in ``[:count]``, ``count`` at ``[N]`` (zeros between), ``rows[inverse[i]] = local[i]``.
    """
    local = global_ids.reshape(-1).to(torch.int64) - row_start
    local = torch.where((local >= 0) & (local < num_rows), local, torch.full_like(local, num_rows))
    rows, inverse = torch.unique(local, sorted=True, return_inverse=True)
    rows_and_count = torch.zeros(local.numel() + 1, dtype=torch.int32, device=local.device)
    rows_and_count[: rows.numel()] = rows.to(torch.int32)
    rows_and_count[-1] = rows.numel()
    return rows_and_count, inverse.to(torch.int32)


def rows_in_lookup_order_reference(global_ids: torch.Tensor, row_start: int, num_rows: int) -> torch.Tensor:
    """Every lookup's local row and their number (:func:`engram.table.kernels.dedup.rows_in_lookup_order`):
    ``rows_and_count int32 [N + 1]``, ``local`` (as in :func:`distinct_rows_reference`) in ``[:N]``, ``N`` at ``[N]``."""
    local = global_ids.reshape(-1).to(torch.int64) - row_start
    local = torch.where((local >= 0) & (local < num_rows), local, torch.full_like(local, num_rows))
    rows_and_count = torch.empty(local.numel() + 1, dtype=torch.int32, device=local.device)
    rows_and_count[:-1] = local.to(torch.int32)
    rows_and_count[-1] = local.numel()
    return rows_and_count
