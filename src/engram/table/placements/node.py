"""Placement ``"node"``: a table spread over a node-local process group.

The table's rows ``[0, rows)`` (a whole layer, or a tensor-parallel shard) are split contiguously
over the group's ``W`` ranks: rank ``r`` owns ``[r * ceil(rows / W), min(rows, (r + 1) * ceil(rows / W)))``
and keeps only those rows. Setup checks that the group runs on one host. Two ways to serve a lookup:

* ``lookup="peer"``: each rank maps the others' shards (:mod:`engram.table.peer_memory`; CUDA IPC,
  every pair of GPUs checked for peer access at setup) and the peer gather kernel
  (:mod:`engram.table.kernels.peer_gather`) reads every row from its owner through a pointer table:
  no collective in a lookup, capturable in a CUDA graph. On gloo groups the shards are
  shared-memory files (CPU tests; ``shm_directory``, default ``/dev/shm``).
  :meth:`NodePlacement.close` (a collective) releases the mappings in order: after the work of every
  device that reads them, and never under a tensor (a view still held keeps its bytes); every
  prepared lookup and plan made over them is refused afterwards, by name. A CUDA graph captured over
  a peer lookup reads the mapped addresses on every replay: release it before closing the table.
* ``lookup="exchange"``: every lookup is a collective: the ranks all-gather how many ids each asks of
  each owner, one ``all_to_all_single`` sends every owner the ids it serves, and one more brings each
  rank exactly its rows. Every rank of the
  group must call every lookup, in the same order (its own number of ids, zero included). Runs over
  gloo (CPU tensors) and NCCL (CUDA tensors).

Building the table is a collective; a rank whose part of it fails (a bad option, no room for its
shard, a checkpoint read) tells the others at the setup's next collective, and every rank raises
(the failing rank its own error, the others one naming it) instead of waiting for the group's
timeout. Failures before the placement's setup starts (the caller's, the loader's) are not seen.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from engram.table.fp8 import BLOCK_SIZE
from engram.table.host_memory.rows import TAG_BYTES, packed_row_bytes, write_row_tags
from engram.table.peer_memory import (allocate_shard, check_node_local, check_peer_access, describe_ranks,
                                      map_peer_shards, shard_rows, shm_directory, tell_group)
from engram.table.table import TablePlacement, register_placement
from engram.triton_launch import interpreting as _interpreting

__all__ = ["NodePlacement", "NodeOptions", "owned_rows", "LOOKUPS"]

LOOKUPS = ("peer", "exchange")


owned_rows = shard_rows
"""Rows ``[start, end)`` of ``num_rows`` that group rank ``rank`` of ``world_size`` owns (:func:`shard_rows`)."""


def _check_lookup(lookup) -> None:
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup: expected 'peer' or 'exchange', found {lookup!r}")


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """Options of placement ``"node"`` that :class:`~engram.options.ServingOptions` can carry (keyword
    arguments of :class:`NodePlacement`, described there); ``group``, a process of this run's, is given
    as ``placement_options={"group": group}``."""

    lookup: str = "exchange"
    shm_directory: str | None = None

    def __post_init__(self):
        _check_lookup(self.lookup)


def _check_group(group) -> tuple[int, int]:
    """This rank's ``(rank, world_size)`` in ``group``; one ValueError per bad option. (Raised on this
    rank alone: without a group there is nobody to tell.)"""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: placement 'node' needs torch.distributed initialized "
                         "(dist.init_process_group) before the table is built")
    if group is None:
        raise ValueError("group: placement 'node' needs placement_options['group'], the node-local "
                         "torch.distributed ProcessGroup the table is spread over; found None")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group "
                         f"given to placement 'node' (dist.new_group returned {group!r} here)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed ProcessGroup, found {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group "
                         f"given to placement 'node'")
    return rank, dist.get_world_size(group)


def _row_width(head_dim: int, lookup: str) -> int:
    """Bytes of a stored row: the peer kernel reads 16-byte aligned packed rows; the exchange sends
    ``D + D // 32`` bytes a row."""
    return packed_row_bytes(head_dim) if lookup == "peer" else head_dim + head_dim // BLOCK_SIZE


def _allocate_owned(rows: int, head_dim: int, lookup: str, device: torch.device, directory=None):
    """``(uint8 [rows, width] uninitialized, shared file or None)``: peers' shards are mappable."""
    width = _row_width(head_dim, lookup)
    if lookup == "peer":
        return allocate_shard(rows, width, device, directory)
    return torch.empty(rows, width, dtype=torch.uint8, device=device), None


def _finish_rows(packed: torch.Tensor, head_dim: int, lookup: str, first: int) -> None:
    """Lookup ``"peer"``'s packed rows (host_memory.rows' layout): zero padding, and each row's tag, its
    index ``first + i`` in the table."""
    if lookup != "peer" or not packed.numel():
        return
    packed[:, head_dim + head_dim // BLOCK_SIZE:packed.shape[1] - TAG_BYTES].zero_()
    write_row_tags(packed, first)


def _check_shm_directory(shm_directory_option, lookup: str, device: torch.device):
    """The directory of CPU peer shards (checked), or None where no file is made."""
    if lookup != "peer" or device.type == "cuda":
        return None
    return shm_directory(shm_directory_option)


class _Lease:
    """What a prepared lookup reads through: the peer pointer table while the mapping is open, None
    once :meth:`NodePlacement.close` released it (the prepared call is then refused)."""

    __slots__ = ("peer", "closed_by")

    def __init__(self, peer):
        self.peer, self.closed_by = peer, None

    def revoke(self, reason: str) -> None:
        self.peer, self.closed_by = None, reason


def _storage_device(group, device) -> torch.device:
    """Where the owned rows live and lookups run: ``device``, else the CPU for a gloo group and
    the current CUDA device for an NCCL group."""
    backend = str(dist.get_backend(group)).lower()
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    target = torch.device(device)
    if backend == "nccl" and target.type != "cuda":
        raise ValueError(f"device: an NCCL group exchanges CUDA tensors, found device {device!r}")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


@register_placement
class NodePlacement(TablePlacement):
    """A table spread over the ranks of ``group``; each rank keeps the rows it owns.

    Args:
        value_bytes, scale_bytes: ``uint8 [rows, D]`` / ``[rows, D // 32]``, the whole table; this
            rank keeps a copy of its own rows (:func:`owned_rows`), so the rest can be freed.
        device: where the owned rows live and lookups run (default: the CPU for gloo, the current
            CUDA device for NCCL).
        group: the node-local ``torch.distributed`` ProcessGroup (required).
        lookup: ``"peer"`` (read the owners' memory, no collective per lookup) or ``"exchange"``
            (ids to their owners and rows back, two all-to-alls per lookup; :attr:`collective`).

    Storage is packed, ``uint8 [owned, width]`` (values, then scales; ``width`` 16-byte aligned for
    ``"peer"``); :attr:`value_bytes` and :attr:`scale_bytes` are views of this rank's rows only,
    while :attr:`num_rows` is the whole table's. Building one is a collective of ``group``.
    """

    name = "node"
    serves_cpu = True
    collective = True
    options_type = NodeOptions

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None, group=None,
                 lookup: str = "exchange", shm_directory=None):
        self._rank, self._world_size = _check_group(group)
        self._group = group
        self._mapping = None
        self._peer = None
        self._lease = None
        self._closed = False
        failure, target, directory = None, None, None
        try:  # this rank's options: a failure is told to the group at its first collective
            _check_lookup(lookup)
            target = _storage_device(group, device)
            directory = _check_shm_directory(shm_directory, lookup, target)
        except Exception as error:
            failure = error
        infos = describe_ranks(group, target, failure)  # every rank raises when one failed
        check_node_local(infos)
        if lookup == "peer" and target.type == "cuda":
            check_peer_access(infos)
        self.lookup = lookup
        self.collective = lookup == "exchange"
        self.has_triton_lookup = lookup == "peer"
        self._shm_directory = directory
        rows, head_dim = value_bytes.shape
        start, end = owned_rows(rows, self._world_size, self._rank)
        self._total_rows = rows
        self._own_start, self._own_end = start, end
        self._block = max(1, -(-rows // self._world_size))
        # The loader's zero-stride placeholders: the owned rows come with adopt(), read once.
        placeholder = rows > 1 and value_bytes.stride(0) == 0
        packed = shared = None
        try:
            if placeholder:
                packed = torch.empty(0, _row_width(head_dim, lookup), dtype=torch.uint8, device=target)
            else:
                packed, shared = _allocate_owned(end - start, head_dim, lookup, target, directory)
                packed[:, :head_dim].copy_(value_bytes[start:end])
                packed[:, head_dim:head_dim + head_dim // BLOCK_SIZE].copy_(scale_bytes[start:end])
                _finish_rows(packed, head_dim, lookup, start)
        except Exception as error:
            failure = error
        try:
            tell_group(group, failure, "placing this rank's rows of the table")
        except BaseException:
            if shared is not None:
                shared.release()
            raise
        self._set_packed(packed, head_dim)
        super().__init__(self._value_bytes, self._scale_bytes, target)
        if lookup == "peer" and not placeholder:
            self._map_peers(packed, shared)

    def _set_packed(self, packed: torch.Tensor, head_dim: int) -> None:
        self._packed = packed
        self._value_bytes = packed[:, :head_dim]
        self._scale_bytes = packed[:, head_dim:head_dim + head_dim // BLOCK_SIZE]

    def _map_peers(self, packed: torch.Tensor, shared) -> None:
        """Collective: map every rank's shard and build the pointer table (where a kernel runs: CUDA, or
        the CPU under the Triton interpreter; elsewhere the torch path reads the mapped shards)."""
        width = packed.shape[1]
        shapes = [(end - start, width) for start, end in
                  (owned_rows(self._total_rows, self._world_size, r) for r in range(self._world_size))]
        if self._mapping is not None:
            self._release_mapping("its rows were replaced (adopt)")
        mapping = map_peer_shards(packed, shared, self._group, self._rank, shapes)
        failure, peer = None, None
        try:
            if self._device.type == "cuda" or _interpreting():
                from engram.table.kernels.peer_gather import PeerShards

                peer = PeerShards(mapping.shards, self._total_rows, self.head_dim, self._device)
        except Exception as error:
            failure = error
        try:
            tell_group(self._group, failure, "building the table's pointer table of the ranks' shards")
        except BaseException:
            mapping.close()  # every rank knows: every rank closes (a collective)
            raise
        self._mapping, self._peer, self._lease = mapping, peer, _Lease(peer)

    def _release_mapping(self, reason: str) -> None:
        """Revoke every prepared lookup, drop this placement's views of the mapped rows, close the mapping."""
        if self._lease is not None:
            self._lease.revoke(reason)
        self._lease = None
        self._peer = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()

    def close(self) -> None:
        """Collective of ``group`` (lookup ``"peer"``): every rank waits for the work that may read the
        mapped rows (every stream of every device holding a shard), drops its mappings of the others'
        rows, then its own. Lookups are refused afterwards, prepared lookups (layer plans) too, each
        naming this placement; a view of the rows still held elsewhere keeps its bytes (never unmapped
        under it). A no-op for ``"exchange"``."""
        if self._mapping is None:
            return
        self._closed = True
        head_dim = self.head_dim
        self._set_packed(torch.empty(0, self._packed.shape[1], dtype=torch.uint8, device=self._packed.device), head_dim)
        self._release_mapping(f"{self!r} was closed (NodePlacement.close released its rows)")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r}: closed (NodePlacement.close released its rows); build the table again")

    # ---- what this rank holds ----------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows of the whole table (over all ranks of the group)."""
        return self._total_rows

    @property
    def owned(self) -> tuple[int, int]:
        """The rows ``[start, end)`` this rank keeps and serves."""
        return self._own_start, self._own_end

    @property
    def group(self):
        return self._group

    @property
    def nbytes(self) -> int:
        """Bytes this rank keeps: ``owned rows * width``."""
        return self._packed.numel()

    # ---- loading from a checkpoint -----------------------------------------------------
    @classmethod
    def storage_device(cls, device) -> torch.device | None:
        """``device`` as given (None: decided from the group's backend when the rows are read)."""
        return None if device is None else torch.device(device)

    @classmethod
    def load_storage(cls, source, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Read only this rank's rows of ``source`` (the group comes from ``source.placement_options``);
        returns zero-stride placeholders of the whole table's shape (what the table checks) and the
        owned rows packed, which :meth:`adopt` installs. A collective: a rank whose read fails tells the
        group, and every rank raises."""
        options = source.placement_options or {}
        group = options.get("group")
        rank, world_size = _check_group(group)
        failure, packed, shared = None, None, None
        start, end = owned_rows(source.num_rows, world_size, rank)
        head_dim = source.head_dim
        try:
            lookup = options.get("lookup", "exchange")
            _check_lookup(lookup)
            target = _storage_device(group, device)
            directory = _check_shm_directory(options.get("shm_directory"), lookup, target)
            packed, shared = _allocate_owned(end - start, head_dim, lookup, target, directory)
            if end > start:
                owned = dataclasses.replace(source, row_start=source.row_start + start, row_end=source.row_start + end)
                owned.read_into(packed[:, :head_dim], packed[:, head_dim:head_dim + head_dim // BLOCK_SIZE])
                _finish_rows(packed, head_dim, lookup, start)
        except Exception as error:
            failure = error
        try:
            tell_group(group, failure, "reading this rank's rows of the checkpoint")
        except BaseException:
            if shared is not None:
                shared.release()
            raise
        placeholder_values = torch.zeros(1, head_dim, dtype=torch.uint8, device=target).expand(source.num_rows, -1)
        placeholder_scales = torch.zeros(1, head_dim // BLOCK_SIZE, dtype=torch.uint8,
                                         device=target).expand(source.num_rows, -1)
        return placeholder_values, placeholder_scales, {"owned_packed": (packed, start, end, shared)}

    def adopt(self, keep: dict) -> None:
        keep = dict(keep)
        owned = keep.pop("owned_packed", None)
        if owned is not None:
            packed, start, end, shared = owned
            if (start, end) != self.owned:
                raise ValueError(f"owned_packed: rows [{start}, {end}) read, this rank owns {list(self.owned)}")
            self._set_packed(packed.to(self._device), self.head_dim)
            if self.lookup == "peer":
                self._map_peers(self._packed, shared)
        super().adopt(keep)

    # ---- the lookup --------------------------------------------------------------------
    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``int64 [N]`` ids in ``[0, rows)`` on :attr:`device` -> ``(uint8 [N, D], uint8 [N, D // 32])``.
        ``"exchange"``: a collective (``N`` per rank, 0 allowed) that syncs with the host once (the
        ranks' per-owner counts); ``"peer"``: read from the owners' mapped rows, no sync."""
        self._check_open()
        if self.lookup == "peer":
            return self._gather_mapped(local_row_ids)
        group, rank, device = self._group, self._rank, self._device
        head_dim = self.head_dim
        width = self._packed.shape[1]
        ids = local_row_ids.to(device=device, dtype=torch.int64).reshape(-1)
        owner = torch.div(ids, self._block, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # this rank's ids grouped by owner
        counts = torch.bincount(owner, minlength=self._world_size)
        matrix = self._exchange_counts(counts)  # [W, W] on the host: ids rank i asks of owner j
        sent, served = matrix[rank].tolist(), matrix[:, rank].tolist()
        if not bool(matrix.any()):
            empty = torch.empty(0, width, dtype=torch.uint8, device=device)
            return empty[:, :head_dim].contiguous(), empty[:, head_dim:].contiguous()
        # Each owner receives exactly the ids it serves and returns exactly their rows: every rank moves
        # its own N rows (an all-to-all of every rank's ids padded to the longest moved W times as many).
        requested = torch.empty(sum(served), dtype=torch.int64, device=device)
        dist.all_to_all_single(requested, ids[order], output_split_sizes=served, input_split_sizes=sent, group=group)
        rows = self._packed.index_select(0, requested - self._own_start)  # [sum(served), D + D/32]
        returned = torch.empty(ids.numel(), width, dtype=torch.uint8, device=device)
        dist.all_to_all_single(returned, rows, output_split_sizes=sent, input_split_sizes=served, group=group)
        picked = torch.empty_like(returned)
        picked[order] = returned  # back in this rank's id order
        return picked[:, :head_dim].contiguous(), picked[:, head_dim:].contiguous()

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Collective: every rank's ids per owner (``int64 [W]`` each -> ``[W, W]`` on the host, row ``i`` from
        rank ``i``: the lookup's one host sync); a row of -1 is a rank that refused its lookup, and every other
        rank then raises naming it (the lookup is not run anywhere)."""
        device = self._device
        gathered = [torch.empty(self._world_size, dtype=torch.int64, device=device) for _ in range(self._world_size)]
        dist.all_gather(gathered, counts.to(device=device, dtype=torch.int64), group=self._group)
        matrix = torch.stack(gathered).cpu()
        refused = [rank for rank, row in enumerate(matrix[:, 0].tolist()) if row < 0]
        if refused and int(matrix[self._rank, 0]) >= 0:
            raise ValueError(f"hash_ids: rank(s) {refused} of the table's group refused their ids for this lookup "
                             f"(their error names the bad id); no rank ran it")
        return matrix

    def refuse_lookup(self) -> None:
        """Lookup ``"exchange"``: join the lookup's first collective with a count of -1, so the other
        ranks raise instead of waiting (see :meth:`_exchange_counts`)."""
        if self.collective and not self._closed:
            self._exchange_counts(torch.full((self._world_size,), -1, dtype=torch.int64))

    def _gather_mapped(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path of ``"peer"``: each shard's rows read where they live (one index_select per
        shard, selected per id; no host sync)."""
        device, head_dim = self._device, self.head_dim
        ids = local_row_ids.to(device=device, dtype=torch.int64).reshape(-1)
        owner = torch.div(ids, self._block, rounding_mode="floor")
        picked = torch.zeros(ids.numel(), self._packed.shape[1], dtype=torch.uint8, device=device)
        for rank, shard in enumerate(self._mapping.shards):
            if shard.shape[0] == 0:
                continue
            within = (ids - rank * self._block).clamp(0, shard.shape[0] - 1)
            rows = shard.index_select(0, within.to(shard.device)).to(device)
            picked = torch.where((owner == rank).unsqueeze(-1), rows, picked)
        return picked[:, :head_dim].contiguous(), picked[:, head_dim:head_dim + head_dim // BLOCK_SIZE].contiguous()

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool, pending=None):
        """``"peer"`` with backend ``"triton"``: the peer gather kernel (one launch, no sync)."""
        if self._peer is None or self.backend != "triton":
            self._check_open()
            return None
        from engram.table.kernels import peer_gather

        if packed:
            return peer_gather.peer_gather_rows_packed(self._peer, global_ids, row_start)
        return peer_gather.peer_gather_rows(self._peer, global_ids, row_start)

    def prepare_gather(self, global_ids: torch.Tensor, row_start: int, column_start: int, column_end: int,
                       flat: bool = False):
        """``"peer"`` with backend ``"triton"``: the peer gather of the columns ``[column_start, column_end)``
        for every call of ``global_ids``' structure (``flat``: ``[T, C_local * D]``), else None."""
        if self._peer is None or self.backend != "triton":
            return None
        from engram.table.kernels import peer_gather

        peer_gather.peer_gather_rows(self._peer, global_ids[:0], row_start, column_start, column_end)  # checked once
        lease = self._lease  # no reference to the mapped rows of its own: close() revokes it

        def prepared(hash_ids: torch.Tensor) -> torch.Tensor:
            peer = lease.peer
            if peer is None:
                raise RuntimeError(f"prepared lookup of placement 'node': {lease.closed_by}; this prepared lookup "
                                   f"(a layer's plan) cannot run: build the table again and plan again")
            rows = peer_gather.peer_gather_rows(peer, hash_ids, row_start, column_start, column_end)
            return rows.view(rows.shape[0], -1) if flat else rows

        return prepared

    def __repr__(self) -> str:
        return (f"NodePlacement(lookup={self.lookup!r}, rows={self.num_rows}, owned={list(self.owned)}, rank={self._rank} of "
                f"{self._world_size}, head_dim={self.head_dim}, device={self.device})")
