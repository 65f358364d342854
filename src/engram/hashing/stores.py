"""History stores the hasher keeps on the device (docs/design.md §2, source 3).

Both hold compressed ids with two negative codes: ``DEAD`` (the token takes no
part in n-grams) and ``UNWRITTEN`` (nothing was ever stored there).
"""

from __future__ import annotations

import math
from typing import Hashable, Iterable

import torch

from engram.checks import check_bool, check_int, check_positive_int

__all__ = ["SlotCache", "RequestHistory", "DEAD", "UNWRITTEN", "fixed_address"]

DEAD = -1
UNWRITTEN = -2


def _allocate(name: str, value: int, shape: tuple[int, ...], fill: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.full(shape, fill)``; a failed allocation is a ValueError naming ``name`` and the bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        store = torch.full(shape, fill, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{name}: {value} needs {nbytes:,} bytes of {torch.device(device)} memory for the store, "
                         f"which could not be allocated ({reason})") from None
    return fixed_address(store)


def fixed_address(store: torch.Tensor) -> torch.Tensor:
    """``store``, marked (on CUDA) as a tensor at one address for its life that the hash op writes in place:
    inductor's CUDA graphs (``torch.compile(mode="reduce-overhead")``) then capture the step with the hash in it
    instead of skipping the whole graph for its mutated inputs."""
    if store.is_cuda:
        from torch._dynamo import mark_static_address

        mark_static_address(store)
    return store


class SlotCache:
    """One int32 compressed id per KV-cache slot of the engine.

    Written from ``slot_mapping`` (slot of each batch token), read through a
    request's ``block_table`` row: the slot of position ``p`` is
    ``block_table[k, p // block_size] * block_size + p % block_size``. It
    follows prefix-cache hits and speculative rollbacks because the engine's
    own slots do.

    A batch's writes land before its reads, so a request may read history that
    another request of the same batch writes (a prefix-cache hit on blocks this step
    fills): on the GPU the slot writes are their own launch, ordered before the hash
    by the stream (:mod:`engram.hashing.launch`). ``fused_write=True`` lets the hash
    launch make the writes itself; the engine then promises that no request reads a
    slot the same batch writes, and validation checks it.
    """

    def __init__(self, num_slots: int, block_size: int, device: torch.device, fused_write: bool = False):
        check_positive_int("num_slots", num_slots)
        check_positive_int("block_size", block_size)
        if num_slots % block_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of block_size {block_size}")
        check_bool("fused_write", fused_write)
        self.num_slots = num_slots
        self.block_size = block_size
        self.fused_write = fused_write
        self.num_blocks = num_slots // block_size
        # One spare slot at the end absorbs the writes of tokens with no slot (-1),
        # so writing needs no host sync; reads never reach it.
        self.values = _allocate("num_slots", num_slots, (num_slots + 1,), UNWRITTEN, torch.int32, device)

    def write(self, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """``values[slot_mapping[t]] = values[t]``; ``-1`` slots are skipped."""
        self.values[self._targets(slot_mapping)] = values.to(torch.int32)

    def saved(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """What the slots of ``slot_mapping`` hold now, for :meth:`restore`."""
        return self.values[self._targets(slot_mapping)].clone()

    def restore(self, slot_mapping: torch.Tensor, previous: torch.Tensor) -> None:
        """Undo a :meth:`write` to ``slot_mapping`` with what :meth:`saved` returned."""
        self.values[self._targets(slot_mapping)] = previous

    def _targets(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        slots = slot_mapping.long()
        return torch.where((slots >= 0) & (slots < self.num_slots), slots, torch.full_like(slots, self.num_slots))

    def slots_of(self, block_table_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 slot of each ``positions[i]`` read through ``block_table_rows[i]`` (a row per entry).

        Out-of-range block indices are clamped (validation reports them first).
        """
        block_index = torch.div(positions, self.block_size, rounding_mode="floor")
        block_index = block_index.clamp(0, block_table_rows.shape[-1] - 1)
        block = torch.gather(block_table_rows, -1, block_index).long().clamp(0, self.num_blocks - 1)
        return block * self.block_size + positions % self.block_size


class RequestHistory:
    """The last ids of each request row, position-tagged, in a small ring.

    ``values[row, p % width]`` holds the compressed id at position ``p`` and
    ``tags[row, p % width] == p`` says it is that position's. A step writes
    every position it hashes (drafts included) and reads only positions before
    its first token, so rejected drafts are never read: they are overwritten when
    the request reaches their positions again. ``width = N - 1 + max_draft_tokens + 1``
    keeps the ``N - 1`` ids before a step alive through one step of drafts; a
    read whose tag does not match is reported, never hashed silently. Each cell holds
    one position, so a step's tokens of one request must be at consecutive positions:
    a request whose positions repeat or skip (token-tree drafts) gets its row cleared
    by the writers (validation refuses such a batch first).

    Rows may be named: :meth:`rows` maps the engine's request ids to rows and
    gives a fresh, empty row to a name it has not seen; :meth:`release` frees it.
    """

    def __init__(self, max_requests: int, history_length: int, max_draft_tokens: int, device: torch.device):
        check_positive_int("max_requests", max_requests)
        check_int("max_draft_tokens", max_draft_tokens, 0)
        self.max_requests = max_requests
        self.width = history_length + max_draft_tokens + 1
        self.device = torch.device(device)
        # One spare row at the end absorbs skipped writes (no host sync); reads never reach it.
        self.values = _allocate("max_requests", max_requests, (max_requests + 1, self.width), UNWRITTEN, torch.int32,
                                device)
        self.tags = _allocate("max_requests", max_requests, (max_requests + 1, self.width), -1, torch.int64, device)
        self._row_of: dict[Hashable, int] = {}
        self._free_rows = list(range(max_requests - 1, -1, -1))

    # ---- rows named by request -----------------------------------------------
    @staticmethod
    def _ids(request_ids: Iterable[Hashable]) -> list[Hashable]:
        """``request_ids`` as a list: an iterable of hashable ids, never a lone string or bytes (whose
        characters would each name a request)."""
        if isinstance(request_ids, (str, bytes, bytearray)) or not hasattr(request_ids, "__iter__"):
            raise ValueError(f"request_ids: expected an iterable of request ids (a list, one id per request), "
                             f"found {type(request_ids).__name__} {request_ids!r}; a single id goes in a list: "
                             f"[{request_ids!r}]")
        ids = list(request_ids)
        for index, request_id in enumerate(ids):
            try:
                hash(request_id)
            except TypeError:
                raise ValueError(f"request_ids[{index}]: expected a hashable request id, found "
                                 f"{type(request_id).__name__} {request_id!r}") from None
        return ids

    def rows(self, request_ids: Iterable[Hashable]) -> torch.Tensor:
        """int64 ``[R]`` rows of the named requests; a new name gets an empty row."""
        request_ids = self._ids(request_ids)
        rows = []
        for request_id in request_ids:
            row = self._row_of.get(request_id)
            if row is None:
                if not self._free_rows:
                    raise ValueError(
                        f"request history is full: all {self.max_requests} rows are taken "
                        f"(release finished requests, or bind with a larger max_requests); request {request_id!r}"
                    )
                row = self._free_rows.pop()
                self._row_of[request_id] = row
                self.reset(torch.tensor([row]))
            rows.append(row)
        if len(set(rows)) != len(rows):
            raise ValueError(f"request_ids: a request appears twice in one batch: {list(request_ids)!r}")
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def release(self, request_ids: Iterable[Hashable]) -> None:
        """Free the rows of finished (or aborted) requests; unknown names raise."""
        for request_id in self._ids(request_ids):
            if request_id not in self._row_of:
                raise ValueError(f"request_ids: {request_id!r} holds no history row")
            row = self._row_of.pop(request_id)
            self.reset(torch.tensor([row]))
            self._free_rows.append(row)

    def reset(self, rows: torch.Tensor) -> None:
        """Forget everything stored in ``rows`` (engines that manage rows themselves
        call this when a row passes to a new request)."""
        rows = rows.to(self.device).long()
        self.values[rows] = UNWRITTEN
        self.tags[rows] = -1

    def saved(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``rows`` hold now (values, tags), for :meth:`restore`."""
        rows = rows.to(self.device).long()
        return self.values[rows].clone(), self.tags[rows].clone()

    def restore(self, rows: torch.Tensor, previous: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Undo the writes of a step to ``rows`` with what :meth:`saved` returned."""
        rows = rows.to(self.device).long()
        self.values[rows], self.tags[rows] = previous

    # ---- device-side access --------------------------------------------------
    def read(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 id stored for ``positions`` of ``rows`` (same shape); ``UNWRITTEN`` where the tag differs.
        Rows outside the bound ones read the spare row (validation reports them first)."""
        rows = rows.clamp(0, self.max_requests)
        column = positions % self.width
        value = self.values[rows, column].long()
        return torch.where(self.tags[rows, column] == positions, value, torch.full_like(value, UNWRITTEN))

    def write(self, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
        """Store ``values`` at ``positions`` where ``keep``; each kept (row, position % width) must appear once."""
        rows = torch.where(keep & (rows >= 0) & (rows < self.max_requests), rows, torch.full_like(rows, self.max_requests))
        column = positions % self.width
        self.values[rows, column] = values.to(torch.int32)
        self.tags[rows, column] = positions
