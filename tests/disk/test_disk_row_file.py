"""The disk tier's row file: its layout arithmetic, the rows written (bit-equal to placement "host"'s
packing), every refusal of open_row_file by name, resumable writes, room refused before any byte, and
ensure_row_file's reuse."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import struct

import numpy as np
import pytest
import torch

from conftest import fresh_seed
from disk_tables import disk_checkpoint
from engram.checkpoint.loading import TableSource
from engram.table.disk import row_file as row_file_module
from engram.table.disk.row_file import (FORMAT_VERSION, HEADER_REGION_BYTES, PAGE_BYTES, RowFileLayout, open_row_file,
                                        read_header)
from engram.table.file_header import header_checksum
from engram.table.disk.writing import ensure_row_file, row_file_path, source_fingerprint, write_row_file

SEED = fresh_seed(__name__)
CHUNK = 256 * PAGE_BYTES   # 256 pages a chunk: the test tables take 14 chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return disk_checkpoint(tmp_path_factory.mktemp("disk-model") / "model", SEED)


@pytest.fixture(scope="module")
def reference(model):
    return model.host_rows(0)


def file_rows(path, layout: RowFileLayout) -> torch.Tensor:
    """Every stored row of the file at ``path``, by the layout's offsets (numpy, no reader)."""
    data = np.fromfile(path, dtype=np.uint8)
    offsets = layout.row_offset(np.arange(layout.stored_rows))
    return torch.from_numpy(data[offsets[:, None] + np.arange(layout.row_bytes)])


def test_layout_arithmetic(rng):
    layout = RowFileLayout(384_006_168, 256)
    assert (layout.row_bytes, layout.rows_per_page, layout.stored_rows) == (272, 15, 384_006_169)
    assert layout.row_offset(0) == HEADER_REGION_BYTES and layout.row_offset(14) == HEADER_REGION_BYTES + 14 * 272
    assert layout.row_offset(15) == HEADER_REGION_BYTES + PAGE_BYTES and layout.page_of(29) == 1
    assert layout.file_bytes == HEADER_REGION_BYTES + -(-384_006_169 // 15) * PAGE_BYTES
    head_dim = int(rng.integers(1, 40)) * 32
    small = RowFileLayout(int(rng.integers(0, 10_000)), head_dim)
    rows = rng.integers(0, small.stored_rows, 1000)
    offsets = small.row_offset(rows)
    assert offsets.dtype == np.int64 and offsets.tolist() == [small.row_offset(int(r)) for r in rows]
    assert np.all((offsets - small.rows_offset) % PAGE_BYTES + small.row_bytes <= PAGE_BYTES)   # no row crosses a page
    assert np.all(small.page_of(rows) == (offsets - small.rows_offset) // PAGE_BYTES)
    assert small.row_offset(small.stored_rows - 1) + small.row_bytes <= small.file_bytes
    for bad, field in ((dict(num_rows=-1, head_dim=256), "num_rows"), (dict(num_rows=5, head_dim=100), "head_dim"),
                       (dict(num_rows=5, head_dim=256, page_bytes=1000), "page_bytes")):
        with pytest.raises(ValueError, match=field):
            RowFileLayout(**bad)


def test_written_rows_are_the_host_packing(model, reference, tmp_path):
    source = model.source(0)
    path = write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    assert path == row_file_path(source, tmp_path) and path.name.endswith(".engram-rows")
    assert source_fingerprint(source).hex()[:32] in path.name and not list(tmp_path.glob("*.tmp"))
    checked = open_row_file(path, source_fingerprint(source), source.num_rows, source.head_dim)
    layout = checked.layout
    assert checked.header.filled and checked.header.rows_written == layout.stored_rows
    assert torch.equal(file_rows(path, layout), reference)
    data = np.fromfile(path, dtype=np.uint8)[layout.rows_offset:].reshape(layout.num_pages, PAGE_BYTES)
    assert not data[:, layout.rows_per_page * layout.row_bytes:].any()   # each page's tail is zero
    last = layout.stored_rows - (layout.num_pages - 1) * layout.rows_per_page
    assert not data[-1, last * layout.row_bytes:].any()                 # so are the last page's unused slots
    assert checked.header.sources == tuple((os.path.realpath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns)
                                           for f in dict.fromkeys(source.files))


def _rewrite_header(path, **changes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        header = read_header(fd)
        os.pwrite(fd, dataclasses.replace(header, **changes).encode(), 0)
    finally:
        os.close(fd)


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x5A]))


@pytest.fixture
def written(model, tmp_path):
    source = model.source(0)
    return source, write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)


@pytest.mark.parametrize("damage", ["truncated", "truncated into the header", "header byte", "fingerprint byte",
                                    "format version", "never filled", "grown", "not ours"])
def test_a_damaged_file_is_refused_by_name(written, damage, rng):
    source, path = written
    layout = RowFileLayout(source.num_rows, source.head_dim)
    if damage == "truncated":
        size = int(rng.integers(layout.rows_offset, layout.file_bytes))
        os.truncate(path, size)
        says = f"{path}: truncated ({size} bytes, expected {layout.file_bytes})"
    elif damage == "truncated into the header":
        os.truncate(path, 100)
        says = f"{path}: truncated (100 bytes, expected {layout.file_bytes}): it holds only 100 bytes"
    elif damage == "header byte":
        # a field of the fixed part between the version (bytes 8-11) and the JSON part's length (56-59),
        # whose damage the length check may name first
        _flip_byte(path, int(rng.integers(12, 56)))
        says = f"{path}: its header checksum does not match"
    elif damage == "fingerprint byte":
        _rewrite_header(path, fingerprint=bytes(32))
        says = f"{path}: header of another checkpoint (its fingerprint 0000000000000000..."
    elif damage == "format version":
        _rewrite_header(path, version=FORMAT_VERSION + 1)
        says = f"{path}: written by format version {FORMAT_VERSION + 1} (this engram reads version {FORMAT_VERSION}"
    elif damage == "never filled":
        _rewrite_header(path, filled=False, rows_written=layout.rows_per_page)
        says = f"{path}: never completely written (filled flag 0, {layout.rows_per_page} of {layout.stored_rows}"
    elif damage == "grown":
        os.truncate(path, layout.file_bytes + PAGE_BYTES)
        says = f"{path}: resized ({layout.file_bytes + PAGE_BYTES} bytes, expected {layout.file_bytes})"
    else:
        with open(path, "r+b") as file:
            file.write(b"NOTOURS!")
        says = f"{path}: it does not start with the magic b'ENGRAMDK' (found b'NOTOURS!')"
    with pytest.raises(ValueError) as refused:
        open_row_file(path, source_fingerprint(source), source.num_rows, source.head_dim)
    assert str(refused.value).startswith(says), str(refused.value)


def test_another_checkpoint_and_another_layout_are_refused(written, model):
    source, path = written
    other = model.source(1)
    with pytest.raises(ValueError, match=r"header of another checkpoint \(its fingerprint [0-9a-f]{16}\.\.\., "
                                         r"expected [0-9a-f]{16}\.\.\.; written from 'layer 1 table'"):
        open_row_file(path, source_fingerprint(other), source.num_rows, source.head_dim)
    with pytest.raises(ValueError, match=f"{path}: row layout {source.num_rows} rows x 272 B .* expected "
                                         f"{source.num_rows + 1} rows"):
        open_row_file(path, source_fingerprint(source), source.num_rows + 1, source.head_dim)
    with pytest.raises(ValueError, match="expected_fingerprint: expected 32 bytes"):
        open_row_file(path, b"short", source.num_rows, source.head_dim)


def test_a_planted_header_is_parsed_as_untrusted_input(written):
    source, path = written
    fixed = row_file_module._FIXED
    with open(path, "rb") as file:
        values = list(fixed.unpack(file.read(fixed.size)))
    values[row_file_module._JSON_FIELD] = 2**31
    with open(path, "r+b") as file:
        file.write(fixed.pack(*values))
    with pytest.raises(ValueError, match="claims 2147483648 bytes of JSON part, more than the limit"):
        open_row_file(path, source_fingerprint(source), source.num_rows, source.head_dim)
    nested = b"[" * 20_000 + b"]" * 20_000
    values[row_file_module._JSON_FIELD] = len(nested)
    body = fixed.pack(*values) + nested
    with open(path, "r+b") as file:
        file.write(body + header_checksum(body))
    with pytest.raises(ValueError, match="nests 20000 levels deep"):
        open_row_file(path, source_fingerprint(source), source.num_rows, source.head_dim)


_READ_INTO = TableSource.read_into


class _Interrupt(Exception):
    pass


def _reads_recorded(monkeypatch, fail_after: int | None = None) -> list[int]:
    """Record the first row of each chunk the writer reads; raise after ``fail_after`` chunks."""
    starts, real = [], _READ_INTO

    def read_into(self, values, scales):
        if fail_after is not None and len(starts) == fail_after:
            raise _Interrupt("interrupted mid-write")
        starts.append(self.row_start)
        real(self, values, scales)

    monkeypatch.setattr(TableSource, "read_into", read_into)
    return starts


def test_an_interrupted_write_resumes_from_its_recorded_rows(model, reference, tmp_path, monkeypatch, rng):
    source = model.source(0)
    layout = RowFileLayout(source.num_rows, source.head_dim)
    chunk_rows = (CHUNK // PAGE_BYTES) * layout.rows_per_page
    done = int(rng.integers(1, layout.stored_rows // chunk_rows - 1))
    _reads_recorded(monkeypatch, fail_after=done)
    with pytest.raises(_Interrupt):
        write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    path = row_file_path(source, tmp_path)
    temporary = path.with_name(path.name + ".tmp")
    assert not path.exists() and temporary.exists()
    fd = os.open(temporary, os.O_RDONLY)
    try:
        header = read_header(fd)
    finally:
        os.close(fd)
    assert (header.filled, header.rows_written) == (False, done * chunk_rows)
    starts = _reads_recorded(monkeypatch)
    assert write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False) == path
    assert starts[0] == done * chunk_rows and starts == list(range(done * chunk_rows, source.num_rows, chunk_rows))
    assert torch.equal(file_rows(path, layout), reference) and not temporary.exists()


def test_a_damaged_resume_point_and_a_changed_checkpoint_restart(model, reference, tmp_path, monkeypatch):
    source = model.source(0)
    layout = RowFileLayout(source.num_rows, source.head_dim)
    _reads_recorded(monkeypatch, fail_after=3)
    with pytest.raises(_Interrupt):
        write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    path = row_file_path(source, tmp_path)
    temporary = path.with_name(path.name + ".tmp")
    chunk_rows = (CHUNK // PAGE_BYTES) * layout.rows_per_page
    _flip_byte(temporary, layout.row_offset(3 * chunk_rows - 1) + layout.row_bytes - 2)   # the last row's tag
    starts = _reads_recorded(monkeypatch, fail_after=2)
    with pytest.raises(_Interrupt):
        write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    assert starts == [0, chunk_rows]   # the recorded rows did not check out: from row 0
    # The checkpoint changes (its files' mtime): another fingerprint, another file, from row 0.
    old_fingerprint = source_fingerprint(source)
    stamp = os.stat(source.values_info.file)
    os.utime(source.values_info.file, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
    changed = model.source(0)
    starts = _reads_recorded(monkeypatch)
    new_path = write_row_file(changed, tmp_path, chunk_bytes=CHUNK, progress=False)
    assert new_path != path and starts[0] == 0 and torch.equal(file_rows(new_path, layout), reference)
    assert not temporary.exists()   # the superseded write of these files is gone
    with pytest.raises(ValueError, match="header of another checkpoint"):
        open_row_file(new_path, old_fingerprint, source.num_rows, source.head_dim)


def test_a_directory_without_room_is_refused_before_any_byte(model, tmp_path, monkeypatch):
    source = model.source(0)
    layout = RowFileLayout(source.num_rows, source.head_dim)
    real = os.statvfs
    free_blocks = (layout.file_bytes - 1) // real(tmp_path).f_frsize

    def statvfs(path):
        stats = real(path)
        return os.statvfs_result((stats.f_bsize, stats.f_frsize, stats.f_blocks, free_blocks, free_blocks,
                                  *tuple(stats)[5:]))

    monkeypatch.setattr(os, "statvfs", statvfs)
    started = _reads_recorded(monkeypatch)
    with pytest.raises(ValueError, match=rf"directory: '{tmp_path}' has \d+ bytes free of \d+, the row file "
                                         rf"{row_file_path(source, tmp_path).name} needs {layout.file_bytes} bytes: "
                                         r"free space there"):
        write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    assert os.listdir(tmp_path) == [] and started == []


def test_ensure_reuses_a_valid_file_and_rewrites_a_damaged_one(model, reference, tmp_path, monkeypatch):
    source = model.source(0)
    path = ensure_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    before = os.stat(path)
    starts = _reads_recorded(monkeypatch)
    assert ensure_row_file(model.source(0), tmp_path, chunk_bytes=CHUNK, progress=False) == path
    assert starts == [] and os.stat(path).st_mtime_ns == before.st_mtime_ns
    os.truncate(path, before.st_size - PAGE_BYTES)
    assert ensure_row_file(model.source(0), tmp_path, chunk_bytes=CHUNK, progress=False) == path
    assert starts[0] == 0 and torch.equal(file_rows(path, RowFileLayout(source.num_rows, source.head_dim)), reference)


def test_a_write_in_progress_elsewhere_is_refused(model, tmp_path):
    source = model.source(0)
    path = row_file_path(source, tmp_path)
    temporary = path.with_name(path.name + ".tmp")
    holder = os.open(temporary, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)   # another open file description: as another process's writer
        with pytest.raises(ValueError, match="is being written by another process now"):
            write_row_file(source, tmp_path, chunk_bytes=CHUNK, progress=False)
    finally:
        os.close(holder)
    assert not path.exists()


def test_header_fields_round_trip(written):
    source, path = written
    fd = os.open(path, os.O_RDONLY)
    try:
        header = read_header(fd)
    finally:
        os.close(fd)
    assert header.layout == RowFileLayout(source.num_rows, source.head_dim) and header.share_key == source.share_key()
    assert header.description == "layer 1 table" and header.writer_pid == os.getpid()
    assert struct.unpack_from("<8s", path.read_bytes()[:8])[0] == b"ENGRAMDK"
