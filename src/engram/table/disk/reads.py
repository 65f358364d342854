"""Rows of a row file by id (:mod:`engram.table.disk.row_file`), read into a caller's buffer.

Two readers, the same bytes:

* ``"native"``: ``disk_reads.c``, built into its own small library ``_disk_reads<EXT_SUFFIX>`` beside
  this module (``setup.py``, by :func:`engram.table.disk.reads_build.build_command`; not the host
  gather's library). The file is opened with ``O_DIRECT`` (reads of whole 4 KiB-aligned pages into
  page-aligned bounce buffers, past the page cache); where its file system refuses ``O_DIRECT``
  (``EINVAL``: ramfs, some FUSE and older tmpfs) it is read buffered, and a warning says so once per
  file system. The ids are sorted by page; each distinct page is one ``pread``, by a pool of
  ``threads`` native threads (0: the calling thread), and the rows on it are copied out. Where no
  built library matches this source, it is compiled once per process at first use (with a warning)
  into a private temporary directory, by the same command.
* ``"python"``: ``os.pread`` of each distinct page (buffered) by ``threads`` Python threads, used
  where no library can be built (no C compiler) and selectable for tests.

``out[i] = packed row ids[i]`` (``uint8 [N, row_bytes]``): ids in ``[0, num_rows]``, id ``num_rows``
being the zero row. A failed or short read raises :class:`RowReadError` (an OSError) naming the file,
the row and the file offset; an id outside the file is a ValueError before any read.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import os
import sysconfig
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from engram.checks import DISK_READ_BACKENDS, check_choice, check_int
from engram.environment import compile_library
from engram.table.disk.reads_build import LIBRARY_STEM, SOURCE, build_command, source_digest
from engram.table.disk.row_file import RowFile

__all__ = ["RowReader", "RowReadError", "read_rows", "READ_BACKENDS", "BUILT_LIBRARY", "load_library",
           "unavailable_reason", "MAX_THREADS"]

READ_BACKENDS = DISK_READ_BACKENDS
MAX_THREADS = 1024
BUILT_LIBRARY = Path(__file__).with_name(LIBRARY_STEM + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))

_ERROR_READ, _ERROR_SHORT, _ERROR_ID, _ERROR_MEMORY, _ERROR_ARGUMENT, _ERROR_OPEN = 1, 2, 3, 4, 5, 6


class _DiskError(ctypes.Structure):
    """``EngramDiskError`` of ``disk_reads.c``."""

    _fields_ = [("kind", ctypes.c_int64), ("error_number", ctypes.c_int64), ("offset", ctypes.c_int64),
                ("row", ctypes.c_int64), ("got", ctypes.c_int64)]


class RowReadError(OSError):
    """A read of a row file that failed or came back short: ``path``, ``row`` (the id it was for),
    ``offset`` (file offset of the page read), ``got`` (bytes it returned, -1 when it failed)."""

    def __init__(self, path, row: int, offset: int, error_number: int, got: int, page_bytes: int):
        if error_number:
            why = os.strerror(error_number)
        else:
            why = (f"short read: {got} of {page_bytes} bytes (the file ends there: truncated or changed since it "
                   f"was checked)")
        self.message = f"{path}: reading row {row} at file offset {offset} failed: {why}"
        super().__init__(error_number or errno.EIO, self.message)
        self.filename = str(path)
        self.path, self.row, self.offset, self.got = Path(path), row, offset, got

    def __str__(self) -> str:
        return self.message


# ---------------------------------------------------------------------------
# the library
# ---------------------------------------------------------------------------
def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    error = ctypes.POINTER(_DiskError)
    lib.engram_disk_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int), error]
    lib.engram_disk_open.restype = ctypes.c_int
    lib.engram_disk_close.argtypes = [ctypes.c_int]
    lib.engram_disk_close.restype = ctypes.c_int
    lib.engram_disk_pool_create.argtypes = [ctypes.c_int]
    lib.engram_disk_pool_create.restype = ctypes.c_void_p
    lib.engram_disk_pool_destroy.argtypes = [ctypes.c_void_p]
    lib.engram_disk_pool_destroy.restype = None
    lib.engram_disk_read_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_void_p, error]
    lib.engram_disk_read_rows.restype = ctypes.c_int64
    return lib


def _mismatch(lib: ctypes.CDLL) -> str | None:
    """Why ``lib`` is not ``disk_reads.c`` as it is now, or None."""
    if not hasattr(lib, "engram_disk_source_digest") or not hasattr(lib, "engram_disk_error_bytes"):
        return "it reports no source digest (not built from disk_reads.c)"
    lib.engram_disk_source_digest.restype = ctypes.c_int64
    lib.engram_disk_error_bytes.restype = ctypes.c_int64
    found, expected = lib.engram_disk_source_digest(), source_digest()
    if found != expected:
        return f"it was built from another disk_reads.c (source digest {found}, expected {expected})"
    if lib.engram_disk_error_bytes() != ctypes.sizeof(_DiskError):
        return f"its error record is {lib.engram_disk_error_bytes()} bytes, expected {ctypes.sizeof(_DiskError)}"
    return None


def _compile() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = compile_library(build_command, LIBRARY_STEM + ".so", "engram-disk-reads-", "library")
    if lib is None:
        return None, reason
    refused = _mismatch(lib)
    return (None, f"the library compiled from {SOURCE.name} is refused: {refused}") if refused else (_declare(lib), "")


def load_library(built: str | Path = BUILT_LIBRARY) -> tuple[ctypes.CDLL | None, str]:
    """``(library, "")``: ``built`` where it exists and reports this source's digest, else
    ``disk_reads.c`` compiled now with a warning saying why; ``(None, why not)`` where neither can be."""
    if os.path.exists(built):
        try:
            lib = ctypes.CDLL(os.fspath(built))
            refused = _mismatch(lib)
        except OSError as error:
            refused = f"it did not load: {error}"
        if refused is None:
            return _declare(lib), ""
        why = f"{built} is refused: {refused}"
    else:
        why = f"no built library at {built}"
    lib, reason = _compile()
    if lib is None:
        return None, f"{why}, and {reason}"
    warnings.warn(f"disk reads: {why}; built it from source ({SOURCE.name}) at first use", RuntimeWarning,
                  stacklevel=3)
    return lib, ""


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    return load_library(BUILT_LIBRARY)


def unavailable_reason() -> str | None:
    """Why the native reader cannot be used here, or None."""
    return _library()[1] or None


# ---------------------------------------------------------------------------
# the fallback warning
# ---------------------------------------------------------------------------
_WARNED_DEVICES: set[int] = set()
_WARNED_LOCK = threading.Lock()


def _file_system(path: Path) -> str:
    """``"<type> at <mount point>"`` of the mount holding ``path`` (/proc/self/mounts), or "unknown"."""
    real, best = os.path.realpath(path), ("unknown", "")
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[1]):
                    best = (parts[2], point)
    except OSError:
        return "unknown"
    return f"{best[0]} at {best[1]}" if best[1] else "unknown"


def _warn_buffered(path: Path, device: int) -> None:
    with _WARNED_LOCK:
        if device in _WARNED_DEVICES:
            return
        _WARNED_DEVICES.add(device)
    warnings.warn(f"disk reads: the file system of {path} ({_file_system(path)}) refuses O_DIRECT; its rows are read "
                  f"through the page cache (buffered reads: page-cache memory, and rates that are not the disk's)",
                  RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------
def _close_native(lib, fd: int, pool) -> None:
    if pool:
        lib.engram_disk_pool_destroy(pool)
    if fd >= 0:
        lib.engram_disk_close(fd)


def _close_python(fd: int, executor) -> None:
    if executor is not None:
        executor.shutdown(wait=True)
    if fd >= 0:
        os.close(fd)


class RowReader:
    """Reads rows of one checked :class:`RowFile` by id (module docstring).

    ``threads``: readers of pages at once (0: the calling thread); ``backend``: ``"auto"`` (native
    where the library loads, else Python), ``"native"`` or ``"python"``. :attr:`direct` says whether
    reads bypass the page cache (``O_DIRECT``). ``close()`` (or the ``with`` block's end) releases the
    descriptor and the threads. ValueError when the file at the path is no longer the one checked."""

    def __init__(self, row_file: RowFile, threads: int = 8, *, backend: str = "auto", direct: bool = True):
        if not isinstance(row_file, RowFile):
            raise ValueError(f"row_file: expected a RowFile (engram.table.disk.open_row_file), found {row_file!r}")
        check_int("threads", threads, 0, maximum=MAX_THREADS)
        check_choice("backend", backend, READ_BACKENDS)
        self.row_file, self.layout, self.threads = row_file, row_file.layout, threads
        lib, reason = _library() if backend != "python" else (None, "")
        if backend == "native" and lib is None:
            raise ValueError(f"backend: 'native' is not available here: {reason}")
        self.backend = "native" if lib is not None else "python"
        self._lib, self._pool, self._executor = lib, None, None
        path = row_file.path
        if self.backend == "native":
            used = ctypes.c_int(0)
            error = _DiskError()
            fd = lib.engram_disk_open(os.fsencode(path), int(direct), self.layout.page_bytes, ctypes.byref(used),
                                      ctypes.byref(error))
            if fd < 0:
                raise OSError(error.error_number, f"{path}: cannot be opened for reads "
                                                  f"({os.strerror(error.error_number)})", str(path))
            self.direct = bool(used.value)
            self._finalizer = weakref.finalize(self, _close_native, lib, fd, None)
            if threads:
                self._pool = lib.engram_disk_pool_create(threads)
                if not self._pool:
                    self.close()
                    raise OSError(errno.EAGAIN, f"{path}: {threads} reader threads could not be started")
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _close_native, lib, fd, self._pool)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.direct = False
            self._executor = (concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="engram-disk-read")
                              if threads else None)
            self._finalizer = weakref.finalize(self, _close_python, fd, self._executor)
        self._fd = fd
        info = os.fstat(fd)
        if row_file.identity != (0, 0) and (info.st_dev, info.st_ino) != row_file.identity:
            self.close()
            raise ValueError(f"{path}: replaced since it was checked (another file at that path now); open it again")
        if direct and self.backend == "native" and not self.direct:
            _warn_buffered(path, info.st_dev)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "RowReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked_ids(self, ids) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
                raise ValueError(f"ids: expected integer row ids, found {ids.dtype}")
            ids = ids.detach().to("cpu", torch.int64).numpy()
        array = np.asarray(ids)
        if array.dtype.kind not in "iu":
            raise ValueError(f"ids: expected integer row ids, found {array.dtype}")
        flat = np.ascontiguousarray(array.reshape(-1), dtype=np.int64)
        stored = self.layout.stored_rows
        if flat.size and (flat.min() < 0 or flat.max() >= stored):
            position = int(np.flatnonzero((flat < 0) | (flat >= stored))[0])
            raise ValueError(f"ids: row {int(flat[position])} at position {position} is outside the rows "
                             f"[0, {stored}) of {self.row_file.path} (row {stored - 1} is the zero row)")
        return flat

    def _checked_out(self, out, count: int) -> torch.Tensor:
        row_bytes = self.layout.row_bytes
        if out is None:
            return torch.empty(count, row_bytes, dtype=torch.uint8)
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.device.type != "cpu"
                or tuple(out.shape) != (count, row_bytes) or not out.is_contiguous()):
            shown = (f"{out.dtype} {list(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}"
                     if isinstance(out, torch.Tensor) else repr(out))
            raise ValueError(f"out: expected a contiguous CPU uint8 tensor [{count}, {row_bytes}], found {shown}")
        return out

    def read(self, ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out[i] = packed row ids[i]``: ``ids`` any integer array or tensor (flattened, N ids),
        ``out`` uint8 ``[N, row_bytes]`` contiguous on the CPU (pinned staging, say; a new tensor
        when None). Returns ``out``."""
        if not self._finalizer.alive:
            raise ValueError(f"{self.row_file.path}: this reader is closed")
        flat = self._checked_ids(ids)
        out = self._checked_out(out, flat.size)
        if flat.size == 0:
            return out
        if self.backend == "native":
            self._read_native(flat, out)
        else:
            self._read_python(flat, out)
        return out

    def _read_native(self, flat: np.ndarray, out: torch.Tensor) -> None:
        layout, error = self.layout, _DiskError()
        done = self._lib.engram_disk_read_rows(self._pool, self._fd, layout.rows_offset, layout.page_bytes,
                                               layout.rows_per_page, layout.row_bytes, layout.stored_rows,
                                               flat.ctypes.data, flat.size, out.data_ptr(), ctypes.byref(error))
        if done >= 0:
            return
        if error.kind in (_ERROR_READ, _ERROR_SHORT):
            raise RowReadError(self.row_file.path, error.row, error.offset, error.error_number, error.got,
                               layout.page_bytes)
        if error.kind == _ERROR_MEMORY:
            raise MemoryError(f"{self.row_file.path}: no memory for a read of {flat.size} rows")
        raise ValueError(f"{self.row_file.path}: the read of {flat.size} rows was refused (error kind {error.kind}, "
                         f"row {error.row})")

    def _read_python(self, flat: np.ndarray, out: torch.Tensor) -> None:
        layout = self.layout
        pages, inverse = np.unique(flat // layout.rows_per_page, return_inverse=True)
        first_id = np.zeros(pages.size, dtype=np.int64)
        first_id[inverse[::-1]] = flat[::-1]   # an id on each page, for an error's message
        buffer = np.empty((pages.size, layout.page_bytes), dtype=np.uint8)

        def read_pages(begin: int, end: int) -> None:
            for k in range(begin, end):
                offset = layout.page_offset(int(pages[k]))
                try:
                    data = os.pread(self._fd, layout.page_bytes, offset)
                except OSError as error:
                    raise RowReadError(self.row_file.path, int(first_id[k]), offset, error.errno, -1,
                                       layout.page_bytes) from None
                if len(data) != layout.page_bytes:
                    raise RowReadError(self.row_file.path, int(first_id[k]), offset, 0, len(data), layout.page_bytes)
                buffer[k] = np.frombuffer(data, dtype=np.uint8)

        workers = max(1, self.threads)
        bounds = np.linspace(0, pages.size, min(workers, pages.size) + 1).astype(np.int64)
        if self._executor is None or len(bounds) == 2:
            read_pages(0, pages.size)
        else:
            for future in [self._executor.submit(read_pages, int(a), int(b)) for a, b in zip(bounds, bounds[1:])]:
                future.result()
        rows = buffer[:, :layout.rows_per_page * layout.row_bytes].reshape(pages.size, layout.rows_per_page,
                                                                            layout.row_bytes)
        out.numpy()[:] = rows[inverse.reshape(-1), flat % layout.rows_per_page]


def read_rows(row_file: RowFile, ids, out: torch.Tensor | None = None, *, threads: int = 8,
              backend: str = "auto") -> torch.Tensor:
    """One read with a reader of its own (:class:`RowReader`): ``uint8 [N, row_bytes]``, ``out[i] = row ids[i]``."""
    with RowReader(row_file, threads, backend=backend) as reader:
        return reader.read(ids, out)
