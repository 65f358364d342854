"""Host buffers (engram.table.host_memory): private fill, one shared copy for several
processes, a filler killed mid-fill, size mismatches, the once-only huge-page warning.

Shared files go to a fresh temporary directory under /dev/shm (a tmpfs, so the pages show
as shared memory in /proc), removed afterwards. Processes are started with 'spawn'.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from engram.table import host_memory
from engram.table.host_memory import (HUGE_PAGE_BYTES, allocate_host_buffer, memory_report, remove_shared_buffer,
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
