"""Listing and removing engram's files in a tmpfs directory (``engram shm list|remove``):
node-shared host tables and CPU peer shards of placement ``"node"`` (one file scheme,
:mod:`engram.table.host_memory.shm_files`).

Each table ``engram-<key>-<digest>`` in a tmpfs directory may come with its filler's
temporary file (``.tmp``, while a fill runs or after a filler died) and its lock file
(``.lock``, held by a live filler). A peer shard ``engram-peer-<pid>-<hex>`` has its lock file,
held by its owner for as long as the shard has its name (the group's setup).
:func:`list_shared_tables` describes each file; :func:`remove_shared_table` deletes a table named
by its key or path, or every stale file; :func:`remove_leftovers` is the clean-up that a fill runs.

A file is **stale** when it is ours (this process's user owns it), no live process holds its
lock, and it can never be attached: a filler's leftover temporary file, a lock file alone, a
peer shard whose owner is gone, a table whose header is missing or invalid (format versions
other than this engram's included), never completely filled, or filled from source files that
changed since (an older checkpoint). Removing a table that processes still map is safe for them:
they keep their pages until they unmap them; the memory is freed then.

Whatever a file in the directory holds (another user's included: a header is untrusted input),
listing it is bounded (a header's parse is, :class:`~engram.table.host_memory.shm_files.TableHeader`)
and never fails the listing: a failure is that file's ``problem``. A listing never looks at the
paths named by another user's header.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from engram.checks import check_bool
from engram.table.host_memory.shm_files import (FILE_PREFIX, LOCK_SUFFIX, PEER_PREFIX, TEMPORARY_SUFFIX, HeaderProblem,
                                                TableHeader, changed_sources, check_directory, file_problem,
                                                lock_holder, probe_lock, shared_buffer_path, table_paths)

__all__ = ["SharedTableInfo", "Removal", "list_shared_tables", "remove_shared_table", "remove_leftovers",
           "remove_superseded_tables"]

_LISTED_MODE = 0o644   # a listing knows no share_mode: group/other read is fine, write never
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class SharedTableInfo:
    """One file of a shared table.

    Attributes:
        path: the file.
        kind: ``"table"`` (published), ``"partial"`` (a filler's temporary file), ``"peer"`` (a
            CPU peer shard of placement ``"node"``) or ``"lock"`` (a lock file alone).
        size: its size in bytes; ``allocated``: bytes of memory it holds (``st_blocks``).
        owner_uid, mode: its owner and permission bits.
        share_key, fingerprint (hex), rows, row_bytes, sources (paths): from a valid header, else None / ().
        filled: the header's filled flag.
        live_filler: a live process holds the file's lock (a fill runs, or a peer shard's owner sets
            its group up); ``filler_pid`` its pid.
        problem: why it cannot be attached (None for a valid table, and for files that are not tables).
        superseded: a valid, filled table whose source files changed or went since its fill.
        stale: safe to remove (see the module docstring).
    """

    path: str
    kind: str
    size: int
    allocated: int
    owner_uid: int
    mode: int
    share_key: str | None = None
    fingerprint: str | None = None
    rows: int | None = None
    row_bytes: int | None = None
    sources: tuple[str, ...] = ()
    filled: bool = False
    live_filler: bool = False
    filler_pid: int | None = None
    problem: str | None = None
    superseded: bool = False
    stale: bool = False


@dataclass
class Removal:
    """What :func:`remove_shared_table` did: ``removed`` paths, ``refused`` messages (one per
    file it had to leave: a live filler, another user's file)."""

    removed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def _base_name(name: str) -> str:
    for suffix in (TEMPORARY_SUFFIX, LOCK_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _read_header(path: Path, info: os.stat_result) -> TableHeader:
    """The header of ``path`` (``info``: its lstat), read from the same inode; HeaderProblem otherwise."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        raise HeaderProblem(f"it cannot be opened ({error.strerror})") from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise HeaderProblem("it was replaced while it was listed")
        return TableHeader.read(fd, opened.st_size)
    finally:
        os.close(fd)


def _describe(path: Path, kind: str, live: bool, pid: int | None) -> SharedTableInfo:
    info = os.lstat(path)
    common = dict(path=str(path), kind=kind, size=info.st_size, allocated=info.st_blocks * 512,
                  owner_uid=info.st_uid, mode=stat.S_IMODE(info.st_mode), live_filler=live, filler_pid=pid)
    ours = info.st_uid == os.getuid()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else f"not a regular file ({stat.filemode(info.st_mode)})"
        return SharedTableInfo(**common, problem=f"it is {what}", stale=ours and not live)
    if kind == "lock":
        return SharedTableInfo(**common, stale=ours and not live)
    problem = file_problem(info, _LISTED_MODE)
    header = None
    try:
        header = _read_header(path, info)
    except HeaderProblem as reason:
        problem = problem or str(reason)
    superseded = False
    if header is not None:
        if header.kind == "peer":
            common["kind"] = kind = "peer"
        common.update(share_key=header.share_key, fingerprint=header.fingerprint.hex(), rows=header.rows,
                      row_bytes=header.row_bytes, sources=tuple(s[0] for s in header.sources), filled=header.filled)
        changed = changed_sources(header.sources) if ours and kind == "table" else []   # never another user's paths
        if kind == "table" and not header.filled:
            problem = problem or "it was never completely filled (filled flag 0)"
        elif changed and header.filled:
            superseded = True
            problem = problem or "the files it was filled from changed since: " + "; ".join(changed)
    elif kind == "table" and path.name.startswith(PEER_PREFIX):
        common["kind"] = kind = "peer"
    if kind == "peer" and not live:
        owner = f"pid {header.filler_pid}" if header is not None else "its pid"
        problem = problem or (f"its owner ({owner}) is gone: a peer shard left by a rank of placement 'node' "
                              f"that died while its group was set up")
    stale = ours and not live and (kind == "partial" or problem is not None)
    return SharedTableInfo(**common, problem=problem, superseded=superseded, stale=stale)


def _unreadable(path: Path, kind: str, error: BaseException) -> SharedTableInfo | None:
    """A file whose description failed in an unforeseen way: listed with that as its problem, never
    stale (nothing is removed on a failure nobody understood); None when it went meanwhile."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return SharedTableInfo(path=str(path), kind=kind, size=info.st_size, allocated=info.st_blocks * 512,
                           owner_uid=info.st_uid, mode=stat.S_IMODE(info.st_mode),
                           problem=f"it could not be examined ({type(error).__name__}: {str(error)[:200]})")


def _lock_state(lock: Path) -> tuple[bool, int | None]:
    """(a live process holds ``lock``, the pid written in it)."""
    live, _ = probe_lock(lock)
    if not live:
        return False, None
    holder = lock_holder(lock)
    return True, int(holder) if holder.isdigit() else None


def _describe_group(directory: Path, base: str, names: set[str]) -> list[SharedTableInfo]:
    table, temporary, lock = table_paths(directory / base)
    try:
        live, pid = _lock_state(lock)
    except Exception as error:   # a lock file that cannot be probed: its files are listed, never stale
        return [entry for path, kind in ((table, "table"), (temporary, "partial"), (lock, "lock"))
                if path.name in names for entry in [_unreadable(path, kind, error)] if entry is not None]
    listed = []
    candidates = [(table, "table"), (temporary, "partial")]
    if lock.name in names and table.name not in names and temporary.name not in names:
        candidates.append((lock, "lock"))
    for path, kind in candidates:
        if path.name not in names:
            continue
        try:
            listed.append(_describe(path, kind, live, pid))
        except FileNotFoundError:   # removed while we listed
            pass
        except Exception as error:   # whatever the file holds, it is that file's problem
            entry = _unreadable(path, kind, error)
            if entry is not None:
                listed.append(entry)
    return listed


def list_shared_tables(directory: str | os.PathLike = "/dev/shm") -> list[SharedTableInfo]:
    """Every engram file in ``directory`` (names ``engram-*``; directories skipped), sorted by
    path: tables, filler's temporary files, peer shards, and lock files that have none of them.
    Never fails on a file's content: what is wrong with one is its ``problem``."""
    directory = check_directory(directory, writable=False)
    groups: dict[str, set[str]] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if entry.name.startswith(FILE_PREFIX) and not entry.is_dir(follow_symlinks=False):
                    groups.setdefault(_base_name(entry.name), set()).add(entry.name)
            except OSError:   # gone meanwhile
                continue
    listed = []
    for base in sorted(groups):
        listed.extend(_describe_group(directory, base, groups[base]))
    return listed


def _resolve(target, directory: Path | None) -> Path:
    """The table path a key or a path (of the table, its temporary or its lock file) names."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and os.sep in target
                                           and Path(target).name.startswith(FILE_PREFIX)):
        path = Path(target)   # a key holding a '/' (checkpoint keys do) is still a key
        if not path.name.startswith(FILE_PREFIX):
            raise ValueError(f"target: {str(target)!r} is not a shared table file (their names start with "
                             f"{FILE_PREFIX!r})")
        if not path.parent.is_dir():
            raise ValueError(f"target: the directory of {str(target)!r} does not exist")
        return path.parent / _base_name(path.name)
    if not isinstance(target, str) or not target:
        raise ValueError(f"target: expected a share key or a file path, found {target!r}")
    directory = check_directory("/dev/shm" if directory is None else directory, writable=False)
    if target.startswith(FILE_PREFIX) and (directory / target).exists():
        return directory / _base_name(target)
    return shared_buffer_path(target, directory)


def _remove_files(paths: list[Path], lock: Path, removal: Removal, *, always_lock: bool) -> None:
    """Remove ``paths`` (and the lock file when ``always_lock`` or when nothing of the table is
    left) while holding the lock, so that no fill starts meanwhile; refused while a fill runs."""
    live, lock_fd = probe_lock(lock, hold=True)
    if live:
        removal.refused.append(f"{paths[0] if paths else lock}: process {lock_holder(lock)} is filling it (holding {lock}); "
                               f"remove it after the fill")
        return
    try:
        table, temporary, _ = table_paths(lock.with_name(_base_name(lock.name)))
        for path in paths:
            _unlink(path, removal)
        if always_lock or not (os.path.lexists(table) or os.path.lexists(temporary)):
            _unlink(lock, removal)   # waiters holding the old inode lock the new file
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _unlink(path: Path, removal: Removal) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except PermissionError:
        try:
            owner = f"uid {os.lstat(path).st_uid}"
        except OSError:
            owner = "another user"
        removal.refused.append(f"{path}: this user may not remove it (owned by {owner}); remove it as its "
                               f"owner or as root")
        return
    removal.removed.append(str(path))


def remove_shared_table(target: str | os.PathLike | None = None, *, directory: str | os.PathLike | None = None,
                        all_stale: bool = False) -> Removal:
    """Delete a shared table with its temporary and lock files, or every stale file.

    Args:
        target: a share key (its file in ``directory``) or the path of the table, its
            temporary or its lock file. Exactly one of ``target`` and ``all_stale``.
        directory: where the tables live (default ``/dev/shm``); a path target names its own.
        all_stale: remove every stale file of ``directory`` (:class:`SharedTableInfo`).

    A table whose filler is alive is left (a ``refused`` message); processes that map a removed
    table keep their copy until they unmap it. Raises ValueError for bad arguments only.
    """
    check_bool("all_stale", all_stale)
    if all_stale == (target is not None):
        raise ValueError("remove_shared_table: expected a target (share key or path) or all_stale=True, "
                         f"found {'both' if all_stale else 'neither'}")
    removal = Removal()
    if not all_stale:
        table, temporary, lock = table_paths(_resolve(target, directory))
        _remove_files([table, temporary], lock, removal, always_lock=True)
        return removal
    directory = check_directory("/dev/shm" if directory is None else directory, writable=False)
    for entry in list_shared_tables(directory):
        if entry.stale:
            _remove_entry(entry, removal)
    return removal


def _remove_entry(entry: SharedTableInfo, removal: Removal) -> None:
    """Remove one stale file of a listing (and its lock file when nothing else of it is left)."""
    path = Path(entry.path)
    lock = table_paths(path.with_name(_base_name(path.name)))[2]
    try:
        _remove_files([] if entry.kind == "lock" else [path], lock, removal, always_lock=entry.kind == "lock")
    except OSError as error:
        removal.refused.append(f"{path}: it could not be removed ({error.strerror or error})")


def remove_leftovers(directory: Path, sources: tuple[str, ...] = (), keep: Path | None = None) -> list[str]:
    """The clean-up after a fill or a peer shard's setup: remove this user's leftovers in
    ``directory`` (never ``keep``): temporary files of dead fillers, peer shards of dead owners,
    and the tables filled from one of ``sources`` (real paths) that are stale because those files
    changed since (tables of an older checkpoint, which no load can attach again). Files of a live
    process, other users' files and tables of other sources are left. Returns the removed paths."""
    wanted = set(sources)
    removal = Removal()
    for entry in list_shared_tables(directory):
        if not entry.stale or (keep is not None and entry.path == str(keep)):
            continue
        if entry.kind in ("partial", "peer") or (entry.superseded and wanted & set(entry.sources)):
            _remove_entry(entry, removal)
    return removal.removed


def remove_superseded_tables(directory: Path, sources: tuple[str, ...], keep: Path) -> list[str]:
    """:func:`remove_leftovers` (its older name)."""
    return remove_leftovers(directory, sources, keep)
