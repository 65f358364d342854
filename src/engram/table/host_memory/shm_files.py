"""Engram's files in a tmpfs directory (``/dev/shm``): names, the header, exclusive creation,
the checks made before a file is attached, lock files, the space reservation and the one
directory check. Two kinds of file share this one scheme:

* a node-shared host table (``kind "table"``, :mod:`engram.table.host_memory.buffers`), named
  after its share key, published by rename once filled and kept for later processes;
* a CPU peer shard of placement ``"node"`` (``kind "peer"``, :mod:`engram.table.peer_memory`),
  ``engram-peer-<pid>-<16 hex digits>``: one rank's rows, opened by the group's other ranks by
  name and inode while its owner sets the group up, then unlinked.

Each file ``engram-<name>`` may have a lock file ``engram-<name>.lock`` beside it, created
exclusively like the file; the process that writes the file (a table's filler, a shard's owner)
holds its ``flock`` from before the file exists until it is done, so a file whose lock no live
process holds is a leftover (:mod:`engram.table.host_memory.shm_admin`). A table's filler
writes a temporary file ``engram-<name>.tmp`` first.

Every file is a regular file owned by the user that wrote it and writable by nobody else::

    [ header region: HEADER_REGION_BYTES = 2 MiB ][ rows: nbytes ]

The header has a leading region of one 2 MiB huge page so that the rows start at a 2 MiB
file offset: a tmpfs maps a file with 2 MiB pages only at 2 MiB-aligned offsets, so the rows
keep huge pages (and their 16-byte and page alignment, which ``host_rows`` and
``cudaHostRegister`` need) exactly as a file of rows alone did. The header is read at offset 0
before anything else in the file is trusted, whatever the file's size. Only the first 4 KiB
page of the region is written (tmpfs allocates on write; a ``huge=always`` mount spends one
2 MiB page per table).

Header, little-endian: magic ``ENGRAMHT``, format version, filled flag, rows offset, bytes per
row, rows, row bytes in all, length of a JSON part, a reserved word, the 32-byte content
fingerprint (BLAKE2b of the share key and the caller's fingerprint bytes); then the JSON part
(kind, share key, source files with size and mtime, filler pid, fill time); then a 32-byte BLAKE2b
checksum of everything before it. The filler writes it with filled 0, fills the rows, then
rewrites it with filled 1 before publishing the file under its name.

The checksum is not keyed: it finds damage, not forgery, so a header is parsed as untrusted
input wherever it is read (a listing reads other users' files too): the JSON part is at most
:data:`MAX_JSON_BYTES` long and nests at most :data:`MAX_JSON_DEPTH` levels, checked before it is
parsed, and every field's type is checked after; whatever is wrong is one :class:`HeaderProblem`.

The bytes are encoded and parsed by :class:`engram.table.file_header.HeaderFormat`, the one
implementation this header shares with the disk tier's row files.

Format version 2 (this one) came with packed host rows that end in their 4-byte row tag; files of
version 1 hold rows without it and are refused on attach (and listed as stale).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from engram.table import file_header
from engram.table.file_header import (HeaderFormat, HeaderProblem, Stamp, changed_sources, check_stamps,
                                      header_checksum, is_int, json_depth, source_stamps, sources_mismatch)

__all__ = ["HEADER_REGION_BYTES", "FORMAT_VERSION", "MAGIC", "DEFAULT_SHARE_MODE", "KINDS", "MAX_JSON_BYTES",
           "MAX_JSON_DEPTH", "TableHeader", "HeaderProblem", "shared_buffer_path", "peer_shard_path", "table_paths",
           "content_fingerprint", "source_stamps", "changed_sources", "check_directory", "check_share_mode",
           "file_problem", "refusal", "create_exclusive", "open_checked", "open_lock", "try_lock", "lock_holder",
           "probe_lock", "check_room", "reserve", "reserve_file", "header_page_bytes", "no_room_error", "TMPFS_ROOM_ADVICE"]

HEADER_REGION_BYTES = 2 * 2**20
"""Bytes before the rows: one 2 MiB huge page holding the header."""
FORMAT_VERSION = 2
"""Version 2: packed host rows end in their 4-byte row tag (version 1 rows had none)."""
MAGIC = b"ENGRAMHT"
DEFAULT_SHARE_MODE = 0o600
LOCK_MODE = 0o600
FILE_PREFIX = "engram-"
PEER_PREFIX = FILE_PREFIX + "peer-"
TEMPORARY_SUFFIX = ".tmp"
LOCK_SUFFIX = ".lock"
KINDS = ("table", "peer")
"""What a file holds: a node-shared host table, or one rank's CPU peer shard of placement ``"node"``."""
MAX_JSON_BYTES = 64 * 2**10
"""Longest JSON part a header may have (share keys and source paths need far less)."""
MAX_JSON_DEPTH = 4
"""Deepest nesting of the JSON part (what is written nests 3 levels: object, sources, one source)."""

_FIXED = struct.Struct("<8sIIQQQQII32s")   # magic, version, filled, offset, row bytes, rows, nbytes, json, 0, fp
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK   # NONBLOCK: a planted FIFO must not hang open()


# ---------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------
def shared_buffer_path(share_key: str, directory: str | os.PathLike = "/dev/shm") -> Path:
    """The file of ``share_key`` in ``directory``: ``engram-<key, sanitized, cut to 80
    characters>-<16 hex digits of the key's SHA-256>`` (the digest keeps distinct keys apart
    however they sanitize)."""
    if not isinstance(share_key, str) or not share_key:
        raise ValueError(f"share_key: expected a non-empty string, found {share_key!r}")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", share_key).strip("._")[:80]
    digest = hashlib.sha256(share_key.encode("utf-8")).hexdigest()[:16]
    return Path(directory) / f"{FILE_PREFIX}{readable}-{digest}"


def peer_shard_path(directory: str | os.PathLike) -> Path:
    """A fresh name for a CPU peer shard of this process in ``directory``:
    ``engram-peer-<pid>-<16 random hex digits>``."""
    return Path(directory) / f"{PEER_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def table_paths(path: Path) -> tuple[Path, Path, Path]:
    """(table, its filler's temporary file, its lock file) of a table path."""
    return path, path.with_name(path.name + TEMPORARY_SUFFIX), path.with_name(path.name + LOCK_SUFFIX)


# ---------------------------------------------------------------------------
# the header
# ---------------------------------------------------------------------------
def content_fingerprint(share_key: str, fingerprint: bytes = b"") -> bytes:
    """32 bytes naming the content: BLAKE2b of the share key and the caller's fingerprint."""
    return file_header.content_fingerprint(share_key, fingerprint)


def _version_problem(version: int) -> str:
    written = ("an older engram, whose packed rows carry no row tag: it is stale" if version < FORMAT_VERSION
               else "a newer engram")
    return (f"its header is format version {version}, this engram reads version {FORMAT_VERSION} only "
            f"(written by {written})")


_FORMAT = HeaderFormat(MAGIC, FORMAT_VERSION, _FIXED, 7, MAX_JSON_BYTES, MAX_JSON_DEPTH,
                       "it is not an engram table file (planted, damaged, or written by an engram older than its "
                       "header)", "key data", _version_problem)
_json_depth = json_depth
_checksum = header_checksum


def _checked_meta(fields: dict) -> dict:
    """The JSON part of a header (parsed by the format) as checked fields; HeaderProblem when it is
    not what :meth:`TableHeader.encode` writes."""
    kind, key, sources = fields.get("kind"), fields.get("share_key"), fields.get("sources")
    pid, fill_time = fields.get("filler_pid"), fields.get("fill_time_s")
    if kind not in KINDS:
        raise HeaderProblem(f"its header's kind is {str(kind)[:80]!r}, expected one of {', '.join(KINDS)}")
    if not isinstance(key, str) or not key:
        raise HeaderProblem("its header's share key is not a non-empty string")
    stamps = check_stamps(sources, "its header's sources")
    if not is_int(pid) or not isinstance(fill_time, (int, float)) or isinstance(fill_time, bool):
        raise HeaderProblem("its header's filler pid or fill time is not a number")
    return {"kind": kind, "share_key": key, "sources": stamps, "filler_pid": pid, "fill_time_s": float(fill_time)}


@dataclass(frozen=True)
class TableHeader:
    """The header of a shared table file or a peer shard (see the module docstring for the bytes)."""

    share_key: str
    fingerprint: bytes
    row_bytes: int
    rows: int
    nbytes: int
    filled: bool = False
    sources: tuple[Stamp, ...] = ()
    filler_pid: int = 0
    fill_time_s: float = 0.0
    data_offset: int = HEADER_REGION_BYTES
    version: int = FORMAT_VERSION
    kind: str = "table"

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole file: header region and rows."""
        return self.data_offset + self.nbytes

    def encode(self) -> bytes:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, found {self.kind!r}")
        meta = {"kind": self.kind, "share_key": self.share_key, "sources": [list(s) for s in self.sources],
                "filler_pid": self.filler_pid, "fill_time_s": self.fill_time_s}
        return _FORMAT.encode((self.version, int(self.filled), self.data_offset, self.row_bytes, self.rows,
                               self.nbytes, 0, self.fingerprint), meta, self.data_offset, "share_key")

    @classmethod
    def read(cls, fd: int, file_bytes: int) -> "TableHeader":
        """The header of the open file ``fd`` of ``file_bytes`` bytes; :class:`HeaderProblem`
        says what is wrong when it is not a valid one (whatever the bytes: reads are bounded, the
        JSON part's length and depth are checked before it is parsed)."""
        fixed, meta = _FORMAT.read(fd, file_bytes)
        _, version, filled, offset, row_bytes, rows, nbytes, _, _, fingerprint = fixed
        fields = _checked_meta(meta)
        header = cls(fields["share_key"], fingerprint, row_bytes, rows, nbytes, bool(filled), fields["sources"],
                     fields["filler_pid"], fields["fill_time_s"], offset, version, fields["kind"])
        if offset != HEADER_REGION_BYTES or row_bytes < 1 or rows * row_bytes != nbytes:
            raise HeaderProblem(f"its header's layout is inconsistent (rows at byte {offset}, {rows} rows x "
                                f"{row_bytes} B != {nbytes} B)")
        if file_bytes != header.total_bytes:
            raise HeaderProblem(f"it holds {file_bytes} bytes where its header says {header.total_bytes} "
                                f"(header + {nbytes} B of rows): the file is truncated or was resized")
        return header

    def mismatch(self, expected: "TableHeader") -> str | None:
        """Why this (valid) header is not the table ``expected`` describes, or None."""
        if self.kind != expected.kind:
            return f"it holds a {self.kind!r} file's rows, not a {expected.kind!r} file's"
        if self.share_key != expected.share_key:
            return f"it was filled for share key {self.share_key!r}, not {expected.share_key!r}"
        if self.fingerprint != expected.fingerprint:
            return (f"its content fingerprint {self.fingerprint.hex()[:16]}... differs from this load's "
                    f"{expected.fingerprint.hex()[:16]}... (filled from other content under the same key)")
        if self.row_bytes == expected.row_bytes == 1 and self.nbytes != expected.nbytes:
            return f"it holds {self.nbytes} B of content, expected nbytes = {expected.nbytes}"
        if (self.row_bytes, self.rows, self.nbytes) != (expected.row_bytes, expected.rows, expected.nbytes):
            return (f"its row layout is {self.rows} rows x {self.row_bytes} B = {self.nbytes} B, expected "
                    f"{expected.rows} rows x {expected.row_bytes} B = {expected.nbytes} B (nbytes = {expected.nbytes})")
        if not self.filled:
            return ("it was never completely filled (filled flag 0: its filler died or was killed mid-fill, "
                    "or it was renamed into place)")
        return sources_mismatch(self.sources, [s[0] for s in expected.sources], "filled")


# ---------------------------------------------------------------------------
# who may write it
# ---------------------------------------------------------------------------
def check_share_mode(share_mode) -> int:
    """``share_mode``: owner read-write, group/other read at most (0o600, 0o640, 0o604, 0o644)."""
    if (isinstance(share_mode, bool) or not isinstance(share_mode, int) or share_mode & ~0o644
            or share_mode & 0o600 != 0o600):
        shown = oct(share_mode) if isinstance(share_mode, int) and not isinstance(share_mode, bool) else repr(share_mode)
        raise ValueError(f"share_mode: expected 0o600 (owner only) or a group/other read bit added (0o640, 0o604, "
                         f"0o644), never a group/other write bit, found {shown}")
    return share_mode


def _uid_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def file_problem(info: os.stat_result, allowed_mode: int) -> str | None:
    """Why a file with ``info`` (from ``fstat`` of the open file) may not be trusted: not a
    regular file, not owned by this process's user, or group/other bits beyond ``allowed_mode``."""
    if not stat.S_ISREG(info.st_mode):
        return f"it is not a regular file ({stat.filemode(info.st_mode)})"
    uid = os.getuid()
    if info.st_uid != uid:
        return (f"it is owned by {_uid_name(info.st_uid)}, not by this process's {_uid_name(uid)}: another user "
                f"created it, so its content cannot be trusted (only that user or root can remove it)")
    mode = stat.S_IMODE(info.st_mode)
    extra = mode & ~allowed_mode & 0o7077
    if extra & 0o022:
        return f"its mode {oct(mode)} lets group or others write it (allowed: {oct(allowed_mode)})"
    if extra:
        return f"its mode {oct(mode)} gives group/others more than the {oct(allowed_mode)} asked for"
    return None


def _describe_unopenable(path: Path, error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return "it is a symbolic link"
    try:
        info = os.lstat(path)
    except OSError:
        return f"it cannot be opened ({error.strerror})"
    return file_problem(info, 0o600) or f"it cannot be opened ({error.strerror})"


def refusal(path: Path, problem: str) -> ValueError:
    """The one error of a shared table file that may not be attached."""
    directory = path.parent
    base = path.name.removesuffix(TEMPORARY_SUFFIX).removesuffix(LOCK_SUFFIX)
    return ValueError(f"shared table file {str(path)!r} is refused: {problem}. Nothing was mapped: remove it with "
                      f"`engram shm remove {directory / base}` and load again to refill it (`engram shm list --dir "
                      f"{directory}` lists every table)")


def create_exclusive(path: Path, mode: int, flags: int = os.O_RDWR) -> int:
    """A new file at ``path`` (``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file or a
    link), its mode set to ``mode`` by ``fchmod`` whatever the umask. Raises FileExistsError."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_checked(path: Path, flags: int, allowed_mode: int) -> int | None:
    """``path`` opened (``O_NOFOLLOW``), refused (:func:`refusal`) unless it is a regular file of
    ours within ``allowed_mode``; None when there is no such file."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise refusal(path, _describe_unopenable(path, error)) from None
    problem = file_problem(os.fstat(fd), allowed_mode)
    if problem is not None:
        os.close(fd)
        raise refusal(path, problem)
    return fd


# ---------------------------------------------------------------------------
# lock files
# ---------------------------------------------------------------------------
def _lock_refusal(lock_path: Path, problem: str) -> ValueError:
    table = lock_path.with_name(lock_path.name.removesuffix(LOCK_SUFFIX))
    return ValueError(f"lock file {str(lock_path)!r} is refused: {problem}. A lock that another user can hold "
                      f"would keep this process waiting for a fill that is not ours: remove it with `engram shm "
                      f"remove {table}` and load again")


def open_lock(lock_path: Path) -> int:
    """An fd of ``lock_path``: created (exclusively, mode 0600) when absent, else opened and
    checked to be a regular file of ours that nobody else can open. ValueError at once when not."""
    while True:
        try:
            return create_exclusive(lock_path, LOCK_MODE)
        except FileExistsError:
            pass
        try:
            fd = os.open(lock_path, os.O_RDWR | _OPEN_FLAGS)
        except FileNotFoundError:
            continue   # removed meanwhile: create it
        except OSError as error:
            raise _lock_refusal(lock_path, _describe_unopenable(lock_path, error)) from None
        problem = file_problem(os.fstat(fd), LOCK_MODE)
        if problem is not None:
            os.close(fd)
            raise _lock_refusal(lock_path, problem)
        return fd


def try_lock(lock_path: Path) -> int | None:
    """An fd holding the exclusive ``flock`` of ``lock_path`` (:func:`open_lock`), or None while
    another process holds it. Retries when the file was replaced meanwhile (the lock must be on
    the inode the path names now)."""
    while True:
        fd = open_lock(lock_path)
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
        os.close(fd)


def lock_holder(lock_path: Path) -> str:
    """The pid the filler wrote into the lock file, as text ("unknown" if none)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | _OPEN_FLAGS)
    except OSError:
        return "unknown"
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    finally:
        os.close(fd)
    return text if text.isdigit() else "unknown"


def probe_lock(lock_path: Path, *, hold: bool = False) -> tuple[bool, int | None]:
    """(a live process holds the lock, an fd holding it exclusively when ``hold`` and it was
    free). A missing or unopenable lock file counts as free (and gives no fd)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | _OPEN_FLAGS)
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if hold else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True, None
        raise
    if hold:
        return False, fd
    os.close(fd)   # releases the probe's shared lock
    return False, None


# ---------------------------------------------------------------------------
# space
# ---------------------------------------------------------------------------
def check_directory(directory, *, writable: bool = True) -> Path:
    """``directory`` as a Path: one ValueError unless it names an existing directory (that this
    process may create files in, when ``writable``). Every engram file in a tmpfs is made, listed
    and removed through this one check."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"directory: expected a path, found {directory!r}")
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"directory: {str(path)!r} does not exist or is not a directory")
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"directory: {str(path)!r} is not writable by this process")
    return path


TMPFS_ROOM_ADVICE = ("a tmpfs is sized when it is mounted; raise it with `mount -o remount,size=<bytes> {directory}` "
                     "(as root), or start the container with a larger shared memory (`docker run --shm-size=<bytes>`; "
                     "Docker's default /dev/shm is 64 MiB), or pass another directory")
"""How to make room in a tmpfs (``{directory}``: the directory), the default advice of :func:`no_room_error`."""


def no_room_error(directory: Path, needed: int, what: str = "the shared table",
                  advice: str = TMPFS_ROOM_ADVICE) -> ValueError:
    """The one error of a file that does not fit ``directory`` (its size, free bytes, and ``advice``:
    how to make room, ``{directory}`` filled in)."""
    try:
        stats = os.statvfs(directory)
        size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
        room = f"has {free} bytes free of {size}"
    except OSError:
        room = "has too few bytes free"
    return ValueError(f"directory: {str(directory)!r} {room}, {what} needs {needed} bytes: "
                      f"{advice.format(directory=directory)}")


def check_room(directory: Path, needed: int, what: str = "the shared table", advice: str = TMPFS_ROOM_ADVICE) -> None:
    """Refuse at once a file larger than the free space (before any work); the reservation
    (:func:`reserve`) is what guarantees the space."""
    stats = os.statvfs(directory)
    if stats.f_bavail * stats.f_frsize < needed:
        raise no_room_error(directory, needed, what, advice)


def reserve(fd: int, offset: int, length: int, directory: Path, needed: int, what: str = "the shared table",
            advice: str = TMPFS_ROOM_ADVICE) -> None:
    """Allocate ``[offset, offset + length)`` of the file now (``posix_fallocate``), so that
    writing its mapped pages can never hit a full tmpfs (which kills with SIGBUS)."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
            raise no_room_error(directory, needed, what, advice) from None
        raise


def header_page_bytes(header: TableHeader) -> int:
    """Bytes of the header region that are written (and reserved): the encoded header rounded up
    to whole pages (the filled header has the same length)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-len(header.encode()) // page) * page


def reserve_file(fd: int, header: TableHeader, directory: Path, what: str = "the shared table") -> None:
    """Reserve the file's written header pages and its rows (the file is sized already)."""
    header_bytes = header_page_bytes(header)
    needed = header_bytes + header.nbytes
    reserve(fd, 0, header_bytes, directory, needed, what)
    if header.nbytes:
        reserve(fd, header.data_offset, header.nbytes, directory, needed, what)
