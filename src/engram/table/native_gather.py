"""Host row gather with software prefetch: ``native/row_gather.c``, compiled on first use.

``gather_rows_prefetch(table, ids, out, threads)`` copies ``out[i] = table[ids[i]]`` like
``torch.index_select(table, 0, ids, out=out)``, bit for bit, but keeps many row reads in
flight per thread: the C loop prefetches every cache line of the rows
:data:`PREFETCH_DISTANCE` ids ahead.

Why: torch's index_select copies one row after the other, one row in flight per thread,
so a gather of 196,608 distinct rows of 272 B from a 34 GiB table is bound by DRAM latency
(H200 host, 16 vCPU KVM: 2.4 ms, 22 GB/s on 14 threads; benchmarks/NOTES.md "Host tables
v2"). On a 2-vCPU AMD EPYC KVM (8 GiB table, 4 KiB pages, ``probe_row_gather.py``, NOTES
"Host tables v3"), one thread: torch 18.5-19.9 ms, this gather 10.7-12.5 ms (1.7x); two
threads: both near that VM's limit for random rows (5-6 GB/s). H200: not yet measured.

Threads: a gather of more than one block (:data:`BLOCK_ROWS`) on ``threads`` > 1 runs on a
persistent pool of Python threads, one task per thread per gather (each task is one ctypes
call, which releases the GIL): the threads claim blocks of rows from a shared atomic
counter, so a thread that starts late (a Python thread hand-off costs 35-55 us here and
60-210 us was seen on the H200 host) takes fewer blocks instead of delaying the end.
A gather may be split into waves (consecutive row ranges): ``RowGather.wait(wave)``
returns once that wave's rows are in ``out``, waited for in C (a futex), so a caller can
start copying a wave while the next is gathered. Smaller gathers, ``threads`` == 1 and the
torch fallback run inside ``wait``, on the waiting thread, one wave at a time. No OpenMP
(torch's libgomp keeps its own threads).

Build (:mod:`engram.table.native_build`): the system C compiler into the engram cache
directory. When there is no compiler or the build fails, one warning names the reason and
every call falls back to ``torch.index_select``. The C gather is opt-in:
``ENGRAM_HOST_GATHER=native`` (the default, ``torch``, runs ``index_select``, measured faster on the
H200's host). The choice is made once per process, at the first gather.
"""

from __future__ import annotations

import concurrent.futures
import functools
import operator
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .native_build import RowGatherLibrary, build_row_gather

__all__ = ["gather_rows_prefetch", "start_gather_rows", "RowGather", "native_gather_status", "PREFETCH_DISTANCE",
           "PREFETCH_LOCALITY", "STREAMING_STORES", "BLOCK_ROWS", "FORCE_TORCH_ENV"]

# "torch" (the default): torch.index_select; "native": this module's C gather. On the H200 host
# (16 vCPUs, KVM, 34 GiB table on 2 MiB pages; probe_row_gather.py, session 5) the C gather took
# 4.4-4.7 ms for 196,608 rows on 14-16 threads against index_select's 3.0 ms, and 2.8 ms against
# 0.9 ms as bench_host's stage: slower there, so it is opt-in until that is understood.
FORCE_TORCH_ENV = "ENGRAM_HOST_GATHER"

# Prefetch settings (probe_row_gather.py sweeps them). 2-vCPU AMD EPYC KVM, 8 GiB table, 4 KiB
# pages, one thread, speedup over torch: distance 8-64 alike (1.6-1.8x), 4 1.5x, 0 1.0x;
# locality 2 (prefetcht1) and 1 1.7x, 3 (prefetcht0) 1.4x, 0 1.5x; non-temporal stores 1.25-1.3x
# against 1.7x for plain ones (and on Intel they hold the fill buffers the prefetches need).
# H200: to measure (NOTES "Host tables v3").
PREFETCH_DISTANCE = 16  # rows ahead of the one being copied, per thread
PREFETCH_LOCALITY = 2   # __builtin_prefetch's: 3 = prefetcht0, 2 = prefetcht1, 1 = prefetcht2, 0 = prefetchnta
STREAMING_STORES = False  # non-temporal 16-byte stores into `out` (x86)
_STREAMING_FLAG = 1       # ENGRAM_STREAMING_STORES in row_gather.c

# Rows per claimed block: ~140 KB of 272 B rows, 30-60 us of copying per thread; a wave of
# 49,152 rows is 96 blocks. Gathers of at most one block run on the waiting thread.
BLOCK_ROWS = 512

_STATE_FIRST_FAILURE = 1  # row_gather.c's state words: next block, first failure, rows per wave
_STATE_WAVE_ROWS = 2
_NO_FAILURE = np.iinfo(np.int64).max
_CHECK_THREADS_NS = 50_000_000  # a waiter checks every 50 ms that the pool's tasks still run


@dataclass(frozen=True)
class _Loaded:
    library: RowGatherLibrary | None  # None: the torch fallback
    reason: str                       # why the fallback ("" when the library loaded)


_LOADED: list[_Loaded] = []
_LOAD_LOCK = threading.Lock()


def _load() -> _Loaded:
    choice = os.environ.get(FORCE_TORCH_ENV, "").strip().lower() or "torch"
    if choice not in ("torch", "native"):
        raise ValueError(f"{FORCE_TORCH_ENV}: expected 'torch' or 'native', found {choice!r}")
    if choice == "torch":
        return _Loaded(None, f"{FORCE_TORCH_ENV}=torch")
    library, reason = build_row_gather()
    if library is None:
        warnings.warn(f"engram host gather: the prefetching C gather is unavailable ({reason}); using "
                      "torch.index_select, which is slower for large lookups", RuntimeWarning, stacklevel=4)
    return _Loaded(library, reason)


def _library() -> RowGatherLibrary | None:
    """Built (or found) and loaded once per process; the fallback's warning comes once."""
    if not _LOADED:
        with _LOAD_LOCK:
            if not _LOADED:
                _LOADED.append(_load())
    return _LOADED[0].library


def native_gather_status() -> tuple[bool, str]:
    """``(True, path of the library)`` or ``(False, why the torch fallback is used)``; builds
    the library on the first call."""
    library = _library()
    return (True, str(library.path)) if library is not None else (False, _LOADED[0].reason)


_POOL: list[tuple[concurrent.futures.ThreadPoolExecutor, int, int]] = []  # (pool, its threads, process id)
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy threads (persistent), grown to ``threads`` when more are asked for
    (a replaced pool finishes its queued tasks, then its threads exit); a new one in a
    forked child (the parent's threads do not exist there)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0][1] < threads or _POOL[0][2] != os.getpid():
            previous = _POOL[0][0] if _POOL and _POOL[0][2] == os.getpid() else None
            _POOL[:] = [(concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="engram-row-gather"), threads,
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


def _settings(prefetch_distance: int | None, prefetch_locality: int | None,
              streaming_stores: bool | None) -> tuple[int, int, int]:
    """(distance, locality, options) for the C functions."""
    distance = PREFETCH_DISTANCE if prefetch_distance is None else prefetch_distance
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality
    streaming = STREAMING_STORES if streaming_stores is None else streaming_stores
    if isinstance(distance, bool) or not isinstance(distance, int) or distance < 0:
        raise ValueError(f"prefetch_distance: expected an integer >= 0, found {distance!r}")
    if locality not in (0, 1, 2, 3) or isinstance(locality, bool):
        raise ValueError(f"prefetch_locality: expected 0, 1, 2 or 3, found {locality!r}")
    return distance, locality, _STREAMING_FLAG if streaming else 0


def _block_plan(wave_ends: list[int]) -> np.ndarray:
    """int64 ``[blocks, 3]``: (begin, end, wave) of blocks of at most :data:`BLOCK_ROWS` rows,
    ascending, never across a wave's end."""
    starts = [0, *wave_ends[:-1]]
    plans = []
    for wave, (begin, end) in enumerate(zip(starts, wave_ends)):
        begins = np.arange(begin, end, BLOCK_ROWS, dtype=np.int64)
        plans.append(np.stack([begins, np.minimum(begins + BLOCK_ROWS, end), np.full_like(begins, wave)], axis=1))
    return np.ascontiguousarray(np.concatenate(plans))


class RowGather:
    """A started gather; :meth:`wait` returns once the rows of a wave (or all) are in ``out``.

    Either the pool copies (``futures``, ``state``: row_gather.c's shared words) or nothing
    runs until :meth:`wait`, which runs ``run_range(begin, end)`` (the C loop or
    ``index_select``) for each wave not yet done, on the waiting thread."""

    def __init__(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, wave_ends: list[int], *,
                 library: RowGatherLibrary | None = None, futures: list[concurrent.futures.Future] | None = None,
                 state: np.ndarray | None = None, plan: np.ndarray | None = None,
                 run_range: Callable[[int, int], int] | None = None):
        self._table, self._ids, self._out, self._plan = table, ids, out, plan  # alive while C reads them
        self._wave_ends = wave_ends
        self._library, self._futures, self._state = library, futures or [], state
        self._run_range = run_range
        self._waves_done = 0  # waves known complete (deferred: run) so far

    @property
    def num_waves(self) -> int:
        return len(self._wave_ends)

    def wait(self, wave: int | None = None) -> None:
        """Block until the rows of waves ``0..wave`` (every wave when None) are in ``out``.
        Raises ``IndexError`` naming the first id outside the table, once no thread still
        writes ``out``."""
        last = self.num_waves - 1 if wave is None else wave
        if not 0 <= last < self.num_waves:
            raise ValueError(f"wave: expected 0 <= wave < {self.num_waves}, found {wave}")
        while self._waves_done <= last:
            index = self._waves_done
            begin = 0 if index == 0 else self._wave_ends[index - 1]
            end = self._wave_ends[index]
            if self._run_range is not None:
                self._raise_if_failed(self._run_range(begin, end))
            else:
                self._wait_counter(index, end - begin)
                failure = int(self._state[_STATE_FIRST_FAILURE])
                if failure != _NO_FAILURE:
                    self.join()
                    self._raise_if_failed(int(self._state[_STATE_FIRST_FAILURE]))
            self._waves_done += 1
        if self._waves_done == self.num_waves:
            self.join()

    def _wait_counter(self, wave: int, rows: int) -> None:
        counter = self._state.ctypes.data + 8 * (_STATE_WAVE_ROWS + wave)
        while not self._library.wait_rows(counter, rows, _CHECK_THREADS_NS):
            if all(future.done() for future in self._futures):  # every task ended, the rows never came
                for future in self._futures:
                    future.result()  # raises what a task raised
                raise RuntimeError(f"host row gather: the pool's tasks ended with wave {wave} incomplete "
                                   f"({int(self._state[_STATE_WAVE_ROWS + wave])} of {rows} rows)")

    def join(self) -> None:
        """Wait until no pool thread works on this gather any more; never raises (for cleanup
        after an error). Waves not yet run on the waiting thread stay unrun."""
        concurrent.futures.wait(self._futures)

    def _raise_if_failed(self, position: int) -> None:
        if position >= 0:
            raise IndexError(f"ids[{position}] = {int(self._ids[position])} is outside the table's "
                             f"{self._table.shape[0]} rows")


def _c_range(library: RowGatherLibrary, table, ids, out, settings, begin: int, end: int) -> int:
    return library.gather_rows(table.data_ptr(), table.shape[0], table.shape[1], ids.data_ptr(), ids.element_size(),
                               out.data_ptr(), begin, end, *settings)


def _torch_range(table, ids, out, begin: int, end: int) -> int:
    torch.index_select(table, 0, ids[begin:end], out=out[begin:end])  # raises IndexError itself
    return -1


def _c_blocks(library: RowGatherLibrary, table, ids, out, plan: np.ndarray, state: np.ndarray, settings) -> None:
    library.gather_blocks(table.data_ptr(), table.shape[0], table.shape[1], ids.data_ptr(), ids.element_size(),
                          out.data_ptr(), plan.ctypes.data, plan.shape[0], state.ctypes.data, *settings)


def start_gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int, *,
                      wave_ends: Sequence[int] | None = None, prefetch_distance: int | None = None,
                      prefetch_locality: int | None = None, streaming_stores: bool | None = None) -> RowGather:
    """Start ``out[i] = table[ids[i]]`` and return at once (where it runs: the module docstring).

    ``table`` uint8 ``[rows, row_bytes]``, ``ids`` int64 or int32 ``[N]`` in ``[0, rows)``, ``out``
    uint8 ``[N, row_bytes]``: contiguous CPU tensors (``out`` not overlapping ``table``),
    unchanged until the gather is waited for. ``threads`` >= 1. ``wave_ends``: ascending row
    counts ending at ``N`` (waves ``[0, e0), [e0, e1), ...``; None: one wave), waited for one by
    one with :meth:`RowGather.wait`. ``prefetch_distance`` (rows ahead), ``prefetch_locality``
    and ``streaming_stores`` default to :data:`PREFETCH_DISTANCE`, :data:`PREFETCH_LOCALITY`
    and :data:`STREAMING_STORES`.
    """
    _check_tensors(table, ids, out, threads)
    ends = _check_wave_ends(wave_ends, ids.shape[0])
    settings = _settings(prefetch_distance, prefetch_locality, streaming_stores)
    library = _library()
    if library is None:
        return RowGather(table, ids, out, ends, run_range=functools.partial(_torch_range, table, ids, out))
    if threads == 1 or ids.shape[0] <= BLOCK_ROWS:
        return RowGather(table, ids, out, ends, run_range=functools.partial(_c_range, library, table, ids, out,
                                                                            settings))
    plan = _block_plan(ends)
    state = np.zeros(_STATE_WAVE_ROWS + len(ends), dtype=np.int64)
    state[_STATE_FIRST_FAILURE] = _NO_FAILURE
    pool = _pool(threads)
    futures = [pool.submit(_c_blocks, library, table, ids, out, plan, state, settings)
               for _ in range(min(threads, plan.shape[0]))]
    return RowGather(table, ids, out, ends, library=library, futures=futures, state=state, plan=plan)


def gather_rows_prefetch(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int, *,
                         prefetch_distance: int | None = None, prefetch_locality: int | None = None,
                         streaming_stores: bool | None = None) -> None:
    """``out[i] = table[ids[i]]`` on up to ``threads`` threads (arguments as
    :func:`start_gather_rows`); returns when done. Raises ``ValueError`` naming a bad
    argument, ``IndexError`` naming an id outside the table."""
    start_gather_rows(table, ids, out, threads, prefetch_distance=prefetch_distance,
                      prefetch_locality=prefetch_locality, streaming_stores=streaming_stores).wait()
