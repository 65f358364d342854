"""Distinct table rows of a lookup, found on the device without a host sync.

The host gather (:mod:`engram.table.host_memory.gather`) fetches each distinct row once, in
ascending row order (neighbouring rows share host pages and TLB entries), and the
consumer reads the gathered rows back in token order through ``inverse``. Everything
here has a fixed size, so the caller's stream never waits for the host: the number of
distinct rows travels to the host with the row ids.

Five launches: the local row ids (:func:`~engram.table.kernels.dedup_kernels.local_rows_kernel`),
``torch.sort``, per-block counts of distinct rows, ``torch.cumsum`` of those counts,
and the scatter of rows and ``inverse``. H200 host: the torch-only version of these
steps (about 20 operators) cost 380 us of launch time per call at T = 8192.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.triton_launch import CompiledLaunch, interpreting
from engram.table.kernels.dedup_kernels import count_firsts_kernel, local_rows_kernel, scatter_distinct_kernel
from engram.table.kernels.reference import distinct_rows_reference, rows_in_lookup_order_reference

__all__ = ["DistinctRows", "distinct_rows", "rows_in_lookup_order"]

_BLOCK = 1024
_LOCAL_ROWS = CompiledLaunch(local_rows_kernel)
_COUNT_FIRSTS = CompiledLaunch(count_firsts_kernel)
_SCATTER_DISTINCT = CompiledLaunch(scatter_distinct_kernel)


@dataclass
class DistinctRows:
    """``rows_and_count int32 [N + 1]``: the distinct local row ids ascending in
    ``[:count]``, ``count`` at ``[N]``, unspecified values between; ``inverse int32 [N]``:
    ``rows_and_count[inverse[i]]`` is lookup ``i``'s row."""

    rows_and_count: torch.Tensor
    inverse: torch.Tensor


def _check_out(name: str, out: torch.Tensor, length: int, device: torch.device) -> None:
    if out.dtype != torch.int32 or out.shape != (length,) or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{name}: expected a contiguous int32 [{length}] tensor on {device}, found "
                         f"{out.dtype} {list(out.shape)} on {out.device}")


def _checked_total(global_ids: torch.Tensor, num_rows: int) -> int:
    """The number of ids, after checking the table size (int32 row ids) and the ids' shape and count."""
    if not 0 < num_rows < 2**31 - 1:
        raise ValueError(f"num_rows: expected 0 < num_rows < 2**31 - 1 (int32 row ids), found {num_rows}")
    if global_ids.dim() != 2:
        raise ValueError(f"global_ids: expected [T, C], found shape {list(global_ids.shape)}")
    total = global_ids.numel()
    if total >= 2**31 - _BLOCK:
        raise ValueError(f"global_ids: {total} ids; expected fewer than 2**31")
    return total


def distinct_rows(global_ids: torch.Tensor, row_start: int, num_rows: int,
                  out: DistinctRows | None = None) -> DistinctRows:
    """Distinct rows of ``global_ids`` (int32/int64 ``[T, C]``, any strides) in a table of
    ``num_rows`` rows starting at global row ``row_start``; ids outside the table become row
    ``num_rows`` (the packed zero row).

    ``local = clamp(id - row_start)``; ``rows = sorted(set(local))``; ``rows[inverse[i]] = local[i]``.
    Triton kernels on CUDA tensors (and under the interpreter), else
    :func:`~engram.table.kernels.reference.distinct_rows_reference`. ``num_rows`` must be below 2**31 - 1.
    ``out``: buffers of those shapes on the ids' device to write instead of fresh ones (a captured gather's,
    kept for its graph).
    """
    total = _checked_total(global_ids, num_rows)
    if out is not None:
        _check_out("out.rows_and_count", out.rows_and_count, total + 1, global_ids.device)
        _check_out("out.inverse", out.inverse, total, global_ids.device)
    if total == 0 or not (global_ids.is_cuda or interpreting()):
        found = DistinctRows(*distinct_rows_reference(global_ids, row_start, num_rows))
        if out is None:
            return found
        out.rows_and_count.copy_(found.rows_and_count)
        out.inverse.copy_(found.inverse)
        return out
    device = global_ids.device
    device_index = device.index if global_ids.is_cuda else 0
    blocks = -(-total // _BLOCK)
    local = torch.empty(total, dtype=torch.int32, device=device)
    ints = (total, global_ids.shape[1], global_ids.stride(0), global_ids.stride(1), row_start, num_rows)
    _LOCAL_ROWS(blocks, (global_ids, local, *ints, _BLOCK, False), num_warps=4, device_index=device_index)
    ordered, order = torch.sort(local)
    rank = torch.empty(total, dtype=torch.int32, device=device)
    block_count = torch.empty(blocks, dtype=torch.int32, device=device)
    _COUNT_FIRSTS(blocks, (ordered, rank, block_count, total, _BLOCK), num_warps=4, device_index=device_index)
    block_end = torch.cumsum(block_count, 0, dtype=torch.int32)
    rows_and_count = torch.empty(total + 1, dtype=torch.int32, device=device) if out is None else out.rows_and_count
    inverse = torch.empty(total, dtype=torch.int32, device=device) if out is None else out.inverse
    _SCATTER_DISTINCT(blocks, (ordered, order, rank, block_count, block_end, rows_and_count, inverse, total, blocks,
                               _BLOCK), num_warps=4, device_index=device_index)
    return DistinctRows(rows_and_count, inverse)


def rows_in_lookup_order(global_ids: torch.Tensor, row_start: int, num_rows: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Every lookup's local row, in lookup order, with their number: ``rows_and_count int32 [N + 1]``,
    ``local`` as in :func:`distinct_rows` in ``[:N]`` and ``N`` at ``[N]``. The host gather's form for
    lookups with few repeats: one launch (the sort and four launches of :func:`distinct_rows` skipped),
    every id's row copied; the inverse is the identity. ``global_ids`` int32/int64 ``[T, C]``; ``out``: an
    ``int32 [N + 1]`` buffer on the ids' device to write instead of a fresh one."""
    total = _checked_total(global_ids, num_rows)
    if out is not None:
        _check_out("out", out, total + 1, global_ids.device)
    if total == 0 or not (global_ids.is_cuda or interpreting()):
        found = rows_in_lookup_order_reference(global_ids, row_start, num_rows)
        return found if out is None else out.copy_(found)
    rows_and_count = torch.empty(total + 1, dtype=torch.int32, device=global_ids.device) if out is None else out
    ints = (total, global_ids.shape[1], global_ids.stride(0), global_ids.stride(1), row_start, num_rows)
    _LOCAL_ROWS(-(-total // _BLOCK), (global_ids, rows_and_count, *ints, _BLOCK, True), num_warps=4,
                device_index=global_ids.device.index if global_ids.is_cuda else 0)
    return rows_and_count
