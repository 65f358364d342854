"""Tensors of a safetensors file as memory maps: the ``cpu`` placement serves table rows
straight from the file (page cache, zero copy) instead of copying ~100 GB into RAM.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``name -> {"dtype", "shape", "data_offsets": [begin, end]}``, offsets relative to the
end of the header), then the data. :func:`map_tensor_rows` maps the bytes of rows
``[row_start, row_end)`` of a 2-D one-byte tensor privately (``MAP_PRIVATE``,
copy-on-write: the file is never written, and the mapped pages are the page cache's
own, shared with every process that maps the file); :func:`check_table_rows` makes one
read-only pass over such rows in chunks for the NaN bytes a table never holds.

A map shows the file as it is now: a file rewritten in place under a running process changes
the rows it serves (a page not yet read comes from the new bytes), and one truncated below a
mapped row ends the process with SIGBUS when that row is read. Replacing the file by a rename
(as every writer of this package does) is safe: the map keeps the old file. :class:`MappedFiles`
keeps each mapped file open and compares its size and mtime with those it had when mapped, so
that a step can refuse with an error before reading a file that changed.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from engram.table.fp8 import first_nan_byte, nan_byte_error

__all__ = ["CHECK_CHUNK_BYTES", "TensorLocation", "tensor_location", "map_tensor_rows", "check_table_rows",
           "MappedFileChanged", "MappedFiles"]

_MAX_HEADER_BYTES = 100 * 2**20   # safetensors' own limit on the JSON header
CHECK_CHUNK_BYTES = 4 * 2**20
"""Most bytes the NaN check looks at per step (its temporaries are a few eighths of this)."""


class _Progress(Protocol):
    def update(self, n: int) -> Any: ...


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes are in its file: ``offset`` (absolute) and ``nbytes``, with
    its header ``dtype`` string and ``shape``."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def where(self) -> str:
        return f"tensor {self.name!r} in file {str(self.file)!r}"


def tensor_location(file: str | os.PathLike, name: str, item_bytes: int = 1) -> TensorLocation:
    """Read ``name``'s entry from the header of ``file``; ValueError naming the tensor and the
    file when the header is unreadable, lacks the tensor, or points past the file's end."""
    file = Path(file)
    where = f"tensor {name!r} in file {str(file)!r}"
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            header_bytes = int.from_bytes(handle.read(8), "little")
            if not 0 < header_bytes <= min(_MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {header_bytes} does not fit the file's {size} bytes")
            header = json.loads(handle.read(header_bytes))
        entry = header[name]
        dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
    except KeyError:
        raise ValueError(f"{where}: the file's header has no entry for it") from None
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{where}: could not read its offsets from the header ({error})") from None
    expected = math.prod(shape) * item_bytes
    if end - begin != expected or begin < 0:
        raise ValueError(f"{where}: header gives data_offsets [{begin}, {end}), {end - begin} bytes; expected "
                         f"{expected} for shape {list(shape)}")
    offset = 8 + header_bytes + begin
    if offset + expected > size:
        raise ValueError(f"{where}: its data ends at byte {offset + expected}, past the end of the file "
                         f"({size} bytes); the file is truncated")
    return TensorLocation(file, name, dtype, shape, offset, expected)


def map_tensor_rows(location: TensorLocation, row_start: int, row_end: int) -> torch.Tensor:
    """Rows ``[row_start, row_end)`` of a 2-D one-byte tensor as ``uint8 [rows, width]``, a view
    of a private (copy-on-write) memory map of its file: nothing is read until used, and
    reads come from the page cache. The map lives as long as the tensor or a view of it."""
    if len(location.shape) != 2:
        raise ValueError(f"{location.where()}: expected a 2-D tensor, found shape {list(location.shape)}")
    rows, width = location.shape
    if not 0 <= row_start < row_end <= rows:
        raise ValueError(f"{location.where()}: rows [{row_start}, {row_end}) are not inside its {rows} rows")
    start = location.offset + row_start * width
    length = (row_end - row_start) * width
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    with open(location.file, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), length + (start - aligned), access=mmap.ACCESS_COPY, offset=aligned)
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=start - aligned, count=length).view(row_end - row_start,
                                                                                                  width)


def check_table_rows(rows: torch.Tensor, where: str, row_start: int, *, chunk_bytes: int = CHECK_CHUNK_BYTES,
                     progress: _Progress | None = None, check_ue8m0: bool = False, check_e4m3: bool = False,
                     check_chunk: Callable[[torch.Tensor, int], None] | None = None) -> None:
    """One read-only pass over ``rows`` (``uint8 [rows, width]``, row 0 = file row ``row_start``)
    in chunks of at most ``chunk_bytes`` (capped at :data:`CHECK_CHUNK_BYTES`): ValueError naming
    ``where``, the row and the column on scale byte 255 (UE8M0 NaN, ``check_ue8m0``) or value
    bytes 0x7F/0xFF (E4M3 NaN, ``check_e4m3``); ``check_chunk(chunk [n, width], file row of its
    row 0)`` is called on each chunk too (the scales' overflow check). ``progress.update(bytes)``
    after each chunk. The scan (:func:`engram.table.fp8.first_nan_byte`) holds no table-sized
    temporary."""
    num_rows, width = rows.shape
    chunk_rows = max(1, min(chunk_bytes, CHECK_CHUNK_BYTES) // width)
    for first in range(0, num_rows, chunk_rows):
        chunk = rows[first:first + chunk_rows].reshape(-1)   # a view: the mapping is contiguous
        size = chunk.numel()
        for enabled, what in ((check_ue8m0, "ue8m0"), (check_e4m3, "e4m3")):
            if not enabled:
                continue
            flat = first_nan_byte(chunk, what)
            if flat is not None:
                raise nan_byte_error(where, row_start + first + flat // width, flat % width, int(chunk[flat]), what)
        if check_chunk is not None:
            check_chunk(rows[first:first + chunk_rows], row_start + first)
        if progress is not None:
            progress.update(size)


class MappedFileChanged(RuntimeError):
    """A memory-mapped checkpoint file changed (size or mtime) after its rows were mapped."""


class MappedFiles:
    """The files some memory-mapped tensors come from, as they were when mapped: each kept open
    (so a rename or unlink of the path changes nothing), its size and mtime compared by
    :meth:`check` (two ``fstat`` calls per file, about a microsecond each)."""

    def __init__(self, paths):
        self._files = []
        for path in dict.fromkeys(Path(p) for p in paths):
            descriptor = os.open(path, os.O_RDONLY)
            stat = os.fstat(descriptor)
            self._files.append((path, descriptor, stat.st_size, stat.st_mtime_ns))

    def check(self) -> None:
        """Raise :class:`MappedFileChanged` naming the file and what changed, if any did."""
        for path, descriptor, size, mtime_ns in self._files:
            stat = os.fstat(descriptor)
            if stat.st_size != size or stat.st_mtime_ns != mtime_ns:
                change = (f"size {size:,} -> {stat.st_size:,} bytes" if stat.st_size != size
                          else f"modified in place (mtime {mtime_ns} -> {stat.st_mtime_ns} ns)")
                raise MappedFileChanged(
                    f"file {str(path)!r} changed while its table rows were memory-mapped ({change}): its rows "
                    f"may be other bytes now, or (shorter) unreadable; load the checkpoint again (replace "
                    f"checkpoint files by a rename, never in place, under a running process)")

    def close(self) -> None:
        for _, descriptor, _, _ in self._files:
            try:
                os.close(descriptor)
            except OSError:
                pass
        self._files = []

    def __del__(self):
        self.close()
