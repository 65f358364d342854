"""Placement "disk" lookups on a GPU, beside placement "host" over the same number of rows (on a machine
without CUDA: on the CPU, beside placement "cpu", a smoke run).

Makes (or reuses, as ``bench_disk.py`` does) a row file of ``--gib`` GiB of random rows at V4.1-Flash row
shape (272-byte rows, 24 columns a token) in ``--directory``, serves it as placement ``"disk"`` on ``cuda``
(a RAM cache of ``--ram-cache-fraction`` of its rows, ``--read-threads`` reader threads), and builds a
placement ``"host"`` table of as many random rows (the baseline: same ids, same bytes a row). For each
id stream (``uniform`` random ids; ``realtext``: held-out English prose hashed at V4.1's layer 1, folded
into the table's rows, read in order from ``.bench-data/`` when carried) and each ``--tokens`` T, steps
of T tokens in order:

* ``prefetched``: ``prefetch(ids)``, ``--gap-ms`` of host time (the layers before the Engram layer), then
  ``lookup(ids, prefetch=...)``: microseconds from the lookup's call to its rows on the device (what the
  step waits for);
* ``direct``: ``lookup(ids)`` alone, call to rows on the device;
* the RAM cache's hit rate over the measured steps (distinct ids of each lookup) and the disk reads a
  second they reached.

The first ``--warm-steps`` steps of each stream fill the RAM cache and are not timed. Prints a table with
``disk_vs_host`` (median disk time / median host time, same column) and writes ``disk-lookup-<device>.json``
to ``$OUT`` (or benchmarks/results/): device, torch/Triton versions, commit, date.

    PYTHONPATH=src ENGRAM_COMMIT=<sha> python benchmarks/disk/bench_disk_lookup.py --gib 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import engram  # noqa: E402
from bench_disk import make_row_file  # noqa: E402
from engram.table.fp8 import BLOCK_SIZE  # noqa: E402
from engram.table.placements.disk import ROW_FILE_ATTRIBUTE  # noqa: E402

COLUMNS, HEAD_DIM = 24, 256


def disk_table(row_file, fraction: float, read_threads: int, device: torch.device) -> engram.EngramTable:
    """Placement "disk" over ``row_file`` on ``device`` (placeholders carrying the checked row file, as its
    loader makes them)."""
    layout = row_file.layout
    values = torch.zeros(1, layout.head_dim, dtype=torch.uint8).expand(layout.num_rows, -1)
    scales = torch.zeros(1, layout.head_dim // BLOCK_SIZE, dtype=torch.uint8).expand(layout.num_rows, -1)
    setattr(values, ROW_FILE_ATTRIBUTE, row_file)
    options = {"directory": str(row_file.path.parent), "ram_cache_fraction": fraction, "read_threads": read_threads}
    return engram.EngramTable(values, scales, placement="disk", device=device, validate=False, check_values=False,
                              placement_options=options)


def baseline_table(rows: int, device: torch.device) -> engram.EngramTable:
    """Placement "host" of ``rows`` random rows on a GPU; on the CPU, placement "cpu"."""
    from common import host_table

    if device.type == "cuda":
        return host_table(rows, distinct_rows=1 << 20)
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 0x7F, (rows, HEAD_DIM), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 127, (rows, HEAD_DIM // BLOCK_SIZE), dtype=torch.uint8, generator=generator)
    return engram.EngramTable(values, scales, placement="cpu", validate=False, check_values=False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def id_streams(rows: int, tokens_needed: int, seed: int) -> dict[str, np.ndarray]:
    """``{name: int64 [N, 24]}``: uniform ids, and real text folded into ``[0, rows)`` when it is here."""
    from common import fold_ids
    from real_text import STREAM_PATH, load_stream

    streams = {"uniform": np.random.default_rng(seed).integers(0, rows, (tokens_needed, COLUMNS))}
    if STREAM_PATH.exists():
        ids, _ = load_stream(STREAM_PATH, max_tokens=tokens_needed)
        streams["realtext"] = fold_ids(ids, rows).astype(np.int64)
    else:
        print(f"no {STREAM_PATH}: uniform ids only (make it with real_text.py stream, carry .bench-data)")
    return streams


def time_steps(table, windows: list[torch.Tensor], gap_s: float, prefetched: bool) -> list[float]:
    """Microseconds from each lookup's call to its rows on the device, one window a step."""
    samples = []
    for ids in windows:
        synchronize(ids.device)
        handle = table.prefetch(ids) if prefetched else None
        if prefetched:
            time.sleep(gap_s)
        start = time.perf_counter()
        rows = table.lookup(ids, prefetch=handle)
        synchronize(ids.device)
        samples.append((time.perf_counter() - start) * 1e6)
        del rows
    return samples


def cache_counts(table) -> tuple[int, int]:
    stats = table.storage.reads.cache.stats
    return stats["hits"], stats["misses"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the row file (default 2 GiB)")
    parser.add_argument("--directory", type=Path, default=Path.cwd() / ".bench-disk",
                        help="where the row file goes (default ./.bench-disk/)")
    parser.add_argument("--tokens", default="64,1024", help="tokens a step, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per stream, T and path")
    parser.add_argument("--warm-steps", type=int, default=20, help="untimed steps first (the RAM cache fills)")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="host time between prefetch and lookup")
    parser.add_argument("--ram-cache-fraction", type=float, default=0.1)
    parser.add_argument("--read-threads", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: expected comma-separated integers, found {args.tokens!r}")
    if min(token_counts) < 1 or args.steps < 1 or args.warm_steps < 0 or args.gap_ms < 0 or args.gib <= 0:
        parser.error("--tokens, --steps and --gib must be positive; --warm-steps and --gap-ms not negative")
    from common import device_slug, versions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    baseline = "host" if device.type == "cuda" else "cpu"

    started = time.perf_counter()
    row_file, reused = make_row_file(args.directory, args.gib)
    rows = row_file.layout.num_rows
    print(f"row file: {rows:,} rows, {row_file.layout.file_bytes / 2**30:.1f} GiB, "
          f"{'reused' if reused else 'written'} in {time.perf_counter() - started:.1f} s", flush=True)
    disk = disk_table(row_file, args.ram_cache_fraction, args.read_threads, device)
    host = baseline_table(rows, device)
    per_step = args.warm_steps + 2 * args.steps   # prefetched and direct steps read different windows
    streams = id_streams(rows, max(token_counts) * per_step, seed=0)
    results = []
    for stream, ids in streams.items():
        for tokens in token_counts:
            windows = [torch.from_numpy(ids[i * tokens:(i + 1) * tokens]).to(device) for i in range(per_step)]
            warm, timed = windows[:args.warm_steps], windows[args.warm_steps:]
            prefetched_windows, direct_windows = timed[0::2], timed[1::2]
            for table in (disk, host):
                time_steps(table, warm, 0.0, prefetched=False)
            before = cache_counts(disk)
            read_start = time.perf_counter()
            row = {"stream": stream, "tokens": tokens}
            for name, path_windows, prefetched in (("prefetched", prefetched_windows, True),
                                                   ("direct", direct_windows, False)):
                row[f"disk_{name}_us"] = statistics.median(time_steps(disk, path_windows, args.gap_ms / 1e3,
                                                                      prefetched))
                row[f"host_{name}_us"] = statistics.median(time_steps(host, path_windows, args.gap_ms / 1e3,
                                                                      prefetched))
                row[f"disk_vs_host_{name}"] = row[f"disk_{name}_us"] / row[f"host_{name}_us"]
            hits, misses = (after - first for after, first in zip(cache_counts(disk), before))
            row["ram_hit_rate"] = hits / max(1, hits + misses)
            row["disk_rows_read_per_s"] = misses / (time.perf_counter() - read_start)
            results.append(row)
            print(f"{stream} T={tokens}: {row}", flush=True)
    print(f"\n{'stream':>9} {'T':>6} {'RAM hits':>9} {'disk pref us':>13} {baseline + ' pref us':>13} "
          f"{'disk_vs_host':>13} {'disk direct us':>15} {baseline + ' direct us':>15} {'disk_vs_host':>13}")
    for row in results:
        print(f"{row['stream']:>9} {row['tokens']:6d} {row['ram_hit_rate']:9.3f} {row['disk_prefetched_us']:13,.0f} "
              f"{row['host_prefetched_us']:13,.0f} {row['disk_vs_host_prefetched']:13.1f} "
              f"{row['disk_direct_us']:15,.0f} {row['host_direct_us']:15,.0f} {row['disk_vs_host_direct']:13.1f}")
    report = {"benchmark": "bench_disk_lookup", "baseline": baseline,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **versions(device),
              "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "rows": rows, "file_bytes": row_file.layout.file_bytes, "file_reused": reused,
              "options": vars(args) | {"directory": str(args.directory)},
              "disk_stats": dict(disk.storage.stats), "results": results}
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"disk-lookup-{device_slug(device)}.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
