"""A fixed-size RAM cache of packed rows above a row file: set-associative, ``set-lru`` replacement.

The rule is :mod:`engram.tools.cache_policy`'s ``set-lru`` with each :meth:`RamRowCache.serve` call
one step, so ``engram profile tiers`` predicts the hit rate a live cache reaches on the same stream:

* ``capacity`` rows (of a fraction ``f`` of ``R`` rows: ``max(1, floor(f * R))``, as the replay sizes it), ``ways =
  min(ways, capacity)``, ``sets = max(1, capacity // ways)``; row ``r`` lives only in set ``r % sets``.
* A call's distinct ids are hits when cached at its start. Hit ways score ``step + 1``.
* The misses, per set in ascending id, each replace the way of lowest score (empty ways score -1; ties:
  the lowest way) among those not filled in this call; once every way of a set was filled in this
  call, its further misses are read but not admitted.

Rows are stored packed (``row_bytes`` each, :mod:`engram.table.host_memory.rows`) in one anonymous
mapping (2 MiB pages asked for with ``MADV_HUGEPAGE``); tags are ``int64 [sets, ways]`` (:data:`EMPTY`
for an empty way). One lock per cache: a call runs whole (probe, the misses' read, admission) under it.
"""

from __future__ import annotations

import mmap
import threading
from typing import Callable

import numpy as np
import torch

from engram.checks import check_int

__all__ = ["RamRowCache", "EMPTY", "DEFAULT_WAYS"]

EMPTY = -1
"""Tag of an empty way."""
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
    """``capacity`` packed rows of a table of ``num_rows`` rows (module docstring for the rule).

    ``capacity`` 0 keeps no row (every call reads all its ids). ``stats``: ``calls``, ``hits`` and
    ``misses`` (distinct ids of each call), ``admitted``."""

    def __init__(self, capacity: int, row_bytes: int, ways: int = DEFAULT_WAYS):
        check_int("capacity", capacity, 0)
        check_int("row_bytes", row_bytes, 4)
        check_int("ways", ways, 1)
        self.ways = min(ways, capacity) if capacity else 0
        self.num_sets = max(1, capacity // self.ways) if capacity else 0
        self.row_bytes = row_bytes
        slots = self.num_sets * self.ways
        self._mapping, self.rows = _anonymous_rows(slots, row_bytes)   # uint8 [sets * ways, row_bytes]
        self.tags = np.full((self.num_sets, self.ways), EMPTY, dtype=np.int64)
        self.scores = np.full((self.num_sets, self.ways), -1, dtype=np.int64)
        self.step = 0
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "hits": 0, "misses": 0, "admitted": 0}

    @classmethod
    def for_fraction(cls, fraction: float, num_rows: int, row_bytes: int, ways: int = DEFAULT_WAYS) -> "RamRowCache":
        """A cache of ``fraction`` of ``num_rows`` rows (``max(1, floor(fraction * num_rows))``; 0: no cache)."""
        capacity = 0 if fraction == 0 else max(1, int(fraction * num_rows))
        return cls(capacity, row_bytes, ways)

    @property
    def num_slots(self) -> int:
        return self.num_sets * self.ways

    @property
    def nbytes(self) -> int:
        """Bytes of the cached rows and their tags and scores."""
        return self.num_slots * (self.row_bytes + 16)

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """``bool [N]``: whether each id of ``ids int64 [N]`` is cached now (for tests and reports)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.num_slots:
            return np.zeros(ids.shape, dtype=bool)
        with self.lock:
            return (self.tags[ids % self.num_sets] == ids[..., None]).any(-1)

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
            sets = ids % self.num_sets
            match = self.tags[sets] == ids[:, None]                         # [U, ways]
            hit = match.any(1)
            hit_index = np.flatnonzero(hit)
            hit_ways = match[hit_index].argmax(1)
            if hit_index.size:
                slots = torch.from_numpy(sets[hit_index] * self.ways + hit_ways)
                out[torch.from_numpy(hit_index)] = self.rows.index_select(0, slots)
            miss_index = np.flatnonzero(~hit)
            if miss_index.size:
                missed = torch.empty(miss_index.size, self.row_bytes, dtype=torch.uint8)
                read(ids[miss_index], missed)   # may raise: nothing changed yet
                out[torch.from_numpy(miss_index)] = missed
            step = self.step
            self.scores[sets[hit_index], hit_ways] = step + 1
            admitted = self._admit(ids[miss_index], sets[miss_index], missed if miss_index.size else None, step)
            self.step = step + 1
            self._count(count, hit_index.size, admitted)
            return int(hit_index.size)

    def _count(self, count: int, hits: int, admitted: int) -> None:
        self.stats["calls"] += 1
        self.stats["hits"] += hits
        self.stats["misses"] += count - hits
        self.stats["admitted"] += admitted

    def _admit(self, ids: np.ndarray, sets: np.ndarray, rows: torch.Tensor | None, step: int) -> int:
        """Admit missed ``ids`` (ascending) of ``sets`` with their ``rows``; returns how many entered."""
        if not ids.size:
            return 0
        order = np.argsort(sets, kind="stable")   # per set, ascending id
        ordered_sets = sets[order]
        starts = np.flatnonzero(np.r_[True, ordered_sets[1:] != ordered_sets[:-1]])
        lengths = np.diff(np.r_[starts, ids.size])
        rank = np.arange(ids.size) - np.repeat(starts, lengths)
        local = np.empty(ids.size, dtype=np.int64)   # each candidate's set, numbered among this call's sets
        local[order] = np.repeat(np.arange(starts.size), lengths)
        filled = np.zeros((starts.size, self.ways), dtype=bool)   # ways filled in this call
        admitted = 0
        never = np.iinfo(np.int64).max
        for r in range(min(self.ways, int(rank.max()) + 1)):
            pick = order[rank == r]
            candidate_sets = sets[pick]
            current = np.where(filled[local[pick]], never, self.scores[candidate_sets])   # [n, ways]
            way = current.argmin(1)
            free = current[np.arange(pick.size), way] < never
            pick, candidate_sets, way = pick[free], candidate_sets[free], way[free]
            self.tags[candidate_sets, way] = ids[pick]
            self.scores[candidate_sets, way] = step + 1
            filled[local[pick], way] = True
            self.rows[torch.from_numpy(candidate_sets * self.ways + way)] = rows[torch.from_numpy(pick)]
            admitted += int(pick.size)
        return admitted

    def close(self) -> None:
        """Drop the rows (the mapping goes once no view of :attr:`rows` remains)."""
        with self.lock:
            self.tags[:] = EMPTY
            self.scores[:] = -1
            self.rows = torch.empty(0, self.row_bytes, dtype=torch.uint8)
            self.num_sets = self.ways = 0
