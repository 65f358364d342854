"""The disk tier's HBM cache: packed rows on the table's device above the RAM cache, ``set-lru``.

The index (:class:`~engram.table.disk.set_lru.SetLruIndex`) lives on the host, the rows ``uint8 [slots,
row_bytes]`` on the device. A disk lookup is host work anyway (its ids come to the host, its misses are read
by host threads), so the host decides every hit and admission at no GPU cost, and the GPU only copies: the
hits out of the slots, the admitted misses into them. Each :meth:`HbmRowCache.serve` call is one step of
the rule, over the distinct ids of one lookup; the RAM cache below sees only its misses, as ``engram
profile tiers`` replays the two tiers.

Every device access of the slots is ordered after the one before it, whatever stream either ran on (an
event recorded after each, waited on by the next), in the order the host index saw them: a slot is never
overwritten before an earlier lookup has copied it out. (Placement ``"cached"`` keeps its index on the
GPU instead, for lookups inside CUDA graphs: :mod:`engram.table.placements.row_cache`.)
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from engram.checks import check_int
from engram.table.disk.set_lru import SetLruIndex

__all__ = ["HbmRowCache"]


class HbmRowCache:
    """``capacity`` packed rows of ``row_bytes`` on ``device`` (a CUDA device; the CPU for tests), ``ways``
    per set. ``stats``: ``calls``, ``hits`` and ``misses`` (distinct ids of each call), ``admitted``."""

    def __init__(self, capacity: int, row_bytes: int, ways: int, device: torch.device):
        check_int("row_bytes", row_bytes, 4)
        self.index = SetLruIndex(capacity, ways)
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        with torch.inference_mode(False):   # updated in place in and out of inference mode
            self.rows = torch.zeros(self.index.num_slots, row_bytes, dtype=torch.uint8, device=self.device)
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "hits": 0, "misses": 0, "admitted": 0}
        self._last_use = None   # CUDA event after the last enqueued access of the slots

    @classmethod
    def for_fraction(cls, fraction: float, num_rows: int, row_bytes: int, ways: int,
                     device: torch.device) -> "HbmRowCache | None":
        """A cache of ``fraction`` of ``num_rows`` rows (``max(1, floor(fraction * num_rows))``); None for 0."""
        capacity = SetLruIndex.capacity_for(fraction, num_rows)
        return cls(capacity, row_bytes, ways, device) if capacity else None

    num_slots = property(lambda self: self.index.num_slots)

    @property
    def nbytes(self) -> int:
        """Device bytes of the cached rows."""
        return self.rows.numel()

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """``bool [N]``: whether each id of ``ids int64 [N]`` is cached now."""
        with self.lock:
            return self.index.cached(ids)

    def serve(self, ids: np.ndarray, read: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
        """``uint8 [U, row_bytes]`` on the device: the rows of the distinct ascending ``ids int64 [U]``, hits
        copied from the slots, the misses from ``read(miss_positions int64 [M])`` (the rows of
        ``ids[miss_positions]``, ``uint8 [M, row_bytes]`` on the device) and admitted, on the current stream.
        An exception of ``read`` leaves the cache as it was (nothing admitted, no score changed)."""
        count = ids.shape[0]
        with self.lock:
            stream = self._after_last_use()
            try:
                out = torch.empty(count, self.row_bytes, dtype=torch.uint8, device=self.device)
                probe = self.index.probe(ids)
                if probe.hit_index.size:
                    hit_slots = torch.from_numpy(probe.hit_slots).to(self.device, non_blocking=True)
                    out[torch.from_numpy(probe.hit_index).to(self.device, non_blocking=True)] = self.rows[hit_slots]
                missed = None
                if probe.miss_index.size:
                    missed = read(probe.miss_index)   # may raise: nothing changed yet
                    out[torch.from_numpy(probe.miss_index).to(self.device, non_blocking=True)] = missed
                positions, slots = self.index.commit(ids, probe)
                if positions.size:
                    self.rows[torch.from_numpy(slots).to(self.device, non_blocking=True)] = \
                        missed[torch.from_numpy(positions).to(self.device, non_blocking=True)]
            finally:
                self._record_use(stream)
            self.stats["calls"] += 1
            self.stats["hits"] += int(probe.hit_index.size)
            self.stats["misses"] += count - int(probe.hit_index.size)
            self.stats["admitted"] += int(positions.size)
            return out

    def _after_last_use(self):
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(self.device)
        if self._last_use is not None:
            stream.wait_event(self._last_use)
        return stream

    def _record_use(self, stream) -> None:
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._last_use = event

    def close(self) -> None:
        """Drop the rows (once the last access of them is done) and the index."""
        with self.lock:
            if self._last_use is not None:
                self._last_use.synchronize()
            self.index.clear()
            self.rows = torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.device)
