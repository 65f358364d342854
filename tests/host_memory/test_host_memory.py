"""Host buffers (engram.table.host_memory.buffers): private fill, one shared copy for several
processes, a filler killed mid-fill, size mismatches, the once-only huge-page warning.

Shared files go to a fresh temporary directory under /dev/shm (a tmpfs, so the pages show
as shared memory in /proc), removed afterwards. Processes are started with 'spawn'.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from engram.table.host_memory import buffers as host_memory
from engram.table.host_memory.buffers import (HUGE_PAGE_BYTES, allocate_host_buffer, memory_report, remove_shared_buffer,
                                      shared_buffer_path)

SHM = Path("/dev/shm")
WAIT_S = 120.0   # bound of every wait on a child process (never reached when things work)


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm (tmpfs), removed after the test."""
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        pytest.skip("/dev/shm is not a writable directory on this machine")
    directory = tempfile.mkdtemp(prefix="engram-test-", dir=SHM)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """``uint8 [nbytes]`` random bytes from ``seed``: the content every test fills."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def fill_pattern(seed: int, tensor: torch.Tensor, delay_s: float = 0.0) -> None:
    tensor.copy_(pattern(seed, tensor.numel()))
    time.sleep(delay_s)   # keeps the fill open so that other processes arrive while it runs


def fill_half_then_hang(seed: int, flag_file: str, tensor: torch.Tensor) -> None:
    """Writes half the content, says so through ``flag_file``, then waits to be killed."""
    half = tensor.numel() // 2
    tensor[:half].copy_(pattern(seed, tensor.numel())[:half])
    Path(flag_file).write_text(str(os.getpid()))
    time.sleep(WAIT_S)


def fill_must_not_run(tensor: torch.Tensor) -> None:
    raise AssertionError("fill ran in a process that should have found the published buffer")


def mapped_at(address: int) -> bool:
    """Whether a mapping of this process covers ``address`` (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(bound, 16) for bound in line.split(" ", 1)[0].split("-"))
            if start <= address < end:
                return True
    return False


def wait_for(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------
# workers (module level: 'spawn' imports them)
# ---------------------------------------------------------------------------
def share_worker(nbytes, seed, key, directory, barrier, results):
    before = memory_report()
    buffer = allocate_host_buffer(nbytes, fill=functools.partial(fill_pattern, seed, delay_s=1.0), share_key=key,
                                  directory=directory)
    same = torch.equal(buffer.tensor, pattern(seed, nbytes))   # reads (maps) every page
    barrier.wait(timeout=WAIT_S)   # all three map the whole table now
    after = memory_report()
    barrier.wait(timeout=WAIT_S)   # nobody unmaps before all have measured
    results.put({"pid": os.getpid(), "filled_here": buffer.filled_here, "same": same, "path": buffer.shared_path,
                 "before": before, "after": after})
    buffer.close()


def hang_worker(nbytes, seed, key, directory, flag_file):
    allocate_host_buffer(nbytes, fill=functools.partial(fill_half_then_hang, seed, flag_file), share_key=key,
                         directory=directory)


def complete_worker(nbytes, seed, key, directory, results):
    results.put("started")
    buffer = allocate_host_buffer(nbytes, fill=functools.partial(fill_pattern, seed), share_key=key,
                                  directory=directory, wait_timeout_s=WAIT_S)
    results.put({"filled_here": buffer.filled_here, "same": torch.equal(buffer.tensor, pattern(seed, nbytes))})


def write_after_fill_worker(read_only):
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the fault below leaves no core file
    buffer = allocate_host_buffer(4096, fill=lambda t: t.fill_(7), read_only=read_only)
    buffer.tensor[0] = 1   # faults when read-only


# ---------------------------------------------------------------------------
# private buffers
# ---------------------------------------------------------------------------
def test_private_fill_and_read_back(seed):
    nbytes = 3 * HUGE_PAGE_BYTES + 12345 + seed % 4096
    buffer = allocate_host_buffer(nbytes, fill=functools.partial(fill_pattern, seed))
    address = buffer.tensor.data_ptr()
    try:
        assert mapped_at(address)
        assert buffer.tensor.dtype == torch.uint8 and tuple(buffer.tensor.shape) == (nbytes,)
        assert torch.equal(buffer.tensor, pattern(seed, nbytes))
        assert buffer.shared_path is None and buffer.filled_here
        length = 4 * HUGE_PAGE_BYTES   # rounded up to 2 MiB
        assert 0 <= buffer.huge_page_bytes <= length
        assert buffer.huge_pages == (buffer.huge_page_bytes * 2 >= length and buffer.huge_page_bytes > 0)
        if host_memory._thp_setting("enabled") == "never":
            assert not buffer.huge_pages
        print(f"private buffer of {nbytes} bytes: huge pages {buffer.huge_pages} "
              f"({buffer.huge_page_bytes} bytes in 2 MiB pages; THP enabled = {host_memory._thp_setting('enabled')})")
    finally:
        buffer.close()
    assert not mapped_at(address)   # no view left: unmapped at once
    buffer.close()   # twice is harmless
    assert buffer.tensor is None


def test_view_outlives_close(seed):
    buffer = allocate_host_buffer(5000, fill=functools.partial(fill_pattern, seed), huge_pages=False)
    view = buffer.tensor[100:200]
    buffer.close()
    assert torch.equal(view, pattern(seed, 5000)[100:200])   # still mapped: the view keeps it


@pytest.mark.parametrize("read_only, exit_code", [(True, -signal.SIGSEGV), (False, 0)])
def test_read_only_after_fill(read_only, exit_code):
    process = multiprocessing.get_context("spawn").Process(target=write_after_fill_worker, args=(read_only,))
    process.start()
    process.join(WAIT_S)
    assert process.exitcode == exit_code


def test_huge_page_warning_once(monkeypatch, seed):
    monkeypatch.setattr(host_memory, "_warned_no_huge_pages", False)
    monkeypatch.setattr(host_memory, "_huge_page_bytes", lambda address, length: 0)   # as if the OS said no
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = [allocate_host_buffer(HUGE_PAGE_BYTES, fill=functools.partial(fill_pattern, seed + k))
                   for k in range(3)]
        buffers.append(allocate_host_buffer(HUGE_PAGE_BYTES, fill=functools.partial(fill_pattern, seed),
                                            huge_pages=False))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "huge pages" in messages[0] and "4 KiB pages" in messages[0]
    assert caught[0].filename == __file__   # points at the caller
    assert not any(b.huge_pages for b in buffers)
    for buffer in buffers:
        buffer.close()


@pytest.mark.parametrize("arguments, message", [
    (dict(nbytes=0), "nbytes: expected a positive integer, found 0"),
    (dict(nbytes=-5), "nbytes: expected a positive integer, found -5"),
    (dict(nbytes=True), "nbytes: expected a positive integer, found True"),
    (dict(nbytes=1.5), "nbytes: expected a positive integer, found 1.5"),
    (dict(fill=None), "fill: expected a callable"),
    (dict(share_key=""), "share_key: expected a non-empty string or None, found ''"),
    (dict(wait_timeout_s=0), "wait_timeout_s: expected a positive finite number of seconds, found 0"),
    (dict(wait_timeout_s=float("nan")), "wait_timeout_s: expected a positive finite number of seconds, found nan"),
    (dict(huge_pages="yes"), "huge_pages: expected True or False, found 'yes'"),
    (dict(read_only=None), "read_only: expected True or False, found None"),
    (dict(share_key="k", directory="/no/such/directory"),
     "directory: '/no/such/directory' does not exist or is not a directory"),
    (dict(share_mode=0o660), "share_mode: expected 0o600 (owner only) or a group/other read bit added"),
    (dict(share_mode=0o666), "never a group/other write bit, found 0o666"),
    (dict(share_mode=0o400), "never a group/other write bit, found 0o400"),
    (dict(share_mode="0o600"), "never a group/other write bit, found '0o600'"),
    (dict(fingerprint="v1"), "fingerprint: expected bytes naming the content, found 'v1'"),
    (dict(row_bytes=3), "row_bytes: expected a positive integer dividing nbytes = 4096, found 3"),
    (dict(row_bytes=0), "row_bytes: expected a positive integer dividing nbytes = 4096, found 0"),
    (dict(sources="model.safetensors"), "sources: expected a list of file paths, found 'model.safetensors'"),
    (dict(share_key="k", directory="/dev/shm", sources=["/no/such/file"]),
     "sources: '/no/such/file' cannot be read (No such file or directory)"),
])
def test_bad_arguments(arguments, message):
    call = {"nbytes": 4096, "fill": lambda tensor: None, **arguments}
    with pytest.raises(ValueError, match=re.escape(message)):
        allocate_host_buffer(call.pop("nbytes"), **call)


# ---------------------------------------------------------------------------
# shared buffers
# ---------------------------------------------------------------------------
def test_three_processes_share_one_copy(shm_dir, seed):
    nbytes = 24 * 2**20
    key = f"checkpoint /models/x (sizes 1,2; mtimes 3,4) layer 1 rows [0, {nbytes // 264}) fp8-264 seed {seed}"
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(3), context.Queue()
    processes = [context.Process(target=share_worker, args=(nbytes, seed, key, shm_dir, barrier, results))
                 for _ in range(3)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=WAIT_S) for _ in processes]
    for process in processes:
        process.join(WAIT_S)
        assert process.exitcode == 0
    path = Path(reports[0]["path"])
    file_bytes = path.stat().st_blocks * 512
    mib = 2**20
    print(f"\nshared table of {nbytes / mib:.1f} MiB in {path} (file occupies {file_bytes / mib:.1f} MiB):")
    for report in reports:
        grow = {k: (report["after"][k] - report["before"][k]) / mib for k in ("rss", "rss_shmem", "pss", "pss_shmem")}
        print(f"  pid {report['pid']} filled_here={report['filled_here']}: after RSS {report['after']['rss'] / mib:.1f} "
              f"MiB, RssShmem {report['after']['rss_shmem'] / mib:.1f} MiB, Shared "
              f"{report['after']['shared'] / mib:.1f} MiB, PSS {report['after']['pss'] / mib:.1f} MiB; growth: "
              + ", ".join(f"{k} {v:+.1f} MiB" for k, v in grow.items()))
    assert sum(r["filled_here"] for r in reports) == 1
    assert all(r["same"] for r in reports)
    assert len({r["path"] for r in reports}) == 1
    assert abs(file_bytes - nbytes) <= 2 * HUGE_PAGE_BYTES   # one copy on the node
    tolerance = 0.05 * nbytes
    for report in reports:
        rss_shmem = report["after"]["rss_shmem"] - report["before"]["rss_shmem"]
        pss_shmem = report["after"]["pss_shmem"] - report["before"]["pss_shmem"]
        assert abs(rss_shmem - nbytes) <= tolerance   # each maps all of it...
        assert abs(pss_shmem - nbytes / 3) <= tolerance   # ...and is charged a third
    total_pss = sum(r["after"]["pss_shmem"] - r["before"]["pss_shmem"] for r in reports)
    assert abs(total_pss - nbytes) <= tolerance
    # A later process finds it published and maps it without filling.
    later = allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=shm_dir)
    assert not later.filled_here and torch.equal(later.tensor, pattern(seed, nbytes))
    later.close()
    remove_shared_buffer(key, shm_dir)
    assert os.listdir(shm_dir) == []


def test_killed_filler_is_replaced(shm_dir, seed):
    nbytes = 8 * 2**20 + 4096
    key = f"killed filler {seed}"
    flag_file = os.path.join(shm_dir, "filling.flag")
    context = multiprocessing.get_context("spawn")
    hanging = context.Process(target=hang_worker, args=(nbytes, seed, key, shm_dir, flag_file))
    hanging.start()
    try:
        wait_for(lambda: os.path.exists(flag_file), "the first filler to start")
        path = shared_buffer_path(key, shm_dir)
        assert Path(str(path) + ".tmp").exists() and not path.exists()
        # Meanwhile: a short wait times out naming the key and the filler's pid; removal is refused.
        with pytest.raises(TimeoutError, match=f"share_key '{key}'.*pid {hanging.pid}"):
            allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=shm_dir,
                                 wait_timeout_s=0.3)
        with pytest.raises(ValueError, match=f"process {hanging.pid} is filling"):
            remove_shared_buffer(key, shm_dir)
        results = context.Queue()
        completing = context.Process(target=complete_worker, args=(nbytes, seed, key, shm_dir, results))
        completing.start()
        assert results.get(timeout=WAIT_S) == "started"
        time.sleep(0.5)   # most likely waiting by now; if not, it finds the lock free: same outcome
    finally:
        os.kill(hanging.pid, signal.SIGKILL)
        hanging.join(WAIT_S)
    assert hanging.exitcode == -signal.SIGKILL
    outcome = results.get(timeout=WAIT_S)
    completing.join(WAIT_S)
    assert completing.exitcode == 0
    assert outcome == {"filled_here": True, "same": True}
    assert path.exists() and not Path(str(path) + ".tmp").exists()
    again = allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=shm_dir)
    assert not again.filled_here and torch.equal(again.tensor, pattern(seed, nbytes))
    again.close()
    remove_shared_buffer(key, shm_dir)


def test_size_mismatch_is_refused(shm_dir, seed):
    key = f"size mismatch {seed}"
    first = allocate_host_buffer(4 * 2**20, fill=functools.partial(fill_pattern, seed), share_key=key,
                                 directory=shm_dir)
    path = shared_buffer_path(key, shm_dir)
    with pytest.raises(ValueError, match=f"shared table file '{path}' is refused: it holds {4 * 2**20} B of "
                                         f"content, expected nbytes = {5 * 2**20}"):
        allocate_host_buffer(5 * 2**20, fill=fill_must_not_run, share_key=key, directory=shm_dir)
    assert torch.equal(first.tensor, pattern(seed, 4 * 2**20))   # the published copy is untouched
    first.close()
    remove_shared_buffer(key, shm_dir)


def test_no_room_is_refused(shm_dir):
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize
    with pytest.raises(ValueError, match=f"directory: '{shm_dir}' has .* bytes free of .*, the shared table needs "
                                         f"{free + 2**30 + 4096} bytes"):
        allocate_host_buffer(free + 2**30, fill=fill_must_not_run, share_key="too big", directory=shm_dir)
    assert [name for name in os.listdir(shm_dir) if not name.endswith(".lock")] == []


def test_failed_fill_leaves_nothing(shm_dir, seed):
    key = f"failing fill {seed}"

    def broken(tensor):
        tensor[:10] = 1
        raise RuntimeError("checkpoint unreadable")

    with pytest.raises(RuntimeError, match="checkpoint unreadable"):
        allocate_host_buffer(65536, fill=broken, share_key=key, directory=shm_dir)
    assert [name for name in os.listdir(shm_dir) if not name.endswith(".lock")] == []
    buffer = allocate_host_buffer(65536, fill=functools.partial(fill_pattern, seed), share_key=key, directory=shm_dir)
    assert buffer.filled_here and torch.equal(buffer.tensor, pattern(seed, 65536))
    buffer.close()
    remove_shared_buffer(key, shm_dir)
    remove_shared_buffer(key, shm_dir)   # nothing there: not an error
    assert os.listdir(shm_dir) == []


def test_keys_name_distinct_files(tmp_path):
    a = shared_buffer_path("ckpt a/b layer 1", tmp_path)
    b = shared_buffer_path("ckpt a_b layer 1", tmp_path)   # sanitizes alike, digests differ
    assert a != b and a.name.startswith("engram-ckpt_a_b_layer_1-")
    assert len(shared_buffer_path("x" * 5000, tmp_path).name) < 120


# ---------------------------------------------------------------------------
# who may write a shared table, and what is attached
# ---------------------------------------------------------------------------
def fill_table(key, directory, nbytes, seed, **options):
    """A published table of ``pattern(seed)`` (filled in this process)."""
    buffer = allocate_host_buffer(nbytes, fill=functools.partial(fill_pattern, seed), share_key=key,
                                  directory=directory, huge_pages=False, **options)
    assert buffer.filled_here
    return buffer


def header_region() -> int:
    from engram.table.host_memory import shm_files

    return shm_files.HEADER_REGION_BYTES


def refused(path, reason: str) -> str:
    """The pattern of the refusal of ``path``: names it, says why, says how to remove it."""
    return (re.escape(f"shared table file '{path}' is refused: ") + reason
            + r".*Nothing was mapped.*" + re.escape(f"engram shm remove {path}"))


def attach_and_write_worker(nbytes, key, directory, write, results):
    """Attaches a published table with every warning an error; writes to it when ``write``."""
    import resource

    from engram.table.host_memory.rows import mapped_read_only

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            buffer = allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=directory,
                                          huge_pages=False, read_only=False)
    except BaseException as error:
        results.put(repr(error))
        raise
    try:
        buffer._mapping.write(b"x")
        mapping_writable = True
    except TypeError:
        mapping_writable = False
    results.put({"filled_here": buffer.filled_here, "mapping_writable": mapping_writable,
                 "read_only": mapped_read_only(buffer.tensor.data_ptr(), nbytes)})
    results.close()
    results.join_thread()   # the result is sent before the fault below
    if write:
        buffer.tensor[nbytes // 2] = 1   # faults on a read-only mapping


@pytest.mark.parametrize("planted", ["rows only", "header size", "symlink"])
def test_planted_file_is_refused(shm_dir, seed, planted):
    nbytes = 3 * 4096 + seed % 4096
    key = f"planted {seed}"
    path = shared_buffer_path(key, shm_dir)
    content = pattern(seed, nbytes + (header_region() if planted == "header size" else 0)).numpy().tobytes()
    if planted == "symlink":
        target = Path(shm_dir) / "elsewhere"
        target.write_bytes(content)
        path.symlink_to(target)
        reason = "it is a symbolic link"
    else:
        path.write_bytes(content)
        os.chmod(path, 0o600)   # owner and mode pass: the header must refuse it
        reason = "it (holds only|does not start with the magic).*not an engram table file"
    with pytest.raises(ValueError, match=refused(path, reason)):
        allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=shm_dir)
    assert path.read_bytes() == content if planted != "symlink" else path.is_symlink()


@pytest.mark.parametrize("share_mode", [None, 0o640, 0o644])
def test_file_and_lock_modes_under_umask_0(shm_dir, seed, share_mode):
    expected = 0o600 if share_mode is None else share_mode
    key = f"modes {seed}"
    path = shared_buffer_path(key, shm_dir)
    seen = {}

    def fill(tensor):
        seen["temporary"] = os.stat(str(path) + ".tmp").st_mode & 0o7777   # created exclusively, already narrow
        seen["lock while filling"] = os.stat(str(path) + ".lock").st_mode & 0o7777
        fill_pattern(seed, tensor)

    previous = os.umask(0)
    try:
        options = {} if share_mode is None else {"share_mode": share_mode}
        allocate_host_buffer(8192, fill=fill, share_key=key, directory=shm_dir, huge_pages=False, **options)
    finally:
        os.umask(previous)
    assert seen == {"temporary": expected, "lock while filling": 0o600}
    assert path.stat().st_mode & 0o7777 == expected
    assert Path(str(path) + ".lock").stat().st_mode & 0o7777 == 0o600
    attached = allocate_host_buffer(8192, fill=fill_must_not_run, share_key=key, directory=shm_dir,
                                    huge_pages=False, **options)
    assert torch.equal(attached.tensor, pattern(seed, 8192))


@pytest.mark.parametrize("how", ["chown", "getuid"])
def test_table_of_another_user_is_refused(shm_dir, seed, monkeypatch, how):
    key = f"owner {seed}"
    fill_table(key, shm_dir, 8192, seed)
    path = shared_buffer_path(key, shm_dir)
    other = 4242 if os.getuid() != 4242 else 4243
    if how == "chown":
        if os.getuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(path, other, -1)
        reason = f"it is owned by uid {other}.*, not by this process's uid {os.getuid()}"
    else:
        monkeypatch.setattr(os, "getuid", lambda: other)   # as if another user ran this process
        reason = f"it is owned by uid {os.stat(path).st_uid}.*, not by this process's uid {other}"
    with pytest.raises(ValueError, match=refused(path, reason)):
        allocate_host_buffer(8192, fill=fill_must_not_run, share_key=key, directory=shm_dir)


def lock_holder_worker(lock_path, flag_file):
    import fcntl

    fd = os.open(lock_path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    Path(flag_file).write_text("locked")
    time.sleep(WAIT_S)


def test_lock_of_another_user_is_refused_at_once(shm_dir, seed):
    if os.getuid() != 0:
        pytest.skip("planting a lock file of another uid needs root (chown)")
    key = f"foreign lock {seed}"
    lock_path = Path(str(shared_buffer_path(key, shm_dir)) + ".lock")
    lock_path.write_text("")
    os.chmod(lock_path, 0o600)
    os.chown(lock_path, 4242, -1)
    flag_file = os.path.join(shm_dir, "locked.flag")
    holder = multiprocessing.get_context("spawn").Process(target=lock_holder_worker, args=(str(lock_path), flag_file))
    holder.start()
    try:
        wait_for(lambda: os.path.exists(flag_file), "the other user's process to hold the lock")
        started = time.monotonic()
        with pytest.raises(ValueError, match=re.escape(f"lock file '{lock_path}' is refused: it is owned by uid 4242")):
            allocate_host_buffer(8192, fill=fill_must_not_run, share_key=key, directory=shm_dir, wait_timeout_s=20)
        assert time.monotonic() - started < 5   # at once, not after wait_timeout_s
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(WAIT_S)


@pytest.mark.parametrize("target, mode, reason", [
    ("table", 0o666, r"its mode 0o666 lets group or others write it \(allowed: 0o600\)"),
    ("table", 0o620, r"its mode 0o620 lets group or others write it"),
    ("table", 0o644, r"its mode 0o644 gives group/others more than the 0o600 asked for"),
    ("lock", 0o666, r"its mode 0o666 lets group or others write it"),
    ("lock", 0o640, r"its mode 0o640 gives group/others more than the 0o600 asked for"),
])
def test_wider_mode_is_refused(shm_dir, seed, target, mode, reason):
    key = f"wide mode {seed}"
    fill_table(key, shm_dir, 8192, seed)
    path = shared_buffer_path(key, shm_dir)
    if target == "lock":
        path.unlink()   # a fill must take the lock
        path = Path(str(path) + ".lock")
        pattern_ = re.escape(f"lock file '{path}' is refused: ") + reason
    else:
        pattern_ = refused(path, reason)
    os.chmod(path, mode)
    with pytest.raises(ValueError, match=pattern_):
        allocate_host_buffer(8192, fill=fill_must_not_run, share_key=key, directory=shm_dir, wait_timeout_s=20)


def rewrite_header(path, **changes) -> None:
    """Re-encode the header of ``path`` with ``changes`` (a valid checksum)."""
    from engram.table.host_memory import shm_files

    fd = os.open(path, os.O_RDWR)
    try:
        header = shm_files.TableHeader.read(fd, os.fstat(fd).st_size)
        os.pwrite(fd, dataclasses.replace(header, **changes).encode(), 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("damage", ["version", "older version", "checksum", "magic", "fingerprint", "key", "layout",
                                    "filled", "truncated", "source changed"])
def test_header_mismatch_is_refused(shm_dir, seed, tmp_path, damage):
    nbytes = 16 * 512
    key = f"header {seed}"
    source = tmp_path / "rows.bin"
    source.write_bytes(pattern(seed + 1, 100).numpy().tobytes())
    fill_table(key, shm_dir, nbytes, seed, fingerprint=b"checkpoint v1", row_bytes=16, sources=[source])
    path = shared_buffer_path(key, shm_dir)
    attach = {"fingerprint": b"checkpoint v1", "row_bytes": 16, "sources": [source]}
    fd = os.open(path, os.O_RDWR)
    if damage == "version":
        os.pwrite(fd, (99).to_bytes(4, "little"), 8)   # the u32 after the 8-byte magic
        reason = re.escape("its header is format version 99, this engram reads version 2 only (written by a newer engram)")
    elif damage == "older version":
        rewrite_header(path, version=1)   # a valid header of the format before rows carried their tag
        reason = re.escape("its header is format version 1, this engram reads version 2 only (written by an older "
                           "engram, whose packed rows carry no row tag: it is stale)")
    elif damage == "checksum":
        byte = os.pread(fd, 1, 100)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), 100)   # inside the key data
        reason = re.escape("its header checksum does not match the header's fields (damaged or edited)")
    elif damage == "magic":
        os.pwrite(fd, b"NOTATABL", 0)
        reason = "it does not start with the magic"
    elif damage == "fingerprint":
        attach["fingerprint"] = b"checkpoint v2"
        reason = r"its content fingerprint [0-9a-f]{16}\.\.\. differs from this load's [0-9a-f]{16}\.\.\."
    elif damage == "key":
        rewrite_header(path, share_key="another key")
        reason = re.escape(f"it was filled for share key 'another key', not {key!r}")
    elif damage == "layout":
        attach["row_bytes"] = 32
        reason = re.escape(f"its row layout is 512 rows x 16 B = {nbytes} B, expected 256 rows x 32 B = {nbytes} B")
    elif damage == "filled":
        rewrite_header(path, filled=False)
        reason = re.escape("it was never completely filled (filled flag 0")
    elif damage == "truncated":
        os.ftruncate(fd, header_region() + nbytes - 512)
        reason = re.escape(f"it holds {header_region() + nbytes - 512} bytes where its header says "
                           f"{header_region() + nbytes}")
    else:
        with open(source, "ab") as handle:
            handle.write(b"more rows")
        reason = re.escape(f"the files it was filled from changed since: {os.path.realpath(source)} was 100 B")
    os.close(fd)
    with pytest.raises(ValueError, match=refused(path, reason)):
        allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=shm_dir, **attach)


def test_attached_table_is_mapped_read_only(shm_dir, seed):
    nbytes = 64 * 1024
    key = f"read only {seed}"
    filler = allocate_host_buffer(nbytes, fill=functools.partial(fill_pattern, seed), share_key=key,
                                  directory=shm_dir, huge_pages=False, read_only=False)   # as the checkpoint asks
    from engram.table.host_memory.rows import mapped_read_only

    assert filler.filled_here and mapped_read_only(filler.tensor.data_ptr(), nbytes)   # mprotected after its fill
    context = multiprocessing.get_context("spawn")
    for write, exit_code in ((False, 0), (True, -signal.SIGSEGV)):
        results = context.Queue()
        process = context.Process(target=attach_and_write_worker, args=(nbytes, key, shm_dir, write, results))
        process.start()
        outcome = results.get(timeout=WAIT_S)
        process.join(WAIT_S)
        assert outcome == {"filled_here": False, "mapping_writable": False, "read_only": True}
        assert process.exitcode == exit_code   # no warning became an error; the write faulted
    assert torch.equal(filler.tensor, pattern(seed, nbytes))   # untouched


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records ``cudaHostRegister`` flags; refuses
    the flags in ``refuse`` with CUDA error 801 (not supported)."""

    def __init__(self, refuse=()):
        self.calls, self.refuse, self.unregistered = [], set(refuse), []

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(flags)
        return 801 if flags in self.refuse else 0

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


def test_register_with_cuda_uses_the_read_only_flag(shm_dir, seed, monkeypatch):
    from engram.table.host_memory import rows as host_rows

    key = f"register {seed}"
    fill_table(key, shm_dir, 8192, seed)
    attached = allocate_host_buffer(8192, fill=fill_must_not_run, share_key=key, directory=shm_dir, huge_pages=False)
    private = allocate_host_buffer(8192, fill=functools.partial(fill_pattern, seed), huge_pages=False,
                                   read_only=False)
    cleared = []
    monkeypatch.setattr(host_rows, "_clear_cuda_error", lambda: cleared.append(True))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for tensor, refuse, calls, clears in ((attached.tensor, (), [0x0B], 0),
                                          (attached.tensor, (0x0B,), [0x0B, 0x03], 1),   # falls back, no error
                                          (private.tensor, (), [0x03], 0)):
        fake = FakeCudart(refuse)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        cleared.clear()
        release = host_rows.register_with_cuda(tensor)
        assert fake.calls == calls and len(cleared) == clears
        release()
        assert fake.unregistered == [tensor.data_ptr()]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_failed_reservation_is_one_clear_error(shm_dir, seed, monkeypatch, code):
    def no_room(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    nbytes = 1 << 20
    with pytest.raises(ValueError, match=re.escape(f"directory: '{shm_dir}' has ") + r"\d+ bytes free of \d+, "
                       + re.escape(f"the shared table needs {nbytes + 4096} bytes: a tmpfs is sized when it is mounted; "
                                   f"raise it with `mount -o remount,size=<bytes> {shm_dir}`") + r".*--shm-size"):
        allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=f"no room {seed}", directory=shm_dir)
    assert [name for name in os.listdir(shm_dir) if not name.endswith(".lock")] == []


def wait_then_fill_worker(nbytes, seed, key, directory, go_file, ready_file, results):
    def fill(tensor):
        Path(ready_file).write_text("reserved")
        wait_for(lambda: os.path.exists(go_file), "the go-ahead")
        fill_pattern(seed, tensor)

    buffer = allocate_host_buffer(nbytes, fill=fill, share_key=key, directory=directory, huge_pages=False)
    results.put(torch.equal(buffer.tensor, pattern(seed, nbytes)))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs of its own (needs root), unmounted after the test."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield str(mount_point)
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_parallel_fills_cannot_overcommit(small_tmpfs, seed, monkeypatch):
    """Two 3 MiB tables on a 4 MiB tmpfs: the first reserves its bytes before its fill, so the
    second is refused with the clear error, even without the free-space check, and the first
    completes (no SIGBUS)."""
    nbytes = 3 << 20
    go_file, ready_file = os.path.join(small_tmpfs, "go"), os.path.join(small_tmpfs, "ready")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    first = context.Process(target=wait_then_fill_worker,
                            args=(nbytes, seed, f"first {seed}", small_tmpfs, go_file, ready_file, results))
    first.start()
    try:
        wait_for(lambda: os.path.exists(ready_file), "the first fill to start")
        for free_space_check in (True, False):
            if not free_space_check:
                monkeypatch.setattr(host_memory, "check_room", lambda directory, needed: None)   # as if both checked at once
            with pytest.raises(ValueError, match=re.escape(f"directory: '{small_tmpfs}' has ") + r"\d+ bytes free of "
                               + f"{4 << 20}, the shared table needs {nbytes + 4096} bytes"):
                allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=f"second {seed}",
                                     directory=small_tmpfs, huge_pages=False)
        Path(go_file).write_text("go")
        assert results.get(timeout=WAIT_S) is True
    finally:
        Path(go_file).write_text("go")
        first.join(WAIT_S)
    assert first.exitcode == 0


def test_killed_filler_leaves_nothing_valid(shm_dir, seed, capsys):
    from engram.tools.cli import main

    nbytes = 4 * 2**20 + 4096
    key = f"killed mid-fill {seed}"
    path = shared_buffer_path(key, shm_dir)
    temporary = Path(str(path) + ".tmp")
    flag_file = os.path.join(shm_dir, "filling.flag")
    context = multiprocessing.get_context("spawn")
    hanging = context.Process(target=hang_worker, args=(nbytes, seed, key, shm_dir, flag_file))
    hanging.start()
    try:
        wait_for(lambda: os.path.exists(flag_file), "the filler to be half-way")
        (entry,) = [e for e in host_memory.list_shared_tables(shm_dir) if e.kind == "partial"]
        assert (entry.path, entry.share_key, entry.filled, entry.live_filler, entry.filler_pid, entry.stale) == (
            str(temporary), key, False, True, hanging.pid, False)
        assert main(["shm", "remove", str(path)]) == 1   # its filler is alive: left
        assert f"process {hanging.pid} is filling" in capsys.readouterr().out
    finally:
        os.kill(hanging.pid, signal.SIGKILL)
        hanging.join(WAIT_S)
    assert hanging.exitcode == -signal.SIGKILL
    (entry,) = [e for e in host_memory.list_shared_tables(shm_dir) if e.kind == "partial"]
    assert (entry.filled, entry.live_filler, entry.stale) == (False, False, True)
    # Even renamed into place, the half-filled file is refused: its header says it was never filled.
    os.rename(temporary, path)
    with pytest.raises(ValueError, match=refused(path, re.escape("it was never completely filled"))):
        allocate_host_buffer(nbytes, fill=fill_must_not_run, share_key=key, directory=shm_dir)
    assert main(["shm", "list", "--dir", shm_dir]) == 1
    assert main(["shm", "remove", "--all-stale", "--dir", shm_dir]) == 0
    assert not path.exists() and not Path(str(path) + ".lock").exists()
    results = context.Queue()
    refill = context.Process(target=complete_worker, args=(nbytes, seed, key, shm_dir, results))
    refill.start()
    assert results.get(timeout=WAIT_S) == "started"
    assert results.get(timeout=WAIT_S) == {"filled_here": True, "same": True}
    refill.join(WAIT_S)
    assert refill.exitcode == 0


def test_list_and_remove(shm_dir, seed, tmp_path):
    from engram.table.host_memory.shm_files import content_fingerprint

    source = tmp_path / "checkpoint.bin"
    source.write_bytes(b"v1")
    keys = {name: f"/models/x {name} {seed}" for name in ("kept", "removed", "older")}   # keys hold '/'
    fill_table(keys["kept"], shm_dir, 8192, seed, sources=[source], remove_superseded=False)
    fill_table(keys["removed"], shm_dir, 4096 * 3, seed, row_bytes=4096)
    fill_table(keys["older"], shm_dir, 8192, seed, sources=[source])
    source.write_bytes(b"v2, longer")   # "kept" and "older" are now of an older checkpoint
    kept, removed, older = (shared_buffer_path(keys[name], shm_dir) for name in ("kept", "removed", "older"))
    os.utime(source, ns=(0, 0))
    lonely_lock = Path(shm_dir) / "engram-gone-0123456789abcdef.lock"
    lonely_lock.write_text("")
    foreign = Path(shm_dir) / "engram-planted-fedcba9876543210"
    foreign.write_bytes(b"\0" * 5000)
    if os.getuid() == 0:
        os.chown(foreign, 4242, -1)
    entries = {e.path: e for e in host_memory.list_shared_tables(shm_dir)}
    assert sorted(entries) == sorted(map(str, (kept, removed, older, lonely_lock, foreign)))
    entry = entries[str(removed)]
    assert (entry.kind, entry.size, entry.owner_uid, entry.share_key, entry.fingerprint, entry.rows,
            entry.row_bytes, entry.filled, entry.live_filler, entry.problem, entry.stale) == (
        "table", header_region() + 4096 * 3, os.getuid(), keys["removed"],
        content_fingerprint(keys["removed"]).hex(), 3, 4096, True, False, None, False)
    assert entries[str(older)].superseded and entries[str(older)].stale
    assert "the files it was filled from changed since" in entries[str(older)].problem
    assert (entries[str(lonely_lock)].kind, entries[str(lonely_lock)].stale) == ("lock", True)
    assert "not an engram table file" in entries[str(foreign)].problem or "owned by uid 4242" in entries[str(foreign)].problem
    assert entries[str(foreign)].stale == (os.getuid() != 0)   # another user's file is never stale for us

    removal = host_memory.remove_shared_table(keys["removed"], directory=shm_dir)
    assert (sorted(removal.removed), removal.refused) == (sorted([str(removed), str(removed) + ".lock"]), [])
    if os.getuid() == 0:
        removal = host_memory.remove_shared_table(directory=shm_dir, all_stale=True)
        assert sorted(removal.removed) == sorted([str(kept), str(kept) + ".lock", str(older), str(older) + ".lock",
                                                  str(lonely_lock)])
        assert [e.path for e in host_memory.list_shared_tables(shm_dir)] == [str(foreign)]
    with pytest.raises(ValueError, match="expected a target .* or all_stale=True, found neither"):
        host_memory.remove_shared_table(directory=shm_dir)
    with pytest.raises(ValueError, match="found both"):
        host_memory.remove_shared_table("k", directory=shm_dir, all_stale=True)


def test_filling_a_newer_table_removes_superseded_ones(shm_dir, seed, tmp_path):
    source = tmp_path / "model.safetensors"
    source.write_bytes(b"old weights")
    first = fill_table(f"ckpt old {seed}", shm_dir, 8192, seed, sources=[source])
    source.write_bytes(b"new weights, more of them")
    unrelated = tmp_path / "other.safetensors"
    unrelated.write_bytes(b"other")
    fill_table(f"ckpt other {seed}", shm_dir, 8192, seed, sources=[unrelated])
    fill_table(f"ckpt new {seed}", shm_dir, 8192, seed + 1, sources=[source], remove_superseded=False)
    assert Path(first.shared_path).exists()   # kept when asked to
    host_memory.remove_shared_buffer(f"ckpt new {seed}", shm_dir)
    fill_table(f"ckpt new {seed}", shm_dir, 8192, seed + 1, sources=[source])
    assert not Path(first.shared_path).exists()   # the older checkpoint's table went
    assert torch.equal(first.tensor, pattern(seed, 8192))   # a process mapping it keeps its copy
    names = {e.share_key for e in host_memory.list_shared_tables(shm_dir)}
    assert names == {f"ckpt other {seed}", f"ckpt new {seed}"}


def test_shm_cli_exit_codes(shm_dir, seed, capsys):
    from engram.tools.cli import main

    assert main(["shm", "list", "--dir", shm_dir]) == 0
    assert "no shared table files" in capsys.readouterr().out
    key = f"/models/cli {seed}"
    fill_table(key, shm_dir, 8192, seed)
    assert main(["shm", "list", "--dir", shm_dir]) == 0
    out = capsys.readouterr().out
    assert shared_buffer_path(key, shm_dir).name[:20] in out and "ok" in out
    assert main(["shm", "list", "--dir", shm_dir, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["share_key"], listed["filled"], listed["stale"]) == (key, True, False)
    Path(shm_dir, "engram-gone-0123456789abcdef.lock").write_text("")
    assert main(["shm", "list", "--dir", shm_dir]) == 1   # a stale file
    assert "1 stale" in capsys.readouterr().out
    assert main(["shm", "remove", "--all-stale", "--dir", shm_dir]) == 0
    assert main(["shm", "remove", "--all-stale", "--dir", shm_dir]) == 0   # nothing stale: fine
    assert main(["shm", "remove", key, "--dir", shm_dir]) == 0
    assert main(["shm", "remove", key, "--dir", shm_dir]) == 2   # nothing to remove: a key that names no table
    captured = capsys.readouterr()
    assert "nothing to remove" not in captured.out and captured.err.startswith("error: nothing to remove")
    assert main(["shm", "list", "--dir", "/no/such/directory"]) == 2
    assert main(["shm", "remove", "--all-stale", "--dir", "/no/such/directory"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.count("error: directory: '/no/such/directory' does not exist") == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["shm", "remove", key, "--all-stale", "--dir", shm_dir])   # both: argparse's usage error
    assert exit_info.value.code == 2


def test_checkpoint_shared_host_table(tmp_path, seed, monkeypatch):
    """The checkpoint loader's share path (CPU part; the placement, which needs CUDA, stubbed):
    the second load attaches the first's table read-only, its header records the checkpoint's
    files, and a load after the files changed fills a new table and removes the older one."""
    import types

    from engram import checkpoint as loader
    from engram.layout import EngramLayout
    from engram.table.placements.host import HostPlacement
    from engram.table.host_memory.rows import PackedRows, mapped_read_only, packed_row_bytes
    from engram.tools.testing import write_synthetic_checkpoint

    synthetic = write_synthetic_checkpoint(tmp_path / "model", seed=seed % 2**31)
    layout = EngramLayout(synthetic.spec)
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        pytest.skip("/dev/shm is not a writable directory on this machine")

    def load():
        checkpoint = loader.SafetensorsCheckpoint(synthetic.directory)
        infos = [checkpoint.info(checkpoint.name(synthetic.spec.layer_ids[0], kind))
                 for kind in ("embed.weight", "embed.scale")]
        source = loader.TableSource(checkpoint, *infos, 0, layout.num_embeddings[0], synthetic.spec.head_dim,
                                    "layer table", 2**20, None, True, True)
        _values, _scales, keep = HostPlacement.load_storage(source, None)  # the placement itself needs CUDA
        return types.SimpleNamespace(**keep), infos

    loads = []
    try:
        for _ in range(2):
            loads.append(load())
        (first, infos), (second, _) = loads
        assert first.host_buffer.filled_here and not second.host_buffer.filled_here
        assert first.share_key == second.share_key
        buffer = second.host_buffer
        assert mapped_read_only(buffer.tensor.data_ptr(), buffer.nbytes)
        assert torch.equal(buffer.tensor, first.host_buffer.tensor)
        rows = PackedRows(buffer.tensor.view(-1, packed_row_bytes(synthetic.spec.head_dim)), synthetic.spec.head_dim)
        from safetensors.torch import load_file

        values = load_file(infos[0].file)[infos[0].name].view(torch.uint8)
        assert torch.equal(rows.values, values)
        (entry,) = [e for e in host_memory.list_shared_tables(SHM) if e.share_key == first.share_key]
        assert (entry.row_bytes, entry.rows, entry.filled, entry.stale) == (
            packed_row_bytes(synthetic.spec.head_dim), values.shape[0] + 1, True, False)
        assert set(entry.sources) == {os.path.realpath(info.file) for info in infos}
        os.utime(infos[0].file, ns=(1, 1))   # the checkpoint changed: a new key, the old table superseded
        loads.append(load())
        assert loads[-1][0].host_buffer.filled_here and loads[-1][0].share_key != first.share_key
        assert not Path(first.host_buffer.shared_path).exists()
    finally:
        for storage, _ in loads:
            host_memory.remove_shared_buffer(storage.share_key)
