"""The step benchmark's figures (``bench_step.py``): each variant's spread, its steps paired per round with
``device``'s (or ``none``'s) and the 95% interval of that median, the pairs of :data:`PAIRS` (``cached``
against ``host``, per round; the disk variants against ``device_eager`` / ``device`` and the host path), the row
caches' hit rates and host bytes, the disk tiers' hit rates and reads, and the headline keys of the report."""

from __future__ import annotations

import math
import statistics

HOST_PREFETCHED = ("host_prefetch", "host_prefetch_late", "host_kv_ahead")  # the host key's best of these
DISK_TAGS = ("ram10", "ram30")  # the disk variants' RAM cache fractions, 10% and 30% of the rows
DISK_VARIANTS = tuple(f"disk_prefetch_realtext_{tag}" for tag in DISK_TAGS)
# (variant, base) compared per round: cached against host with the same ids and prefetch form, what
# the neighbours' traffic costs each placement, and disk against device (decode: the eager control; prefill:
# device, eager there) and against host on the same text.
PAIRS = (("cached_prefetch", "host_prefetch"),
         ("cached_prefetch_realtext", "host_prefetch_realtext"),
         ("cached_prefetch_realtext_neighbors", "host_prefetch_realtext_neighbors"),
         ("host_prefetch_realtext_neighbors", "host_prefetch_realtext"),
         ("cached_prefetch_realtext_neighbors", "cached_prefetch_realtext"),
         ("device_eager", "device"),
         *((name, base) for name in DISK_VARIANTS for base in ("device_eager", "device", "host_prefetch_realtext")))


def spread(samples: list[float]) -> dict:
    """Median, quartiles, min, max (ms) of one variant's steps."""
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {"median_ms": statistics.median(ordered), "p25_ms": quartiles[0], "p75_ms": quartiles[2],
            "min_ms": ordered[0], "max_ms": ordered[-1], "n": len(ordered)}


def _pct(value, base):
    return None if value is None or not base else 100 * (value - base) / base


def _phase(report: dict, mode: str, tokens: int) -> dict | None:
    return next((p for p in report.get("phases", []) if p["mode"] == mode and p["T"] == tokens), None)


def _median(phase: dict | None, name: str):
    if phase is None:
        return None
    return phase["variants"].get(name, {}).get("median_ms")


def _best(phase: dict | None, names: tuple[str, ...]):
    found = [m for m in (_median(phase, n) for n in names) if m is not None]
    return min(found) if found else None


def paired_pct(values: list[float], base: list[float]) -> float | None:
    """Median over rounds of ``100 * (values[r] - base[r]) / base[r]``: each round's two steps ran
    seconds apart, so a drift of the clocks over the run (prefill T = 8192 on the H200: steps
    without Engram 352-377 ms in one run) cancels where a ratio of two medians keeps it."""
    pairs = [(v, b) for v, b in zip(values, base) if b]
    return statistics.median(100 * (v - b) / b for v, b in pairs) if pairs else None


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``values`` (order statistics of the binomial
    sign test): ``(values_(k), values_(n-k+1))`` sorted, with the largest k whose two tails each hold at
    most ``(1 - level) / 2``; None below 6 values (no such k at 95%)."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k, below = (1 - level) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(at most k values below the median)
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def paired_pct_interval(values: list[float], base: list[float]) -> tuple[float, float] | None:
    """:func:`median_interval` of the per-round % differences :func:`paired_pct` takes the median of."""
    return median_interval([100 * (v - b) / b for v, b in zip(values, base) if b])


def pair_figures(samples: dict[str, list[float]]) -> dict:
    """Per pair of :data:`PAIRS` whose two variants both ran: the per-round ``100 * (variant - base) / base``
    (the two steps of one round, seconds apart): its median (``pct``, :func:`paired_pct`), the 95% interval
    of that median, quartiles, min, max and the number of rounds."""
    found = {}
    for name, base in PAIRS:
        diffs = [100 * (v - b) / b for v, b in zip(samples.get(name) or [], samples.get(base) or []) if b]
        if not diffs:
            continue
        ordered = sorted(diffs)
        quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
        interval = median_interval(diffs)
        found[f"{name}_vs_{base}"] = {"pct": statistics.median(diffs),
                                      "ci95_pct": None if interval is None else list(interval),
                                      "p25_pct": quartiles[0], "p75_pct": quartiles[2], "min_pct": ordered[0],
                                      "max_pct": ordered[-1], "rounds": len(diffs)}
    return found


def cache_figures(counts: dict, steps: int, lookup_rows: int, direct_max_rows: int | None, row_bytes: int) -> dict:
    """A cached memory's row caches over ``steps`` steps (``counts``: reads, hits, distinct and distinct missed
    rows per step, summed over steps and layers): the hit rate, and the host rows and bytes a step that
    ``cached`` and ``host`` read as their paths read them. A lookup of more than ``direct_max_rows`` rows
    (``lookup_rows``: one layer's) takes the host gather, which reads each distinct row of the step once
    (``cached``: each distinct miss); a smaller one the direct reads, every row read (``cached``: every
    miss). ``host_bytes_ratio``: cached's host bytes over host's."""
    reads, hits = counts["reads"], counts["hits"]
    gathered = direct_max_rows is not None and lookup_rows > direct_max_rows
    host_rows = counts["distinct"] if gathered else reads
    cached_rows = counts["distinct_missed"] if gathered else reads - hits
    steps = max(steps, 1)
    return {**counts, "steps": steps, "hit_rate": hits / reads if reads else None,
            "path": "host_gather" if gathered else "direct", "row_bytes": row_bytes,
            "host_rows_per_step": host_rows / steps, "cached_rows_per_step": cached_rows / steps,
            "host_bytes_per_step": host_rows * row_bytes / steps, "cached_bytes_per_step": cached_rows * row_bytes / steps,
            "host_bytes_ratio": cached_rows / host_rows if host_rows else None}


def disk_figures(before: dict, after: dict, steps: int, row_bytes: int) -> dict:
    """A disk memory's tiers over ``steps`` timed steps, from its counters (``step_engram.disk_counts``) before
    and after them: lookups and hits of the HBM cache and of the RAM cache below it (over each lookup's
    distinct ids), their hit rates (the RAM one of the HBM misses, prefetch reads included), and the rows
    read from disk (the RAM misses) per step, over both tables."""
    found = {key: value - before.get(key, 0) for key, value in after.items() if not key.endswith("_slots")}
    steps = max(steps, 1)
    hbm = found["hbm_hits"] + found["hbm_misses"]
    ram = found["ram_hits"] + found["ram_misses"]
    return {**found, "hbm_slots": after.get("hbm_slots"), "ram_slots": after.get("ram_slots"), "steps": steps,
            "hbm_lookups": hbm, "ram_lookups": ram,
            "hbm_hit_rate": found["hbm_hits"] / hbm if hbm and after.get("hbm_slots") else None,
            "ram_hit_rate": found["ram_hits"] / ram if ram else None,
            "disk_rows": found["ram_misses"], "disk_reads_per_step": found["ram_misses"] / steps,
            "disk_bytes_per_step": found["ram_misses"] * row_bytes / steps, "row_bytes": row_bytes}


def _pair(phase: dict | None, name: str, base: str, field: str = "pct"):
    """``name`` against ``base`` from the phase's pairs (``field``: ``pct`` or ``ci95_pct``); for a phase without
    them the ratio of the medians (``pct`` only)."""
    if phase is None:
        return None
    entry = (phase.get("pairs") or {}).get(f"{name}_vs_{base}")
    if entry is not None:
        return entry.get(field)
    return _pct(_median(phase, name), _median(phase, base)) if field == "pct" else None


def _cache(phase: dict | None, kind: str, field: str):
    return None if phase is None else ((phase.get("row_cache") or {}).get(kind) or {}).get(field)


def _neighbors(phase: dict | None, field: str = "GBps"):
    return None if phase is None else (phase.get("host_neighbors") or {}).get(field)


def _vs(phase: dict | None, names: tuple[str, ...], base: str):
    """The best of ``names`` against ``base`` in %: paired per round where the phase has the
    per-round figures, else the ratio of medians."""
    if phase is None:
        return None
    key = f"paired_vs_{base}_pct"
    paired = [phase["variants"].get(n, {}).get(key) for n in names]
    if any(p is not None for p in paired):
        return min(p for p in paired if p is not None)
    return _pct(_best(phase, names), _median(phase, base))


def _interval(phase: dict | None, name: str, base: str):
    """``name``'s 95% interval of its paired % against ``base`` (:func:`paired_pct_interval`), or None."""
    if phase is None:
        return None
    return phase["variants"].get(name, {}).get(f"paired_vs_{base}_ci95_pct")


def headline(report: dict) -> dict:
    """The report's headline keys, from what has finished (None where its phase did not run); each
    comparison paired per round (:func:`paired_pct`) where the phase has per-round figures."""
    decode64, prefill = _phase(report, "decode", 64), _phase(report, "prefill", 8192)
    none_prefill = _median(prefill, "none")
    floor_prefill = None if prefill is None or prefill.get("floor_us") is None else prefill["floor_us"] / 1e3
    device_vs_none = _vs(prefill, ("device",), "none")
    over_floor = None
    if None not in (device_vs_none, none_prefill, floor_prefill):
        over_floor = device_vs_none - 100 * floor_prefill / none_prefill
    ceiling = (report.get("host_gather_ceiling") or {}).get("best_GBps")
    alone = report.get("host_path_T8192") or {}
    return {
        "host_vs_device_prefill_T8192_pct": _vs(prefill, HOST_PREFETCHED, "device"),
        "host_vs_device_decode_T64_pct": _vs(decode64, HOST_PREFETCHED, "device"),
        # decode steps are graph replays: host_prefetch there gathers inside the graph above graph_direct_max_rows
        **{f"host_graph_vs_device_decode_T{tokens}_pct": _vs(_phase(report, "decode", tokens), ("host_prefetch",),
                                                               "device") for tokens in (1, 64, 256, 1024)},
        **{f"control_vs_device_decode_T{tokens}_pct": _vs(_phase(report, "decode", tokens), ("device_again",),
                                                           "device") for tokens in (256, 1024)},
        **{f"{name}_vs_device_prefill_T8192_pct": _vs(prefill, (name,), "device") for name in HOST_PREFETCHED},
        **{f"{name}_vs_device_prefill_T8192_ci95_pct": _interval(prefill, name, "device") for name in HOST_PREFETCHED},
        "cached_vs_device_prefill_T8192_pct": _vs(prefill, ("cached_prefetch", "cached_kv_ahead"), "device"),
        "common_vs_device_prefill_T8192_pct": _vs(prefill, ("seed",), "device"),
        "device_again_vs_device_prefill_T8192_pct": _vs(prefill, ("device_again",), "device"),
        "device_again_vs_device_prefill_T8192_ci95_pct": _interval(prefill, "device_again", "device"),
        "device_again_vs_device_decode_T64_pct": _vs(decode64, ("device_again",), "device"),
        "device_over_floor_prefill_T8192_pct": over_floor,
        "host_gather_vs_ceiling_T8192": alone["GBps"] / ceiling if ceiling and alone.get("GBps") else None,
        **{f"update_cache_{kind}_us_T{tokens}": (phase or {}).get(f"update_cache_{kind}_us")
           for tokens, phase in ((64, decode64), (8192, prefill)) for kind in ("host", "gpu")},
        "update_cache_graph_us_T64": (decode64 or {}).get("update_cache_graph_us"),
        "layer_us_T64": report.get("layer_us", {}).get("64"),
        "layer_us_T8192": report.get("layer_us", {}).get("8192"),
        **cached_keys(decode64, prefill),
        **disk_keys(decode64, prefill),
        "host_neighbors": (report.get("host_neighbors_setup") or {}).get("count"),  # None: none started
        "host_neighbors_gbps_T64": _neighbors(decode64),
        "host_neighbors_gbps_T8192": _neighbors(prefill),
        **{f"host_neighbors_gbps_{p['mode']}_T{p['T']}": _neighbors(p) for p in report.get("phases", [])
           if _neighbors(p) is not None},
    }


def cached_keys(decode64: dict | None, prefill: dict | None) -> dict:
    """``cached`` against ``host`` (prefetched right after hashing, paired per round) on uniform and real-text
    ids, with the node's neighbours' traffic, and the real-text caches' hit rates and host bytes."""
    keys = {}
    for ids, suffix in (("", ""), ("_realtext", "_realtext"), ("_realtext_neighbors", "_realtext_neighbors")):
        for label, phase in (("decode_T64", decode64), ("prefill_T8192", prefill)):
            pair = (f"cached_prefetch{ids}", f"host_prefetch{ids}")
            keys[f"cached_vs_host_{label}{suffix}_pct"] = _pair(phase, *pair)
            keys[f"cached_vs_host_{label}{suffix}_ci95_pct"] = _pair(phase, *pair, field="ci95_pct")
    keys["host_realtext_neighbors_vs_alone_prefill_T8192_pct"] = _pair(prefill, "host_prefetch_realtext_neighbors",
                                                                       "host_prefetch_realtext")
    keys["cached_realtext_neighbors_vs_alone_prefill_T8192_pct"] = _pair(
        prefill, "cached_prefetch_realtext_neighbors", "cached_prefetch_realtext")
    for label, phase, tail in (("prefill T8192", prefill, ""), ("decode T64", decode64, "_decode_T64")):
        keys[f"cached_hit_rate_realtext{tail}"] = _cache(phase, "cached_realtext", "hit_rate")
        keys[f"cached_host_bytes_vs_host_realtext{tail}"] = _cache(phase, "cached_realtext", "host_bytes_ratio")
    keys["cached_hit_rate_uniform_T8192"] = _cache(prefill, "cached", "hit_rate")
    return keys


def _disk(phase: dict | None, kind: str, field: str):
    return None if phase is None else ((phase.get("disk_tiers") or {}).get(kind) or {}).get(field)


def disk_keys(decode64: dict | None, prefill: dict | None) -> dict:
    """Per RAM cache fraction: disk (real text, prefetched) against device (decode: ``device_eager``, the
    eager step the disk step is; prefill: ``device``) and against ``host_prefetch_realtext`` (decode: a graph
    replay), paired per round, and its tiers' figures per phase; ``device_eager`` against the graph replays."""
    keys = {"device_eager_vs_device_decode_T64_pct": _pair(decode64, "device_eager", "device")}
    for tag, name in zip(DISK_TAGS, DISK_VARIANTS):
        kind = f"disk_realtext_{tag}"
        for label, phase, device in (("decode_T64", decode64, "device_eager"), ("prefill_T8192", prefill, "device")):
            keys[f"disk_vs_device_{label}_realtext_{tag}_pct"] = _pair(phase, name, device)
            keys[f"disk_vs_device_{label}_realtext_{tag}_ci95_pct"] = _pair(phase, name, device, field="ci95_pct")
            keys[f"disk_vs_host_{label}_realtext_{tag}_pct"] = _pair(phase, name, "host_prefetch_realtext")
        for tokens, phase in ((64, decode64), (8192, prefill)):
            for key, field in (("disk_hbm_hit_rate", "hbm_hit_rate"), ("disk_ram_hit_rate", "ram_hit_rate"),
                               ("disk_reads_per_step", "disk_reads_per_step")):
                keys[f"{key}_realtext_{tag}_T{tokens}"] = _disk(phase, kind, field)
    return keys
