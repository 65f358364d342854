"""Host memory for big tables: huge pages where the OS allows, one copy per node.

:func:`allocate_host_buffer` returns a :class:`HostBuffer`, ``uint8 [nbytes]`` of host
memory that ``fill`` writes once:

- **private** (``share_key`` None): an anonymous mapping of ``nbytes`` rounded up to
  2 MiB, advised to use transparent huge pages (``MADV_HUGEPAGE``) before ``fill``
  touches it.
- **shared** (``share_key`` given): one file per key in ``directory`` (a tmpfs such as
  ``/dev/shm``), mapped ``MAP_SHARED`` by every process that asks for the key, so a node
  keeps one copy however many processes serve from it (one per GPU). The first process
  fills a temporary file while holding an ``flock`` on the key's lock file, then renames
  it into place (atomic publication). The others sleep-poll until it is published; a
  waiter that gets the lock while nothing is published knows the filler died (the
  kernel drops the lock of a dead process), removes its temporary file and fills it
  itself. Every wait is bounded by ``wait_timeout_s``.

Whether huge pages were obtained is read back from ``/proc/self/smaps`` after ``fill``
(``AnonHugePages``, ``ShmemPmdMapped``, ``FilePmdMapped`` of the mapping), never assumed;
when they were asked for and not obtained, one warning per process says so.

After ``fill`` the mapping is made read-only (``mprotect``) unless ``read_only=False``:
a stray write then faults instead of corrupting a table other processes read. (A GPU
registration of a read-only mapping, ``cudaHostRegister``, needs the flag
``cudaHostRegisterReadOnly``.)

:func:`memory_report` gives this process's RSS, shared and PSS bytes, to show that a
shared table is counted once per node (each of ``n`` processes mapping it carries
``nbytes / n`` of PSS).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import math
import mmap
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

__all__ = ["HUGE_PAGE_BYTES", "HostBuffer", "allocate_host_buffer", "remove_shared_buffer", "memory_report",
           "shared_buffer_path"]

HUGE_PAGE_BYTES = 2 * 2**20
"""Size of one transparent huge page (x86-64 and most arm64 kernels: a PMD)."""

_PAGE_BYTES = mmap.PAGESIZE
_FILE_PREFIX = "engram-"
_POLL_FIRST_S = 0.01        # a waiter's first sleep between checks; doubles up to _POLL_MAX_S
_POLL_MAX_S = 0.5
_THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")

_warned_no_huge_pages = False   # one warning per process


# ---------------------------------------------------------------------------
# the buffer
# ---------------------------------------------------------------------------
@dataclass(eq=False)
class HostBuffer:
    """``nbytes`` of host memory filled once, as a ``uint8`` tensor.

    Attributes:
        tensor: ``torch.uint8 [nbytes]`` on the CPU, a view of the mapping (read-only after
            ``fill`` unless allocated with ``read_only=False``). None after :meth:`close`.
        huge_pages: at least half of the mapping is backed by 2 MiB pages (read from
            ``/proc/self/smaps`` after ``fill``).
        shared_path: the shared file when shared, else None.
        filled_here: this process ran ``fill`` (False: another process had filled it).
        huge_page_bytes: bytes of the mapping in 2 MiB pages when checked.
        nbytes: the size asked for.
    """

    tensor: torch.Tensor | None
    huge_pages: bool
    shared_path: str | None
    filled_here: bool
    huge_page_bytes: int = 0
    nbytes: int = 0
    _mapping: mmap.mmap | None = field(default=None, repr=False)

    def close(self) -> None:
        """Give up this buffer's mapping. The memory is unmapped as soon as no view of
        :attr:`tensor` remains (at once when the caller holds none; a view still alive keeps
        it mapped, so it never dangles). A shared file stays for later processes
        (:func:`remove_shared_buffer` deletes it). Calling it twice is harmless."""
        self.tensor = None
        self._mapping = None   # the mmap object unmaps when its last reference (tensor storages) goes


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------
def _check_arguments(nbytes, fill, share_key, huge_pages, wait_timeout_s, directory) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes: expected a positive integer, found {nbytes!r}")
    if not callable(fill):
        raise ValueError(f"fill: expected a callable taking the uint8 tensor, found {fill!r}")
    if share_key is not None and (not isinstance(share_key, str) or not share_key):
        raise ValueError(f"share_key: expected a non-empty string or None, found {share_key!r}")
    if not isinstance(huge_pages, bool):
        raise ValueError(f"huge_pages: expected True or False, found {huge_pages!r}")
    if (isinstance(wait_timeout_s, bool) or not isinstance(wait_timeout_s, (int, float))
            or not math.isfinite(wait_timeout_s) or wait_timeout_s <= 0):
        raise ValueError(f"wait_timeout_s: expected a positive finite number of seconds, found {wait_timeout_s!r}")
    if share_key is not None:
        _check_directory(directory)


def _check_directory(directory) -> Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"directory: expected a path, found {directory!r}")
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"directory: {str(path)!r} does not exist or is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"directory: {str(path)!r} is not writable by this process")
    return path


def shared_buffer_path(share_key: str, directory: str | os.PathLike = "/dev/shm") -> Path:
    """The file of ``share_key`` in ``directory``: ``engram-<key, sanitized, cut to 80
    characters>-<16 hex digits of the key's SHA-256>`` (the digest keeps distinct keys apart
    however they sanitize)."""
    if not isinstance(share_key, str) or not share_key:
        raise ValueError(f"share_key: expected a non-empty string, found {share_key!r}")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", share_key).strip("._")[:80]
    digest = hashlib.sha256(share_key.encode("utf-8")).hexdigest()[:16]
    return Path(directory) / f"{_FILE_PREFIX}{readable}-{digest}"


# ---------------------------------------------------------------------------
# huge pages
# ---------------------------------------------------------------------------
def _thp_setting(name: str) -> str | None:
    """The bracketed choice of ``/sys/kernel/mm/transparent_hugepage/<name>``, or None."""
    try:
        text = (_THP_DIR / name).read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w[\w-]*)\]", text)
    return found.group(1) if found else None


def _huge_page_bytes(address: int, length: int) -> int:
    """Bytes in 2 MiB pages of the mappings overlapping ``[address, address + length)``,
    from ``/proc/self/smaps`` (capped at ``length``)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
            for line in smaps:
                header = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
                if header:
                    start, end = int(header.group(1), 16), int(header.group(2), 16)
                    inside = start < address + length and end > address
                    continue
                if inside and line.startswith(("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return min(total, length)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this module."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _huge_page_outcome(address: int, length: int, shared: bool) -> tuple[bool, int]:
    """(huge pages obtained, bytes in huge pages) after fill; warns once per process if not."""
    global _warned_no_huge_pages
    huge_bytes = _huge_page_bytes(address, length)
    obtained = huge_bytes * 2 >= length and huge_bytes > 0
    if not obtained and not _warned_no_huge_pages:
        _warned_no_huge_pages = True
        setting = "shmem_enabled" if shared else "enabled"
        value = _thp_setting(setting)
        reason = (f"{_THP_DIR / setting} is [{value}]" if value is not None
                  else f"{_THP_DIR / setting} is not readable")
        warnings.warn(f"engram host memory: 2 MiB huge pages were asked for but not obtained "
                      f"({huge_bytes} of {length} bytes in huge pages; {reason}); using normal 4 KiB pages, "
                      f"which costs TLB misses on random row reads", RuntimeWarning, stacklevel=_caller_stacklevel())
    return obtained, huge_bytes


# ---------------------------------------------------------------------------
# mappings
# ---------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mprotect.restype = ctypes.c_int


def _make_read_only(address: int, length: int) -> None:
    if _libc.mprotect(address, length, mmap.PROT_READ) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mprotect(PROT_READ) of the host buffer failed: {os.strerror(code)}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _advise_huge(mapping: mmap.mmap) -> None:
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):   # no THP in this kernel/Python: the check after fill says so
        pass


def _fill_mapping(mapping: mmap.mmap, nbytes: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    fill(tensor)
    return tensor


def _finish(mapping: mmap.mmap, tensor: torch.Tensor, length: int, *, huge_pages: bool, shared_path: Path | None,
            filled_here: bool, read_only: bool) -> HostBuffer:
    address = tensor.data_ptr()
    obtained, huge_bytes = (_huge_page_outcome(address, length, shared_path is not None) if huge_pages
                            else (False, _huge_page_bytes(address, length)))
    if read_only:
        _make_read_only(address, _round_up(length, _PAGE_BYTES))
    return HostBuffer(tensor, obtained, None if shared_path is None else str(shared_path), filled_here,
                      huge_page_bytes=huge_bytes, nbytes=tensor.numel(), _mapping=mapping)


def _allocate_private(nbytes: int, fill, huge_pages: bool, read_only: bool) -> HostBuffer:
    length = _round_up(nbytes, HUGE_PAGE_BYTES)
    try:
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as error:
        raise MemoryError(f"nbytes = {nbytes}: could not map {length} bytes of private host memory ({error})") from None
    if huge_pages:
        _advise_huge(mapping)
    tensor = _fill_mapping(mapping, nbytes, fill)
    return _finish(mapping, tensor, length, huge_pages=huge_pages, shared_path=None, filled_here=True,
                   read_only=read_only)


def _map_file(fd: int, nbytes: int, huge_pages: bool) -> mmap.mmap:
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge_pages:
        _advise_huge(mapping)
    return mapping


def _map_published(path: Path, nbytes: int, huge_pages: bool, read_only: bool) -> HostBuffer | None:
    """Map the published file of a key, or None when there is none (yet)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"shared buffer file {str(path)!r} holds {size} bytes, expected nbytes = {nbytes}: "
                             f"the key does not identify the content (or the file is damaged); remove it with "
                             f"remove_shared_buffer or use a key naming everything the content depends on")
        mapping = _map_file(fd, nbytes, huge_pages)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return _finish(mapping, tensor, nbytes, huge_pages=huge_pages, shared_path=path, filled_here=False,
                   read_only=read_only)


# ---------------------------------------------------------------------------
# the lock of a key
# ---------------------------------------------------------------------------
def _try_lock(lock_path: Path) -> int | None:
    """An fd holding the exclusive flock of ``lock_path`` (created if needed), or None when
    another process holds it. Retries when the file was replaced while we waited (the lock
    must be on the inode the path names now)."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)   # removed or replaced meanwhile: lock the current file


def _lock_holder(lock_path: Path) -> str:
    """The pid the filler wrote into the lock file, as text for an error ("unknown" if none)."""
    try:
        text = lock_path.read_text().strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _check_free_space(directory: Path, nbytes: int) -> None:
    """Refuse a fill that cannot fit: on a full tmpfs, writing a mapped page kills the process
    with SIGBUS instead of raising."""
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise ValueError(f"directory: {str(directory)!r} has {free} bytes free, nbytes = {nbytes} do not fit "
                         f"(a tmpfs such as /dev/shm is sized at mount time: mount -o remount,size=...)")


def _fill_shared(path: Path, lock_fd: int, nbytes: int, fill, huge_pages: bool, read_only: bool) -> HostBuffer:
    """Holding the lock: fill ``<path>.tmp`` (removing a dead filler's), publish it by rename."""
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)   # a filler that died left it
    _check_free_space(path.parent, nbytes)
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.ftruncate(fd, nbytes)
        mapping = _map_file(fd, nbytes, huge_pages)
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        tensor = _fill_mapping(mapping, nbytes, fill)
        os.rename(temporary, path)   # atomic: others see nothing or the whole table
    except BaseException:
        mapping = None
        temporary.unlink(missing_ok=True)
        raise
    return _finish(mapping, tensor, nbytes, huge_pages=huge_pages, shared_path=path, filled_here=True,
                   read_only=read_only)


def _allocate_shared(nbytes: int, fill, share_key: str, huge_pages: bool, wait_timeout_s: float,
                     directory: Path, read_only: bool) -> HostBuffer:
    path = shared_buffer_path(share_key, directory)
    lock_path = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + wait_timeout_s
    pause = _POLL_FIRST_S
    while True:
        published = _map_published(path, nbytes, huge_pages, read_only)
        if published is not None:
            return published
        lock_fd = _try_lock(lock_path)
        if lock_fd is not None:
            try:
                # Published between our look and the lock? Then the filler is done.
                published = _map_published(path, nbytes, huge_pages, read_only)
                if published is not None:
                    return published
                return _fill_shared(path, lock_fd, nbytes, fill, huge_pages, read_only)
            finally:
                os.close(lock_fd)   # releases the flock
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"share_key {share_key!r}: waited {wait_timeout_s} s (wait_timeout_s) for another "
                               f"process to fill {str(path)!r}; the filler (pid {_lock_holder(lock_path)}, holding "
                               f"{str(lock_path)!r}) has not finished")
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL_MAX_S)


# ---------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------
def allocate_host_buffer(nbytes: int, *, fill: Callable[[torch.Tensor], None], share_key: str | None = None,
                         huge_pages: bool = True, wait_timeout_s: float = 3600.0,
                         directory: str = "/dev/shm", read_only: bool = True) -> HostBuffer:
    """``nbytes`` of host memory, written once by ``fill(tensor)`` (``tensor``: ``uint8 [nbytes]``).

    Args:
        nbytes: size in bytes (> 0).
        fill: writes the content; runs in at most one process per ``share_key`` (the first
            to come; another if that one dies). An exception in ``fill`` leaves nothing behind.
        share_key: None for private memory; else the name of the content, shared by every
            process of the node that passes the same key. It must name everything the
            content depends on (e.g. checkpoint path, file sizes and mtimes, layer, row range,
            row format): a published file of another size is refused.
        huge_pages: ask for 2 MiB pages (``MADV_HUGEPAGE``); one warning per process if the
            OS does not give them (then 4 KiB pages are used).
        wait_timeout_s: how long a process waits for another's fill before ``TimeoutError``.
        directory: where shared files live (a tmpfs: ``/dev/shm``).
        read_only: make the mapping read-only after ``fill`` (writes then fault).

    Raises:
        ValueError: a bad argument, or a published file whose size is not ``nbytes``.
        TimeoutError: another process held the key's fill longer than ``wait_timeout_s``.
    """
    _check_arguments(nbytes, fill, share_key, huge_pages, wait_timeout_s, directory)
    if not isinstance(read_only, bool):
        raise ValueError(f"read_only: expected True or False, found {read_only!r}")
    if share_key is None:
        return _allocate_private(nbytes, fill, huge_pages, read_only)
    return _allocate_shared(nbytes, fill, share_key, huge_pages, float(wait_timeout_s), Path(directory), read_only)


def remove_shared_buffer(share_key: str, directory: str = "/dev/shm") -> None:
    """Delete the shared file of ``share_key`` (and a dead filler's temporary and the lock
    file). Processes that map it keep their copy until they close it; the next
    :func:`allocate_host_buffer` of the key fills a new one. Refused (ValueError naming the
    pid) while a process is filling it. Nothing there is not an error."""
    directory = _check_directory(directory)
    path = shared_buffer_path(share_key, directory)
    lock_path = path.with_name(path.name + ".lock")
    lock_fd = _try_lock(lock_path)
    if lock_fd is None:
        raise ValueError(f"share_key {share_key!r}: process {_lock_holder(lock_path)} is filling {str(path)!r}; "
                         f"remove it after the fill")
    try:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        lock_path.unlink(missing_ok=True)   # waiters that hold the old inode re-lock the new file
    finally:
        os.close(lock_fd)


_STATUS_FIELDS = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem",
                  "VmHWM": "peak_rss"}
_ROLLUP_FIELDS = {"Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file", "Pss_Shmem": "pss_shmem",
                  "Shared_Clean": "shared_clean", "Shared_Dirty": "shared_dirty",
                  "Private_Clean": "private_clean", "Private_Dirty": "private_dirty",
                  "AnonHugePages": "anon_huge_pages"}


def memory_report() -> dict[str, int]:
    """This process's memory in bytes, from ``/proc/self/status`` and ``/proc/self/smaps_rollup``.

    Keys (those the kernel reports): ``rss``, ``rss_anon``, ``rss_file``, ``rss_shmem``
    (RSS and its parts: a mapped shared-memory table counts fully in each process's
    ``rss_shmem``), ``peak_rss``, ``pss`` and ``pss_anon``/``pss_file``/``pss_shmem``
    (proportional: a page mapped by ``n`` processes counts ``1/n`` in each),
    ``shared`` (``Shared_Clean + Shared_Dirty``: resident pages other processes map too),
    ``private`` (``Private_Clean + Private_Dirty``), ``shared_clean``, ``shared_dirty``,
    ``private_clean``, ``private_dirty``, ``anon_huge_pages``.
    """
    report: dict[str, int] = {}
    for path, fields in (("/proc/self/status", _STATUS_FIELDS), ("/proc/self/smaps_rollup", _ROLLUP_FIELDS)):
        try:
            with open(path, encoding="ascii", errors="replace") as handle:
                for line in handle:
                    name, _, rest = line.partition(":")
                    if name in fields:
                        report[fields[name]] = int(rest.split()[0]) * 1024   # kB
        except OSError:
            continue
    if "shared_clean" in report:
        report["shared"] = report["shared_clean"] + report.get("shared_dirty", 0)
    if "private_clean" in report:
        report["private"] = report["private_clean"] + report.get("private_dirty", 0)
    return report
