"""Policies of an HBM cache of hot table rows, and a fast replay of a row-read stream through them.

A *stream* is one layer's row reads in serving order: int64 ``[N]`` row ids, token-major and
hash-column-minor (``hash_ids[:, layer, :].reshape(-1)``). It is cut into *steps* of
``step_reads`` consecutive reads (an engine step of ~4096 tokens x C columns). The cache holds
at most ``capacity`` rows. Its content is fixed during a step: a read is a **hit** (served from
HBM) when its row is cached at the start of the step; otherwise the row is fetched from host
memory once per step (deduplicated) and the policy updates the content **between steps**.
Every policy below is deterministic and can be implemented on the device as written.

Policies (the exact rules; :func:`replay` follows them and ``tests/tools/test_cache_policy.py`` checks it
against a plain loop):

``static``
    The content is the first ``capacity`` rows of the initial hot list (hottest first, as
    written by ``engram profile build``) and never changes.

``lru``
    After each step the cache holds the ``capacity`` most recently read rows, recency being the
    position of a row's last read in the stream (rows of the initial hot list count as read
    before the stream, the hottest last; the first ``capacity`` of them). Equivalently: a
    per-read LRU whose hits are judged against the content at the start of the step.

``dynamic``
    Set-associative with frequency-based replacement and aging. ``S = max(1, capacity // ways)``
    sets of ``min(ways, capacity)`` ways; row ``r`` lives only in set ``r % S``. Each cached row
    has an integer score. Between steps, with ``c`` = reads of a row in the step just served:

    1. aging: when the step index ``k`` (0-based) is a multiple of ``age_steps`` and ``k > 0``,
       every score is halved (integer shift right by one) *before* the step's counts are added
       (``age_steps=1``: every step);
    2. a cached row read in the step adds ``c`` to its score;
    3. each missed row is a candidate with score ``c``. Candidates of one set are taken in
       descending score (ties: smaller row id first); each replaces the lowest-scored row of its
       set among those not inserted in this step (an empty way first; ties: lowest way index)
       when its score is at least that row's (``admit_ties=True``) or strictly greater
       (``admit_ties=False``), else it is dropped (also when every way was filled in this step).

    With ``recency=True`` the score is recency instead of frequency (set-associative LRU): a row
    read or inserted after step ``k`` scores ``k + 1``, there is no aging, and a candidate
    replaces the set's least recently read row not inserted in this step.

``set-lru`` (the default)
    ``dynamic`` with ``recency=True`` (``params.ways`` ways): the LRU that placement ``"cached"``
    serves by default (:class:`engram.table.placements.row_cache.RowCache` follows ``dynamic``'s rules, both
    scores, and ``tests/placements/test_cached_placement.py`` checks that it serves the same hits).

    Initial content: the hot list's first ``capacity`` rows, hottest first, each row placed in its
    set (in the set's next way) while the set has an empty way, with score
    ``max(1, ceil(count / profile_steps))`` (its reads per step in the profile); with
    ``recency=True`` score 0 (so among them the lowest way, the set's hottest, goes first).

The replay works in a compact id space (the stream's distinct rows plus the initial rows), so its
state arrays have one entry per distinct row, not per table row, and loops only over steps (and,
for ``dynamic``, over the few candidates that share a set within one step). ``dynamic`` keeps the
ways of the sets those rows fall in only (a set no row of the stream maps to stays empty whatever
happens), so its memory follows the stream, never the capacity: a cache of all 384M rows of a V4.1
table replays a short text in megabytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from engram.checks import check_bool, check_fraction, check_int

__all__ = ["POLICIES", "DEFAULT_POLICY", "DynamicParams", "CompactStream", "ReplayResult", "replay",
           "capacity_for", "best_static_hits", "sorted_unique"]

POLICIES = ("static", "dynamic", "lru", "set-lru")
DEFAULT_POLICY = "set-lru"
"""What placement ``"cached"`` serves by default, chosen on held-out text (benchmarks/NOTES.md, "HBM
cache policies on real text"): LRU serves the most reads from 0.5% of rows up (``dynamic`` only wins
at 0.1%), and the device holds it set-associatively (one set read per row), 0.2-1.9 points under the
fully associative ``lru``."""


@dataclass(frozen=True)
class DynamicParams:
    """Parameters of the ``dynamic`` policy (module docstring)."""

    ways: int = 8
    age_steps: int = 16
    admit_ties: bool = True
    recency: bool = False

    def __post_init__(self):
        for name in ("admit_ties", "recency"):
            check_bool(name, getattr(self, name))
        for name in ("ways", "age_steps"):
            check_int(name, getattr(self, name), 1)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values of an int64 array, ascending: one sort (numpy's own ``unique`` takes a hash
    table here, several times slower on millions of row ids)."""
    ordered = np.sort(np.asarray(values).reshape(-1))
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def capacity_for(fraction: float, num_rows: int) -> int:
    """Rows a cache of ``fraction`` of a ``num_rows`` table holds: ``max(1, floor(fraction * num_rows))``."""
    check_fraction("fraction", fraction)
    return max(1, int(fraction * num_rows))


class CompactStream:
    """One layer's read stream, preprocessed once for any number of replays.

    ``reads``: int64 ``[N]`` row ids; ``step_reads``: reads per step; ``extra_rows``: rows that may
    be cached without being read (an initial hot list), given compact ids too; ``progress``: told
    ``update(1)`` after each step is prepared.

    Attributes: ``rows`` int64 ``[U]`` sorted distinct rows (compact id = index); ``read_counts``
    ``[U]`` reads of each; ``extra_ids`` ``[H]`` compact ids of ``extra_rows``; per step ``k`` the
    slice ``bounds[k]:bounds[k+1]`` of ``step_ids`` (distinct compact ids read in the step, ascending), ``step_counts`` (reads of each)
    and ``step_last`` (stream position of each one's last read in the step).
    """

    def __init__(self, reads: np.ndarray, step_reads: int, extra_rows: np.ndarray | None = None, progress=None,
                 step_bounds: np.ndarray | None = None):
        reads = np.asarray(reads, dtype=np.int64).reshape(-1)
        check_int("step_reads", step_reads, 1, numpy_ints=True)
        self.num_reads = len(reads)
        self.step_reads = int(step_reads)
        if step_bounds is None:  # steps of step_reads reads
            step_bounds = np.r_[np.arange(0, self.num_reads, self.step_reads), self.num_reads]
        step_bounds = np.asarray(step_bounds, dtype=np.int64)
        self.num_steps = len(step_bounds) - 1
        extra = np.zeros(0, dtype=np.int64) if extra_rows is None else np.asarray(extra_rows, dtype=np.int64)
        step_rows, step_counts, step_last, sizes = [], [], [], [0]
        for start, end in zip(step_bounds[:-1], step_bounds[1:]):  # small sorts, one per step
            chunk = reads[start:end]
            rows, reversed_first, counts = np.unique(chunk[::-1], return_index=True, return_counts=True)
            step_rows.append(rows)
            step_counts.append(counts)
            step_last.append(start + len(chunk) - 1 - reversed_first)
            sizes.append(len(rows))
            if progress is not None:
                progress.update(1)
        step_rows = np.concatenate(step_rows) if step_rows else np.zeros(0, dtype=np.int64)
        self.rows = sorted_unique(np.concatenate([step_rows, extra]))
        self.step_ids = np.searchsorted(self.rows, step_rows)
        self.step_counts = np.concatenate(step_counts) if step_counts else np.zeros(0, dtype=np.int64)
        self.step_last = np.concatenate(step_last) if step_last else np.zeros(0, dtype=np.int64)
        self.bounds = np.cumsum(sizes)
        self.extra_ids = np.searchsorted(self.rows, extra)  # [H] compact ids of extra_rows
        self.read_counts = np.bincount(self.step_ids, weights=self.step_counts,
                                       minlength=len(self.rows)).astype(np.int64)
        self.first_touches = int(np.count_nonzero(self.read_counts))
        self.memo: dict = {}
        """What replays of one capacity share (set layouts, best static hits), kept across replays."""

    @classmethod
    def from_steps(cls, steps: list[np.ndarray], extra_rows: np.ndarray | None = None) -> "CompactStream":
        """A stream whose steps are given: ``steps[k]`` int64 the rows step ``k`` reads (a lower tier's
        stream: the rows an upper cache missed in each step, each once; a step may read none)."""
        steps = [np.asarray(step, dtype=np.int64).reshape(-1) for step in steps]
        bounds = np.cumsum([0] + [len(step) for step in steps])
        reads = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
        return cls(reads, max(1, max((len(step) for step in steps), default=1)), extra_rows, step_bounds=bounds)

    def step(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = self.bounds[k], self.bounds[k + 1]
        return self.step_ids[lo:hi], self.step_counts[lo:hi], self.step_last[lo:hi]


@dataclass
class ReplayResult:
    """Counts of one replay. ``hits``: reads whose row was cached at the step's start; ``fetches``:
    distinct rows per step, summed over steps; ``fetch_hits``: those cached (host fetches saved)."""

    reads: int
    hits: int
    fetches: int
    fetch_hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.reads if self.reads else 0.0

    @property
    def host_fetch_ratio(self) -> float:
        """Rows fetched from host with the cache / without it (both deduplicated per step)."""
        return (self.fetches - self.fetch_hits) / self.fetches if self.fetches else 0.0


def best_static_hits(stream: CompactStream, capacity: int) -> int:
    """Hits of the best static set for this very stream: its ``capacity`` most-read rows."""
    counts = stream.read_counts
    if capacity >= len(counts):
        return int(counts.sum())
    key = ("best static", capacity)
    if key not in stream.memo:
        stream.memo[key] = int(np.partition(counts, len(counts) - capacity)[len(counts) - capacity:].sum())
    return stream.memo[key]


def replay(stream: CompactStream, capacity: int, policy: str = DEFAULT_POLICY, *, initial: bool = False,
           initial_counts: np.ndarray | None = None, profile_steps: int = 1,
           params: DynamicParams = DynamicParams(), progress=None, misses: list | None = None) -> ReplayResult:
    """Serve ``stream`` through a cache of ``capacity`` rows under ``policy`` (module docstring).

    ``initial``: start from the stream's ``extra_rows`` as the hot list (hottest first; its first
    ``capacity`` rows are used); ``initial_counts`` ``[H]``: their profile reads, and
    ``profile_steps`` the profile's steps (``dynamic``'s initial scores). ``progress``: an object
    with ``update(steps)`` (a tqdm bar), told of the steps as they are replayed. ``misses``: a list
    that receives, per step, the distinct rows not cached at its start (int64, ascending).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, found {policy!r}")
    check_int("capacity", capacity, 1, numpy_ints=True)
    capacity = int(capacity)
    hot = stream.extra_ids[:capacity] if initial else np.zeros(0, dtype=np.int64)
    progress = progress if progress is not None else _NoProgress()
    if policy == "static":
        result = _replay_static(stream, hot, misses)
        progress.update(stream.num_steps)
        return result
    if policy == "lru":
        return _replay_lru(stream, capacity, hot, progress, misses)
    if policy == "set-lru":
        params = dataclasses.replace(params, recency=True)
    counts = np.ones(len(hot), dtype=np.int64) if initial_counts is None else \
        np.asarray(initial_counts, dtype=np.int64)[:capacity]
    if len(counts) != len(hot):
        raise ValueError(f"initial_counts: expected {len(hot)} counts (one per initial row), found {len(counts)}")
    scores = np.maximum(1, -(-counts // max(1, int(profile_steps))))
    if params.recency:
        scores = np.zeros(len(hot), dtype=np.int64)  # read "before step 0"
    return _replay_dynamic(stream, capacity, hot, scores, params, progress, misses)


class _NoProgress:
    def update(self, steps: int) -> None:
        pass


def _record_misses(misses: list | None, stream: CompactStream, ids: np.ndarray, hit: np.ndarray) -> None:
    if misses is not None:
        misses.append(stream.rows[ids[~hit]])  # compact ids ascend with the rows


def _replay_static(stream: CompactStream, hot: np.ndarray, misses: list | None = None) -> ReplayResult:
    cached = np.zeros(len(stream.rows), dtype=bool)
    cached[hot] = True
    hit = cached[stream.step_ids]
    for k in range(stream.num_steps if misses is not None else 0):
        lo, hi = stream.bounds[k], stream.bounds[k + 1]
        _record_misses(misses, stream, stream.step_ids[lo:hi], hit[lo:hi])
    return ReplayResult(stream.num_reads, int(stream.step_counts[hit].sum()), len(stream.step_ids), int(hit.sum()))


def _replay_lru(stream: CompactStream, capacity: int, hot: np.ndarray, progress,
                misses: list | None = None) -> ReplayResult:
    size = len(stream.rows)
    cached = np.zeros(size, dtype=bool)
    last = np.full(size, np.iinfo(np.int64).min, dtype=np.int64)
    # The log: (compact id, time) in time order; an entry is live while the row is cached with that time.
    log_ids = np.empty(len(hot) + len(stream.step_ids), dtype=np.int64)
    log_times = np.empty_like(log_ids)
    coldest_first = hot[::-1]
    log_ids[:len(hot)] = coldest_first
    log_times[:len(hot)] = -1 - np.arange(len(hot))[::-1]
    cached[coldest_first] = True
    last[coldest_first] = log_times[:len(hot)]
    head, tail, count = 0, len(hot), len(hot)
    hits = fetch_hits = 0
    for k in range(stream.num_steps):
        ids, counts, last_read = stream.step(k)
        hit = cached[ids]
        hits += int(counts[hit].sum())
        fetch_hits += int(hit.sum())
        _record_misses(misses, stream, ids, hit)
        order = np.argsort(last_read)
        ids, last_read = ids[order], last_read[order]
        count += int((~hit).sum())
        cached[ids] = True
        last[ids] = last_read
        log_ids[tail:tail + len(ids)] = ids
        log_times[tail:tail + len(ids)] = last_read
        tail += len(ids)
        need = count - capacity
        while need > 0:
            chunk = slice(head, min(tail, head + max(2 * need, 1024)))
            chunk_ids = log_ids[chunk]
            live = np.flatnonzero(cached[chunk_ids] & (last[chunk_ids] == log_times[chunk]))
            evict = live[:need]
            cached[chunk_ids[evict]] = False
            need -= len(evict)
            count -= len(evict)
            head = chunk.start + (int(evict[-1]) + 1 if need == 0 else len(chunk_ids))
        progress.update(1)
    return ReplayResult(stream.num_reads, hits, len(stream.step_ids), fetch_hits)


def _set_layout(stream: CompactStream, num_sets: int, ways: int, hot: np.ndarray
                ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """``(set_of [U], sets, keep, slots)`` of a set-associative cache of ``num_sets`` sets of ``ways``:
    each compact id's set, numbered among the sets the stream's rows fall in (ascending, so the order
    of sets, which breaks no tie but groups candidates, is the table's own), how many such sets, and
    the initial content: the positions ``keep`` in ``hot`` of the rows each set takes (its hottest,
    while it has ways) and their slots. Kept on the stream: every policy and replay of one capacity
    shares it."""
    key = ("sets", num_sets, ways, len(hot))   # hot: always a prefix of stream.extra_ids (replay)
    cached = stream.memo.get(key)
    if cached is not None:
        return cached
    table_sets = stream.rows % num_sets
    if num_sets <= 8 * len(stream.rows) + (1 << 20):  # dense numbering by a presence map: no sort
        present = np.zeros(num_sets, dtype=bool)
        present[table_sets] = True
        number = np.cumsum(present, dtype=np.int64) - 1
        set_of = number[table_sets]
    else:
        set_of = np.unique(table_sets, return_inverse=True)[1].reshape(-1)   # [U]
    used_sets = int(set_of.max()) + 1 if len(set_of) else 1
    keep = slots = np.zeros(0, dtype=np.int64)
    if len(hot):
        sets = set_of[hot]
        order = np.argsort(sets, kind="stable")
        sorted_sets = sets[order]
        starts = np.flatnonzero(np.r_[True, sorted_sets[1:] != sorted_sets[:-1]])
        rank = np.arange(len(hot)) - np.repeat(starts, np.diff(np.r_[starts, len(hot)]))
        keep = order[rank < ways]
        slots = set_of[hot[keep]] * ways + rank[rank < ways]
    stream.memo[key] = result = (set_of, used_sets, keep, slots)
    return result


def _replay_dynamic(stream: CompactStream, capacity: int, hot: np.ndarray, hot_scores: np.ndarray,
                    params: DynamicParams, progress, misses: list | None = None) -> ReplayResult:
    ways = min(params.ways, capacity)
    set_of, num_sets, keep, slots = _set_layout(stream, max(1, capacity // ways), ways, hot)
    slot_row = np.full(num_sets * ways, -1, dtype=np.int64)
    slot_score = np.full(num_sets * ways, -1, dtype=np.int64)  # -1: empty way (below any score)
    slot_epoch = np.zeros(num_sets * ways, dtype=np.int64)
    slot_inserted = np.full(num_sets * ways, -1, dtype=np.int64)  # step of the last insertion
    slot_of = np.full(len(stream.rows), -1, dtype=np.int64)
    if len(keep):  # initial content: each set takes its hottest rows while it has ways
        slot_row[slots] = hot[keep]
        slot_score[slots] = hot_scores[keep]
        slot_of[hot[keep]] = slots
    hits = fetch_hits = 0
    for k in range(stream.num_steps):
        ids, counts, _ = stream.step(k)
        epoch = k // params.age_steps
        slots = slot_of[ids]
        hit = slots >= 0
        hits += int(counts[hit].sum())
        fetch_hits += int(hit.sum())
        _record_misses(misses, stream, ids, hit)
        # Residents read in the step: age lazily, then add the step's reads.
        s = slots[hit]
        if params.recency:
            slot_score[s] = k + 1
            epoch = 0  # no aging
        else:
            slot_score[s] = (slot_score[s] >> np.minimum(epoch - slot_epoch[s], 63)) + counts[hit]
        slot_epoch[s] = epoch
        # Candidates, per set in descending score then ascending row id (= compact id).
        cand, cand_score = ids[~hit], (np.full(int((~hit).sum()), k + 1) if params.recency else counts[~hit])
        cand_set = set_of[cand]
        order = np.lexsort((cand, -cand_score, cand_set))
        cand, cand_score, cand_set = cand[order], cand_score[order], cand_set[order]
        starts = np.flatnonzero(np.r_[True, cand_set[1:] != cand_set[:-1]]) if len(cand) else np.zeros(0, np.int64)
        rank = np.arange(len(cand)) - np.repeat(starts, np.diff(np.r_[starts, len(cand)]))
        # A set takes at most `ways` candidates (rows inserted in this step are never replaced in
        # it), in order, and rejects every one after its first rejection (later ones score no
        # more, and the rows they could replace only score more): ranks >= ways never enter.
        for r in range(min(ways, int(rank.max()) + 1) if len(cand) else 0):
            pick = rank == r
            c, cs, cset = cand[pick], cand_score[pick], cand_set[pick]
            block = cset[:, None] * ways + np.arange(ways)  # [n, ways] slots of each candidate's set
            block_score = slot_score[block]
            occupied = block_score >= 0
            shift = np.where(occupied, epoch - slot_epoch[block], 0)
            current = np.where(occupied, block_score >> np.minimum(shift, 63), -1)
            current = np.where(slot_inserted[block] == k, np.iinfo(np.int64).max, current)
            way = np.argmin(current, axis=1)
            lowest = current[np.arange(len(c)), way]
            win = (cs >= lowest if params.admit_ties else cs > lowest) & (lowest < np.iinfo(np.int64).max)
            target = block[np.arange(len(c)), way][win]
            old = slot_row[target]
            slot_of[old[old >= 0]] = -1
            slot_row[target] = c[win]
            slot_score[target] = cs[win]
            slot_epoch[target] = epoch
            slot_inserted[target] = k
            slot_of[c[win]] = target
        progress.update(1)
    return ReplayResult(stream.num_reads, hits, len(stream.step_ids), fetch_hits)
