"""Distinct table rows of a lookup, found on the device without a host sync.

The host gather (:mod:`engram.table.host_gather`) fetches each distinct row once, in
ascending row order (neighbouring rows share host pages and TLB entries), and the
consumer reads the gathered rows back in token order through ``inverse``. Everything
here has a fixed size, so the caller's stream never waits for the host: the number of
distinct rows travels to the host with the row ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DistinctRows", "distinct_rows"]


@dataclass
class DistinctRows:
    """``rows_and_count int32 [N + 1]``: the distinct local row ids ascending in
    ``[:count]``, ``count`` at ``[N]``, unspecified values between; ``inverse int32 [N]``:
    ``rows_and_count[inverse[i]]`` is lookup ``i``'s row."""

    rows_and_count: torch.Tensor
    inverse: torch.Tensor


def distinct_rows(global_ids: torch.Tensor, row_start: int, num_rows: int) -> DistinctRows:
    """Distinct rows of ``global_ids`` (int32/int64, any shape) in a table of ``num_rows``
    rows starting at global row ``row_start``; ids outside ``[row_start, row_start + num_rows)``
    become row ``num_rows`` (the packed zero row).

    ``local = clamp(id - row_start)``; ``rows = sorted(set(local))``; ``rows[inverse[i]] = local[i]``.
    Runs on the ids' device with fixed-size outputs (no sync). ``num_rows`` must be below 2**31 - 1.
    """
    if not 0 < num_rows < 2**31 - 1:
        raise ValueError(f"num_rows: expected 0 < num_rows < 2**31 - 1 (int32 row ids), found {num_rows}")
    count = global_ids.numel()
    local = global_ids.reshape(-1).to(torch.int64) - row_start
    local = torch.where((local >= 0) & (local < num_rows), local, num_rows).to(torch.int32)
    ordered, order = torch.sort(local)
    is_first = torch.empty(count, dtype=torch.bool, device=local.device)
    is_first[:1] = True
    torch.ne(ordered[1:], ordered[:-1], out=is_first[1:])
    slot = torch.cumsum(is_first, 0, dtype=torch.int32)  # 1-based position among the distinct rows
    rows_and_count = torch.empty(count + 1, dtype=torch.int32, device=local.device)
    rows_and_count[count:] = slot[-1:] if count else 0
    slot -= 1
    rows_and_count.scatter_(0, slot.to(torch.int64), ordered)  # equal values for equal slots
    inverse = torch.empty(count, dtype=torch.int32, device=local.device)
    inverse.scatter_(0, order, slot)
    return DistinctRows(rows_and_count, inverse)
