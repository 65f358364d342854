"""Figures for choosing placement ``"cached"``'s ``cache_fraction`` (``engram profile size``).

Per policy, cached fraction and step size (``step_tokens``): the hit rate of the replay
(:func:`engram.tools.profile.replay_streams`, the very figures ``profile eval`` gives), the HBM
the cache takes (a :class:`~engram.table.placements.row_cache.RowCache` made on the ``meta``
device, as the placement makes it: its ``nbytes`` and the work buffers of its update), and the
host bytes per step that its misses leave, beside placement ``"host"``'s (every row read from
host memory). A step's host rows are counted twice: ``host_bytes_per_step``, deduplicated per
step (what the host gather moves), and ``host_read_bytes_per_step``, every missed read (what the
one-kernel path of small lookups reads); both at :func:`~engram.table.host_memory.rows.packed_row_bytes`
per row, averaged over the trace's steps. ``smallest_fraction`` searches the fraction that
reaches a target hit rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from engram.layout import EngramLayout
from engram.tools.cache_policy import DynamicParams, capacity_for
from engram.tools.profile import HotSet, Trace, corpus_warnings, prepare_streams, replay_streams

__all__ = ["DEFAULT_SIZE_FRACTIONS", "DEFAULT_SIZE_STEP_TOKENS", "SizeReport", "layer_cache_bytes", "size_report",
           "smallest_fraction", "candidate_fractions"]

DEFAULT_SIZE_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1)
DEFAULT_SIZE_STEP_TOKENS = (64, 8192)
"""A decode step of a batch of 64 requests and a prefill step of 8192 tokens."""
UPDATED_POLICIES = ("set-lru", "dynamic")  # policies whose update_cache runs (and keeps work buffers)


@dataclass
class SizeReport:
    """``figures``: the JSON-able result (:func:`size_report`); ``warnings``: sentences for stderr."""

    figures: dict
    warnings: list[str] = field(default_factory=list)


def layer_cache_bytes(layout: EngramLayout, fraction: float, policy: str, step_tokens: int,
                      ways: int = DynamicParams.ways) -> list[dict]:
    """Per layer index, the HBM of placement ``"cached"``'s cache of ``fraction`` of the layer's rows:
    ``slots``, ``cache_bytes`` (``RowCache.nbytes``: slots of packed rows, tags, counters),
    ``update_bytes`` (the work buffers its update makes for steps of ``step_tokens`` tokens; 0 for
    ``static``, which never updates; None where Triton, which they belong to, is not installed)
    and ``hbm_bytes`` (their sum, or ``cache_bytes`` alone). Made on the ``meta`` device: nothing is
    allocated."""
    import torch

    from engram.table.placements.row_cache import RowCache

    layers = []
    for rows in layout.num_embeddings:
        # The placement's slot count (CachedPlacement: max(1, int(rows * cache_fraction))).
        cache = RowCache(capacity_for(fraction, int(rows)), layout.spec.head_dim, "meta", ways=ways,
                         recency=policy == "set-lru")
        update = 0
        if policy in UPDATED_POLICIES:
            try:
                buffers = cache.admission_buffers(step_tokens * layout.spec.num_columns)
            except ImportError:  # the update kernels' module needs Triton
                update = None
            else:
                update = sum(t.numel() * t.element_size() for t in vars(buffers).values()
                             if isinstance(t, torch.Tensor))
        layers.append({"slots": cache.num_slots, "cache_bytes": cache.nbytes, "update_bytes": update,
                       "hbm_bytes": cache.nbytes + (update or 0)})
    return layers


def candidate_fractions(low: float, high: float) -> list[float]:
    """The fractions of two significant digits in ``(low, high)``, ascending (``0 < low < high``)."""
    values = set()
    exponent = math.floor(math.log10(low))
    while 10.0 ** exponent < high:
        for mantissa in range(10, 100):
            value = float(f"{mantissa}e{exponent - 1}")
            if low < value < high:
                values.add(value)
        exponent += 1
    return sorted(values)


def smallest_fraction(listed: list[dict], target: float, evaluate_at: Callable[[float], dict]) -> dict:
    """The smallest fraction whose hit rate reaches ``target``, given ``listed`` entries (``fraction``,
    ``hit_rate``; ascending fractions) and ``evaluate_at(fraction)`` (an entry for any fraction up to
    the largest listed). Below the first listed fraction that reaches it, down to the listed one before,
    a bisection over :func:`candidate_fractions` (hit rate taken to grow with the fraction). Returns
    ``{"reached", "searched", "entry"}``: ``entry`` the answer's figures (``reached`` False: the largest
    listed fraction's), ``searched`` False when the answer is the smallest listed fraction (a smaller one
    may reach it too)."""
    reaching = [i for i, entry in enumerate(listed) if entry["hit_rate"] >= target]
    if not reaching:
        return {"reached": False, "searched": False, "entry": listed[-1]}
    first = reaching[0]
    if first == 0:
        return {"reached": True, "searched": False, "entry": listed[0]}
    candidates = candidate_fractions(listed[first - 1]["fraction"], listed[first]["fraction"])
    best, lo, hi = listed[first], 0, len(candidates)   # candidates[hi:] reach the target (assumed)
    while lo < hi:
        middle = (lo + hi) // 2
        entry = evaluate_at(candidates[middle])
        if entry["hit_rate"] >= target:
            best, hi = entry, middle
        else:
            lo = middle + 1
    return {"reached": True, "searched": True, "entry": best}


def size_report(trace: Trace, layout: EngramLayout, fractions, policies, step_tokens, *, hot: HotSet | None = None,
                target_hit_rate: float | None = None, params: DynamicParams = DynamicParams(),
                progress: bool = False) -> SizeReport:
    """The figures of ``trace`` under each policy at each fraction, for each step size in ``step_tokens``.
    ``figures``: ``row_bytes``, ``ways``, ``host`` (one entry per step size: placement ``"host"``'s bytes),
    ``sizes`` (one entry per step size, policy and fraction, in that order; per layer id under ``layers``)
    and, with ``target_hit_rate``, ``targets`` (one per step size and policy: :func:`smallest_fraction`)."""
    from engram.table.host_memory.rows import packed_row_bytes

    fractions = sorted(set(fractions))
    row_bytes = packed_row_bytes(layout.spec.head_dim)
    figures = {"tokens": trace.tokens, "files": trace.files, "layer_ids": list(layout.spec.layer_ids),
               "row_bytes": row_bytes, "ways": params.ways, "fractions": fractions, "policies": list(policies),
               "step_tokens": list(step_tokens), "host": [], "sizes": []}
    if target_hit_rate is not None:
        figures.update(target_hit_rate=target_hit_rate, targets=[])
    warnings = []
    for tokens in step_tokens:
        streams = prepare_streams(trace, layout, fractions, policies, hot=hot, step_tokens=tokens, progress=progress)
        steps = streams[0].num_steps
        figures["host"].append(_host_entry(streams, layout, tokens, row_bytes))

        def entries(at: list[float], chosen: list[str], streams=streams, tokens=tokens, steps=steps) -> list[dict]:
            results = replay_streams(streams, layout, at, chosen, hot=hot, params=params, progress=progress)
            return [_size_entry(result, layout, tokens, steps, row_bytes, params.ways) for result in results]

        sizes = entries(fractions, list(policies))
        warnings += corpus_warnings(trace, [entry["eval"] for entry in sizes], tokens)
        figures["sizes"] += sizes
        for policy in (policies if target_hit_rate is not None else ()):
            listed = [entry for entry in sizes if entry["policy"] == policy]
            answer = smallest_fraction(listed, target_hit_rate, lambda f, p=policy: entries([f], [p])[0])
            figures["targets"].append({"policy": policy, "step_tokens": tokens, **answer})
    return SizeReport(figures, list(dict.fromkeys(warnings)))


def _host_entry(streams, layout: EngramLayout, step_tokens: int, row_bytes: int) -> dict:
    """Placement ``"host"``: every row of every step from host memory (deduplicated per step, and not)."""
    steps = streams[0].num_steps
    layers = {str(layer_id): {"host_bytes_per_step": len(stream.step_ids) * row_bytes / steps,
                              "host_read_bytes_per_step": stream.num_reads * row_bytes / steps}
              for layer_id, stream in zip(layout.spec.layer_ids, streams)}
    return {"step_tokens": step_tokens, "steps": steps, **_summed(layers), "layers": layers}


def _size_entry(result: dict, layout: EngramLayout, step_tokens: int, steps: int, row_bytes: int, ways: int) -> dict:
    """One (policy, fraction, step size): hit rate, HBM and host bytes per step; ``eval``: the replay's dict."""
    policy, fraction = result["policy"], result["fraction"]
    layers = {}
    for layer_id, hbm in zip(layout.spec.layer_ids, layer_cache_bytes(layout, fraction, policy, step_tokens, ways)):
        replayed = result["layers"][str(layer_id)]
        missed_rows = replayed["fetches"] - replayed["fetch_hits"]   # distinct per step, summed over steps
        missed_reads = replayed["reads"] - replayed["hits"]
        layers[str(layer_id)] = {"hit_rate": replayed["hit_rate"], **hbm,
                                 "host_bytes_per_step": missed_rows * row_bytes / steps,
                                 "host_read_bytes_per_step": missed_reads * row_bytes / steps}
    update = [layer["update_bytes"] for layer in layers.values()]
    return {"policy": policy, "fraction": fraction, "step_tokens": step_tokens, "steps": steps,
            "hit_rate": result["hit_rate"], "ceiling": result["ceiling"],
            "cache_bytes": sum(layer["cache_bytes"] for layer in layers.values()),
            "update_bytes": None if None in update else sum(update),
            "hbm_bytes": sum(layer["hbm_bytes"] for layer in layers.values()),
            **_summed(layers), "layers": layers, "eval": result}


def _summed(layers: dict) -> dict:
    return {key: sum(layer[key] for layer in layers.values())
            for key in ("host_bytes_per_step", "host_read_bytes_per_step")}
