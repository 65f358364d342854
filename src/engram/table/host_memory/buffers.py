"""Host memory for big tables: huge pages where the OS allows, one copy per node.

:func:`allocate_host_buffer` returns a :class:`HostBuffer`, ``uint8 [nbytes]`` of host
memory that ``fill`` writes once:

- **private** (``share_key`` None): an anonymous mapping of ``nbytes`` rounded up to
  2 MiB, advised to use transparent huge pages (``MADV_HUGEPAGE``) before ``fill``
  touches it.
- **shared** (``share_key`` given): one file per key in ``directory`` (a tmpfs such as
  ``/dev/shm``), mapped ``MAP_SHARED`` by every process of this user that asks for the key,
  so a node keeps one copy however many processes serve from it (one per GPU). Only its
  owner can write it (:mod:`engram.table.host_memory.shm_files`): the first process creates a temporary
  file exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode ``share_mode``, 0600 by default,
  whatever the umask) while holding an ``flock`` on the key's lock file (created the same
  way), reserves its bytes (``posix_fallocate``: a full tmpfs is one clear error, never a
  SIGBUS mid-fill), writes a header with filled 0, fills the rows, sets filled 1, renames it
  into place (atomic publication) and makes its mapping read-only. The others map it
  read-only after checking owner, mode and header (magic, version, checksum, content
  fingerprint, row layout, filled flag, source files), and refuse a mismatch with one
  ValueError naming the file and what is wrong. They sleep-poll until it is published; a
  waiter that gets the lock while nothing is published knows the filler died (the kernel
  drops the lock of a dead process), removes its temporary file and fills it itself. Every
  wait is bounded by ``wait_timeout_s``; a lock file of another user is refused at once.
  :mod:`engram.table.host_memory.shm_admin` lists and removes them (``engram shm list|remove``).

Whether huge pages were obtained is read back from ``/proc/self/smaps`` after ``fill``
(``AnonHugePages``, ``ShmemPmdMapped``, ``FilePmdMapped`` of the mapping), never assumed;
when they were asked for and not obtained, one warning per process says so.

After ``fill`` the mapping is made read-only (``mprotect``; always for a shared table,
else unless ``read_only=False``): a stray write then faults instead of corrupting a table
other processes read. (:func:`engram.table.host_memory.rows.register_with_cuda` registers a
read-only mapping with ``cudaHostRegisterReadOnly``.)

:func:`memory_report` gives this process's RSS, shared and PSS bytes, to show that a
shared table is counted once per node (each of ``n`` processes mapping it carries
``nbytes / n`` of PSS).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from engram.checks import check_bool, check_positive_int
from engram.table.host_memory.shm_admin import SharedTableInfo, list_shared_tables, remove_leftovers, remove_shared_table
from engram.table.host_memory.shm_files import (DEFAULT_SHARE_MODE, HeaderProblem, TableHeader, check_directory,
                                                check_room, check_share_mode, content_fingerprint, create_exclusive,
                                                file_problem, header_page_bytes, lock_holder, open_checked, refusal,
                                                reserve_file, shared_buffer_path, source_stamps, table_paths,
                                                try_lock)

__all__ = ["HUGE_PAGE_BYTES", "HostBuffer", "allocate_host_buffer", "remove_shared_buffer", "memory_report",
           "shared_buffer_path", "list_shared_tables", "remove_shared_table", "SharedTableInfo"]

HUGE_PAGE_BYTES = 2 * 2**20
"""Size of one transparent huge page (x86-64 and most arm64 kernels: a PMD)."""

_PAGE_BYTES = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23   # Linux 5.14+: fault pages in writable; an error, never SIGBUS, when there is no room
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
            ``fill``: always when shared, else unless allocated with ``read_only=False``; a
            write to a read-only one faults). None after :meth:`close`.
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
    check_positive_int("nbytes", nbytes)
    if not callable(fill):
        raise ValueError(f"fill: expected a callable taking the uint8 tensor, found {fill!r}")
    if share_key is not None and (not isinstance(share_key, str) or not share_key):
        raise ValueError(f"share_key: expected a non-empty string or None, found {share_key!r}")
    check_bool("huge_pages", huge_pages)
    if (isinstance(wait_timeout_s, bool) or not isinstance(wait_timeout_s, (int, float))
            or not math.isfinite(wait_timeout_s) or wait_timeout_s <= 0):
        raise ValueError(f"wait_timeout_s: expected a positive finite number of seconds, found {wait_timeout_s!r}")
    if share_key is not None:
        check_directory(directory)


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


def _read_only_tensor(mapping: mmap.mmap, nbytes: int) -> torch.Tensor:
    """``uint8 [nbytes]`` over a read-only mapping. torch has no read-only tensors and warns
    about the buffer once; nothing in engram writes an attached table (a write would fault)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


# ---------------------------------------------------------------------------
# shared tables
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _SharedTable:
    """What a shared allocation asks for: where, who may read it, and the header it must have."""

    path: Path
    directory: Path
    expected: TableHeader   # filled, with the sources as they are now
    share_mode: int
    huge_pages: bool
    remove_superseded: bool

    @property
    def temporary(self) -> Path:
        return table_paths(self.path)[1]

    @property
    def lock_path(self) -> Path:
        return table_paths(self.path)[2]


def _attach(table: _SharedTable) -> HostBuffer | None:
    """Map the published file of a key read-only after checking it, or None when there is none
    (yet). A file that is not the table asked for is refused (ValueError naming it and why)."""
    fd = open_checked(table.path, os.O_RDONLY, table.share_mode)
    if fd is None:
        return None
    try:
        try:
            header = TableHeader.read(fd, os.fstat(fd).st_size)
        except HeaderProblem as problem:
            raise refusal(table.path, str(problem)) from None
        problem = header.mismatch(table.expected)
        if problem is not None:
            raise refusal(table.path, problem)
        mapping = mmap.mmap(fd, header.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                            offset=header.data_offset)
    finally:
        os.close(fd)
    if table.huge_pages:
        _advise_huge(mapping)
    tensor = _read_only_tensor(mapping, header.nbytes)
    return _finish(mapping, tensor, header.nbytes, huge_pages=table.huge_pages, shared_path=table.path,
                   filled_here=False, read_only=False)   # mapped read-only already


def _remove_leftover(temporary: Path) -> None:
    """Remove a dead filler's temporary file (we hold the lock: no filler is alive)."""
    try:
        temporary.unlink()
    except FileNotFoundError:
        pass
    except PermissionError:
        try:
            problem = file_problem(os.lstat(temporary), 0o600) or "this user may not remove it"
        except OSError:
            problem = "this user may not remove it"
        raise refusal(temporary, problem) from None


def _populate(mapping: mmap.mmap) -> None:
    """Fault the (huge-page advised) mapping in, so that a tmpfs mounted ``huge=advise`` gives
    2 MiB pages before ``posix_fallocate``, which has no mapping to take the advice from,
    reserves the rest. Best effort: a kernel without it, or no room, is left to the reservation."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except (AttributeError, OSError, ValueError):
        pass


def _fill_shared(table: _SharedTable, lock_fd: int, fill) -> HostBuffer:
    """Holding the lock: create ``<path>.tmp`` exclusively (removing a dead filler's), reserve
    it, write the header (filled 0), fill, set filled 1, publish it by rename."""
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
    _remove_leftover(table.temporary)
    header = replace(table.expected, filled=False, filler_pid=os.getpid(), fill_time_s=time.time())
    header_bytes = header_page_bytes(header)   # the filled header has the same length
    nbytes, needed = header.nbytes, header.nbytes + header_bytes
    check_room(table.directory, needed)   # at once; the reservation below is what guarantees it
    try:
        fd = create_exclusive(table.temporary, table.share_mode)
    except FileExistsError:
        raise refusal(table.temporary, "it was created again while this process held the lock (by another "
                                       "user or a process that does not lock)") from None
    mapping = tensor = None
    try:
        os.ftruncate(fd, header.total_bytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                            offset=header.data_offset)
        if table.huge_pages:
            _advise_huge(mapping)
            _populate(mapping)
        reserve_file(fd, header, table.directory)
        os.pwrite(fd, header.encode(), 0)
        tensor = _fill_mapping(mapping, nbytes, fill)
        _make_read_only(tensor.data_ptr(), _round_up(nbytes, _PAGE_BYTES))   # before anyone can attach it
        mapping.flush()
        os.pwrite(fd, replace(header, filled=True).encode(), 0)   # last: the rows are all there
        os.rename(table.temporary, table.path)   # atomic: others see nothing or the whole table
    except BaseException:
        tensor = mapping = None
        table.temporary.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    buffer = _finish(mapping, tensor, nbytes, huge_pages=table.huge_pages, shared_path=table.path,
                     filled_here=True, read_only=False)   # made read-only above
    sources = tuple(s[0] for s in header.sources) if table.remove_superseded else ()
    try:
        remove_leftovers(table.directory, sources, keep=table.path)
    except Exception as error:   # clean-up only: the table is published and mapped either way
        warnings.warn(f"engram host memory: the clean-up of {str(table.directory)!r} after filling "
                      f"{str(table.path)!r} failed ({type(error).__name__}: {error}); the table is in place. "
                      f"`engram shm list --dir {table.directory}` shows what is left", RuntimeWarning,
                      stacklevel=_caller_stacklevel())
    return buffer


def _allocate_shared(table: _SharedTable, fill, share_key: str, wait_timeout_s: float) -> HostBuffer:
    deadline = time.monotonic() + wait_timeout_s
    pause = _POLL_FIRST_S
    while True:
        published = _attach(table)
        if published is not None:
            return published
        lock_fd = try_lock(table.lock_path)   # a lock file of another user: refused at once
        if lock_fd is not None:
            try:
                # Published between our look and the lock? Then the filler is done.
                published = _attach(table)
                if published is not None:
                    return published
                return _fill_shared(table, lock_fd, fill)
            finally:
                os.close(lock_fd)   # releases the flock
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"share_key {share_key!r}: waited {wait_timeout_s} s (wait_timeout_s) for another "
                               f"process to fill {str(table.path)!r}; the filler (pid {lock_holder(table.lock_path)}, "
                               f"holding {str(table.lock_path)!r}) has not finished")
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL_MAX_S)


def _check_shared_arguments(nbytes, share_mode, fingerprint, row_bytes, sources, remove_superseded) -> None:
    check_share_mode(share_mode)
    if not isinstance(fingerprint, (bytes, bytearray, memoryview)):
        raise ValueError(f"fingerprint: expected bytes naming the content, found {fingerprint!r}")
    check_positive_int("row_bytes", row_bytes, note=f" dividing nbytes = {nbytes}")
    if nbytes % row_bytes:
        raise ValueError(f"row_bytes: expected a positive integer dividing nbytes = {nbytes}, found {row_bytes!r}")
    if isinstance(sources, (str, bytes, os.PathLike)) or not isinstance(sources, Iterable):
        raise ValueError(f"sources: expected a list of file paths, found {sources!r}")
    check_bool("remove_superseded", remove_superseded)


# ---------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------
def allocate_host_buffer(nbytes: int, *, fill: Callable[[torch.Tensor], None], share_key: str | None = None,
                         huge_pages: bool = True, wait_timeout_s: float = 3600.0,
                         directory: str = "/dev/shm", read_only: bool = True, share_mode: int = DEFAULT_SHARE_MODE,
                         fingerprint: bytes = b"", row_bytes: int = 1, sources: Iterable[str | os.PathLike] = (),
                         remove_superseded: bool = True) -> HostBuffer:
    """``nbytes`` of host memory, written once by ``fill(tensor)`` (``tensor``: ``uint8 [nbytes]``).

    Args:
        nbytes: size in bytes (> 0).
        fill: writes the content; runs in at most one process per ``share_key`` (the first
            to come; another if that one dies). An exception in ``fill`` leaves nothing behind.
        share_key: None for private memory; else the name of the content, shared by every
            process of this user on the node that passes the same key. It must name
            everything the content depends on (e.g. checkpoint path, file sizes and mtimes,
            layer, row range, row format): it is recorded in the file's header, and a file
            filled for another key, fingerprint, layout or size is refused.
        huge_pages: ask for 2 MiB pages (``MADV_HUGEPAGE``); one warning per process if the
            OS does not give them (then 4 KiB pages are used).
        wait_timeout_s: how long a process waits for another's fill before ``TimeoutError``.
        directory: where shared files live (a tmpfs: ``/dev/shm``).
        read_only: make a private mapping read-only after ``fill`` (writes then fault). A
            shared table is always read-only after its fill, in every process.
        share_mode: permission bits of a shared file: 0o600 (default: this user only), or
            with group/other read added (0o640, 0o604, 0o644) for other readers; never write.
            Only files of this process's user are attached, whatever the mode.
        fingerprint: bytes the caller has about the content (a checksum, a version), recorded
            with the key as the header's content fingerprint and compared on attach.
        row_bytes: bytes per row of the content (dividing ``nbytes``), recorded and compared.
        sources: files the content is read from; their size and mtime are recorded, and a
            table whose sources changed is refused and listed as stale.
        remove_superseded: after a fill, remove this user's tables in ``directory`` filled from
            the same source files that changed since (an older checkpoint's; no load can
            attach them again). Processes that map them keep their copy. Leftovers of dead
            processes (fillers' temporary files, peer shards) are removed after every fill
            (:func:`~engram.table.host_memory.shm_admin.remove_leftovers`).

    Raises:
        ValueError: a bad argument; a shared file that is not the table asked for (the message
            names the file, what is wrong and how to remove it); a lock file of another user;
            too little room in ``directory`` (its size, the bytes needed, how to grow it).
        TimeoutError: another process held the key's fill longer than ``wait_timeout_s``.
    """
    _check_arguments(nbytes, fill, share_key, huge_pages, wait_timeout_s, directory)
    check_bool("read_only", read_only)
    _check_shared_arguments(nbytes, share_mode, fingerprint, row_bytes, sources, remove_superseded)
    if share_key is None:
        return _allocate_private(nbytes, fill, huge_pages, read_only)
    directory = Path(directory)
    expected = TableHeader(share_key, content_fingerprint(share_key, bytes(fingerprint)), row_bytes,
                           nbytes // row_bytes, nbytes, filled=True, sources=source_stamps(sources))
    expected.encode()   # a key too long for the header: refused now
    table = _SharedTable(shared_buffer_path(share_key, directory), directory, expected, share_mode, huge_pages,
                         remove_superseded)
    return _allocate_shared(table, fill, share_key, float(wait_timeout_s))


def remove_shared_buffer(share_key: str, directory: str = "/dev/shm") -> None:
    """Delete the shared file of ``share_key`` (and a dead filler's temporary and the lock
    file). Processes that map it keep their copy until they close it; the next
    :func:`allocate_host_buffer` of the key fills a new one. Refused (ValueError naming the
    pid) while a process is filling it, or when the files are another user's. Nothing there
    is not an error. (:func:`remove_shared_table` also takes paths and removes stale files.)"""
    directory = check_directory(directory)
    removal = remove_shared_table(shared_buffer_path(share_key, directory))
    if removal.refused:
        raise ValueError(f"share_key {share_key!r}: " + "; ".join(removal.refused))


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
