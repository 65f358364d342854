"""One step's prefetch of every Engram layer: what :meth:`EngramMemory.prefetch
<engram.memory.EngramMemory.prefetch>` returns, and the per-layer entries it hands out once
(docs/design.md, "Step lifecycle")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engram.common import IdsIdentity, cuda_capturing
from engram.table.prefetch import PrefetchState, TablePrefetch

if TYPE_CHECKING:
    from engram.memory import EngramMemory

__all__ = ["StepPrefetch"]


class StepPrefetch:
    """One step's prefetch of every Engram layer (what :meth:`EngramMemory.prefetch` returns).

    It holds the step's ids tensor (weakly, with its version), the hasher's call count at the
    prefetch, each layer's :class:`~engram.table.prefetch.TablePrefetch`, and ``prepared``: the event
    after the prefetch's device work where it ran on the memory's prefetch stream (None: on the
    caller's stream). :meth:`take` hands a layer its table handle once, and only for the same ids in
    the same step, after making the current stream wait for ``prepared``; a refilled or reused
    buffer (the entry becomes ``DROPPED``), a later hashing call (``STALE``) or a second use gets None
    (the layer then reads its own rows). The states and transitions: docs/design.md "Step lifecycle"."""

    def __init__(self, memory: "EngramMemory", hasher_calls: int, ids: IdsIdentity,
                 tables: dict[int, TablePrefetch | None], kv: dict | None = None,
                 prepared: "torch.cuda.Event | None" = None):
        self.memory, self.hasher_calls, self.ids = memory, hasher_calls, ids
        self._tables = dict(tables)
        self._kv = dict(kv or {})  # layer id -> KvAhead (prefetch(kv_ahead=True))
        self.prepared = prepared

    def _after_prepared(self) -> None:
        """Order the current stream after the prefetch's device work (its probes, dedups, id copies)."""
        if self.prepared is not None and not cuda_capturing():  # under capture no prefetch is served
            torch.cuda.current_stream(self.memory.device).wait_event(self.prepared)

    def take_kv(self, layer_id: int, hash_ids: torch.Tensor, hasher_calls: int):
        """Layer ``layer_id``'s kv computed ahead, for the gate of exactly this step's ``hash_ids`` (the
        same tensor, unrefilled, no hashing since), or None; it is taken either way."""
        kv = self._kv.pop(layer_id, None)
        if (kv is None or hasher_calls != self.hasher_calls or not self.ids.sees_edits
                or not self.ids.matches(hash_ids)):
            return None
        self._after_prepared()
        return kv

    def take(self, layer_id: int, hash_ids: torch.Tensor, hasher_calls: int) -> TablePrefetch | None:
        """Layer ``layer_id``'s handle for the lookup of ``hash_ids [T, L, C]`` when this prefetch was
        made for exactly that tensor and no hashing ran since; it is taken either way."""
        handle = self._tables.pop(layer_id, None)
        if handle is not None and (hasher_calls != self.hasher_calls or not self.ids.matches(hash_ids)):
            # A later step's hashing ran (this step is over: STALE), or other ids (DROPPED).
            handle.drop(PrefetchState.STALE if hasher_calls != self.hasher_calls else PrefetchState.DROPPED)
            return None
        if handle is not None:
            self._after_prepared()
        return handle

    @property
    def states(self) -> dict[int, PrefetchState]:
        """Layer id -> its entry's :class:`~engram.table.prefetch.PrefetchState` while not yet taken."""
        return {layer_id: getattr(handle, "state", PrefetchState.EMPTY) for layer_id, handle in self._tables.items()}

    @property
    def started(self) -> dict[int, bool]:
        """Layer id -> whether its prefetch started a read that a lookup can still take."""
        return {layer_id: handle is not None and handle.started and not handle.spent
                for layer_id, handle in self._tables.items()}

    def __repr__(self) -> str:
        return f"StepPrefetch(layers={list(self._tables)}, hasher_calls={self.hasher_calls})"
