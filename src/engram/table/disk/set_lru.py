"""The ``set-lru`` rule of the disk tier's caches, apart from where their rows live.

:class:`SetLruIndex` holds the tags and scores of ``capacity`` slots and decides, per call (one step of
:mod:`engram.tools.cache_policy`'s ``set-lru``), which distinct ids hit and which misses enter which
slot. The RAM cache (:mod:`engram.table.disk.ram_cache`, rows in host memory) and the HBM cache
(:mod:`engram.table.disk.hbm_cache`, rows on the GPU) each copy rows where it says:

* ``capacity`` slots, ``ways = min(ways, capacity)``, ``sets = max(1, capacity // ways)``; row ``r`` lives
  only in set ``r % sets``.
* A call's distinct ids are hits when cached at its start. Hit ways score ``step + 1``.
* The misses, per set in ascending id, each replace the way of lowest score (empty ways score -1; ties:
  the lowest way) among those not filled in this call; once every way of a set was filled in this
  call, its further misses are read but not admitted.

The caller holds its own lock around :meth:`probe` and :meth:`commit`; between them it reads the misses,
and a read that fails leaves the index as it was (commit is never called).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engram.checks import check_int

__all__ = ["SetLruIndex", "Probe", "EMPTY"]

EMPTY = -1
"""Tag of an empty way."""


@dataclass(frozen=True)
class Probe:
    """One call's probe of distinct ids ``int64 [U]``: each id's set ``int64 [U]``, the positions of the hits
    ``int64 [H]`` and their slots ``int64 [H]``, the positions of the misses ``int64 [M]``."""

    sets: np.ndarray
    hit_index: np.ndarray
    hit_slots: np.ndarray
    miss_index: np.ndarray


class SetLruIndex:
    """Tags and scores of ``capacity`` slots (0: none, every id misses) in sets of ``ways``."""

    def __init__(self, capacity: int, ways: int):
        check_int("capacity", capacity, 0)
        check_int("ways", ways, 1)
        self.ways = min(ways, capacity) if capacity else 0
        self.num_sets = max(1, capacity // self.ways) if capacity else 0
        self.tags = np.full((self.num_sets, self.ways), EMPTY, dtype=np.int64)
        self.scores = np.full((self.num_sets, self.ways), -1, dtype=np.int64)
        self.step = 0

    @staticmethod
    def capacity_for(fraction: float, num_rows: int) -> int:
        """Slots of a cache of ``fraction`` of ``num_rows`` rows: ``max(1, floor(fraction * num_rows))``, 0 for 0."""
        return 0 if fraction == 0 else max(1, int(fraction * num_rows))

    @property
    def num_slots(self) -> int:
        return self.num_sets * self.ways

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """``bool [N]``: whether each id of ``ids int64 [N]`` is cached now."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.num_slots:
            return np.zeros(ids.shape, dtype=bool)
        return (self.tags[ids % self.num_sets] == ids[..., None]).any(-1)

    def probe(self, ids: np.ndarray) -> Probe:
        """Which of the distinct ids ``int64 [U]`` hit, and where; changes nothing."""
        if not self.num_slots:
            empty = np.zeros(0, dtype=np.int64)
            return Probe(np.zeros(ids.shape[0], dtype=np.int64), empty, empty, np.arange(ids.shape[0]))
        sets = ids % self.num_sets
        match = self.tags[sets] == ids[:, None]                         # [U, ways]
        hit = match.any(1)
        hit_index = np.flatnonzero(hit)
        hit_ways = match[hit_index].argmax(1)
        return Probe(sets, hit_index, sets[hit_index] * self.ways + hit_ways, np.flatnonzero(~hit))

    def commit(self, ids: np.ndarray, probe: Probe) -> tuple[np.ndarray, np.ndarray]:
        """The step of ``probe`` (of the distinct ascending ``ids``): hit ways scored, misses admitted.
        Returns ``(positions int64 [A] among the probe's misses, slots int64 [A])``: the admitted misses
        and where their rows go (each slot once)."""
        if not self.num_slots:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        step = self.step
        self.scores.reshape(-1)[probe.hit_slots] = step + 1
        positions, slots = self._admit(ids[probe.miss_index], probe.sets[probe.miss_index], step)
        self.step = step + 1
        return positions, slots

    def _admit(self, ids: np.ndarray, sets: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros(0, dtype=np.int64)
        if not ids.size:
            return empty, empty
        order = np.argsort(sets, kind="stable")   # per set, ascending id
        ordered_sets = sets[order]
        starts = np.flatnonzero(np.r_[True, ordered_sets[1:] != ordered_sets[:-1]])
        lengths = np.diff(np.r_[starts, ids.size])
        rank = np.arange(ids.size) - np.repeat(starts, lengths)
        local = np.empty(ids.size, dtype=np.int64)   # each candidate's set, numbered among this call's sets
        local[order] = np.repeat(np.arange(starts.size), lengths)
        filled = np.zeros((starts.size, self.ways), dtype=bool)   # ways filled in this call
        never = np.iinfo(np.int64).max
        positions, slots = [], []
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
            positions.append(pick)
            slots.append(candidate_sets * self.ways + way)
        return np.concatenate(positions), np.concatenate(slots)

    def clear(self) -> None:
        """No slot, from now on (every id misses)."""
        self.tags = np.full((0, 0), EMPTY, dtype=np.int64)
        self.scores = np.full((0, 0), -1, dtype=np.int64)
        self.num_sets = self.ways = 0
