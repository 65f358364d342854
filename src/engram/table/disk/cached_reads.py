"""Rows of a row file by id through its RAM cache: each distinct id once, hits from RAM, misses from disk.

:class:`CachedRowReader` pairs a :class:`~engram.table.disk.reads.RowReader` with a
:class:`~engram.table.disk.ram_cache.RamRowCache`; :meth:`CachedRowReader.read` is one cache step
(:mod:`engram.table.disk.ram_cache`). The cache's lock covers the reader too, so calls from several
threads (a lookup and the prefetch worker) run one at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from engram.table.disk.ram_cache import DEFAULT_WAYS, RamRowCache
from engram.table.disk.reads import RowReader
from engram.table.disk.row_file import RowFile

__all__ = ["CachedRowReader"]


class CachedRowReader:
    """Packed rows of ``row_file`` (ids in ``[0, num_rows]``, ``num_rows`` the zero row) through a RAM cache
    of ``ram_cache_fraction`` of the table's rows (0: none) with ``ways`` ways; ``read_threads`` and
    ``read_backend`` as :class:`RowReader` takes them. ``close()`` releases the reader and the cache."""

    def __init__(self, row_file: RowFile, *, ram_cache_fraction: float = 0.1, ways: int = DEFAULT_WAYS,
                 read_threads: int = 8, read_backend: str = "auto", reader: RowReader | None = None):
        self.row_file = row_file
        self.layout = row_file.layout
        self.reader = reader if reader is not None else RowReader(row_file, read_threads, backend=read_backend)
        self.cache = RamRowCache.for_fraction(ram_cache_fraction, self.layout.num_rows, self.layout.row_bytes, ways)
        self.closed = False

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    def _read_disk(self, ids: np.ndarray, out: torch.Tensor) -> None:
        self.reader.read(ids, out)

    def read(self, ids: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out[i] = packed row ids[i]``: ``ids int64 [N]`` (numpy, any order, repeats), ``out uint8 [N,
        row_bytes]`` contiguous on the CPU (pinned staging, say; new when None). Returns ``out``. A failed
        read (:class:`~engram.table.disk.reads.RowReadError`) admits nothing."""
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
        if out is None:
            out = torch.empty(ids.size, self.row_bytes, dtype=torch.uint8)
        if self.closed:
            raise ValueError(f"{self.row_file.path}: this reader is closed")
        if ids.size == 0:
            return out
        stored = self.layout.stored_rows
        if ids.min() < 0 or ids.max() >= stored:
            position = int(np.flatnonzero((ids < 0) | (ids >= stored))[0])
            raise ValueError(f"ids: row {int(ids[position])} at position {position} is outside the rows "
                             f"[0, {stored}) of {self.row_file.path}")
        distinct, inverse = np.unique(ids, return_inverse=True)
        if distinct.size == ids.size and np.array_equal(distinct, ids):
            self.cache.serve(distinct, out, self._read_disk)   # already distinct and ascending
            return out
        rows = torch.empty(distinct.size, self.row_bytes, dtype=torch.uint8)
        self.cache.serve(distinct, rows, self._read_disk)
        torch.index_select(rows, 0, torch.from_numpy(inverse.reshape(-1)), out=out)
        return out

    def close(self) -> None:
        with self.cache.lock:
            if self.closed:
                return
            self.closed = True
            self.reader.close()
        self.cache.close()
