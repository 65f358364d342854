"""Every rank's shard of a node-local group, mapped into every rank (placement ``"node"``, lookup ``"peer"``).

Setup only (collectives of the group, once per table); a lookup then reads peers' rows with plain loads.

* CUDA shards are ordinary device tensors, shared with torch's CUDA IPC (``cudaIpcGetMemHandle``
  under :class:`multiprocessing.reduction.ForkingPickler`): each rank maps the others' shards
  and its kernels read them over NVLink. torch opens a peer's memory on the peer's GPU (a CUDA
  context there in every rank: its memory is part of the cost) and this GPU's access to it is
  enabled explicitly. Every rank must see the same GPUs in the same order, and
  every pair of the group's GPUs must have peer access: both are checked at setup, on every rank,
  and every rank raises the same error naming what is missing.
* CPU shards (gloo groups: tests, and hosts without GPUs) live in a shared-memory file the owner
  creates under a random name (``O_EXCL``, mode 0600); the others open it by the name and inode the
  owner sent, refuse a file of another owner, map it read-only, and the owner unlinks the name as
  soon as every rank has it mapped (nothing is left in ``/dev/shm``, a planted file is never mapped).

:meth:`PeerMapping.close` releases in order: every rank drops its mappings of the others' shards,
the group waits for all, then each drops its own.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import secrets
import socket
import stat
import tempfile
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["shard_rows", "RankInfo", "describe_ranks", "check_node_local", "check_peer_access", "allocate_shard", "PeerMapping",
           "enable_peer_access", "map_peer_shards"]


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


def describe_ranks(group, device: torch.device) -> list[RankInfo]:
    """Collective: every rank's :class:`RankInfo`, in group rank order."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        mine = device.index if device.index is not None else torch.cuda.current_device()
        visible = tuple(_uuid(i) for i in range(count))
        access = tuple(i == mine or torch.cuda.can_device_access_peer(mine, i) for i in range(count))
        info = RankInfo(socket.gethostname(), visible[mine], visible, access)
    else:
        info = RankInfo(socket.gethostname(), None, (), ())
    infos: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, info, group=group)
    return infos


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


@dataclass
class _SharedFile:
    """A CPU shard's shared-memory file: the owner's (``path`` set until unlinked) or a peer's mapping."""

    mapping: mmap.mmap
    path: str | None = None
    identity: tuple[int, int, int] = (0, 0, 0)  # (st_dev, st_ino, size)

    def __del__(self):
        self.unlink()  # a shard whose setup never finished leaves no name behind

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def _shm_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _as_tensor(mapping: mmap.mmap, rows: int, row_bytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: torch warns that writes would fail
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=rows * row_bytes) if rows else \
            torch.empty(0, dtype=torch.uint8)
    return flat.view(rows, row_bytes)


def allocate_shard(rows: int, row_bytes: int, device: torch.device) -> tuple[torch.Tensor, _SharedFile | None]:
    """An uninitialized shard ``uint8 [rows, row_bytes]`` other ranks can map: on a CUDA device a plain
    tensor; on the CPU a shared-memory file of this process (see the module docstring)."""
    if device.type == "cuda":
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=device), None
    size = max(1, rows * row_bytes)
    path = os.path.join(_shm_directory(), f"engram-peer-{os.getpid()}-{secrets.token_hex(12)}")
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.ftruncate(descriptor, size)
        info = os.fstat(descriptor)
        mapping = mmap.mmap(descriptor, size)
    except BaseException:
        os.close(descriptor)
        os.unlink(path)
        raise
    os.close(descriptor)
    shared = _SharedFile(mapping, path, (info.st_dev, info.st_ino, size))
    return _as_tensor(mapping, rows, row_bytes), shared


def _open_peer_file(path: str, identity: tuple[int, int, int], rows: int, row_bytes: int, rank: int) -> _SharedFile:
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(descriptor)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or
                (info.st_dev, info.st_ino, info.st_size) != identity):
            raise ValueError(f"group: the shared shard of rank {rank} at {path} is not the file that rank created "
                             f"(owner uid {info.st_uid}, inode {info.st_ino}, {info.st_size} bytes): refusing to map it")
        mapping = mmap.mmap(descriptor, identity[2], access=mmap.ACCESS_READ)
    finally:
        os.close(descriptor)
    return _SharedFile(mapping)


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
        """Collective: drop the mappings of the others' shards, wait for every rank, drop our own."""
        if self.closed:
            return
        own = self.shards[self.rank]
        self.shards = [own]
        own_file = self._files[self.rank] if self._files else None
        for index, shared in enumerate(self._files):
            if index != self.rank and shared is not None:
                try:
                    shared.mapping.close()
                except BufferError:  # a view is still held elsewhere: the mapping goes with it
                    pass
        self._files = []
        if own.is_cuda:
            torch.cuda.synchronize(own.device)  # no kernel of ours still reads a peer's rows
        dist.barrier(group=self.group)
        self.shards = []
        del own
        if own_file is not None:
            own_file.unlink()
            try:
                own_file.mapping.close()
            except BufferError:  # a view of the shard is still held elsewhere: the mapping goes with it
                pass
        self.closed = True


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


def map_peer_shards(local: torch.Tensor, shared: _SharedFile | None, group, rank: int,
                    shapes: list[tuple[int, int]]) -> PeerMapping:
    """Collective: map every rank's shard (``shapes[r]`` = its ``[rows, row_bytes]``) next to ``local``
    (this rank's, from :func:`allocate_shard`, filled). The owner's shared file is unlinked on return."""
    world = dist.get_world_size(group)
    if local.is_cuda:
        if local.numel():
            from multiprocessing.reduction import ForkingPickler
            import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions)

            buffer = io.BytesIO()
            ForkingPickler(buffer).dump(local)
            payload = buffer.getvalue()
        else:
            payload = None
    else:
        payload = None if shared is None else (shared.path, shared.identity)
    payloads: list = [None] * world
    dist.all_gather_object(payloads, payload, group=group)
    shards: list[torch.Tensor] = []
    files: list = []
    error = None
    try:
        for owner, (sent, shape) in enumerate(zip(payloads, shapes)):
            if owner == rank:
                shards.append(local)
                files.append(shared)
            elif local.is_cuda:
                shards.append(pickle.loads(sent) if sent is not None else
                              torch.empty(shape, dtype=torch.uint8, device=local.device))
                files.append(None)
            else:
                peer_file = _open_peer_file(sent[0], tuple(sent[1]), shape[0], shape[1], owner)
                files.append(peer_file)
                shards.append(_as_tensor(peer_file.mapping, shape[0], shape[1]))
    except (OSError, ValueError, RuntimeError) as failure:
        error = f"rank {rank}: {failure}"
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)  # every rank has opened every shard, or failed
    if shared is not None:
        shared.unlink()
    failed = [message for message in errors if message is not None]
    if failed:
        raise ValueError(f"group: mapping the ranks' shards failed: {'; '.join(failed)}")
    if local.is_cuda:
        enable_peer_access(local.device, [shard.device for shard in shards])
    return PeerMapping(shards, rank, group, files)
