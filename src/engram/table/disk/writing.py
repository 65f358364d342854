"""Writing a row file (:mod:`engram.table.disk.row_file`) from a checkpoint's table, resumably.

:func:`write_row_file` streams the rows of a ``TableSource`` (:mod:`engram.checkpoint.loading`) in
chunks of whole pages (:data:`DEFAULT_CHUNK_BYTES` of pages; memory about three chunks whatever the
table's size): each chunk is read from the memory-mapped checkpoint (every byte checked as the
loader checks it), packed as placement ``"host"`` packs rows (values, scales, zero padding, the
row's index as its tag), laid into pages and written; the file is fsynced, the chunk read back and
compared, and the header rewritten with the rows written so far and fsynced again.

The file is written as ``<name>.tmp`` in the target directory, under an exclusive ``flock`` on it,
with a header of filled 0, and renamed to ``<name>`` once its header says filled 1. An interrupted
write (an exception, Ctrl-C, a kill) leaves the ``.tmp`` and its header's count of rows written and
verified: a later write of the same rows (same fingerprint, so the same name) continues after them,
once the last page recorded is checked to hold its rows' tags. The name carries the fingerprint
(:func:`row_file_path`), so another checkpoint (or a changed one) writes another file and never
continues this one; the ``.tmp`` of a superseded write of the same checkpoint files is removed.

Room is checked before any byte is written (``statvfs``: the file's bytes not yet on disk), and the
whole file is reserved (``posix_fallocate``) where the file system can. :func:`ensure_row_file`
returns an existing valid file (:func:`~engram.table.disk.row_file.open_row_file`) and writes one
only where none is.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engram.checks import check_positive_int
from engram.progress import progress_bar
from engram.table.disk.row_file import RowFileHeader, RowFileLayout, open_row_file, read_header, row_file_fingerprint
from engram.table.file_header import HeaderProblem, source_stamps
from engram.table.host_memory.rows import PackedRows, row_tags, write_row_tags
from engram.table.host_memory.shm_files import check_directory, check_room, reserve

if TYPE_CHECKING:
    from engram.checkpoint.loading import TableSource

__all__ = ["DEFAULT_CHUNK_BYTES", "FILE_SUFFIX", "TEMPORARY_SUFFIX", "DISK_ROOM_ADVICE", "row_file_path",
           "source_fingerprint", "write_row_file", "ensure_row_file", "layer_table_source", "TensorTableSource",
           "ROW_FILE_ATTRIBUTE", "row_file_placeholders"]

ROW_FILE_ATTRIBUTE = "_engram_row_file"
"""Set on the placeholder values of :func:`row_file_placeholders`: the checked row file they stand for."""

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Bytes of pages written (and fsynced) at a time."""
FILE_SUFFIX = ".engram-rows"
TEMPORARY_SUFFIX = ".tmp"
FILE_MODE = 0o644
DISK_ROOM_ADVICE = "free space there, or pass a directory on a disk with room (`df -h {directory}`)"


def source_fingerprint(source: "TableSource") -> bytes:
    """The fingerprint of the row file of ``source``'s rows (:func:`row_file_fingerprint` of its share key)."""
    return row_file_fingerprint(source.share_key(), RowFileLayout(source.num_rows, source.head_dim))


def _slug(source: "TableSource") -> str:
    readable = re.sub(r"[^A-Za-z0-9]+", "-", source.description).strip("-")[:60] or "table"
    return f"{readable}-rows-{source.row_start}-{source.row_end}"


def row_file_path(source: "TableSource", directory: str | os.PathLike, fingerprint: bytes | None = None) -> Path:
    """``<directory>/<description>-rows-<start>-<end>-<32 hex digits of the fingerprint>.engram-rows``."""
    fingerprint = source_fingerprint(source) if fingerprint is None else fingerprint
    return Path(directory) / f"{_slug(source)}-{fingerprint.hex()[:32]}{FILE_SUFFIX}"


def layer_table_source(checkpoint, layout, layer_index: int, shard=None, *, check_values: bool = True,
                       chunk_bytes: int | None = None) -> "TableSource":
    """The ``TableSource`` of layer ``layout.spec.layer_ids[layer_index]``'s rows (all, or ``shard``'s
    range) in ``checkpoint`` (a ``SafetensorsCheckpoint``), its tensors checked as the loader checks them."""
    from engram.checkpoint.loading import TableSource
    from engram.checkpoint.reading import DEFAULT_CHUNK_BYTES as READ_CHUNK_BYTES, expected_layer_tensors

    spec = layout.spec
    layer_id = spec.layer_ids[layer_index]
    expected = expected_layer_tensors(spec, layout, layer_index)
    values = checkpoint.check(checkpoint.name(layer_id, "embed.weight"), *expected["embed.weight"])
    scales = checkpoint.check(checkpoint.name(layer_id, "embed.scale"), *expected["embed.scale"])
    start, end = (0, layout.num_embeddings[layer_index]) if shard is None else shard.row_ranges[layer_index]
    return TableSource(checkpoint, values, scales, start, end, spec.head_dim, f"layer {layer_id} table",
                       chunk_bytes or READ_CHUNK_BYTES, None, check_values)


@dataclasses.dataclass
class TensorTableSource:
    """Rows of tables held as tensors (``values uint8 [rows, D]``, ``scales uint8 [rows, D // 32]`` on the
    CPU), written as a checkpoint's ``TableSource`` is: for a table of placement ``"disk"`` built from
    tensors. Its share key names the bytes (a BLAKE2b digest of both tensors), so equal tensors reuse one
    row file. ``row_start``/``row_end`` index the tensors' rows."""

    values: torch.Tensor
    scales: torch.Tensor
    row_start: int = 0
    row_end: int = -1
    description: str = "tensor table"
    progress: object = None
    digest: str = ""

    def __post_init__(self):
        if self.row_end < 0:
            self.row_end = self.values.shape[0]
        if not self.digest:
            hasher = hashlib.blake2b(digest_size=16, person=b"engram-tensors")
            for tensor in (self.values, self.scales):
                flat = tensor.detach().cpu().contiguous().reshape(-1)
                for begin in range(0, flat.numel(), DEFAULT_CHUNK_BYTES):
                    hasher.update(flat[begin:begin + DEFAULT_CHUNK_BYTES].numpy().tobytes())
            self.digest = hasher.hexdigest()

    head_dim = property(lambda self: self.values.shape[1])
    num_rows = property(lambda self: self.row_end - self.row_start)
    nbytes = property(lambda self: self.num_rows * (self.head_dim + self.head_dim // 32))
    files = property(lambda self: ())

    def share_key(self) -> str:
        return f"tensors {self.digest} {list(self.values.shape)}|rows {self.row_start}-{self.row_end}|packed"

    def read_into(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        values.copy_(self.values[self.row_start:self.row_end])
        scales.copy_(self.scales[self.row_start:self.row_end])


def row_file_placeholders(row_file) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values uint8 [rows, D], scales uint8 [rows, D // 32])`` that hold no rows (one zero row, expanded),
    the values carrying the open, checked ``row_file`` (a :class:`~engram.table.disk.row_file.RowFile`): what
    placement ``"disk"`` takes in place of the tables' tensors to serve that file without reading or hashing
    the tensors again."""
    layout = row_file.layout
    values = torch.zeros(1, layout.head_dim, dtype=torch.uint8).expand(layout.num_rows, -1)
    scales = torch.zeros(1, layout.head_dim // 32, dtype=torch.uint8).expand(layout.num_rows, -1)
    setattr(values, ROW_FILE_ATTRIBUTE, row_file)
    return values, scales


# ---------------------------------------------------------------------------
# pieces of the write
# ---------------------------------------------------------------------------
def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _pread_exact(fd: int, count: int, offset: int) -> bytes:
    pieces, done = [], 0
    while done < count:
        piece = os.pread(fd, count - done, offset + done)
        if not piece:
            raise OSError(errno.EIO, f"short read at offset {offset + done}: the file ended")
        pieces.append(piece)
        done += len(piece)
    return b"".join(pieces)


def _pack_pages(source: "TableSource", layout: RowFileLayout, first: int, end: int) -> np.ndarray:
    """Pages holding stored rows ``[first, end)`` (``first`` at a page start): ``uint8 [pages, page_bytes]``."""
    per_page, row_bytes = layout.rows_per_page, layout.row_bytes
    real_end = min(end, layout.num_rows)   # the zero row (index num_rows) is not in the checkpoint
    count, num_pages = real_end - first, -(-(end - first) // per_page)
    # Whole pages of row slots (+1 row for PackedRows' zero row): slots past the last row stay zero.
    buffer = torch.zeros((num_pages * per_page + 1) * row_bytes, dtype=torch.uint8)
    rows = PackedRows.view_of(buffer, count, source.head_dim)   # zero pad and zero row written here
    if count:
        piece = dataclasses.replace(source, row_start=source.row_start + first, row_end=source.row_start + real_end,
                                    progress=None)
        piece.read_into(rows.values, rows.scales)
    write_row_tags(rows.packed, first)   # tags first .. real_end (the zero row's: num_rows)
    if end - first == count:   # a chunk before the last: the zero row's slot belongs to the next chunk
        buffer[count * row_bytes:(count + 1) * row_bytes].zero_()
    pages = np.zeros((num_pages, layout.page_bytes), dtype=np.uint8)
    pages[:, :per_page * row_bytes] = buffer[:num_pages * per_page * row_bytes].numpy().reshape(num_pages, -1)
    return pages


def _tags_hold(fd: int, layout: RowFileLayout, rows_written: int) -> bool:
    """Whether the last page written before ``rows_written`` holds its rows with their tags."""
    if rows_written == 0:
        return True
    page = (rows_written - 1) // layout.rows_per_page
    first = page * layout.rows_per_page
    try:
        data = _pread_exact(fd, layout.page_bytes, layout.page_offset(page))
    except OSError:
        return False
    count = rows_written - first
    slots = torch.frombuffer(bytearray(data[:count * layout.row_bytes]), dtype=torch.uint8).view(count, layout.row_bytes)
    return bool(torch.equal(row_tags(slots).to(torch.int64), torch.arange(first, rows_written)))


def _resumable_rows(fd: int, layout: RowFileLayout, fingerprint: bytes) -> int:
    """Rows a temporary file holds, written and verified by an earlier write of these rows; 0 when it
    is not such a file (empty, another layout or content, damaged)."""
    try:
        header = read_header(fd)
    except HeaderProblem:
        return 0
    if header.fingerprint != fingerprint or header.layout != layout or os.fstat(fd).st_size != layout.file_bytes:
        return 0
    written = header.rows_written
    if written % layout.rows_per_page and written != layout.stored_rows:
        return 0
    return written if _tags_hold(fd, layout, written) else 0


def _remove_superseded(directory: Path, source: "TableSource", temporary: Path) -> None:
    """Remove the ``.tmp`` of earlier writes of these rows from these checkpoint files as they were
    before they changed (another fingerprint): never resumable, never locked by a live writer."""
    paths = [os.path.realpath(f) for f in source.files]
    paths = list(dict.fromkeys(paths))
    for stale in directory.glob(f"{_slug(source)}-*{FILE_SUFFIX}{TEMPORARY_SUFFIX}"):
        if stale == temporary:
            continue
        try:
            fd = os.open(stale, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            header = read_header(fd)
            if [s[0] for s in header.sources] == paths and os.stat(stale).st_ino == os.fstat(fd).st_ino:
                os.unlink(stale)
        except (OSError, HeaderProblem):
            pass
        finally:
            os.close(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# the write
# ---------------------------------------------------------------------------
def write_row_file(source: "TableSource", directory: str | os.PathLike, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   progress: bool = True) -> Path:
    """Write the row file of ``source`` into ``directory`` (module docstring) and return its path:
    continues an interrupted write of the same rows, replaces a file of that name that is not valid.
    ValueError before any byte is written when ``directory`` is not a writable directory or lacks
    room, or when another process is writing the same file now."""
    directory = check_directory(directory)
    check_positive_int("chunk_bytes", chunk_bytes)
    layout = RowFileLayout(source.num_rows, source.head_dim)
    stamps = source_stamps(source.files)
    fingerprint = row_file_fingerprint(source.share_key(), layout)
    path = row_file_path(source, directory, fingerprint)
    temporary = path.with_name(path.name + TEMPORARY_SUFFIX)
    try:
        on_disk = os.stat(temporary).st_blocks * 512
    except FileNotFoundError:
        on_disk = 0
    check_room(directory, max(0, layout.file_bytes - on_disk), f"the row file {path.name}", DISK_ROOM_ADVICE)
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"directory: {str(temporary)!r} is being written by another process now; wait for "
                                 f"it (it leaves {path.name} when done)") from None
            raise
        try:   # another writer may have finished it meanwhile
            return open_row_file(path, fingerprint, layout.num_rows, layout.head_dim).path
        except ValueError:
            pass
        _remove_superseded(directory, source, temporary)
        first = _resumable_rows(fd, layout, fingerprint)
        if first == 0:
            os.ftruncate(fd, 0)
        os.ftruncate(fd, layout.file_bytes)
        _reserve(fd, layout, directory, path)
        _write_rows(fd, source, layout, fingerprint, stamps, first, chunk_bytes, progress)
        os.replace(temporary, path)
        _fsync_directory(directory)
    finally:
        os.close(fd)   # releases the lock
    return path


def _reserve(fd: int, layout: RowFileLayout, directory: Path, path: Path) -> None:
    try:
        reserve(fd, 0, layout.file_bytes, directory, layout.file_bytes, f"the row file {path.name}", DISK_ROOM_ADVICE)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise   # a file system without fallocate: its writes find ENOSPC instead


def _write_rows(fd: int, source: "TableSource", layout: RowFileLayout, fingerprint: bytes, stamps, first: int,
                chunk_bytes: int, progress: bool) -> None:
    header = RowFileHeader(layout, fingerprint, source.share_key(), source.description, stamps, False, first,
                           os.getpid(), time.time())

    def record(rows_written: int, filled: bool = False) -> None:
        nonlocal header
        header = dataclasses.replace(header, rows_written=rows_written, filled=filled, write_time_s=time.time())
        _pwrite_all(fd, memoryview(header.encode()), 0)
        os.fsync(fd)

    record(first)
    chunk_rows = max(1, chunk_bytes // layout.page_bytes) * layout.rows_per_page
    source_row_bytes = source.head_dim + source.head_dim // 32
    bar = progress_bar(source.nbytes, f"{source.description} -> row file", unit="B", unit_divisor=1024,
                       enabled=progress)
    try:
        bar.update(min(first, layout.num_rows) * source_row_bytes)
        for begin in range(first, layout.stored_rows, chunk_rows):
            end = min(begin + chunk_rows, layout.stored_rows)
            pages = _pack_pages(source, layout, begin, end)
            offset = layout.page_offset(begin // layout.rows_per_page)
            _pwrite_all(fd, memoryview(pages).cast("B"), offset)
            os.fsync(fd)
            if _pread_exact(fd, pages.nbytes, offset) != pages.tobytes():
                raise OSError(errno.EIO, f"{source.description}: the pages written at offset {offset} read back "
                                         f"different (the disk or file system lost the write)")
            record(end)
            bar.update((min(end, layout.num_rows) - min(begin, layout.num_rows)) * source_row_bytes)
        record(layout.stored_rows, filled=True)
    finally:
        bar.close()


def ensure_row_file(source: "TableSource", directory: str | os.PathLike, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    progress: bool = True) -> Path:
    """The row file of ``source`` in ``directory``: the existing one when it is valid for the
    checkpoint as it is now (files' size and mtime, tensors, row range, layout: its fingerprint and
    every check of :func:`open_row_file`), else written (:func:`write_row_file`)."""
    directory = check_directory(directory, writable=False)
    layout = RowFileLayout(source.num_rows, source.head_dim)
    fingerprint = row_file_fingerprint(source.share_key(), layout)
    path = row_file_path(source, directory, fingerprint)
    if path.exists():
        try:
            return open_row_file(path, fingerprint, layout.num_rows, layout.head_dim).path
        except ValueError:
            pass   # damaged or incomplete: written again
    return write_row_file(source, directory, chunk_bytes=chunk_bytes, progress=progress)
