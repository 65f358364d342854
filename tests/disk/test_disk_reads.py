"""Reads of a row file by id, by the native reader (disk_reads.c: O_DIRECT page reads by a thread pool)
and the Python one (os.pread): rows bit-equal to placement "host"'s packing, the buffered fallback
where O_DIRECT is refused (said once), read errors named with the file and offset, bad input refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import fresh_seed, missing_dependency
from disk_tables import disk_checkpoint
from engram.table.disk import reads
from engram.table.disk.reads import RowReader, RowReadError, read_rows
from engram.table.disk.row_file import PAGE_BYTES, open_row_file
from engram.table.disk.writing import source_fingerprint, write_row_file

SEED = fresh_seed(__name__)
BACKENDS = ["native", "python"]
WAIT_S = 60.0


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """(row file path, fingerprint, rows, head_dim, placement "host"'s packed rows)."""
    model = disk_checkpoint(tmp_path_factory.mktemp("disk-reads") / "model", SEED)
    source = model.source(0)
    path = write_row_file(source, tmp_path_factory.mktemp("rows"), progress=False)
    return path, source_fingerprint(source), source.num_rows, source.head_dim, model.host_rows(0)


def checked(table, path=None):
    default, fingerprint, rows, head_dim, _ = table
    return open_row_file(path or default, fingerprint, rows, head_dim)


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "native" and reads.unavailable_reason() is not None:
        missing_dependency(f"the native disk reader: {reads.unavailable_reason()}")
    return request.param


def mixed_ids(rng, rows: int, per_page: int, count: int = 3000) -> np.ndarray:
    """Random ids with the first and last rows, the zero row, duplicates and several ids on one page."""
    page = int(rng.integers(0, rows // per_page))
    special = [0, rows - 1, rows, 0, rows - 1, *range(page * per_page, page * per_page + per_page)]
    ids = np.concatenate([rng.integers(0, rows + 1, count), special, rng.integers(0, rows, 50).repeat(3)])
    return ids[rng.permutation(ids.size)]


@pytest.mark.parametrize("threads", [0, 1, 63])
def test_rows_read_back_bit_equal(table, backend, threads, rng):
    row_file = checked(table)
    reference = table[4]
    ids = mixed_ids(rng, row_file.layout.num_rows, row_file.layout.rows_per_page)
    with RowReader(row_file, threads, backend=backend) as reader:
        assert reader.backend == backend and (reader.direct if backend == "native" else not reader.direct)
        out = torch.full((ids.size, row_file.layout.row_bytes), 0xAA, dtype=torch.uint8)   # poisoned
        assert reader.read(ids, out) is out
        assert torch.equal(out, reference[torch.from_numpy(ids)])
        again = reader.read(torch.from_numpy(ids[:7]).to(torch.int32))   # a tensor of ids, a new output
        assert torch.equal(again, reference[torch.from_numpy(ids[:7])])
        assert reader.read(np.zeros(0, dtype=np.int64)).shape == (0, row_file.layout.row_bytes)


def test_both_readers_agree_and_each_page_is_read_once(table, rng, monkeypatch):
    row_file = checked(table)
    ids = mixed_ids(rng, row_file.layout.num_rows, row_file.layout.rows_per_page)
    pages = np.unique(ids // row_file.layout.rows_per_page).size
    offsets = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: offsets.append(offset) or real(fd, n, offset))
    python = read_rows(row_file, ids, threads=4, backend="python")
    assert len(offsets) == pages == len(set(offsets))   # two ids on one page: one read
    if reads.unavailable_reason() is None:
        assert torch.equal(read_rows(row_file, ids, threads=4, backend="native"), python)


def test_bad_input_is_refused_before_any_read(table, backend):
    row_file = checked(table)
    stored = row_file.layout.stored_rows
    with RowReader(row_file, 2, backend=backend) as reader:
        with pytest.raises(ValueError, match=f"ids: row {stored} at position 1 is outside the rows \\[0, {stored}\\)"):
            reader.read([3, stored, 4])
        with pytest.raises(ValueError, match="ids: row -1 at position 0"):
            reader.read([-1])
        with pytest.raises(ValueError, match="ids: expected integer row ids, found float"):
            reader.read(np.array([1.0]))
        with pytest.raises(ValueError, match=r"out: expected a contiguous CPU uint8 tensor \[2, 272\], found "
                                             r"torch.uint8 \[2, 271\]"):
            reader.read([1, 2], torch.empty(2, 271, dtype=torch.uint8))
    with pytest.raises(ValueError, match="this reader is closed"):
        reader.read([1])
    with pytest.raises(ValueError, match="threads: expected an integer in \\[0, 1024\\], found 2000"):
        RowReader(row_file, 2000, backend=backend)
    with pytest.raises(ValueError, match="backend: expected one of"):
        RowReader(row_file, 1, backend="uring")


def test_a_file_replaced_since_it_was_checked_is_refused(table, backend, tmp_path):
    path = tmp_path / "rows"
    shutil.copyfile(table[0], path)
    row_file = checked(table, path)
    shutil.copyfile(table[0], tmp_path / "other")
    os.replace(tmp_path / "other", path)
    with pytest.raises(ValueError, match=f"{path}: replaced since it was checked"):
        RowReader(row_file, 1, backend=backend)


def _bounded(call) -> BaseException | None:
    """What ``call()`` raised, run in a thread that must end within WAIT_S (a read error must not hang)."""
    caught: list[BaseException | None] = [None]

    def run():
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            caught[0] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(WAIT_S)
    assert not worker.is_alive(), "the read hung"
    return caught[0]


@pytest.mark.parametrize("threads", [0, 4])
def test_a_file_truncated_after_it_was_opened_fails_naming_the_file_and_offset(table, backend, threads, tmp_path):
    path = tmp_path / "rows"
    shutil.copyfile(table[0], path)
    row_file = checked(table, path)
    layout = row_file.layout
    with RowReader(row_file, threads, backend=backend) as reader:
        kept_pages = 3
        os.truncate(path, layout.rows_offset + kept_pages * PAGE_BYTES)
        row = (kept_pages + 2) * layout.rows_per_page + 1
        ids = np.array([0, 1, row, row + 1, layout.rows_per_page])
        error = _bounded(lambda: reader.read(ids))
        assert isinstance(error, RowReadError) and isinstance(error, OSError), error
        offset = layout.page_offset(kept_pages + 2)
        assert (error.row, error.offset, error.got) == (row, offset, 0) and error.path == path
        assert str(error).startswith(f"{path}: reading row {row} at file offset {offset} failed: short read: 0 of "
                                     f"{PAGE_BYTES} bytes")
        assert torch.equal(reader.read([0, 1]), table[4][[0, 1]])   # the pages still there read fine


def _refuses_direct(directory: str) -> bool:
    probe = os.path.join(directory, "engram-direct-probe")
    with open(probe, "wb") as file:
        file.write(bytes(PAGE_BYTES))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return False
    except OSError:
        return True
    finally:
        os.unlink(probe)


@pytest.fixture
def no_direct_dir():
    """A directory whose file system refuses O_DIRECT: /dev/shm where it does (tmpfs before Linux 6.6),
    else a ramfs mounted for the test (as root)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) and _refuses_direct("/dev/shm"):
        directory = tempfile.mkdtemp(prefix="engram-disk-test-", dir="/dev/shm")
        yield directory
        shutil.rmtree(directory, ignore_errors=True)
        return
    if os.getuid() != 0 or shutil.which("mount") is None:
        pytest.skip("no file system refusing O_DIRECT here (tmpfs of Linux >= 6.6 takes it; a ramfs needs root)")
    directory = tempfile.mkdtemp(prefix="engram-ramfs-test-")
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", directory], capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"no file system refusing O_DIRECT here (mount -t ramfs: {mounted.stderr.strip()})")
    try:
        assert _refuses_direct(directory)
        yield directory
    finally:
        subprocess.run(["umount", directory], capture_output=True)
        os.rmdir(directory)


def test_where_o_direct_is_refused_reads_are_buffered_and_said_once(table, no_direct_dir, rng, monkeypatch):
    if reads.unavailable_reason() is not None:
        missing_dependency(f"the native disk reader: {reads.unavailable_reason()}")
    monkeypatch.setattr(reads, "_WARNED_DEVICES", set())
    path = Path(no_direct_dir) / "rows"
    shutil.copyfile(table[0], path)
    row_file = checked(table, path)
    ids = mixed_ids(rng, row_file.layout.num_rows, row_file.layout.rows_per_page, 500)
    with pytest.warns(RuntimeWarning, match=f"the file system of {path} \\(.* at {no_direct_dir}\\) refuses O_DIRECT"):
        reader = RowReader(row_file, 3, backend="native")
    with reader:
        assert not reader.direct and torch.equal(reader.read(ids), table[4][torch.from_numpy(ids)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same file system again: no second warning
        with RowReader(row_file, 0, backend="native") as again:
            assert torch.equal(again.read(ids), table[4][torch.from_numpy(ids)])
