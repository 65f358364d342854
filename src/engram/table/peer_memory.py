"""Every rank's shard of a node-local group, mapped into every rank (placement ``"node"``, lookup ``"peer"``).

Setup only (collectives of the group, once per table); a lookup then reads peers' rows with plain loads.

* CUDA shards are ordinary device tensors, shared with torch's CUDA IPC (``cudaIpcGetMemHandle``
  under :class:`multiprocessing.reduction.ForkingPickler`): each rank maps the others' shards
  and its kernels read them over NVLink. torch opens a peer's memory on the peer's GPU (a CUDA
  context there in every rank: its memory is part of the cost) and this GPU's access to it is
  enabled explicitly. Every rank must see the same GPUs in the same order, and
  every pair of the group's GPUs must have peer access: both are checked at setup, on every rank,
  and every rank raises the same error naming what is missing.
* CPU shards (gloo groups: tests, and hosts without GPUs) are files of the one tmpfs file scheme
  (:mod:`engram.table.host_memory.shm_files`, kind ``"peer"``): ``engram-peer-<pid>-<hex>`` in
  ``/dev/shm``, created exclusively (mode 0600) with a header and a lock file that the owner holds
  while the name exists (so ``engram shm remove --all-stale`` knows the shard is live), its bytes
  reserved (``posix_fallocate``: a full tmpfs is one clear error, never a SIGBUS). The others open
  it by the name and inode the owner sent, refuse a file of another owner or whose header is not
  the shard's, map it read-only, and the owner unlinks the name (and its lock) as soon as every
  rank has it mapped: nothing is left in ``/dev/shm``, a planted file is never mapped, a rank that
  dies mid-setup leaves a shard that the next clean-up removes.

Setup failures are told: every collective of the setup carries each rank's failure, and a failure
on one rank makes every rank raise (the failing rank its own error, the others one naming it),
instead of the others waiting for the group's timeout (:func:`tell_group`).

:meth:`PeerMapping.close` releases in order: every rank waits for the work of every device that
reads a shard, drops its mappings of the others' shards, the group waits for all, then each drops
its own. A mapping is never unmapped under a tensor: it goes when its last view does.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
import socket
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engram.table.host_memory.shm_admin import remove_leftovers
from engram.table.host_memory.shm_files import (HeaderProblem, TableHeader, check_directory,
                                                check_room, create_exclusive, header_page_bytes, peer_shard_path,
                                                reserve_file, table_paths, try_lock)

__all__ = ["shard_rows", "RankInfo", "describe_ranks", "check_node_local", "check_peer_access", "allocate_shard",
           "ShardFile", "PeerMapping", "enable_peer_access", "map_peer_shards", "tell_group", "shm_directory"]

_LOCK_WAIT_S = 5.0  # a fresh lock file is held by nobody; only `engram shm` probes it for an instant


def shard_rows(num_rows: int, num_shards: int, shard: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of ``num_rows`` that shard (group rank) ``shard`` of ``num_shards`` holds:
    contiguous blocks of ``ceil(num_rows / num_shards)`` rows (the last ones may be short or empty)."""
    block = -(-num_rows // num_shards)
    return min(num_rows, shard * block), min(num_rows, (shard + 1) * block)


@dataclass(frozen=True)
class RankInfo:
    """What setup learns of one rank: its host, its GPU and the GPUs it sees (UUIDs; empty on the CPU)."""

    host: str
    device: str | None
    visible: tuple[str, ...]
    peer_access: tuple[bool, ...]


def _uuid(index: int) -> str:
    properties = torch.cuda.get_device_properties(index)
    return str(getattr(properties, "uuid", None) or getattr(properties, "pci_bus_id", index))


def _failure_text(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {failure}"


def _raise_failures(messages: list, failure: BaseException | None, what: str) -> None:
    """After every rank's failure (or None) was gathered: raise on every rank when one failed."""
    if failure is not None:
        raise failure  # this rank's own error; the others were told
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        told = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise RuntimeError(f"group: {what} failed on rank{'s' if len(failed) > 1 else ''} "
                           f"{', '.join(str(rank) for rank, _ in failed)} of the group ({told}); this rank released "
                           f"its part: no rank has the table")


def tell_group(group, failure: BaseException | None, what: str) -> None:
    """Collective: each rank says whether its part of ``what`` failed (``failure``, or None). When one
    did, every rank raises: the failing rank ``failure`` itself, the others a RuntimeError naming the
    failed ranks and their errors. Every rank of ``group`` calls it at the same point of the setup."""
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if failure is None else _failure_text(failure), group=group)
    _raise_failures(messages, failure, what)


def _rank_info(device: torch.device) -> RankInfo:
    if device.type == "cuda":
        count = torch.cuda.device_count()
        mine = device.index if device.index is not None else torch.cuda.current_device()
        visible = tuple(_uuid(i) for i in range(count))
        access = tuple(i == mine or torch.cuda.can_device_access_peer(mine, i) for i in range(count))
        return RankInfo(socket.gethostname(), visible[mine], visible, access)
    return RankInfo(socket.gethostname(), None, (), ())


def describe_ranks(group, device: torch.device | None, failure: BaseException | None = None) -> list[RankInfo]:
    """Collective: every rank's :class:`RankInfo`, in group rank order. ``failure``: this rank's setup
    failed before (``device`` may then be None); as in :func:`tell_group`, every rank raises when one
    rank's setup failed, before or here."""
    info = None
    if failure is None:
        try:
            info = _rank_info(device)
        except Exception as error:
            failure = error
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (info, None if failure is None else _failure_text(failure)), group=group)
    _raise_failures([message for _, message in gathered], failure, "setting up placement 'node'")
    return [info for info, _ in gathered]


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def check_node_local(infos: list[RankInfo]) -> None:
    """ValueError (on every rank alike) unless every rank of the group runs on one host."""
    hosts: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        hosts.setdefault(info.host, []).append(rank)
    if len(hosts) > 1:
        spread = "; ".join(f"ranks {_ranges(ranks)} on host {host!r}" for host, ranks in hosts.items())
        raise ValueError(f"group: placement 'node' spreads a table over one node's processes; this group spans "
                         f"{len(hosts)} hosts ({spread}): build it from the ranks of one node (dist.new_group)")


def check_peer_access(infos: list[RankInfo]) -> None:
    """ValueError (on every rank alike) unless all ranks see the same GPUs, each on its own, with peer access."""
    first = infos[0].visible
    for rank, info in enumerate(infos):
        if info.visible != first:
            raise ValueError(f"group: lookup 'peer' maps each rank's GPU memory by its index, so every rank must "
                             f"see the same GPUs in the same order; rank {rank} sees {len(info.visible)} "
                             f"({', '.join(info.visible)}), rank 0 sees {len(first)} ({', '.join(first)}): "
                             f"give every rank the same CUDA_VISIBLE_DEVICES and pick its GPU with torch.cuda.set_device")
    owners: dict[str, int] = {}
    for rank, info in enumerate(infos):
        if info.device in owners:
            raise ValueError(f"device: ranks {owners[info.device]} and {rank} of the group use the same GPU "
                             f"({info.device}); lookup 'peer' needs one GPU per rank")
        owners[info.device] = rank
    missing = []
    for rank, info in enumerate(infos):
        for other_rank, other in enumerate(infos):
            index = first.index(other.device)
            if other_rank != rank and not info.peer_access[index]:
                missing.append(f"rank {rank} ({info.device}) -> rank {other_rank} ({other.device})")
    if missing:
        raise ValueError(f"group: lookup 'peer' reads every rank's rows over NVLink/PCIe peer access, which "
                         f"these pairs lack: {'; '.join(missing)}. Use lookup='exchange' (collectives) instead")


def shm_directory(directory=None) -> Path:
    """Where CPU shards' files go: ``directory`` (checked), else ``/dev/shm`` (the system's temporary
    directory where there is none)."""
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return check_directory(directory)


@dataclass(eq=False)
class ShardFile:
    """A CPU shard's file: the owner's (``path`` and its lock held until :meth:`unlink`) or a peer's
    read-only mapping of it (``path`` None). ``mapping`` is dropped, never closed, on release: it is
    unmapped when the last tensor viewing it goes."""

    mapping: mmap.mmap | None
    path: Path | None = None
    identity: tuple[int, int, int] = (0, 0, 0)  # (st_dev, st_ino, size)
    header: TableHeader | None = None
    _fd: int | None = field(default=None, repr=False)
    _lock_path: Path | None = field(default=None, repr=False)
    _lock_fd: int | None = field(default=None, repr=False)

    def __del__(self):
        self.unlink()  # a shard whose setup never finished leaves no name behind

    def publish(self) -> None:
        """The owner, once its rows are written: set the header's filled flag (what a peer checks)."""
        self.header = dataclasses.replace(self.header, filled=True)
        os.pwrite(self._fd, self.header.encode(), 0)

    def unlink(self) -> None:
        """The owner: remove the name and then the lock file (nothing of the shard left in the
        directory; the mappings stay)."""
        for attribute in ("path", "_lock_path"):  # the file first, then its lock (held until it is gone)
            name = getattr(self, attribute)
            if name is not None:
                setattr(self, attribute, None)
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass
        for attribute in ("_fd", "_lock_fd"):
            fd = getattr(self, attribute)
            if fd is not None:
                setattr(self, attribute, None)
                os.close(fd)

    def release(self) -> None:
        """Unlink (the owner's) and drop this object's reference to the mapping."""
        self.unlink()
        self.mapping = None


def _as_tensor(mapping: mmap.mmap | None, rows: int, row_bytes: int, writable: bool = False) -> torch.Tensor:
    if not rows:
        return torch.empty(0, row_bytes, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that writes would fail
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=rows * row_bytes)
    return flat.view(rows, row_bytes)


def _take_lock(lock_path: Path) -> int:
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        fd = try_lock(lock_path)
        if fd is not None:
            return fd
        if time.monotonic() > deadline:
            raise RuntimeError(f"lock file {str(lock_path)!r} of a new peer shard stayed held by another process for "
                               f"{_LOCK_WAIT_S} s")
        time.sleep(0.01)


def _remove_leftovers(directory: Path) -> None:
    """The tmpfs files' one clean-up (shards of ranks that died mid-setup, dead fillers' temporary files),
    before this shard takes room. Best effort: it never fails a setup."""
    try:
        remove_leftovers(directory)
    except Exception as error:
        warnings.warn(f"engram placement 'node': the clean-up of {str(directory)!r} before a peer shard failed "
                      f"({type(error).__name__}: {error}); `engram shm list --dir {directory}` shows what is left",
                      RuntimeWarning, stacklevel=3)


def _create_shard_file(rows: int, row_bytes: int, directory: Path) -> ShardFile:
    _remove_leftovers(directory)
    path = peer_shard_path(directory)
    lock_path = table_paths(path)[2]
    header = TableHeader(path.name, os.urandom(32), row_bytes, rows, rows * row_bytes, filled=False,
                         filler_pid=os.getpid(), fill_time_s=time.time(), kind="peer")
    what = "the peer shard"
    check_room(directory, header_page_bytes(header) + header.nbytes, what)  # at once; the reservation guarantees it
    shard = ShardFile(None, header=header)
    try:
        shard._lock_fd = _take_lock(lock_path)  # held before the file exists: the shard is never "stale"
        shard._lock_path = lock_path
        os.pwrite(shard._lock_fd, str(os.getpid()).encode(), 0)
        shard._fd = create_exclusive(path, 0o600)
        shard.path = path
        os.ftruncate(shard._fd, header.total_bytes)
        reserve_file(shard._fd, header, directory, what)  # a full tmpfs: one clear error, never SIGBUS
        os.pwrite(shard._fd, header.encode(), 0)
        info = os.fstat(shard._fd)
        shard.identity = (info.st_dev, info.st_ino, header.total_bytes)
        shard.mapping = mmap.mmap(shard._fd, header.nbytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=header.data_offset)
    except BaseException:
        shard.release()
        raise
    return shard


def allocate_shard(rows: int, row_bytes: int, device: torch.device, directory=None
                   ) -> tuple[torch.Tensor, ShardFile | None]:
    """An uninitialized shard ``uint8 [rows, row_bytes]`` other ranks can map: on a CUDA device a plain
    tensor; on the CPU a shared-memory file of this process in ``directory`` (:func:`shm_directory`; see
    the module docstring), none for an empty shard."""
    if device.type == "cuda":
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=device), None
    directory = shm_directory(directory)
    if rows == 0:
        return torch.empty(0, row_bytes, dtype=torch.uint8), None
    shard = _create_shard_file(rows, row_bytes, directory)
    return _as_tensor(shard.mapping, rows, row_bytes), shard


def _open_peer_file(path: str, identity: tuple[int, int, int], rows: int, row_bytes: int, rank: int) -> ShardFile:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(descriptor)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or
                (info.st_dev, info.st_ino, info.st_size) != tuple(identity)):
            raise ValueError(f"group: the shared shard of rank {rank} at {path} is not the file that rank created "
                             f"(owner uid {info.st_uid}, inode {info.st_ino}, {info.st_size} bytes): refusing to map it")
        try:
            header = TableHeader.read(descriptor, info.st_size)
        except HeaderProblem as problem:
            raise ValueError(f"group: the shared shard of rank {rank} at {path} is refused: {problem}") from None
        expected = (Path(path).name, "peer", True, rows, row_bytes)
        found = (header.share_key, header.kind, header.filled, header.rows, header.row_bytes)
        if found != expected:
            raise ValueError(f"group: the shared shard of rank {rank} at {path} is not the one that rank sent: its "
                             f"header says (name, kind, filled, rows, row bytes) = {found}, expected {expected}")
        mapping = mmap.mmap(descriptor, header.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                            offset=header.data_offset)
    finally:
        os.close(descriptor)
    return ShardFile(mapping)


@dataclass
class PeerMapping:
    """Every rank's shard as this rank addresses it (``shards[r]``: rank ``r``'s, this rank's own
    included), and how to release them (:meth:`close`, a collective)."""

    shards: list[torch.Tensor]
    rank: int
    group: object
    _files: list = field(default_factory=list, repr=False)
    closed: bool = False

    def close(self) -> None:
        """Collective: wait for every device that reads a shard (all its streams: no kernel still reads
        one), drop the mappings of the others' shards, wait for every rank, drop our own. A mapping
        goes when its last view does: a view still held elsewhere keeps its bytes, never dangles."""
        if self.closed:
            return
        self.closed = True
        own = self.shards[self.rank] if self.shards else None
        for device in {shard.device for shard in self.shards if shard.is_cuda}:
            torch.cuda.synchronize(device)  # lookups on any stream, the torch path's reads on the peers' GPUs
        own_file = self._files[self.rank] if self._files else None
        for index, shared in enumerate(self._files):
            if index != self.rank and shared is not None:
                shared.release()
        self._files = []
        self.shards = [] if own is None else [own]  # the IPC handles of the others' memory close here
        dist.barrier(group=self.group)  # no rank reads our shard any more
        self.shards = []
        del own
        if own_file is not None:
            own_file.release()


def enable_peer_access(device: torch.device, peers: list[torch.device]) -> None:
    """Let kernels on ``device`` read memory of each of ``peers`` (and the reverse). torch maps another
    process's memory on its owner's GPU, so this GPU's kernels need peer access to it; a one-element
    copy each way makes torch enable it (it keeps that state itself, ``at::cuda::get_p2p_access``)."""
    here = torch.empty(1, dtype=torch.uint8, device=device)
    for peer in sorted({p for p in peers if p != device}, key=lambda d: d.index):
        there = torch.empty(1, dtype=torch.uint8, device=peer)
        here.copy_(there)
        there.copy_(here)
    torch.cuda.synchronize(device)


def map_peer_shards(local: torch.Tensor, shared: ShardFile | None, group, rank: int,
                    shapes: list[tuple[int, int]]) -> PeerMapping:
    """Collective: map every rank's shard (``shapes[r]`` = its ``[rows, row_bytes]``) next to ``local``
    (this rank's, from :func:`allocate_shard`, filled). The owner's shared file is unlinked on return.
    A failure on any rank (sending its shard, opening another's) makes every rank raise, each having
    released what it mapped (:func:`tell_group`)."""
    world = dist.get_world_size(group)
    failure, payload = None, None
    try:
        if local.is_cuda:
            if local.numel():
                from multiprocessing.reduction import ForkingPickler
                import torch.multiprocessing as _registers_ipc  # noqa: F401  (torch's CUDA IPC reductions)

                buffer = io.BytesIO()
                ForkingPickler(buffer).dump(local)
                payload = buffer.getvalue()
        elif shared is not None:
            shared.publish()
            payload = (str(shared.path), shared.identity)
    except Exception as error:
        failure = error
    payloads: list = [None] * world
    dist.all_gather_object(payloads, (payload, None if failure is None else _failure_text(failure)), group=group)
    try:
        _raise_failures([message for _, message in payloads], failure, "sending the ranks' shards")
    except BaseException:
        if shared is not None:
            shared.release()
        raise
    shards: list[torch.Tensor] = []
    files: list = []
    try:
        for owner, ((sent, _), shape) in enumerate(zip(payloads, shapes)):
            if owner == rank:
                shards.append(local)
                files.append(shared)
            elif sent is None:  # an empty shard
                shards.append(torch.empty(shape, dtype=torch.uint8, device=local.device))
                files.append(None)
            elif local.is_cuda:
                shards.append(pickle.loads(sent))
                files.append(None)
            else:
                peer_file = _open_peer_file(sent[0], tuple(sent[1]), shape[0], shape[1], owner)
                files.append(peer_file)
                shards.append(_as_tensor(peer_file.mapping, shape[0], shape[1]))
        if local.is_cuda:
            enable_peer_access(local.device, [shard.device for shard in shards])
    except Exception as error:
        failure = error
    try:
        tell_group(group, failure, "mapping the ranks' shards")  # every rank has opened every shard, or failed
    except BaseException:
        for index, peer_file in enumerate(files):
            if index != rank and peer_file is not None:
                peer_file.release()
        shards.clear()
        if shared is not None:
            shared.release()
        raise
    finally:
        if shared is not None:
            shared.unlink()
    return PeerMapping(shards, rank, group, files)
