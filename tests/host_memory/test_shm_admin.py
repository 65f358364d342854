"""``engram shm list|remove`` and the clean-up after every fill, over planted and leftover files: a
header is untrusted input (its checksum is not keyed), so whatever a file in the directory holds, the
listing, ``remove --all-stale`` and a victim's load do not fail on it; each bad file is reported as
that file's problem. Also: a live CPU peer shard is never stale, a dead rank's shard is, and files of
older header versions are stale.

Files go to a fresh directory under /dev/shm (a tmpfs), removed afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch

from engram.table.host_memory import shm_admin, shm_files
from engram.table.host_memory.buffers import allocate_host_buffer, shared_buffer_path
from engram.table.host_memory.shm_admin import list_shared_tables, remove_shared_table

SHM = Path("/dev/shm")
WAIT_S = 120.0   # bound of every wait on a child process (never reached when things work)


@pytest.fixture
def shm_dir():
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        pytest.skip("/dev/shm is not a writable directory on this machine")
    directory = tempfile.mkdtemp(prefix="engram-admin-test-", dir=SHM)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def fill_pattern(seed: int, tensor: torch.Tensor) -> None:
    tensor.copy_(pattern(seed, tensor.numel()))


def header_bytes(meta: bytes, *, version: int = shm_files.FORMAT_VERSION, meta_length: int | None = None,
                 rows: int = 0, row_bytes: int = 1) -> bytes:
    """A header whose checksum passes (anyone can compute it) around the JSON part ``meta``."""
    fixed = shm_files._FIXED.pack(shm_files.MAGIC, version, 1, shm_files.HEADER_REGION_BYTES, row_bytes, rows,
                                  rows * row_bytes, len(meta) if meta_length is None else meta_length, 0, bytes(32))
    body = fixed + meta
    return body + shm_files._checksum(body)


def plant(directory, name: str, content: bytes, *, size: int | None = None) -> Path:
    path = Path(directory) / name
    path.write_bytes(content)
    os.chmod(path, 0o600)
    if size is not None:
        os.truncate(path, size)
    return path


def good_meta(**changes) -> bytes:
    fields = {"kind": "table", "share_key": "planted", "sources": [], "filler_pid": 1, "fill_time_s": 0.0}
    fields.update(changes)
    return json.dumps(fields).encode()


# name -> (content, expected phrase of the problem)
def planted_files(seed: int) -> dict[str, tuple[bytes | None, str]]:
    depth = 20_000 + seed % 1000   # far deeper than Python's recursion limit, within the length limit
    nested = b"[" * depth + b"]" * depth
    deep_and_long = b"{" * 300_000
    region = shm_files.HEADER_REGION_BYTES
    return {
        "nested-json": (header_bytes(nested), f"nests {depth} levels deep"),
        "nested-long": (header_bytes(deep_and_long), "more than the limit"),
        "nested-in-field": (header_bytes(good_meta(share_key=[[[[["x"]]]]])), "nests 6 levels deep"),
        "huge-length": (header_bytes(b"{}", meta_length=2**31 + seed % 1000), "bytes of key data, more than the limit"),
        "truncated": (header_bytes(good_meta())[:40], "too few for a header"),
        "cut-json": (header_bytes(good_meta())[:-50], "header is cut short"),
        "not-an-object": (header_bytes(b"[1, 2]"), "not an object"),
        "bad-utf8": (header_bytes(b'{"share_key": "\xff\xfe"}'), "not JSON"),
        "wrong-types": (header_bytes(good_meta(sources=[["/x", "big", 0]])), "[path, size, mtime]"),
        "huge-number": (header_bytes(good_meta(filler_pid=None)[:-1] + b', "filler_pid": ' + b"9" * 5000 + b"}"),
                        "not JSON"),
        "unknown-kind": (header_bytes(good_meta(kind="../../etc")), "kind is"),
        "older-version": (header_bytes(good_meta(), version=1), "format version 1"),
        "rows-only": (bytes(pattern(seed, 3 * 4096).numpy().tobytes()), "does not start with the magic"),
        "size-mismatch": (header_bytes(good_meta(), rows=10, row_bytes=8) + bytes(region), "where its header says"),
    }


def test_listing_and_removal_survive_planted_files(shm_dir, seed):
    """Every planted file is listed with its own problem, is stale (ours, no live filler) and goes with
    ``remove --all-stale``; a real table beside them is listed ok and kept."""
    table = allocate_host_buffer(8192, fill=functools.partial(fill_pattern, seed), share_key=f"real {seed}",
                                 directory=shm_dir, huge_pages=False)
    planted = {}
    for name, (content, phrase) in planted_files(seed).items():
        planted[str(plant(shm_dir, f"engram-{name}-0123456789abcdef", content))] = phrase
    fifo = Path(shm_dir) / "engram-fifo-0123456789abcdef"
    os.mkfifo(fifo, 0o600)
    planted[str(fifo)] = "not a regular file"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(Path(shm_dir) / "engram-socket-0123456789abcdef"))
    planted[str(Path(shm_dir) / "engram-socket-0123456789abcdef")] = "not a regular file"
    (Path(shm_dir) / "engram-dir-0123456789abcdef").mkdir()   # directories are skipped
    lock_dir = Path(shm_dir) / "engram-lockdir-0123456789abcdef.lock"
    lock_dir.mkdir()
    entries = {entry.path: entry for entry in list_shared_tables(shm_dir)}
    for path, phrase in planted.items():
        assert path in entries, path
        assert entries[path].problem is not None and phrase in entries[path].problem, (path, entries[path].problem)
        assert entries[path].stale, path
    assert entries[table.shared_path].problem is None and not entries[table.shared_path].stale
    removal = remove_shared_table(directory=shm_dir, all_stale=True)
    assert set(planted) <= set(removal.removed)
    left = {entry.path for entry in list_shared_tables(shm_dir)}
    assert table.shared_path in left and not left & set(planted)
    sock.close()


def test_cli_lists_planted_files(shm_dir, seed, capsys):
    from engram.tools.cli import main

    for name, (content, _) in planted_files(seed).items():
        plant(shm_dir, f"engram-{name}-0123456789abcdef", content)
    assert main(["shm", "list", "--dir", shm_dir]) == 1   # files need attention; no traceback
    out = capsys.readouterr().out
    assert "stale" in out and "Traceback" not in out
    assert main(["shm", "list", "--dir", shm_dir, "--json"]) == 1
    listed = json.loads(capsys.readouterr().out)
    assert len(listed) == len(planted_files(seed)) and all(entry["stale"] for entry in listed)
    assert main(["shm", "remove", "--all-stale", "--dir", shm_dir]) == 0
    assert os.listdir(shm_dir) == []


def test_a_victims_load_survives_a_planted_header(shm_dir, seed, tmp_path):
    """The clean-up after a fill lists the directory: a planted nested header there must not fail the
    load that has just published its table (it once raised RecursionError)."""
    content, _ = planted_files(seed)["nested-json"]
    planted = plant(shm_dir, "engram-trap-0123456789abcdef", content)
    source = tmp_path / "weights.bin"
    source.write_bytes(b"weights")
    buffer = allocate_host_buffer(8192, fill=functools.partial(fill_pattern, seed), share_key=f"victim {seed}",
                                  directory=shm_dir, huge_pages=False, sources=[source])
    assert buffer.filled_here and torch.equal(buffer.tensor, pattern(seed, 8192))
    assert planted.exists()   # not a superseded table of this load's sources: left to `engram shm remove`


def test_listing_never_stats_paths_named_in_another_users_header(shm_dir, seed, monkeypatch):
    if os.getuid() != 0:
        pytest.skip("planting another user's file needs root")
    secret = f"/root/never-stat-this-{seed}"
    meta = good_meta(sources=[[secret, 1, 1]])
    foreign = plant(shm_dir, "engram-foreign-0123456789abcdef", header_bytes(meta, rows=1, row_bytes=8) + bytes(
        shm_files.HEADER_REGION_BYTES - len(header_bytes(meta)) + 8))
    os.chown(foreign, 4242, -1)
    stat_calls = []
    real_stat = os.stat

    def recording_stat(path, *args, **kwargs):
        stat_calls.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", recording_stat)
    (entry,) = list_shared_tables(shm_dir)
    assert entry.path == str(foreign) and entry.owner_uid == 4242 and not entry.stale
    assert "owned by uid 4242" in entry.problem
    assert secret not in stat_calls
    assert remove_shared_table(directory=shm_dir, all_stale=True).removed == []
    assert foreign.exists()


def test_older_format_is_refused_and_stale(shm_dir, seed):
    key = f"old format {seed}"
    buffer = allocate_host_buffer(8192, fill=functools.partial(fill_pattern, seed), share_key=key, directory=shm_dir,
                                  huge_pages=False)
    path = Path(buffer.shared_path)
    fd = os.open(path, os.O_RDWR)
    try:
        header = shm_files.TableHeader.read(fd, os.fstat(fd).st_size)
        os.pwrite(fd, dataclasses.replace(header, version=1).encode(), 0)   # as an engram of format 1 wrote it
    finally:
        os.close(fd)
    buffer.close()
    with pytest.raises(ValueError, match="format version 1, this engram reads version 2 only .*older engram"):
        allocate_host_buffer(8192, fill=functools.partial(fill_pattern, seed), share_key=key, directory=shm_dir,
                             huge_pages=False)
    (entry,) = [entry for entry in list_shared_tables(shm_dir) if entry.kind == "table"]
    assert entry.stale and "older engram" in entry.problem
    assert str(path) in remove_shared_table(directory=shm_dir, all_stale=True).removed


def test_json_depth_is_measured_outside_strings():
    assert shm_files._json_depth(b'{"a": "[[[[[[[[", "b": [[1]]}') == 3
    assert shm_files._json_depth(b'{"a": "\\"[[[[[[", "b": []}') == 2
    assert shm_files._json_depth(good_meta(sources=[["/a", 1, 2]])) == 3


# ---------------------------------------------------------------------------
# peer shards of placement "node"
# ---------------------------------------------------------------------------
def shard_worker(directory: str, ready_file: str) -> None:
    from engram.table.peer_memory import allocate_shard

    shard, shared = allocate_shard(4, 80, torch.device("cpu"), directory)
    shard.fill_(3)
    Path(ready_file).write_text(str(shared.path))
    time.sleep(WAIT_S)   # killed here, mid-setup


def test_a_live_peer_shard_is_never_stale(shm_dir, seed):
    from engram.table.peer_memory import allocate_shard

    shard, shared = allocate_shard(3 + seed % 5, 80, torch.device("cpu"), shm_dir)
    shard.fill_(1)
    (entry,) = list_shared_tables(shm_dir)
    assert (entry.path, entry.kind, entry.live_filler, entry.filler_pid, entry.stale, entry.problem) == (
        str(shared.path), "peer", True, os.getpid(), False, None)
    assert remove_shared_table(directory=shm_dir, all_stale=True).removed == []
    assert shm_admin.remove_leftovers(Path(shm_dir)) == []
    refused = remove_shared_table(str(shared.path))
    assert refused.removed == [] and f"process {os.getpid()}" in refused.refused[0]
    assert shared.path.exists() and torch.all(shard == 1)
    shared.release()
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("cleanup", ["fill", "peer shard"])
def test_a_dead_ranks_peer_shard_is_a_leftover(shm_dir, seed, cleanup):
    ready_file = os.path.join(shm_dir, "ready")
    context = multiprocessing.get_context("spawn")
    owner = context.Process(target=shard_worker, args=(shm_dir, ready_file))
    owner.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(ready_file):
            assert time.monotonic() < deadline, "timed out waiting for the shard's owner"
            assert owner.is_alive() or os.path.exists(ready_file), f"the shard's owner exited ({owner.exitcode})"
            time.sleep(0.05)
        shard_path = Path(Path(ready_file).read_text())
        (entry,) = list_shared_tables(shm_dir)
        assert (entry.kind, entry.live_filler, entry.stale) == ("peer", True, False)
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(WAIT_S)
    (entry,) = list_shared_tables(shm_dir)
    assert (entry.path, entry.kind, entry.live_filler, entry.stale) == (str(shard_path), "peer", False, True)
    assert f"its owner (pid {owner.pid}) is gone" in entry.problem
    # the one clean-up, after a fill or before a new shard, removes it (and its lock)
    if cleanup == "fill":
        allocate_host_buffer(4096, fill=functools.partial(fill_pattern, seed), share_key=f"after {seed}",
                             directory=shm_dir, huge_pages=False)
        kept = shared_buffer_path(f"after {seed}", shm_dir)
    else:
        from engram.table.peer_memory import allocate_shard

        _, shared = allocate_shard(2, 80, torch.device("cpu"), shm_dir)
        kept = shared.path
    names = sorted(os.listdir(shm_dir))
    assert shard_path.name not in names and shard_path.name + ".lock" not in names
    assert kept.name in names
