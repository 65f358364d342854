"""A fixed-size RAM cache of packed rows above a row file: set-associative, ``set-lru`` replacement.

The rule (:mod:`engram.table.disk.set_lru`) is :mod:`engram.tools.cache_policy`'s ``set-lru`` with each
:meth:`RamRowCache.serve` call one step, so ``engram profile tiers`` predicts the hit rate a live cache
reaches on the same stream. Rows are stored packed (``row_bytes`` each, :mod:`engram.table.host_memory.rows`)
in one anonymous mapping (2 MiB pages asked for with ``MADV_HUGEPAGE``); tags are ``int64 [sets, ways]``
(:data:`EMPTY` for an empty way). One lock per cache: a call runs whole (probe, the misses' read,
admission) under it.
"""

from __future__ import annotations

import mmap
import threading
from typing import Callable

import numpy as np
import torch

from engram.checks import check_int
from engram.table.disk.set_lru import EMPTY, SetLruIndex

__all__ = ["RamRowCache", "EMPTY", "DEFAULT_WAYS"]

DEFAULT_WAYS = 8
"""Ways per set: what ``engram profile tiers`` replays (``DynamicParams().ways``)."""


def _anonymous_rows(count: int, row_bytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """``uint8 [count, row_bytes]`` zeros in one private anonymous mapping (huge pages asked for)."""
    mapping = mmap.mmap(-1, max(1, count * row_bytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass  # no transparent huge pages here: 4 KiB pages
    rows = torch.frombuffer(mapping, dtype=torch.uint8, count=count * row_bytes) if count else torch.empty(0, dtype=torch.uint8)
    return mapping, rows.view(count, row_bytes)


class RamRowCache:
    """``capacity`` packed rows of a table (:mod:`engram.table.disk.set_lru` for the rule).

    ``capacity`` 0 keeps no row (every call reads all its ids). ``stats``: ``calls``, ``hits`` and
    ``misses`` (distinct ids of each call), ``admitted``."""

    def __init__(self, capacity: int, row_bytes: int, ways: int = DEFAULT_WAYS):
        check_int("capacity", capacity, 0)
        check_int("row_bytes", row_bytes, 4)
        check_int("ways", ways, 1)
        self.index = SetLruIndex(capacity, ways)
        self.row_bytes = row_bytes
        self._mapping, self.rows = _anonymous_rows(self.index.num_slots, row_bytes)   # uint8 [sets * ways, row_bytes]
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "hits": 0, "misses": 0, "admitted": 0}

    @classmethod
    def for_fraction(cls, fraction: float, num_rows: int, row_bytes: int, ways: int = DEFAULT_WAYS) -> "RamRowCache":
        """A cache of ``fraction`` of ``num_rows`` rows (``max(1, floor(fraction * num_rows))``; 0: no cache)."""
        return cls(SetLruIndex.capacity_for(fraction, num_rows), row_bytes, ways)

    ways = property(lambda self: self.index.ways)
    num_sets = property(lambda self: self.index.num_sets)
    num_slots = property(lambda self: self.index.num_slots)
    tags = property(lambda self: self.index.tags)
    scores = property(lambda self: self.index.scores)
    step = property(lambda self: self.index.step)

    @property
    def nbytes(self) -> int:
        """Bytes of the cached rows and their tags and scores."""
        return self.num_slots * (self.row_bytes + 16)

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """``bool [N]``: whether each id of ``ids int64 [N]`` is cached now (for tests and reports)."""
        with self.lock:
            return self.index.cached(ids)

    def serve(self, ids: np.ndarray, out: torch.Tensor, read: Callable[[np.ndarray, torch.Tensor], None]) -> int:
        """``out[i] = row ids[i]`` for distinct ascending ``ids int64 [U]`` into ``out uint8 [U, row_bytes]``
        (CPU, contiguous): hits copied from the cache, the misses read by ``read(miss_ids, rows)`` (into a
        ``uint8 [M, row_bytes]`` buffer) and admitted. An exception of ``read`` leaves the cache as it was
        before the call (nothing admitted, no score changed). Returns the hits."""
        count = ids.shape[0]
        with self.lock:
            if not self.num_slots:
                read(ids, out)
                self._count(count, 0, 0)
                return 0
            probe = self.index.probe(ids)
            if probe.hit_index.size:
                out[torch.from_numpy(probe.hit_index)] = self.rows.index_select(0, torch.from_numpy(probe.hit_slots))
            missed = None
            if probe.miss_index.size:
                missed = torch.empty(probe.miss_index.size, self.row_bytes, dtype=torch.uint8)
                read(ids[probe.miss_index], missed)   # may raise: nothing changed yet
                out[torch.from_numpy(probe.miss_index)] = missed
            positions, slots = self.index.commit(ids, probe)
            if positions.size:
                self.rows[torch.from_numpy(slots)] = missed[torch.from_numpy(positions)]
            self._count(count, probe.hit_index.size, positions.size)
            return int(probe.hit_index.size)

    def _count(self, count: int, hits: int, admitted: int) -> None:
        self.stats["calls"] += 1
        self.stats["hits"] += hits
        self.stats["misses"] += count - hits
        self.stats["admitted"] += admitted

    def close(self) -> None:
        """Drop the rows (the mapping goes once no view of :attr:`rows` remains)."""
        with self.lock:
            self.index.clear()
            self.rows = torch.empty(0, self.row_bytes, dtype=torch.uint8)
