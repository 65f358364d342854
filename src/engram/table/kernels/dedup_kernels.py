"""Triton kernels that find a lookup's distinct rows on the device (no host sync).

Only ``@triton.jit`` functions live here; :mod:`engram.table.kernels.dedup` launches them
around a ``torch.sort`` and :func:`engram.table.kernels.reference.distinct_rows_reference` is
their plain-torch reference. Every program works on its own ``BLOCK`` of the sorted ids;
block offsets come from a ``torch.cumsum`` between two launches, so no program waits
on another.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def local_rows_kernel(ids_ptr, local_ptr, total, columns, stride_token, stride_column, row_start, num_rows,
                      BLOCK: tl.constexpr, WRITE_COUNT: tl.constexpr):
    """``local[i] = id - row_start`` if ``0 <= id - row_start < num_rows`` else ``num_rows`` (int32),
    ``id = ids[i // columns, i % columns]`` through the ids' strides; with ``WRITE_COUNT`` program 0
    also stores ``total`` at ``local[total]`` (every id its own row: the count of a lookup-order gather)."""
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    token, column = offsets // columns, offsets % columns
    ids = tl.load(ids_ptr + token * stride_token + column * stride_column, mask=mask, other=0).to(tl.int64)
    local = ids - row_start
    local = tl.where((local >= 0) & (local < num_rows), local, num_rows)
    tl.store(local_ptr + offsets, local.to(tl.int32), mask=mask)
    if WRITE_COUNT:
        count = (tl.zeros([BLOCK], dtype=tl.int64) + total).to(tl.int32)
        tl.store(local_ptr + total + tl.arange(0, BLOCK), count, mask=offsets == 0)  # lane 0 of program 0


@triton.jit
def _firsts(ordered_ptr, offsets, mask):
    """``(row, first)``: the sorted row at ``offsets`` and whether it differs from its left neighbour."""
    row = tl.load(ordered_ptr + offsets, mask=mask, other=0)
    left = tl.load(ordered_ptr + offsets - 1, mask=mask & (offsets > 0), other=-1)  # rows are >= 0
    return row, (row != left) & mask


@triton.jit
def count_firsts_kernel(ordered_ptr, rank_ptr, block_count_ptr, total, BLOCK: tl.constexpr):
    """Per block: ``rank[i]`` = distinct rows in the block up to ``i`` (inclusive, int32),
    ``block_count[block]`` = distinct rows that start in the block."""
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    _, first = _firsts(ordered_ptr, offsets, mask)
    first = first.to(tl.int32)
    tl.store(rank_ptr + offsets, tl.cumsum(first, axis=0), mask=mask)
    tl.store(block_count_ptr + block, tl.sum(first, axis=0))


@triton.jit
def scatter_distinct_kernel(ordered_ptr, order_ptr, rank_ptr, block_count_ptr, block_end_ptr, rows_ptr,
                            inverse_ptr, total, num_blocks, BLOCK: tl.constexpr):
    """``slot = block_end[block] - block_count[block] + rank[i] - 1``; ``rows[slot] = ordered[i]``
    where ``i`` starts a run of equal rows; ``inverse[order[i]] = slot``; program 0 writes the
    number of distinct rows at ``rows[total]``."""
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    row, first = _firsts(ordered_ptr, offsets, mask)
    before = tl.load(block_end_ptr + block) - tl.load(block_count_ptr + block)
    slot = before + tl.load(rank_ptr + offsets, mask=mask, other=1) - 1
    slot = tl.minimum(tl.maximum(slot, 0), total - 1).to(tl.int64)  # in bounds whatever the inputs
    tl.store(rows_ptr + slot, row, mask=first)
    lookup = tl.load(order_ptr + offsets, mask=mask, other=0)
    tl.store(inverse_ptr + lookup, slot.to(tl.int32), mask=mask & (lookup >= 0) & (lookup < total))
    count = tl.load(block_end_ptr + num_blocks - 1)
    tl.store(rows_ptr + total, count, mask=block == 0)
