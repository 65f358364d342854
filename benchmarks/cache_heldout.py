"""What a cache could serve on the held-out steps of a read stream (bench_cache.py), on the CPU.

The stream is split into steps of ``step_reads`` reads; the first ``warm_steps`` only warm the
cache, the rest are measured. For the measured steps:

* :func:`heldout_ceiling`: the share of reads whose row was read in an earlier step (warm-up
  included): no cache that learns only from the stream served so far can serve more;
* :func:`best_static_share`: the share the ``capacity`` most-read rows of the measured steps
  themselves would serve (an oracle, chosen on the text it is scored on);
* :func:`simulated_hit_rates`: ``engram.tools.cache_policy`` replays (the fully associative ``lru``,
  and ``set-lru`` and ``dynamic`` with the device cache's parameters: the rules the device index
  follows), warm-up excluded.
"""

from __future__ import annotations

import numpy as np

from engram.tools.cache_policy import CompactStream, DynamicParams, replay


def heldout_ceiling(reads: np.ndarray, step_reads: int, warm_steps: int) -> float:
    reads = np.asarray(reads, dtype=np.int64).reshape(-1)
    rows, first_index, inverse = np.unique(reads, return_index=True, return_inverse=True)
    first_step = first_index // step_reads
    step = np.arange(len(reads)) // step_reads
    measured = step >= warm_steps
    seen_before = first_step[inverse] < step
    return float(seen_before[measured].mean()) if measured.any() else 0.0


def measured_distinct_rows(reads: np.ndarray, step_reads: int, warm_steps: int) -> int:
    """Distinct rows read in the measured steps: when the cache has at least as many slots,
    :func:`best_static_share` holds them all (1.0, an oracle that says nothing of the policy)."""
    return int(np.unique(np.asarray(reads, dtype=np.int64).reshape(-1)[warm_steps * step_reads:]).size)


def best_static_share(reads: np.ndarray, step_reads: int, warm_steps: int, capacity: int) -> float:
    measured = np.asarray(reads, dtype=np.int64).reshape(-1)[warm_steps * step_reads:]
    if len(measured) == 0:
        return 0.0
    counts = np.unique(measured, return_counts=True)[1]
    top = counts if capacity >= len(counts) else np.partition(counts, len(counts) - capacity)[len(counts) - capacity:]
    return float(top.sum() / len(measured))


def device_cache_params(ways: int, aging_interval: int) -> DynamicParams:
    """The replay parameters of :class:`engram.table.placements.row_cache.RowCache` with these ``ways`` and
    ``aging_interval`` (it follows the replay's ``dynamic`` / ``set-lru`` rules exactly)."""
    return DynamicParams(ways=ways, age_steps=aging_interval)


def simulated_hit_rates(reads: np.ndarray, step_reads: int, warm_steps: int, capacity: int,
                        params: DynamicParams) -> dict[str, dict[str, float]]:
    """Per policy (``lru``, ``set-lru``, ``dynamic``): hit rate and host fetch ratio (deduplicated per step) of the
    measured steps, from a cold cache warmed by the first ``warm_steps`` steps. A replay is causal, so
    the measured steps' counts are the whole stream's minus the warm-up's."""
    reads = np.asarray(reads, dtype=np.int64).reshape(-1)
    whole = CompactStream(reads, step_reads)
    warm = CompactStream(reads[:warm_steps * step_reads], step_reads) if warm_steps else None
    results = {}
    for policy in ("lru", "set-lru", "dynamic"):
        total = replay(whole, capacity, policy, params=params)
        before = replay(warm, capacity, policy, params=params) if warm is not None else None
        reads_n = total.reads - (before.reads if before else 0)
        hits = total.hits - (before.hits if before else 0)
        fetches = total.fetches - (before.fetches if before else 0)
        fetch_hits = total.fetch_hits - (before.fetch_hits if before else 0)
        results[policy] = {"hit_rate": hits / reads_n if reads_n else 0.0,
                           "host_fetch_ratio": (fetches - fetch_hits) / fetches if fetches else 0.0}
    return results
