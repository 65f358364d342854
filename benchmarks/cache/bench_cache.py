"""Cached-placement benchmark (GPU, one call): placements "host", "cached" and "device" at
V4.1-Flash row shape on real-text ids.

Table: 128 Mi random rows (256 E4M3 values + 8 UE8M0 scales, packed 272 B; 34 GiB pinned, as
bench_host.py builds it), read 24 columns per token. ``cached`` and ``device`` serve the same
rows (``cached`` over the host table's pinned rows, ``device`` a copy in HBM).

Ids: held-out English prose, ``fortunes`` (``real_text.py stream``'s token ids, hashed here at
V4.1's layer 1 and folded into the table's rows, ``id % rows``, as bench_host.py folds them).
The stream is cut into steps of 8192 tokens, served in order, the cache updated between steps
(``update_cache``, the placement's ``policy``: ``Sizes.policy``, its default ``set-lru``) and starting **empty**: no hot
set, nothing built from the text it is measured on. The first half of the steps only warm the
cache; the hit rate and the host bytes are counted on the second half (each step's reads against
the content the preceding steps left). Cache size: 2% of the rows of V4.1's real layer-1 table
(384,006,168 rows: 7.68 M slots, 2.1 GB of HBM), since the folded stream keeps its distinct rows
(how many merged is reported) and so behaves as on the real table.

Timed, on the last step's ids (before that step's update): one lookup at T in {64, 1024, 8192}
per placement, wall clock from the call to its rows on the device (synchronized; "host" and
"cached" at T = 8192 take their host gather path, which needs the host clock), median; and device
time (CUDA events, graph replays up to T = 1024) for the paths that run on the device alone. Each
lookup is checked equal to "device" bit for bit, as is every measured step's cached lookup.

Host bytes: the rows each placement's lookup moves from host memory, counted as its path moves
them (:func:`moved_rows`): the host gather (lookups over ``direct_max_rows`` rows) fetches each
distinct row once (the dedup's count; ``cached`` asks only for its misses, plus the zero row that
stands in for hits), the direct reads fetch every read row that is not cached. The headline
``cached_host_bytes_ratio`` is cached / host over the measured steps (each step's lookup against the
content the steps before it left). Per stage of ``cached``'s host-gather path at T = 8192
(``stages_T8192``): probe, dedup of the miss ids, host gather (dedup + ids to the host + gather +
copies, wall clock), merge; and the host gather of ``host`` on all the ids, for comparison. And
``cached`` at T = 8192 with a share of its misses read directly from host memory while the host
gathers the rest (``direct_share`` in {0.25, 0.4, 0.55}; the placement's default is 0).

Writes ``cache-h200.json`` to ``$OUT`` (or benchmarks/results/) and prints a table, and a
markdown table for docs/placements.md.

    PYTHONPATH=src ENGRAM_COMMIT=<sha> python benchmarks/cache/bench_cache.py
    PYTHONPATH=src TRITON_INTERPRET=1 python benchmarks/cache/bench_cache.py --smoke   # CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import engram  # noqa: E402
from common import COLUMNS, HEAD_DIM, ROW_BYTES_ON_DISK, fold_ids  # noqa: E402
from engram.tools.cache_policy import CompactStream, DynamicParams, replay  # noqa: E402
from real_text import STREAM_PATH, load_stream, synthetic_stream  # noqa: E402

V41_LAYER1_ROWS = 384_006_168
PLACEMENTS = ("host", "cached", "device")


@dataclass(frozen=True)
class Sizes:
    rows: int  # rows of the benchmark table
    tokens: tuple[int, ...]  # lookup sizes timed
    step_tokens: int  # tokens per engine step (update_cache between steps)
    cache_rows: int  # cache slots asked for
    max_stream_tokens: int | None  # tokens of the stream used (None: all)
    ways: int = 8
    aging_interval: int = 16
    policy: str = "set-lru"  # the placement's default (the run of 2026-11-30 at e5e4c42: "dynamic", aging 8, ties refused)
    direct_max_rows: int | None = None  # the placements' switch to the host gather (None: their default)


FULL = Sizes(rows=128 * 2**20, tokens=(64, 1024, 8192), step_tokens=8192, cache_rows=int(0.02 * V41_LAYER1_ROWS),
             max_stream_tokens=None)
# The smoke sends its largest lookups (T = 64, the steps) through the host-gather path, as T = 8192 goes.
SMOKE = Sizes(rows=20_000, tokens=(1, 16, 64), step_tokens=64, cache_rows=400, max_stream_tokens=64 * 10,
              direct_max_rows=16 * COLUMNS)


# ---- the stream -----------------------------------------------------------------
def stream_steps(sizes: Sizes) -> tuple[np.ndarray, dict]:
    """``(ids int32 [steps, step_tokens, 24] in [0, rows), facts)``; a partial last step is dropped."""
    if STREAM_PATH.is_file():
        ids, corpus = load_stream(STREAM_PATH, max_tokens=sizes.max_stream_tokens)
    else:
        if sizes is FULL:
            raise SystemExit(f"no {STREAM_PATH}: run `PYTHONPATH=src python benchmarks/real_text.py stream` on a "
                             "machine with the DeepSeek-V4 tokenizer and carry .bench-data")
        print(f"no {STREAM_PATH}: a synthetic Zipf stream instead", flush=True)
        ids, corpus = synthetic_stream(sizes.max_stream_tokens, V41_LAYER1_ROWS, COLUMNS), "synthetic-zipf"
    steps = len(ids) // sizes.step_tokens
    ids = ids[:steps * sizes.step_tokens]
    folded = fold_ids(ids, sizes.rows)
    distinct, distinct_folded = np.unique(ids).size, np.unique(folded).size
    facts = {"corpus": corpus, "stream_tokens": len(ids), "steps": steps, "step_tokens": sizes.step_tokens,
             "distinct_rows": int(distinct), "fold_merged_rows_pct": 100 * (distinct - distinct_folded) / distinct}
    return folded.reshape(steps, sizes.step_tokens, COLUMNS), facts


# ---- what a cache could serve on the held-out steps (CPU) -----------------------
# The stream is split into steps of ``step_reads`` reads; the first ``warm_steps`` only warm the
# cache, the rest are measured. For the measured steps: heldout_ceiling, the share of reads whose
# row was read in an earlier step (warm-up included: no cache that learns only from the stream
# served so far can serve more); best_static_share, the share the ``capacity`` most-read rows of
# the measured steps themselves would serve (an oracle, chosen on the text it is scored on);
# simulated_hit_rates, ``engram.tools.cache_policy`` replays (the fully associative ``lru``, and
# ``set-lru`` and ``dynamic`` with the device cache's parameters: the rules the device index
# follows), warm-up excluded.
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


# ---- the tables -----------------------------------------------------------------
def build_tables(sizes: Sizes, on_gpu: bool) -> dict[str, engram.EngramTable]:
    options = {"cache_fraction": min(1.0, sizes.cache_rows / sizes.rows), "ways": sizes.ways,
               "aging_interval": sizes.aging_interval, "policy": sizes.policy}
    if on_gpu:
        from common import host_table, table_over_rows

        host = host_table(sizes.rows)
        tables = {"host": host, "cached": table_over_rows(host, "cached", **options),
                  "device": table_over_rows(host, "device")}
    else:
        # CPU (TRITON_INTERPRET=1): "cached" on CPU tensors, its Triton kernels under the interpreter; placement
        # "cpu" stands in for "device"; no "host".
        generator = torch.Generator().manual_seed(0)
        values = torch.randint(0, 0x7F, (sizes.rows, HEAD_DIM), dtype=torch.uint8, generator=generator)
        scales = torch.randint(0, 0x7F, (sizes.rows, HEAD_DIM // 32), dtype=torch.uint8, generator=generator)
        tables = {"cached": engram.EngramTable(values, scales, placement="cached", device="cpu", validate=False,
                                               backend="triton", placement_options=options),
                  "device": engram.EngramTable(values, scales, placement="cpu", validate=False)}
    if sizes.direct_max_rows is not None:
        for name in ("host", "cached"):
            if name in tables:
                tables[name].storage.direct_max_rows = sizes.direct_max_rows
    return tables


def direct_max_rows(tables, name: str) -> int:
    """The row count up to which placement ``name`` reads host memory directly (host's default when absent)."""
    if name in tables:
        return tables[name].storage.direct_max_rows
    from engram.table.placements.host import DIRECT_MAX_ROWS

    return tables["cached"].storage.direct_max_rows if "cached" in tables else DIRECT_MAX_ROWS


def moved_rows(tables, ids: torch.Tensor, rows: int) -> dict:
    """Host rows the lookup of ``ids [T, 24]`` (in ``[0, rows)``) moves with the cache's current content, per
    placement, counted as its path moves them: over ``direct_max_rows`` rows the host gather's distinct rows
    (its dedup's count: ``host`` on the ids, ``cached`` on its miss ids, whose hits all read the zero row),
    else the direct reads of every row not held (``host``: every read). Runs the placement's own probe and
    dedup; one host sync."""
    from engram.table.kernels.cache_gather import cached_probe
    from engram.table.kernels.dedup import distinct_rows

    cache = tables["cached"].storage.cache
    _, miss = cached_probe(cache, rows, ids, 0)
    counts = {}
    if ids.numel() > direct_max_rows(tables, "cached"):
        counts["cached"] = distinct_rows(miss, 0, rows).rows_and_count[-1]
    else:
        counts["cached"] = (miss >= 0).sum()
    if ids.numel() > direct_max_rows(tables, "host"):
        counts["host"] = distinct_rows(ids, 0, rows).rows_and_count[-1]
    else:
        counts["host"] = torch.tensor(ids.numel())
    return {name: int(count) for name, count in counts.items()}


def same_rows(a: engram.EngramTable, b: engram.EngramTable, ids: torch.Tensor, on_gpu: bool) -> bool:
    """Bit-for-bit equal lookups (bf16 on the GPU; FP8 bytes on the CPU, where the interpreter's bf16 cast
    differs from torch's)."""
    if on_gpu:
        return torch.equal(a.lookup(ids).view(torch.int16), b.lookup(ids).view(torch.int16))
    (av, asc), (bv, bsc) = a.lookup_packed(ids), b.lookup_packed(ids)
    return torch.equal(av.view(torch.uint8), bv.view(torch.uint8)) and torch.equal(asc, bsc)


# ---- serving the stream ---------------------------------------------------------
def serve_steps(tables, steps: np.ndarray, device: str, on_gpu: bool) -> dict:
    """Warm the cache on the first half of the steps but the last, count on the rest; the last
    step's update is left to :func:`finish_last_step` (its ids are timed first)."""
    cached = tables["cached"]
    cache = cached.storage.cache
    warm_steps = (len(steps) - 1) // 2
    started = time.perf_counter()
    for k in range(warm_steps):
        cached.update_cache(torch.from_numpy(steps[k]).to(device))
    cache.stats.zero_()
    mismatches = 0
    moved = {"cached": 0, "host": 0}
    for k in range(warm_steps, len(steps) - 1):
        ids = torch.from_numpy(steps[k]).to(device)
        mismatches += not same_rows(cached, tables["device"], ids, on_gpu)
        for name, count in moved_rows(tables, ids, len_rows(tables)).items():
            moved[name] += count
        cached.update_cache(ids)
    if on_gpu:
        torch.cuda.synchronize()
    return {"warm_steps": warm_steps, "measured_steps": len(steps) - warm_steps, "steps_not_equal": mismatches,
            "serve_seconds": time.perf_counter() - started, "moved_rows_but_last_step": moved}


def len_rows(tables) -> int:
    return tables["cached"].num_rows


def finish_last_step(tables, steps: np.ndarray, device: str, serve: dict) -> dict:
    """The last step's moved rows and update, then the counts of every measured step (stats since the
    warm-up; moved rows as each placement's path moves them, :func:`moved_rows`)."""
    cached = tables["cached"]
    ids = torch.from_numpy(steps[-1]).to(device)
    moved = dict(serve["moved_rows_but_last_step"])
    for name, count in moved_rows(tables, ids, len_rows(tables)).items():
        moved[name] += count
    cached.update_cache(ids)
    reads, hits, distinct, distinct_missed = (int(v) for v in cached.storage.cache.stats.tolist())
    return {"reads": reads, "hits": hits, "distinct_rows_per_step_sum": distinct,
            "distinct_missed_per_step_sum": distinct_missed, "hit_rate": hits / reads,
            "distinct_missed_ratio": distinct_missed / distinct,
            "moved_rows_cached": moved["cached"], "moved_rows_host": moved["host"],
            "host_bytes_ratio": moved["cached"] / moved["host"]}


# ---- timing ---------------------------------------------------------------------
def cpu_us(call, repeats: int = 5) -> float:
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def time_lookups(tables, last_step: np.ndarray, sizes: Sizes, device: str, on_gpu: bool) -> list[dict]:
    rows = []
    for tokens in sizes.tokens:
        ids = torch.from_numpy(np.ascontiguousarray(last_step[:tokens])).to(device)
        hit, _ = tables["cached"].storage.cache.probe(ids.reshape(-1).to(torch.int64), sizes.rows)
        distinct = torch.unique(ids)
        distinct_hit = tables["cached"].storage.cache.probe(distinct.to(torch.int64), sizes.rows)[0]
        moved = moved_rows(tables, ids, sizes.rows)
        row = {"T": tokens, "reads": ids.numel(), "hit_rate": float(hit.float().mean()),
               "distinct_rows": distinct.numel(), "distinct_rows_hit": float(distinct_hit.float().mean()),
               "cached_path": "host_gather" if ids.numel() > direct_max_rows(tables, "cached") else "one_kernel",
               "host_path": "host_gather" if ids.numel() > direct_max_rows(tables, "host") else "direct",
               "moved_rows_cached": moved["cached"], "moved_rows_host": moved["host"],
               "host_bytes_ratio": moved["cached"] / moved["host"],
               "unique_bytes": distinct.numel() * ROW_BYTES_ON_DISK}
        for name, table in tables.items():
            row[f"{name}_equal_to_device"] = same_rows(table, tables["device"], ids, on_gpu)
            if on_gpu:
                from common import median_wall_us

                row[f"{name}_us"] = median_wall_us(lambda: table.lookup(ids), repeats=20 if tokens >= 8192 else 50)
                on_device_only = name == "device" or ids.numel() <= direct_max_rows(tables, name)
                if on_device_only:
                    from common import gpu_us

                    row[f"{name}_device_us"] = gpu_us(lambda: table.lookup(ids), graph=tokens <= 1024)
            else:
                row[f"{name}_us"] = cpu_us(lambda: table.lookup(ids))
        if "host" in tables:
            row["cached_speedup_vs_host"] = row["host_us"] / row["cached_us"]
        if row["cached_path"] == "host_gather":
            if on_gpu:
                row["stages"] = stage_breakdown(tables, ids, sizes.rows)
            row["direct_share_sweep"] = direct_share_sweep(tables, ids, sizes.rows, on_gpu)
        rows.append(row)
    return rows


DIRECT_SHARES = (0.25, 0.4, 0.55)


def direct_share_sweep(tables, ids: torch.Tensor, rows: int, on_gpu: bool) -> dict:
    """``cached``'s host-gather path with a share of its misses read directly (``CachedPlacement.direct_share``):
    per share, the lookup's latency (as timed above), whether it equals "device", the distinct rows the host
    gather moves and the reads the direct kernel makes."""
    from engram.table.kernels.cache_gather import cached_probe
    from engram.table.kernels.dedup import distinct_rows

    storage = tables["cached"].storage
    default = storage.direct_share
    sweep = {}
    try:
        for share in DIRECT_SHARES if on_gpu else DIRECT_SHARES[1:2]:  # the interpreter: one, for its checks
            storage.direct_share = share
            slot, miss = cached_probe(storage.cache, rows, ids, 0, direct_share=share)
            entry = {"equal_to_device": same_rows(tables["cached"], tables["device"], ids, on_gpu),
                     "gathered_rows": int(distinct_rows(miss, 0, rows).rows_and_count[-1]),
                     "direct_reads": int((slot <= -2).sum())}
            if on_gpu:
                from common import median_wall_us

                entry["us"] = median_wall_us(lambda: tables["cached"].lookup(ids), repeats=20)
            else:
                entry["us"] = cpu_us(lambda: tables["cached"].lookup(ids), repeats=1)
            sweep[str(share)] = entry
    finally:
        storage.direct_share = default
    return sweep


def stage_breakdown(tables, ids: torch.Tensor, rows: int) -> dict:
    """Per stage of ``cached``'s host-gather path on ``ids`` (GPU): device time of the probe, of the dedup of
    its miss ids and of each merge kernel; wall clock of the host gather of the misses (dedup, ids to the
    host, worker's gather, copies) and of ``host``'s host gather of all the ids."""
    from common import gpu_us, median_wall_us

    from engram.table.kernels.cache_gather import checked_merge_rows, checked_merge_rows_packed, cached_probe
    from engram.table.kernels.dedup import distinct_rows

    storage = tables["cached"].storage
    cache, host_gather = storage.cache, storage.host.host_gather
    slot, miss = cached_probe(cache, rows, ids, 0)

    def gather(pipeline, gather_ids):
        def run():
            stream = torch.cuda.current_stream()
            staged, inverse = pipeline.finish(pipeline.start(gather_ids, 0, stream), stream)
            pipeline.consumed(stream)
            return staged, inverse
        return run

    stages = {"probe_device_us": gpu_us(lambda: cached_probe(cache, rows, ids, 0)),
              "dedup_misses_device_us": gpu_us(lambda: distinct_rows(miss, 0, rows)),
              "host_gather_misses_wall_us": median_wall_us(gather(host_gather, miss), repeats=20)}
    staged, inverse = gather(host_gather, miss)()
    back = storage.backing
    stages["merge_bf16_device_us"] = gpu_us(lambda: checked_merge_rows(ids, 0, *back, staged, inverse, cache=cache,
                                                                       slot=slot))
    stages["merge_packed_device_us"] = gpu_us(lambda: checked_merge_rows_packed(ids, 0, *back, staged, inverse,
                                                                                cache=cache, slot=slot))
    host_gather.consumed(torch.cuda.current_stream())
    if "host" in tables:
        stages["host_gather_all_ids_wall_us"] = median_wall_us(gather(tables["host"].storage.host_gather, ids),
                                                               repeats=20)
    torch.cuda.synchronize()
    return stages


# ---- the report -----------------------------------------------------------------
def print_table(timings: list[dict], placements) -> None:
    print(f"{'T':>6} | " + " | ".join(f"{p + ' us':>12}" for p in placements)
          + " | hit rate | host bytes kept | cached path")
    for row in timings:
        print(f"{row['T']:>6} | " + " | ".join(f"{row[p + '_us']:12.1f}" for p in placements)
              + f" | {row['hit_rate']:8.1%} | {row['host_bytes_ratio']:15.1%} | {row['cached_path']}")
        if "stages" in row:
            print("       stages: " + ", ".join(f"{k} {v:.1f}" for k, v in row["stages"].items()))
        for share, entry in row.get("direct_share_sweep", {}).items():
            print(f"       direct share {share}: cached {entry['us']:.1f} us, host gather {entry['gathered_rows']} "
                  f"rows + {entry['direct_reads']} direct reads, equal to device: {entry['equal_to_device']}")


def markdown_table(report: dict, placements) -> str:
    """The table of docs/placements.md (lookup latency, us, synchronized wall clock)."""
    lines = ["| T (tokens x 24 rows) | " + " | ".join(f"`{p}`" for p in placements)
             + " | cached vs host | hit rate (this step) | host bytes, cached / host |",
             "| --- | " + " | ".join("---" for _ in placements) + " | --- | --- | --- |"]
    for row in report["timings"]:
        speedup = f"{row['cached_speedup_vs_host']:.2f}x" if "cached_speedup_vs_host" in row else "n/a"
        lines.append(f"| {row['T']} | " + " | ".join(f"{row[p + '_us']:.1f} us" for p in placements)
                     + f" | {speedup} | {row['hit_rate']:.1%} | {row['host_bytes_ratio']:.1%} |")
    counted = report["measured"]
    lines.append("")
    lines.append(f"{report['device']}, {report['stream']['corpus']} (held out; cache warmed by the "
                 f"{report['cache']['policy']} policy "
                 f"over the stream's first {report['serve']['warm_steps']} steps of {report['stream']['step_tokens']} "
                 f"tokens, counted on the next {report['serve']['measured_steps']}): "
                 f"{counted['hit_rate']:.1%} of row reads served from HBM with {_cache_size(report)} cached "
                 f"(ceiling {report['heldout_ceiling']:.1%}, best static set {report['best_static_share']:.1%}"
                 f"{_oracle_note(report)}); "
                 f"host rows moved (as each path moves them: distinct rows per step through the host gather) "
                 f"{counted['host_bytes_ratio']:.1%} of `host`'s.")
    return "\n".join(lines)


def _oracle_note(report: dict) -> str:
    """Why the best static set may be 100%: the measured steps read no more rows than the cache holds."""
    distinct = report.get("measured_distinct_rows")
    if distinct is None or distinct > report["cache"]["slots"]:
        return ""
    return (f": the measured steps read {distinct:,} distinct rows, all of which fit in the "
            f"{report['cache']['slots']:,} slots")


def _cache_size(report: dict) -> str:
    cache = report["cache"]
    if report["smoke"]:
        return f"{cache['fraction_of_table']:.0%} of the table's rows ({cache['slots']:,} slots)"
    return f"{cache['fraction_of_v41_layer1_table']:.0%} of a V4.1 table's rows ({cache['slots']:,} slots)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU under TRITON_INTERPRET=1, or a GPU)")
    parser.add_argument("--simulate", action="store_true",
                        help="also replay the stream through engram.tools.cache_policy's lru, set-lru and dynamic (CPU)")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA device; on the CPU run it with --smoke and TRITON_INTERPRET=1")
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke without CUDA: placement 'cached' runs only under TRITON_INTERPRET=1")
    device = "cuda" if on_gpu else "cpu"
    started = time.perf_counter()
    steps, stream_facts = stream_steps(sizes)
    print(f"stream: {stream_facts}", flush=True)
    tables = build_tables(sizes, on_gpu)
    placements = [p for p in PLACEMENTS if p in tables]
    cache = tables["cached"].storage.cache
    serve = serve_steps(tables, steps, device, on_gpu)
    timings = time_lookups(tables, steps[-1], sizes, device, on_gpu)
    measured = finish_last_step(tables, steps, device, serve)
    reads = steps.reshape(-1)
    step_reads = sizes.step_tokens * COLUMNS
    report = {"device": torch.cuda.get_device_name() if on_gpu else "cpu (TRITON_INTERPRET=1)",
              "torch": torch.__version__, "triton": _triton_version(),
              "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "smoke": args.smoke, "sizes": asdict(sizes), "stream": stream_facts,
              "cache": {"slots": cache.num_slots, "ways": cache.ways, "sets": cache.num_sets,
                        "fraction_of_table": cache.num_slots / sizes.rows,
                        "fraction_of_v41_layer1_table": cache.num_slots / V41_LAYER1_ROWS, "hbm_bytes": cache.nbytes,
                        "policy": tables["cached"].storage.policy, "start": "empty (no hot set)"},
              "serve": serve, "measured": measured, "timings": timings,
              "heldout_ceiling": heldout_ceiling(reads, step_reads, serve["warm_steps"]),
              "best_static_share": best_static_share(reads, step_reads, serve["warm_steps"], cache.num_slots),
              "measured_distinct_rows": measured_distinct_rows(reads, step_reads, serve["warm_steps"])}
    last = {row["T"]: row for row in timings}[max(sizes.tokens)]
    report["hit_rate_2pct_heldout"] = measured["hit_rate"]
    report["cached_host_bytes_ratio"] = measured["host_bytes_ratio"]
    report[f"cached_host_bytes_ratio_T{max(sizes.tokens)}"] = last["host_bytes_ratio"]
    for name in placements:
        report[f"{name}_T{max(sizes.tokens)}_us"] = last[f"{name}_us"]
    if "stages" in last:
        report[f"stages_T{max(sizes.tokens)}"] = last["stages"]
    if "direct_share_sweep" in last:
        report[f"cached_T{max(sizes.tokens)}_us_by_direct_share"] = {
            share: entry["us"] for share, entry in last["direct_share_sweep"].items()}
    if args.simulate:
        report["simulated"] = simulated_hit_rates(reads, step_reads, serve["warm_steps"], cache.num_slots,
                                                  device_cache_params(sizes.ways, sizes.aging_interval))
    report["seconds"] = time.perf_counter() - started
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else (
        Path(tempfile.gettempdir()) if args.smoke else BENCHMARKS / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("cache-smoke.json" if args.smoke else "cache-h200.json")
    out.write_text(json.dumps(report, indent=2))
    print_table(timings, placements)
    print(f"\n{markdown_table(report, placements)}\n")
    headline = [k for k in report if k.endswith("_us") or k.startswith(("cached_host_bytes_ratio", "stages_"))
                or k.endswith("_by_direct_share")
                or k in ("hit_rate_2pct_heldout", "heldout_ceiling", "best_static_share", "seconds")]
    print(json.dumps({k: report[k] for k in headline} | {"simulated": report.get("simulated")}, indent=1))
    print(f"wrote {out}")
    failures = serve["steps_not_equal"] + sum(not v for row in timings for k, v in row.items()
                                              if k.endswith("_equal_to_device"))
    failures += sum(not entry["equal_to_device"] for row in timings
                    for entry in row.get("direct_share_sweep", {}).values())
    if failures:
        raise SystemExit(f"{failures} lookups differ from placement 'device'")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"
    return triton.__version__


if __name__ == "__main__":
    main()
