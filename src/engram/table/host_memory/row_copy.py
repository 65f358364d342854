"""Host row copy: ``out[i] = table[ids[i]]``, in waves, on exactly ``threads`` threads.

:func:`start_gather_rows` checks its arguments and returns a :class:`RowGather` at once;
the rows are copied by :meth:`RowGather.wait`, one wave (a consecutive range of rows) at a
time: ``wait(wave)`` copies the waves up to ``wave`` not yet copied. A caller that enqueues
each wave's device copy after its ``wait`` overlaps that copy with the next wave's gather
(:class:`engram.table.host_memory.gather.HostGather` does).

Each wave is one ``index_select`` on a library thread (the waiting thread if it is one, else the
library's copy thread) whose OpenMP team is ``threads`` large (:mod:`openmp_team`): the engine's
threads and torch's process-wide count are left as they are. H200 host (16 vCPUs), 196,608 random
rows of 272 B from an 8.2 GB pinned table: ``index_select`` on 16 threads 2.2 ms, against
``numpy.take`` over 16 pool threads 8.2 ms and on one thread 12.9 ms (numpy's take scales 1.6x
from 1 to 16 threads there; benchmarks/NOTES.md "Host row copy"). Where torch's threads cannot be
set per thread (no OpenMP runtime), a wave of more than ``2 * MIN_ROWS_PER_THREAD`` rows is split
into ``threads`` parts copied by ``numpy.take`` (which releases the GIL) on the waiting thread and a
persistent pool of ``threads - 1``. ``wait`` returns only once the wave is copied, so no thread
writes ``out`` after it. A gather of random rows from DRAM is latency-bound, one row in flight per
thread.
"""

from __future__ import annotations

import concurrent.futures
import operator
import os
import threading
from typing import Sequence

import numpy as np
import torch

from engram.checks import check_int
from engram.table.host_memory import openmp_team
from engram.tuning import tuning

__all__ = ["start_gather_rows", "gather_rows", "RowGather", "MIN_ROWS_PER_THREAD"]

# ~0.5 MB of 272-byte rows: a part worth a thread hand-off (tens of us); engram.tuning, row_copy.*.
MIN_ROWS_PER_THREAD = tuning().row_copy.min_rows_per_thread

_POOL: list[tuple[concurrent.futures.ThreadPoolExecutor, int, int]] = []  # (pool, its threads, process id)
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy threads (persistent), replaced by a larger pool when more are asked for
    (the old one finishes its queued parts) and anew in a forked child."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0][1] < threads or _POOL[0][2] != os.getpid():
            previous = _POOL[0][0] if _POOL and _POOL[0][2] == os.getpid() else None
            _POOL[:] = [(concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="engram-row-copy"), threads,
                         os.getpid())]
            if previous is not None:
                previous.shutdown(wait=False)
        return _POOL[0][0]


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
    check_int("threads", threads, 1)


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

    def __init__(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, wave_ends: list[int],
                 threads: int = 1):
        self._table, self._ids, self._out = table, ids, out
        self._threads = threads
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
        """Return once no thread writes ``out``: at once, as every part of a wave has finished when
        its ``wait`` returns (kept for cleanup after an error). Waves not yet waited for stay uncopied."""

    def _copy_part(self, begin: int, end: int) -> None:
        if end > begin:
            # mode="clip": `_copy` checked the ids already, and numpy buffers `out` under mode="raise"
            # (a temporary per part, then a second copy): 196,608 rows of an 8M-row table on a 2-core
            # VM 31 ms against 13 ms clipped (index_select 11 ms); H200 host, 14-16 threads: the host
            # path at T = 8192 took 28.7 ms buffered (benchmarks/NOTES.md "Host row copy").
            np.take(self._table.numpy(), self._ids[begin:end].numpy(), axis=0, out=self._out[begin:end].numpy(),
                    mode="clip")

    def _copy_in_team(self, begin: int, end: int) -> None:
        """One ``index_select`` of the wave on an OpenMP team of ``threads`` (a library thread's own)."""
        if not openmp_team.use(self._threads):
            raise RuntimeError(f"the host row copy could not set its thread's OpenMP team to {self._threads}")
        # Grad mode is per thread: a caller under torch.inference_mode() may hand this thread inference tensors,
        # which only inference mode may write.
        with torch.inference_mode():
            torch.index_select(self._table, 0, self._ids[begin:end], out=self._out[begin:end])

    def _copy(self, begin: int, end: int) -> None:
        # The bounds check in numpy, on this thread: torch's min/max of a wave (> 32k ids) run on its
        # OpenMP threads, which then spin and take cores from the copy threads.
        wave_ids = self._ids[begin:end].numpy()
        if wave_ids.size and (int(wave_ids.min()) < 0 or int(wave_ids.max()) >= self._table.shape[0]):
            outside = np.flatnonzero((wave_ids < 0) | (wave_ids >= self._table.shape[0]))  # numpy would wrap < 0
            position = begin + int(outside[0])
            raise IndexError(f"ids[{position}] = {int(self._ids[position])} is outside the table's "
                             f"{self._table.shape[0]} rows")
        if openmp_team.available():
            openmp_team.run_owned(lambda: self._copy_in_team(begin, end))
            return
        parts = min(self._threads, max(1, (end - begin) // MIN_ROWS_PER_THREAD))
        bounds = [begin + (end - begin) * k // parts for k in range(parts + 1)]
        futures = []
        if parts > 1:
            pool = _pool(parts - 1)
            futures = [pool.submit(self._copy_part, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        failure = None
        try:
            self._copy_part(bounds[0], bounds[1])
        except BaseException as error:
            failure = error
        for future in futures:  # every part finishes before this returns, failed or not
            error = future.exception()
            failure = failure or error
        if failure is not None:
            raise failure


def start_gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int, *,
                      wave_ends: Sequence[int] | None = None) -> RowGather:
    """Start ``out[i] = table[ids[i]]`` (bit for bit ``torch.index_select(table, 0, ids)``) and
    return at once; the copy runs in :meth:`RowGather.wait`.

    ``table`` uint8 ``[rows, row_bytes]``, ``ids`` int64 or int32 ``[N]`` in ``[0, rows)``, ``out``
    uint8 ``[N, row_bytes]``: contiguous CPU tensors (``out`` not overlapping ``table``),
    unchanged until the gather is waited for. ``threads``: the threads that copy (>= 1; the
    waiting thread is one of them). ``wave_ends``: ascending row counts
    ending at ``N`` (waves ``[0, e0), [e0, e1), ...``; None: one wave). Raises ``ValueError``
    naming a bad argument before anything is copied.
    """
    _check_tensors(table, ids, out, threads)
    return RowGather(table, ids, out, _check_wave_ends(wave_ends, ids.shape[0]), threads)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """``out[i] = table[ids[i]]`` (arguments as :func:`start_gather_rows`); returns when done.
    Raises ``ValueError`` naming a bad argument, ``IndexError`` naming an id outside the table."""
    start_gather_rows(table, ids, out, threads).wait()
