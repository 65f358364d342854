"""The step benchmark's figures (``bench_step.py``): each variant's spread, its steps paired per round with
``device``'s (or ``none``'s) and the 95% interval of that median, and the headline keys of the report."""

from __future__ import annotations

import math
import statistics

HOST_PREFETCHED = ("host_prefetch", "host_prefetch_late", "host_kv_ahead")  # the host key's best of these


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
        "layer_us_T64": report.get("layer_us", {}).get("64"),
        "layer_us_T8192": report.get("layer_us", {}).get("8192"),
    }
