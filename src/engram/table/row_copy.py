"""Host row copy: ``out[i] = table[ids[i]]`` by ``torch.index_select``, in waves.

:func:`start_gather_rows` checks its arguments and returns a :class:`RowGather` at once;
the rows are copied by :meth:`RowGather.wait`, on the waiting thread, one wave (a
consecutive range of rows) at a time: ``wait(wave)`` copies the waves up to ``wave`` not yet
copied. A caller that enqueues each wave's device copy after its ``wait`` overlaps that copy
with the next wave's gather (:class:`engram.table.host_gather.HostGather` does).

``index_select`` runs on the waiting thread's torch intra-op threads (OpenMP), whose number
the engine sets; this module changes no thread setting. On the H200's host (16 vCPUs, 34 GiB
table of 272-byte rows on 2 MiB pages) it gathers 196,608 distinct rows in 3.0 ms on 14-16
threads (benchmarks/NOTES.md "Host tables v3"). No thread other than the waiter's ever
writes ``out``.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
import torch

__all__ = ["start_gather_rows", "gather_rows", "RowGather"]


def _check_tensors(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    for name, tensor in (("table", table), ("ids", ids), ("out", out)):
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, found one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, found shape {list(tensor.shape)} with strides "
                             f"{list(tensor.stride())}")
    if table.dtype != torch.uint8 or table.dim() != 2:
        raise ValueError(f"table: expected uint8 [rows, row_bytes], found {table.dtype} {list(table.shape)}")
    if table.shape[1] == 0:
        raise ValueError("table: expected rows of at least one byte, found row_bytes 0")
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise ValueError(f"ids: expected int64 (or int32) [N], found {ids.dtype} {list(ids.shape)}")
    expected = [ids.shape[0], table.shape[1]]
    if out.dtype != torch.uint8 or list(out.shape) != expected:
        raise ValueError(f"out: expected uint8 {expected} (ids' length, table's row bytes), found {out.dtype} "
                         f"{list(out.shape)}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected an integer >= 1, found {threads!r}")


def _check_wave_ends(wave_ends: Sequence[int] | None, num_rows: int) -> list[int]:
    if wave_ends is None:
        return [num_rows]
    given = list(wave_ends)
    problem = not given or any(isinstance(end, (bool, np.bool_)) or not hasattr(end, "__index__") for end in given)
    ends = [] if problem else [operator.index(end) for end in given]
    if problem or ends[-1] != num_rows or any(b < a for a, b in zip([0, *ends[:-1]], ends)):
        raise ValueError(f"wave_ends: expected ascending integers in [0, {num_rows}] ending at {num_rows} (the ids' "
                         f"length), found {given}")
    return ends


class RowGather:
    """A started gather of ``table`` uint8 ``[rows, row_bytes]`` rows ``ids`` int64/int32 ``[N]``
    into ``out`` uint8 ``[N, row_bytes]``, split at ``wave_ends``; nothing is copied before
    :meth:`wait`."""

    def __init__(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, wave_ends: list[int]):
        self._table, self._ids, self._out = table, ids, out
        self._wave_ends = wave_ends
        self._waves_done = 0  # waves copied so far (always the first ones)

    @property
    def num_waves(self) -> int:
        return len(self._wave_ends)

    def wait(self, wave: int | None = None) -> None:
        """Copy the rows of waves ``0..wave`` (every wave when None) not yet copied, on this
        thread; returns once they are in ``out``. Raises ``IndexError`` naming the first id
        outside the table (the wave holding it stays not done; earlier waves are copied)."""
        last = self.num_waves - 1 if wave is None else wave
        if not 0 <= last < self.num_waves:
            raise ValueError(f"wave: expected 0 <= wave < {self.num_waves}, found {wave}")
        while self._waves_done <= last:
            index = self._waves_done
            begin = 0 if index == 0 else self._wave_ends[index - 1]
            self._copy(begin, self._wave_ends[index])
            self._waves_done += 1

    def join(self) -> None:
        """Return once no thread other than the waiter's writes ``out``: at once, as none ever
        does (kept for cleanup after an error). Waves not yet waited for stay uncopied."""

    def _copy(self, begin: int, end: int) -> None:
        wave_ids = self._ids[begin:end]
        try:
            torch.index_select(self._table, 0, wave_ids, out=self._out[begin:end])
        except IndexError as error:
            outside = ((wave_ids < 0) | (wave_ids >= self._table.shape[0])).nonzero()
            if outside.numel() == 0:
                raise
            position = begin + int(outside[0, 0])
            raise IndexError(f"ids[{position}] = {int(self._ids[position])} is outside the table's "
                             f"{self._table.shape[0]} rows") from error


def start_gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int, *,
                      wave_ends: Sequence[int] | None = None) -> RowGather:
    """Start ``out[i] = table[ids[i]]`` (bit for bit ``torch.index_select(table, 0, ids)``) and
    return at once; the copy runs in :meth:`RowGather.wait`.

    ``table`` uint8 ``[rows, row_bytes]``, ``ids`` int64 or int32 ``[N]`` in ``[0, rows)``, ``out``
    uint8 ``[N, row_bytes]``: contiguous CPU tensors (``out`` not overlapping ``table``),
    unchanged until the gather is waited for. ``threads``: an integer >= 1, checked only
    (``index_select`` copies on torch's intra-op threads). ``wave_ends``: ascending row counts
    ending at ``N`` (waves ``[0, e0), [e0, e1), ...``; None: one wave). Raises ``ValueError``
    naming a bad argument before anything is copied.
    """
    _check_tensors(table, ids, out, threads)
    return RowGather(table, ids, out, _check_wave_ends(wave_ends, ids.shape[0]))


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """``out[i] = table[ids[i]]`` (arguments as :func:`start_gather_rows`); returns when done.
    Raises ``ValueError`` naming a bad argument, ``IndexError`` naming an id outside the table."""
    start_gather_rows(table, ids, out, threads).wait()
