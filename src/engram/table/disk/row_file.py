"""The disk tier's row file: one table's (or rank shard's) packed rows on local disk, in 4 KiB pages.

Rows are packed exactly as placement ``"host"`` packs them (:mod:`engram.table.host_memory.rows`):
``packed_row_bytes(D)`` bytes a row, ``[D E4M3 values | D/32 UE8M0 scales | zero pad | int32 tag =
the row's own index]`` (272 B at D = 256), and after the table's ``num_rows`` rows the zero row
(value +0, scale byte 0, tag ``num_rows``) that stands in for ids outside the table. The file::

    [ header region: HEADER_REGION_BYTES = 64 KiB ][ page 0 ][ page 1 ] ...   each page PAGE_BYTES = 4096

Page ``p`` holds rows ``[p * R, (p + 1) * R)`` with ``R = PAGE_BYTES // row_bytes`` (15 at 272 B),
then zeros (16 B at 272 B; the last page's unused rows are zeros too), so no row crosses a 4 KiB
page and one aligned ``O_DIRECT`` read of a page serves every row on it::

    offset(r) = HEADER_REGION_BYTES + (r // R) * PAGE_BYTES + (r % R) * row_bytes

Header, little-endian (encoded and parsed by :class:`engram.table.file_header.HeaderFormat`, the
scheme the tmpfs tables' header uses too): magic ``ENGRAMDK``, format version, filled flag, rows
offset, page bytes, bytes per row, rows per page, head_dim, rows of the table, file bytes, length
of a JSON part, a reserved word, the 32-byte content fingerprint (:func:`row_file_fingerprint`:
the checkpoint's files, tensors and row range, and this layout); then the JSON part (kind
``"rows"``, the share key and description of the rows, the source files with size and mtime, the
rows written so far, the writer's pid and time); then a 32-byte BLAKE2b checksum. The writer
(:mod:`engram.table.disk.writing`) writes it with filled 0, rewrites it after each chunk of rows
(rows written, so an interrupted write resumes) and with filled 1 at the end. A header is parsed
as untrusted input: bounded reads, the JSON part's length and depth checked before it is parsed.

:func:`open_row_file` checks all of it against what the caller expects and refuses a file with one
``ValueError`` naming the file, the field and the value.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engram.checks import check_int
from engram.common import ceil_div
from engram.table.file_header import (HeaderFormat, HeaderProblem, Stamp, check_stamps, content_fingerprint, is_int,
                                      sources_mismatch)
from engram.table.fp8 import BLOCK_SIZE
from engram.table.host_memory.rows import packed_row_bytes

__all__ = ["MAGIC", "FORMAT_VERSION", "PAGE_BYTES", "HEADER_REGION_BYTES", "MAX_JSON_BYTES", "MAX_JSON_DEPTH",
           "RowFileLayout", "RowFileHeader", "RowFile", "open_row_file", "row_file_fingerprint", "read_header"]

MAGIC = b"ENGRAMDK"
FORMAT_VERSION = 1
PAGE_BYTES = 4096
"""Bytes of a page: the unit of an O_DIRECT read (the logical block size of the disks served)."""
HEADER_REGION_BYTES = 64 * 2**10
"""Bytes before the first page (16 pages): room for a header naming long paths."""
MAX_JSON_BYTES = HEADER_REGION_BYTES - 4096
MAX_JSON_DEPTH = 3
"""What is written nests 3 levels: object, sources, one source."""
KIND = "rows"

# magic, version, filled, rows offset, page bytes, row bytes, rows per page, head_dim, rows, file bytes, json, 0, fp
_FIXED = struct.Struct("<8sIIQIIIIQQII32s")
_JSON_FIELD = 10


def _version_problem(version: int) -> str:
    return (f"written by format version {version} (this engram reads version {FORMAT_VERSION} only): write it "
            f"again (`engram tables write`)")


_FORMAT = HeaderFormat(MAGIC, FORMAT_VERSION, _FIXED, _JSON_FIELD, MAX_JSON_BYTES, MAX_JSON_DEPTH,
                       "it is not an engram row file (planted, damaged, or another program's file)", "JSON part",
                       _version_problem)


@dataclass(frozen=True)
class RowFileLayout:
    """Where each row of a table of ``num_rows`` rows of ``head_dim`` values lies in its row file
    (pure arithmetic, module docstring): ``stored_rows = num_rows + 1`` (the zero row last), ``R =
    rows_per_page``, ``offset(r) = rows_offset + (r // R) * page_bytes + (r % R) * row_bytes``."""

    num_rows: int
    head_dim: int
    page_bytes: int = PAGE_BYTES
    rows_offset: int = HEADER_REGION_BYTES

    def __post_init__(self):
        check_int("num_rows", self.num_rows, 0, numpy_ints=True)
        check_int("head_dim", self.head_dim, BLOCK_SIZE, numpy_ints=True)
        if self.head_dim % BLOCK_SIZE:
            raise ValueError(f"head_dim: expected a multiple of {BLOCK_SIZE}, found {self.head_dim}")
        check_int("page_bytes", self.page_bytes, PAGE_BYTES, numpy_ints=True)
        if self.page_bytes % PAGE_BYTES:
            raise ValueError(f"page_bytes: expected a multiple of {PAGE_BYTES}, found {self.page_bytes}")
        if self.row_bytes > self.page_bytes:
            raise ValueError(f"head_dim: rows of {self.row_bytes} B (head_dim {self.head_dim}) do not fit a page of "
                             f"{self.page_bytes} B")
        check_int("rows_offset", self.rows_offset, self.page_bytes, numpy_ints=True)
        if self.rows_offset % self.page_bytes:
            raise ValueError(f"rows_offset: expected a multiple of page_bytes {self.page_bytes}, found "
                             f"{self.rows_offset}")

    @property
    def row_bytes(self) -> int:
        """Bytes of a packed row (:func:`~engram.table.host_memory.rows.packed_row_bytes`)."""
        return packed_row_bytes(self.head_dim)

    @property
    def rows_per_page(self) -> int:
        return self.page_bytes // self.row_bytes

    @property
    def stored_rows(self) -> int:
        """Rows in the file: the table's and the zero row."""
        return self.num_rows + 1

    @property
    def num_pages(self) -> int:
        return ceil_div(self.stored_rows, self.rows_per_page)

    @property
    def file_bytes(self) -> int:
        """Bytes of the whole file: header region and pages."""
        return self.rows_offset + self.num_pages * self.page_bytes

    def page_of(self, rows):
        """Page of each row (an int, or int64 numpy of the shape of ``rows``): ``r // rows_per_page``."""
        return rows // self.rows_per_page if isinstance(rows, (int, np.integer)) else (
            np.asarray(rows, dtype=np.int64) // self.rows_per_page)

    def page_offset(self, pages):
        """File offset of each page: ``rows_offset + p * page_bytes`` (int or int64 numpy)."""
        if isinstance(pages, (int, np.integer)):
            return self.rows_offset + int(pages) * self.page_bytes
        return self.rows_offset + np.asarray(pages, dtype=np.int64) * self.page_bytes

    def row_offset(self, rows):
        """File offset of each row (int or int64 numpy): module docstring's formula."""
        if isinstance(rows, (int, np.integer)):
            page, slot = divmod(int(rows), self.rows_per_page)
            return self.rows_offset + page * self.page_bytes + slot * self.row_bytes
        rows = np.asarray(rows, dtype=np.int64)
        return self.rows_offset + (rows // self.rows_per_page) * self.page_bytes + (
            rows % self.rows_per_page) * self.row_bytes

    def describe(self) -> str:
        return (f"{self.num_rows} rows x {self.row_bytes} B (head_dim {self.head_dim}), {self.rows_per_page} rows per "
                f"{self.page_bytes}-byte page from byte {self.rows_offset}")


def row_file_fingerprint(share_key: str, layout: RowFileLayout) -> bytes:
    """32 bytes naming a row file's content: BLAKE2b of the rows' share key (files with size and
    mtime, tensors, row range, packed row format: ``TableSource.share_key()``) and the layout."""
    shape = f"engram row file v{FORMAT_VERSION}|{layout.describe()}".encode("utf-8")
    return content_fingerprint(share_key, shape, person=b"engram-disk")


@dataclass(frozen=True)
class RowFileHeader:
    """A row file's header (module docstring for the bytes)."""

    layout: RowFileLayout
    fingerprint: bytes
    share_key: str
    description: str = ""
    sources: tuple[Stamp, ...] = ()
    filled: bool = False
    rows_written: int = 0
    writer_pid: int = 0
    write_time_s: float = 0.0
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        layout = self.layout
        meta = {"kind": KIND, "share_key": self.share_key, "description": self.description,
                "sources": [list(s) for s in self.sources], "rows_written": self.rows_written,
                "writer_pid": self.writer_pid, "write_time_s": self.write_time_s}
        return _FORMAT.encode((self.version, int(self.filled), layout.rows_offset, layout.page_bytes,
                               layout.row_bytes, layout.rows_per_page, layout.head_dim, layout.num_rows,
                               layout.file_bytes, 0, self.fingerprint), meta, layout.rows_offset, "share_key")

    @classmethod
    def read(cls, fd: int, file_bytes: int) -> "RowFileHeader":
        """The header of the open file ``fd`` of ``file_bytes`` bytes; HeaderProblem naming the field
        when it is not a valid one (whatever the bytes)."""
        fixed, meta = _FORMAT.read(fd, file_bytes)
        (_, version, filled, rows_offset, page_bytes, row_bytes, rows_per_page, head_dim, num_rows, stored_bytes, _,
         _, fingerprint) = fixed
        kind, key, description = meta.get("kind"), meta.get("share_key"), meta.get("description")
        written, pid, when = meta.get("rows_written"), meta.get("writer_pid"), meta.get("write_time_s")
        if kind != KIND:
            raise HeaderProblem(f"its header's kind is {str(kind)[:80]!r}, expected {KIND!r}")
        if not isinstance(key, str) or not key or not isinstance(description, str):
            raise HeaderProblem("its header's share key or description is not a string")
        stamps = check_stamps(meta.get("sources"), "its header's sources")
        if not is_int(written) or not is_int(pid) or not isinstance(when, (int, float)) or isinstance(when, bool):
            raise HeaderProblem("its header's rows written, writer pid or write time is not a number")
        try:
            layout = RowFileLayout(num_rows, head_dim, page_bytes, rows_offset)
        except ValueError as error:
            raise HeaderProblem(f"its header's row layout is impossible ({error})") from None
        for name, found, expected in (("bytes per row", row_bytes, layout.row_bytes),
                                      ("rows per page", rows_per_page, layout.rows_per_page),
                                      ("file bytes", stored_bytes, layout.file_bytes)):
            if found != expected:
                raise HeaderProblem(f"its header's {name} is {found}, inconsistent with its layout ({expected})")
        if not 0 <= written <= layout.stored_rows:
            raise HeaderProblem(f"its header's rows written is {written}, outside 0..{layout.stored_rows}")
        return cls(layout, fingerprint, key, description, stamps, bool(filled), written, pid, float(when), version)


def read_header(fd: int) -> RowFileHeader:
    """:meth:`RowFileHeader.read` of an open file, its size taken from ``fstat``."""
    return RowFileHeader.read(fd, os.fstat(fd).st_size)


@dataclass(frozen=True)
class RowFile:
    """A checked row file (:func:`open_row_file`): its path, layout and header, and the identity
    (device, inode) of the file checked, which a reader opening the path again compares."""

    path: Path
    layout: RowFileLayout
    header: RowFileHeader
    identity: tuple[int, int] = field(default=(0, 0))


def _refuse(path: Path, problem: str) -> ValueError:
    return ValueError(f"{path}: {problem}")


def open_row_file(path: str | os.PathLike, expected_fingerprint: bytes, num_rows: int, head_dim: int) -> RowFile:
    """The row file at ``path`` after checking that it holds the rows of ``num_rows x head_dim`` that
    ``expected_fingerprint`` (:func:`row_file_fingerprint`) names, completely written: its header
    (magic, format version, checksum, fields), the checkpoint it was written from, its row layout and
    its size. One ValueError ``"<path>: <field and value>"`` otherwise (``truncated (N bytes, expected
    M)``, ``header of another checkpoint ...``, ``written by format version X ...``)."""
    path = Path(path)
    expected = RowFileLayout(num_rows, head_dim)
    if not isinstance(expected_fingerprint, (bytes, bytearray)) or len(expected_fingerprint) != 32:
        raise ValueError(f"expected_fingerprint: expected 32 bytes, found {expected_fingerprint!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        raise _refuse(path, f"cannot be opened ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        size = info.st_size
        try:
            header = RowFileHeader.read(fd, size)
        except HeaderProblem as problem:
            if 0 <= size < expected.file_bytes:
                raise _refuse(path, f"truncated ({size} bytes, expected {expected.file_bytes}): {problem}") from None
            raise _refuse(path, str(problem)) from None
    finally:
        os.close(fd)
    if header.fingerprint != bytes(expected_fingerprint):
        why = sources_mismatch(header.sources, [s[0] for s in header.sources], "written")
        raise _refuse(path, f"header of another checkpoint (its fingerprint {header.fingerprint.hex()[:16]}..., "
                            f"expected {bytes(expected_fingerprint).hex()[:16]}...; written from {header.description!r}"
                            f"{f': {why}' if why else ''})")
    if header.layout != expected:
        raise _refuse(path, f"row layout {header.layout.describe()}, expected {expected.describe()}")
    if size != expected.file_bytes:
        what = "truncated" if size < expected.file_bytes else "resized"
        raise _refuse(path, f"{what} ({size} bytes, expected {expected.file_bytes})")
    if not header.filled or header.rows_written != expected.stored_rows:
        raise _refuse(path, f"never completely written (filled flag {int(header.filled)}, {header.rows_written} of "
                            f"{expected.stored_rows} rows written)")
    return RowFile(path, expected, header, (info.st_dev, info.st_ino))
