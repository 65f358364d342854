"""Placement ``"node"``: a table spread over a node-local process group, rows served by collectives.

The table's rows ``[0, rows)`` (a whole layer, or a tensor-parallel shard) are split contiguously
over the group's ``W`` ranks: rank ``r`` owns ``[r * ceil(rows / W), min(rows, (r + 1) * ceil(rows / W)))``
and keeps only those rows. With ``lookup="exchange"`` every lookup is a collective: each rank sends
its ids to all, serves the rows it owns for every rank, and one ``all_to_all_single`` brings each
rank its rows. Every rank of the group must call every lookup, in the same order (its own number
of ids, zero included). Runs over gloo (CPU tensors) and NCCL (CUDA tensors).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from engram.table.fp8 import BLOCK_SIZE
from engram.table.table import TablePlacement, register_placement

__all__ = ["NodePlacement", "owned_rows"]

def owned_rows(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of ``num_rows`` that group rank ``rank`` of ``world_size`` owns
    (contiguous blocks of ``ceil(num_rows / world_size)``; the last ones may be short or empty)."""
    block = -(-num_rows // world_size)
    return min(num_rows, rank * block), min(num_rows, (rank + 1) * block)


def _check_group(group, lookup) -> tuple[int, int]:
    """This rank's ``(rank, world_size)`` in ``group``; one ValueError per bad option."""
    if lookup == "peer":
        raise ValueError("lookup: 'peer' (reading other GPUs' rows over NVLink) is not built yet; "
                         "use lookup='exchange'")
    if lookup != "exchange":
        raise ValueError(f"lookup: expected 'exchange', found {lookup!r}")
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
    """A table spread over the ranks of ``group``; each rank keeps and serves the rows it owns.

    Args:
        value_bytes, scale_bytes: ``uint8 [rows, D]`` / ``[rows, D // 32]``, the whole table; this
            rank keeps a copy of its own rows (:func:`owned_rows`), so the rest can be freed.
        device: where the owned rows live and lookups run (default: the CPU for gloo, the current
            CUDA device for NCCL).
        group: the node-local ``torch.distributed`` ProcessGroup (required).
        lookup: ``"exchange"`` (collectives); ``"peer"`` is refused (not built yet).

    :meth:`gather` is a collective of ``group`` (see the module docstring). Storage is packed:
    ``uint8 [owned, D + D // 32]`` (values then scales); :attr:`value_bytes` and :attr:`scale_bytes`
    are views of this rank's rows only, while :attr:`num_rows` is the whole table's.
    """

    name = "node"
    collective = True

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None, group=None,
                 lookup: str = "exchange"):
        self._rank, self._world_size = _check_group(group, lookup)
        self._group = group
        self.lookup = lookup
        target = _storage_device(group, device)
        rows, head_dim = value_bytes.shape
        start, end = owned_rows(rows, self._world_size, self._rank)
        packed = torch.empty(end - start, head_dim + head_dim // BLOCK_SIZE, dtype=torch.uint8, device=target)
        packed[:, :head_dim].copy_(value_bytes[start:end])
        packed[:, head_dim:].copy_(scale_bytes[start:end])
        self._total_rows = rows
        self._own_start, self._own_end = start, end
        self._block = max(1, -(-rows // self._world_size))
        self._set_packed(packed, head_dim)
        super().__init__(self._value_bytes, self._scale_bytes, target)

    def _set_packed(self, packed: torch.Tensor, head_dim: int) -> None:
        self._packed = packed
        self._value_bytes = packed[:, :head_dim]
        self._scale_bytes = packed[:, head_dim:]

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
        """Bytes this rank keeps: ``owned rows * (D + D // 32)``."""
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
        owned rows packed, which :meth:`adopt` installs."""
        options = source.placement_options or {}
        rank, world_size = _check_group(options.get("group"), options.get("lookup", "exchange"))
        target = _storage_device(options["group"], device)
        start, end = owned_rows(source.num_rows, world_size, rank)
        head_dim = source.head_dim
        packed = torch.empty(end - start, head_dim + head_dim // BLOCK_SIZE, dtype=torch.uint8, device=target)
        if end > start:
            owned = dataclasses.replace(source, row_start=source.row_start + start, row_end=source.row_start + end)
            owned.read_into(packed[:, :head_dim], packed[:, head_dim:])
        placeholder_values = torch.zeros(1, head_dim, dtype=torch.uint8, device=target).expand(source.num_rows, -1)
        placeholder_scales = torch.zeros(1, head_dim // BLOCK_SIZE, dtype=torch.uint8,
                                         device=target).expand(source.num_rows, -1)
        return placeholder_values, placeholder_scales, {"owned_packed": (packed, start, end)}

    def adopt(self, keep: dict) -> None:
        keep = dict(keep)
        owned = keep.pop("owned_packed", None)
        if owned is not None:
            packed, start, end = owned
            if (start, end) != self.owned:
                raise ValueError(f"owned_packed: rows [{start}, {end}) read, this rank owns {list(self.owned)}")
            self._set_packed(packed.to(self._device), self.head_dim)
        super().adopt(keep)

    # ---- the lookup --------------------------------------------------------------------
    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: ``int64 [N]`` ids in ``[0, rows)`` on :attr:`device` (``N`` per rank, 0 allowed) ->
        ``(uint8 [N, D], uint8 [N, D // 32])``. Syncs with the host once (the largest ``N``)."""
        group, world, device = self._group, self._world_size, self._device
        head_dim = self.head_dim
        width = self._packed.shape[1]
        ids = local_row_ids.to(device=device, dtype=torch.int64).reshape(-1)
        count = ids.numel()
        counts = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([count], dtype=torch.int64, device=device), group=group)
        longest = int(torch.cat(counts).max())
        if longest == 0:
            empty = torch.empty(0, width, dtype=torch.uint8, device=device)
            return empty[:, :head_dim].contiguous(), empty[:, head_dim:].contiguous()
        padded = torch.zeros(longest, dtype=torch.int64, device=device)
        padded[:count] = ids
        requested = [torch.empty(longest, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(requested, padded, group=group)
        wanted = torch.stack(requested)  # [W, maxN]: every rank's ids (padding: row 0)
        start, end = self._own_start, self._own_end
        send = torch.zeros(world * longest, width, dtype=torch.uint8, device=device)  # [W * maxN, D + D/32]
        if end > start:
            mine = ((wanted >= start) & (wanted < end)).reshape(-1)
            local = (wanted.reshape(-1) - start).clamp(0, end - start - 1)
            rows = self._packed.index_select(0, local)
            send = rows.masked_fill(~mine.unsqueeze(-1), 0)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # chunk j: owner j's rows for this rank's ids
        owner = torch.div(ids, self._block, rounding_mode="floor")
        picked = received.view(world, longest, width)[owner, torch.arange(count, device=device)]  # [N, D + D/32]
        return picked[:, :head_dim].contiguous(), picked[:, head_dim:].contiguous()

    def __repr__(self) -> str:
        return (f"NodePlacement(rows={self.num_rows}, owned={list(self.owned)}, rank={self._rank} of "
                f"{self._world_size}, head_dim={self.head_dim}, device={self.device})")
