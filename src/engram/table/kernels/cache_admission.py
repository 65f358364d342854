"""Launcher of the row cache's between-steps update (:mod:`engram.table.kernels.cache_admission_kernels`).

:func:`admit_step` runs one step of the policy for a :class:`~engram.table.placements.row_cache.RowCache`
with the step's local ids: five fixed-size launches (six with the frequency score) on the current
stream, no sort, no host sync, nothing allocated once the work buffers fit, so it can be captured in a
CUDA graph and replayed with fresh ids. Same result, slot for slot and byte for byte, as
:meth:`RowCache.update_with_torch <engram.table.placements.row_cache.RowCache.update_with_torch>`.
"""

from __future__ import annotations

import functools

import torch

from engram.table.kernels.cache_admission_kernels import (admit_kernel, ages_kernel, clear_table_kernel,
                                                          copy_admitted_kernel, count_rows_kernel,
                                                          rank_candidates_kernel)
from engram.triton_launch import CompiledLaunch, interpreting

__all__ = ["AdmissionBuffers", "admit_step"]

_LAUNCHERS = {kernel: CompiledLaunch(kernel) for kernel in (
    ages_kernel, count_rows_kernel, rank_candidates_kernel, admit_kernel, copy_admitted_kernel, clear_table_kernel)}
_ID_BLOCK = 256
_ENTRY_BLOCK = 512
_AGE_BLOCK = 2048
# Programs of steps 3 and 4, striding over the touched sets. Each of a program's sets
# is a chain of dependent loads: with 1,024 programs steps 3-4 took 170 + 510 us at T = 8192 (190 k touched sets,
# admitted from the staging) on the H200.
_ADMIT_PROGRAMS = 16384
# Beside the step (an update on its own stream while the decoder's layers run), an update that reads its rows
# from host memory uses at most this many programs per SM in steps 3-4: their programs wait on host reads for
# milliseconds. With 8,192 of them the overlapped update still cost cached +3.0% over host at prefill T = 8192 on
# the H200 (benchmarks/NOTES.md "An HBM cache beside the step"). One given the lookup's staging reads HBM only.
_BESIDE_PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class AdmissionBuffers:
    """A cache's work buffers for steps of up to :attr:`capacity` ids: the counting table (``keys``,
    ``counts``, ``staged_at`` ``int32 [P + 1]``), the touched sets (``int64 [capacity]``) and their count, per set the
    candidates' top list (``int64 [sets, ways]``) and the last step that listed it (``int64 [sets]``), and
    the device step counter (``int64 [1]``). Each launch leaves what it used empty for the next step."""

    def __init__(self, cache, capacity: int, step: int):
        device = cache.device
        self.capacity = capacity
        self.table_size = table_size_for(capacity)
        self.keys = torch.full((self.table_size + 1,), -1, dtype=torch.int32, device=device)
        self.counts = torch.zeros(self.table_size + 1, dtype=torch.int32, device=device)
        self.staged_at = torch.full((self.table_size + 1,), -1, dtype=torch.int32, device=device)
        self.from_staging = torch.zeros(1, dtype=torch.int64, device=device)
        """``int64 [1]``: rows admitted from a lookup's staging (not the backing rows), summed over steps."""
        self.touched = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.touched_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.best = torch.full((cache.num_sets * cache.ways,), -1, dtype=torch.int64, device=device)
        self.stamps = torch.zeros(cache.num_sets, dtype=torch.int64, device=device)
        self.step = torch.full((1,), step, dtype=torch.int64, device=device)
        self.dirty = False  # set while a step's launches are being issued: one that failed leaves it set


def table_size_for(num_ids: int) -> int:
    """Entries of the counting table for a step of ``num_ids`` ids: a power of two, at most a quarter full (a
    program of step 1 waits for its longest probe chain: 25 us for 1,536 ids in 4,096 entries on the H200)."""
    return 1 << max(4, (4 * num_ids - 1).bit_length())


def admit_step(cache, local_ids: torch.Tensor, back_values: torch.Tensor, back_scales: torch.Tensor,
               staged: torch.Tensor | None = None, inverse: torch.Tensor | None = None, *,
               beside: bool = False) -> None:
    """One step of ``cache``'s policy (:mod:`engram.table.placements.row_cache`) for the reads ``local_ids
    int32/int64 [N]`` (contiguous, on the cache's device; ids outside ``[0, rows)`` are ignored), admitting
    rows from ``back_values uint8 [rows, D]`` / ``back_scales uint8 [rows, D // 32]``, or from ``staged uint8
    [S, row_bytes]`` (tagged packed rows, row-contiguous) at ``inverse int32 [N]`` (None: row ``i`` for id ``i``)
    where that staging row's tag is the id's row (same bytes either way). The caller (the cache) has checked the arguments and keeps the
    buffers; under CUDA-graph capture they must already fit. ``beside``: the update runs on a stream beside the step's
    work (steps 3-4 then take few programs, :data:`_BESIDE_PROGRAMS_PER_SM`)."""
    num_ids = local_ids.numel()
    buffers = cache.admission_buffers(num_ids)
    # The step's own prefix of the table: a decode step after a prefill-sized one scans and clears 4 K entries,
    # not the prefill's millions. Its trash entry (index table_size, also an entry of a longer prefix) is never
    # written, so every prefix stays empty between steps.
    table_size = table_size_for(num_ids)
    has_staged = staged is not None and num_ids > 0
    device_index = local_ids.device.index if local_ids.is_cuda else 0
    step_launch = dict(num_warps=4, device_index=device_index)
    buffers.dirty = True
    if not cache.recency:
        counters = cache.counters_with_trash
        grid = -(-counters.numel() // _AGE_BLOCK)
        _LAUNCHERS[ages_kernel](grid, (counters, counters.numel(), buffers.step, cache.aging_interval, _AGE_BLOCK),
                               **step_launch)
    if num_ids:
        _LAUNCHERS[count_rows_kernel](
            -(-num_ids // _ID_BLOCK),
            (local_ids, num_ids, back_values.shape[0], buffers.keys, buffers.counts, table_size, cache.stats,
             buffers.touched_count, inverse if has_staged and inverse is not None else buffers.staged_at,
             buffers.staged_at, has_staged, inverse is None, _ID_BLOCK), **step_launch)
        _LAUNCHERS[rank_candidates_kernel](
            -(-table_size // _ENTRY_BLOCK),
            (buffers.keys, buffers.counts, table_size, cache.tags_with_trash, cache.counters_with_trash,
             cache.num_sets, buffers.step, buffers.best, buffers.stamps, buffers.touched, buffers.touched_count,
             cache.stats, cache.recency, cache.ways, _ENTRY_BLOCK), **step_launch)
    most = _ADMIT_PROGRAMS
    if interpreting():
        most = 2
    elif beside and local_ids.is_cuda and not has_staged:
        most = _multiprocessors(device_index) * _BESIDE_PROGRAMS_PER_SM
    programs = max(1, min(num_ids, cache.num_sets, most))
    head_dim = cache.head_dim
    groups = head_dim // 32
    slot_rows = cache.slot_rows
    if not num_ids:
        buffers.touched_count.zero_()  # step 1 zeroes it: no step 1 ran
    _LAUNCHERS[admit_kernel](
        programs,
        (buffers.touched, buffers.touched_count, buffers.best, cache.tags_with_trash, cache.counters_with_trash,
         buffers.step, programs, cache.ways), **step_launch)
    _LAUNCHERS[copy_admitted_kernel](
        programs,
        (buffers.touched, buffers.touched_count, cache.tags_with_trash, slot_rows, slot_rows.stride(0), back_values,
         back_scales, back_values.stride(0), back_scales.stride(0), programs, buffers.keys, buffers.staged_at,
         table_size, staged if has_staged else slot_rows, (staged if has_staged else slot_rows).stride(0),
         staged.shape[0] if has_staged else 0,
         buffers.from_staging, head_dim, 1 << (groups - 1).bit_length(), slot_rows.shape[1], cache.ways, has_staged),
        **step_launch)
    if num_ids:
        _LAUNCHERS[clear_table_kernel](-(-table_size // _ENTRY_BLOCK),
                                       (buffers.keys, buffers.counts, buffers.staged_at, table_size,
                                        _ENTRY_BLOCK), **step_launch)
    buffers.dirty = False
