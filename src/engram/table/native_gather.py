"""Host row gather with software prefetch: a small C function, compiled on first use.

``gather_rows_prefetch(table, ids, out, threads)`` copies ``out[i] = table[ids[i]]`` like
``torch.index_select(table, 0, ids, out=out)``, bit for bit, but keeps many row reads in
flight per thread (``native/row_gather.c`` prefetches every cache line of the rows
``PREFETCH_DISTANCE`` ids ahead). The rows are split into ``threads`` contiguous chunks run
on a persistent pool of Python threads; each chunk is one ctypes call, which releases the
GIL, so the chunks copy in parallel. No OpenMP: torch's libgomp keeps its own threads.

Why: torch's index_select copies one row after the other, one row in flight per thread,
so a gather of 196,608 distinct rows of 272 B from a 34 GiB table is bound by DRAM latency
(H200 host, 16 vCPU KVM: 2.4 ms, 22 GB/s on 14 threads; benchmarks/NOTES.md "Host tables
v2"). See ``benchmarks/probe_row_gather.py`` and NOTES "Host tables v3" for this gather's
numbers.

Build: the system C compiler (``$CC``, else ``cc``, else ``gcc``) with ``-O3 -shared -fPIC``
into the engram cache directory (``$ENGRAM_CACHE_DIR``, ``$XDG_CACHE_HOME/engram`` or
``~/.cache/engram``), the file named by a hash of the source, the compiler and its flags,
written to a temporary file and renamed into place (concurrent processes are safe). When
there is no compiler or the build fails, one warning names the reason and every call
falls back to ``torch.index_select``. ``ENGRAM_HOST_GATHER=torch`` forces that fallback;
the choice is made once per process, at the first call.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["gather_rows_prefetch", "start_gather_rows", "RowGather", "native_gather_status", "PREFETCH_DISTANCE",
           "PREFETCH_LOCALITY", "STREAMING_STORES", "FORCE_TORCH_ENV"]

SOURCE = Path(__file__).with_name("native") / "row_gather.c"
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
FORCE_TORCH_ENV = "ENGRAM_HOST_GATHER"  # "torch": always torch.index_select
_COMPILE_TIMEOUT_S = 120

# Rows prefetched ahead of the one being copied, per thread. TODO(H200): distance sweep.
PREFETCH_DISTANCE = 16
# __builtin_prefetch locality: 3 = prefetcht0 (every cache level), 2 / 1 = L2 (t1 / t2), 0 = nta.
PREFETCH_LOCALITY = 3
# Non-temporal stores into `out` (x86): no read-for-ownership of the staging, which the copy
# engine reads next; but on Intel they hold the same fill buffers the prefetches need.
STREAMING_STORES = False
_STREAMING_FLAG = 1  # ENGRAM_STREAMING_STORES in row_gather.c

# A chunk is one ctypes call on one pool thread; smaller gathers use fewer threads (a
# thread hand-off costs ~10-50 us, the copy of 1024 rows ~50-150 us).
MIN_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class _Library:
    function: object | None  # the ctypes function, or None: torch fallback
    reason: str              # where it was loaded from, or why not


_STATE: list[_Library] = []
_STATE_LOCK = threading.Lock()


def _compiler_command() -> list[str] | None:
    given = os.environ.get("CC")
    if given:
        return shlex.split(given)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _library_name(compiler: list[str], source: bytes) -> str:
    key = hashlib.sha256()
    for part in (source, " ".join(compiler).encode(), " ".join(CFLAGS).encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return f"row_gather-{key.hexdigest()[:16]}.so"


def _compile(compiler: list[str], source_path: Path, target: Path) -> None:
    """Build into a temporary file next to ``target``, then rename it into place (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.stem + "-", suffix=".so.tmp")
    os.close(handle)
    try:
        result = subprocess.run([*compiler, *CFLAGS, "-o", temporary, str(source_path)], capture_output=True,
                                text=True, timeout=_COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[:5]
            raise RuntimeError(f"{' '.join(compiler)} exited with status {result.returncode}: " + " | ".join(detail))
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _build_and_load() -> _Library:
    if os.environ.get(FORCE_TORCH_ENV, "").strip().lower() == "torch":
        return _Library(None, f"{FORCE_TORCH_ENV}=torch")
    compiler = _compiler_command()
    if compiler is None:
        return _Library(None, "no C compiler found ($CC unset, neither cc nor gcc on PATH)")
    source = SOURCE.read_bytes()
    from ..vocab import cache_dir  # the package's cache directory (token maps live there too)

    name = _library_name(compiler, source)
    target = cache_dir() / name
    try:
        if not target.exists():
            try:
                _compile(compiler, SOURCE, target)
            except OSError:  # cache directory not writable: a private temporary directory
                target = Path(tempfile.mkdtemp(prefix="engram-native-")) / name
                _compile(compiler, SOURCE, target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return _Library(None, f"building {SOURCE.name} with {' '.join(compiler)} failed: {error}")
    function = library.engram_gather_rows
    function.restype = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return _Library(function, str(target))


def _library() -> _Library:
    """Built and loaded once per process; the fallback's warning is given once."""
    if not _STATE:
        with _STATE_LOCK:
            if not _STATE:
                loaded = _build_and_load()
                if loaded.function is None and not loaded.reason.startswith(FORCE_TORCH_ENV):
                    warnings.warn(f"engram host gather: the prefetching C gather is unavailable ({loaded.reason}); "
                                  "using torch.index_select, which is slower for large lookups", RuntimeWarning,
                                  stacklevel=3)
                _STATE.append(loaded)
    return _STATE[0]


def native_gather_status() -> tuple[bool, str]:
    """``(available, detail)``: whether the C gather is used (builds it on the first call),
    and the path of the loaded library or why the torch fallback is used."""
    loaded = _library()
    return loaded.function is not None, loaded.reason


_POOL: list[tuple[concurrent.futures.ThreadPoolExecutor, int]] = []  # (pool, its threads)
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy threads (persistent), grown to ``threads`` when more are asked for
    (the smaller pool finishes its queued chunks, then its threads exit)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0][1] < threads:
            previous = _POOL[0][0] if _POOL else None
            _POOL[:] = [(concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="engram-row-gather"), threads)]
            if previous is not None:
                previous.shutdown(wait=False)
        return _POOL[0][0]


def _check(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    for name, tensor in (("table", table), ("ids", ids), ("out", out)):
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, found one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, found shape {list(tensor.shape)} with strides "
                             f"{list(tensor.stride())}")
    if table.dtype != torch.uint8 or table.dim() != 2:
        raise ValueError(f"table: expected uint8 [rows, row_bytes], found {table.dtype} {list(table.shape)}")
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise ValueError(f"ids: expected int64 (or int32) [N], found {ids.dtype} {list(ids.shape)}")
    expected = [ids.shape[0], table.shape[1]]
    if out.dtype != torch.uint8 or list(out.shape) != expected:
        raise ValueError(f"out: expected uint8 {expected} (ids' length, table's row bytes), found {out.dtype} "
                         f"{list(out.shape)}")
    if table.shape[1] == 0:
        raise ValueError("table: expected rows of at least one byte, found row_bytes 0")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected an integer >= 1, found {threads!r}")


class RowGather:
    """A started gather; :meth:`wait` returns once every row is in ``out``.

    Gathers of several chunks run on the pool from the start. A gather of one chunk (and
    every gather on the torch fallback, ``index_select`` on the calling thread's intra-op
    threads) runs inside :meth:`wait`, on the waiting thread: no thread hand-off for small
    gathers, and a caller that waits for one gather after the other interleaves them with
    its own work in the same order either way."""

    def __init__(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                 futures: list[concurrent.futures.Future], deferred=None):
        self._table, self._ids, self._out = table, ids, out  # alive while the C code reads them
        self._futures = futures
        self._deferred = deferred  # run by wait(): returns the first bad position or -1

    def wait(self) -> None:
        """Block until done. Raises ``IndexError`` naming the first id outside the table
        (after every chunk has finished)."""
        positions = []
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            positions.append(deferred())
        concurrent.futures.wait(self._futures)
        positions += [future.result() for future in self._futures]
        failures = [position for position in positions if position >= 0]
        if failures:
            position = min(failures)
            raise IndexError(f"ids[{position}] = {int(self._ids[position])} is outside the table's "
                             f"{self._table.shape[0]} rows")


def _chunk_bounds(num_rows: int, threads: int) -> list[int]:
    chunks = max(1, min(threads, num_rows // MIN_CHUNK_ROWS))
    return [num_rows * k // chunks for k in range(chunks + 1)]


def _call(function, table, ids, out, begin, end, settings: tuple[int, int, int]) -> int:
    """One chunk, ``[begin, end)``; ``settings``: (prefetch distance, locality, options)."""
    return function(table.data_ptr(), table.shape[0], table.shape[1], ids.data_ptr(), ids.element_size(),
                    out.data_ptr(), begin, end, *settings)


def _index_select(table, ids, out) -> int:
    torch.index_select(table, 0, ids, out=out)  # raises IndexError itself
    return -1


def _settings(prefetch_distance: int | None, prefetch_locality: int | None,
              streaming_stores: bool | None) -> tuple[int, int, int]:
    distance = PREFETCH_DISTANCE if prefetch_distance is None else prefetch_distance
    locality = PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality
    streaming = STREAMING_STORES if streaming_stores is None else streaming_stores
    if not isinstance(distance, int) or distance < 0:
        raise ValueError(f"prefetch_distance: expected an integer >= 0, found {distance!r}")
    if locality not in (0, 1, 2, 3):
        raise ValueError(f"prefetch_locality: expected 0, 1, 2 or 3, found {locality!r}")
    return distance, locality, _STREAMING_FLAG if streaming else 0


def start_gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int, *,
                      prefetch_distance: int | None = None, prefetch_locality: int | None = None,
                      streaming_stores: bool | None = None) -> RowGather:
    """Start ``out[i] = table[ids[i]]`` and return at once (see :class:`RowGather` for where it runs).

    ``table`` uint8 ``[rows, row_bytes]``, ``ids`` int64 or int32 ``[N]`` in ``[0, rows)``, ``out``
    uint8 ``[N, row_bytes]``, all contiguous CPU tensors (``out`` must not overlap ``table``),
    unchanged until :meth:`RowGather.wait` returns. ``threads`` >= 1: the rows are split into at
    most that many contiguous chunks of at least :data:`MIN_CHUNK_ROWS` rows, one per pool thread.
    ``prefetch_distance`` (rows ahead), ``prefetch_locality`` and ``streaming_stores`` default to
    :data:`PREFETCH_DISTANCE`, :data:`PREFETCH_LOCALITY` and :data:`STREAMING_STORES`.
    """
    _check(table, ids, out, threads)
    settings = _settings(prefetch_distance, prefetch_locality, streaming_stores)
    function = _library().function
    if function is None:
        return RowGather(table, ids, out, [], functools.partial(_index_select, table, ids, out))
    bounds = _chunk_bounds(ids.shape[0], threads)
    if len(bounds) == 2:
        return RowGather(table, ids, out, [], functools.partial(_call, function, table, ids, out, 0, ids.shape[0],
                                                                settings))
    pool = _pool(threads)
    futures = [pool.submit(_call, function, table, ids, out, begin, end, settings)
               for begin, end in zip(bounds[:-1], bounds[1:])]
    return RowGather(table, ids, out, futures)


def gather_rows_prefetch(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int, *,
                         prefetch_distance: int | None = None, prefetch_locality: int | None = None,
                         streaming_stores: bool | None = None) -> None:
    """``out[i] = table[ids[i]]`` on up to ``threads`` threads (arguments as
    :func:`start_gather_rows`); returns when done. Raises ``ValueError`` naming a bad
    argument, ``IndexError`` naming an id outside the table."""
    start_gather_rows(table, ids, out, threads, prefetch_distance=prefetch_distance,
                      prefetch_locality=prefetch_locality, streaming_stores=streaming_stores).wait()
