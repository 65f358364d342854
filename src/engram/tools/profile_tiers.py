"""Figures for sizing a disk tier's two caches (``engram profile tiers``): an HBM cache above a RAM cache
above rows on disk.

The tiers, per step (the rules of :mod:`engram.tools.cache_policy`, one policy for both caches):

1. the step's reads hit the HBM cache (fraction ``hbm_fraction`` of a table's rows; none at 0) as
   placement ``"cached"`` serves them;
2. the distinct rows it missed (each once: the host gather deduplicates them) are read from the RAM cache
   (fraction ``ram_fraction``), a cache of its own with the same policy over that stream of misses;
3. the rows the RAM cache missed are read from disk: one read of the 4 KiB page holding each
   (``rows_per_page`` rows a page, :func:`rows_per_page`); rows sharing a page in a step share its read.

Both caches change between steps, each by its own policy over the reads it saw. Per step size, RAM fraction
and HBM fraction: the HBM hit rate (of reads), the RAM hit rate (of the rows reaching it), disk pages and
bytes per step, per token, and the RAM and HBM the caches take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engram.layout import EngramLayout
from engram.tools.cache_policy import CompactStream, DynamicParams, capacity_for, replay
from engram.tools.profile import Trace, corpus_warnings

__all__ = ["DEFAULT_RAM_FRACTIONS", "DEFAULT_HBM_FRACTIONS", "PAGE_BYTES", "TierReport", "rows_per_page",
           "hbm_tier", "tier_steps", "tier_report"]

DEFAULT_RAM_FRACTIONS = (0.1, 0.3)
DEFAULT_HBM_FRACTIONS = (0.0, 0.02)
PAGE_BYTES = 4096
"""Bytes of one disk read: a page holding whole rows (no row crosses one)."""


@dataclass
class TierReport:
    """``figures``: the JSON-able result (:func:`tier_report`); ``warnings``: sentences for stderr."""

    figures: dict
    warnings: list[str] = field(default_factory=list)


def rows_per_page(row_bytes: int) -> int:
    """Rows of ``row_bytes`` bytes in one 4 KiB page (15 at V4.1's 272-byte rows)."""
    return max(1, PAGE_BYTES // row_bytes)


def hbm_tier(stream: CompactStream, num_rows: int, hbm_fraction: float, policy: str,
             params: DynamicParams = DynamicParams()) -> tuple[CompactStream, int]:
    """The HBM cache's part: ``(the stream of its misses, each step's distinct missed rows once; its hits)``
    (no cache at ``hbm_fraction`` 0: every step's distinct rows, no hit)."""
    if hbm_fraction > 0:
        upper_misses: list = []
        upper = replay(stream, capacity_for(hbm_fraction, num_rows), policy, params=params, misses=upper_misses)
        return CompactStream.from_steps(upper_misses), upper.hits
    return CompactStream.from_steps([stream.rows[stream.step(k)[0]] for k in range(stream.num_steps)]), 0


def tier_steps(stream: CompactStream, num_rows: int, ram_fraction: float, hbm_fraction: float, policy: str,
               page_rows: int, params: DynamicParams = DynamicParams(), upper=None) -> dict:
    """One layer's stream through the tiers: ``reads``, ``hbm_hits`` (reads), ``ram_reads`` / ``ram_hits``
    (distinct rows per step reaching the RAM cache / found there, summed over steps), ``disk_rows`` and
    ``disk_pages`` (summed over steps), ``steps``. ``upper``: :func:`hbm_tier`'s result for these arguments
    when already made (it is the same for every RAM fraction)."""
    lower, hbm_hits = upper if upper is not None else hbm_tier(stream, num_rows, hbm_fraction, policy, params)
    lower_misses: list = []
    ram = replay(lower, capacity_for(ram_fraction, num_rows), policy, params=params, misses=lower_misses)
    disk_pages = sum(len(np.unique(rows // page_rows)) for rows in lower_misses)
    return {"reads": stream.num_reads, "hbm_hits": hbm_hits, "ram_reads": ram.reads, "ram_hits": ram.hits,
            "disk_rows": sum(len(rows) for rows in lower_misses), "disk_pages": disk_pages,
            "steps": stream.num_steps}


def tier_report(trace: Trace, layout: EngramLayout, ram_fractions, hbm_fractions, step_tokens, *,
                policy: str = "set-lru", params: DynamicParams = DynamicParams()) -> TierReport:
    """The figures of ``trace`` for every (step size, RAM fraction, HBM fraction): ``tiers`` entries with the
    layers summed and per layer id under ``layers``."""
    from engram.table.host_memory.rows import packed_row_bytes
    from engram.tools.profile_size import layer_cache_bytes

    row_bytes = packed_row_bytes(layout.spec.head_dim)
    page_rows = rows_per_page(row_bytes)
    figures = {"tokens": trace.tokens, "files": trace.files, "layer_ids": list(layout.spec.layer_ids),
               "policy": policy, "row_bytes": row_bytes, "rows_per_page": page_rows, "page_bytes": PAGE_BYTES,
               "ram_fractions": sorted(set(ram_fractions)), "hbm_fractions": sorted(set(hbm_fractions)),
               "step_tokens": list(step_tokens), "tiers": []}
    warnings: list[str] = []
    for tokens in step_tokens:
        columns = layout.spec.num_columns
        streams = [CompactStream(trace.reads[index], tokens * columns) for index in range(len(layout.spec.layer_ids))]
        warnings += corpus_warnings(trace, [], tokens)
        full: set = set()
        for hbm_fraction in figures["hbm_fractions"]:
            uppers = [hbm_tier(stream, int(layout.num_embeddings[index]), hbm_fraction, policy, params)
                      for index, stream in enumerate(streams)]
            for ram_fraction in figures["ram_fractions"]:
                layers = {}
                for index, (layer_id, stream) in enumerate(zip(layout.spec.layer_ids, streams)):
                    rows = int(layout.num_embeddings[index])
                    counts = tier_steps(stream, rows, ram_fraction, hbm_fraction, policy, page_rows, params,
                                        upper=uppers[index])
                    if capacity_for(ram_fraction, rows) >= len(uppers[index][0].rows):
                        full.add(ram_fraction)
                    hbm = (layer_cache_bytes(layout, hbm_fraction, policy, tokens, params.ways)[index]["hbm_bytes"]
                           if hbm_fraction > 0 else 0)
                    layers[str(layer_id)] = {**_rates(counts, tokens), "ram_bytes":
                                             capacity_for(ram_fraction, rows) * row_bytes, "hbm_bytes": hbm}
                totals = {key: sum(layer[key] for layer in layers.values())
                          for key in ("disk_pages_per_step", "disk_bytes_per_step", "disk_pages_per_token",
                                      "ram_bytes", "hbm_bytes")}
                reads = sum(stream.num_reads for stream in streams)
                figures["tiers"].append({
                    "step_tokens": tokens, "ram_fraction": ram_fraction, "hbm_fraction": hbm_fraction,
                    "steps": streams[0].num_steps,
                    "hbm_hit_rate": sum(layer["hbm_hit_rate"] * stream.num_reads
                                        for layer, stream in zip(layers.values(), streams)) / max(1, reads),
                    **totals, "layers": layers})
        if full:
            warnings.append(f"the corpus: a RAM cache of {min(full):g} of the rows already holds every distinct row the "
                            f"text sends it (at {tokens} tokens per step), so it never evicts and larger RAM fractions "
                            f"read the same disk pages; only more text tells them apart")
    return TierReport(figures, list(dict.fromkeys(warnings)))


def _rates(counts: dict, step_tokens: int) -> dict:
    steps = max(1, counts["steps"])
    return {"hbm_hit_rate": counts["hbm_hits"] / max(1, counts["reads"]),
            "ram_hit_rate": counts["ram_hits"] / max(1, counts["ram_reads"]),
            "disk_rows_per_step": counts["disk_rows"] / steps,
            "disk_pages_per_step": counts["disk_pages"] / steps,
            "disk_bytes_per_step": counts["disk_pages"] * PAGE_BYTES / steps,
            "disk_pages_per_token": counts["disk_pages"] / (steps * step_tokens)}
