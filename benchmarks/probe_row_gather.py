"""Host row gather: torch.index_select against the prefetching C gather (native_gather.py).

A table of ``--gib`` GiB of 272-byte rows (private memory, 4 KiB pages unless
``--huge-pages``), and the host gather of one T = 8192 x 24 lookup: 196,608 distinct
ascending random row ids (seeded; drawn afresh for every run, so neither the rows nor the
ids are in the last-level cache from the run before), gathered into one staging buffer
(pinned when CUDA is available) by

- ``torch``: ``torch.index_select(..., out=)`` on T intra-op threads;
- ``C d=D Lk st|nt``: ``gather_rows_prefetch`` on T pool threads, prefetch distance D rows,
  prefetch locality k (3 = prefetcht0), plain (``st``) or non-temporal (``nt``) stores:
  every distance of ``--distances`` at the default locality and stores, then the default
  distance with the other localities and with the other kind of store;
- ``C waves``: the HostGather worker's shape: one gather of 4 waves, waited for in order
  (module defaults).

After ``--warmup-s`` of C gathers (a freshly filled table reads slowly for a while on a
VM), the configurations run round-robin (round 0 is a warm-up and is dropped, then
``--repeats`` rounds), so a drift of the machine touches them all alike; ``--gap-ms`` of
sleep before each run (a serving step's gap: thread pools fall asleep as they would).
Prints per configuration the median ms, GB/s of row bytes gathered, and the speedup over
torch at the same thread count (median of the per-round ratios, robust to a slow round);
``--json PATH`` writes them too.

    PYTHONPATH=src python benchmarks/probe_row_gather.py --gib 8 --threads 1,2
    PYTHONPATH=src python benchmarks/probe_row_gather.py --threads 1,4,8,14,16 --json row-gather-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engram.table import native_gather  # noqa: E402
from engram.table.host_memory import allocate_host_buffer  # noqa: E402

ROW_BYTES = 272
DISTINCT_ROWS = 8192 * 24


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=32.0, help="table size in GiB (default 32)")
    parser.add_argument("--rows", type=int, default=DISTINCT_ROWS, help="distinct rows per gather (196,608)")
    parser.add_argument("--threads", type=_int_list, default=[1, 2], help="thread counts, comma-separated")
    parser.add_argument("--distances", type=_int_list, default=[0, 4, 8, 16, 32, 64],
                        help="prefetch distances (rows ahead), comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per configuration (after one warm-up)")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="sleep before each run")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="C gathers for this long before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--huge-pages", action="store_true", help="ask for 2 MiB pages for the table")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def machine() -> dict:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "")
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cpus": cpus, "machine": platform.machine(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available()}


def make_table(num_rows: int, huge_pages: bool):
    """``uint8 [num_rows, ROW_BYTES]``, every page written (an untouched page would read the
    shared zero page), contents distinct per 8 bytes."""
    nbytes = num_rows * ROW_BYTES

    def fill(buffer: torch.Tensor) -> None:
        words = nbytes // 8
        torch.arange(words, dtype=torch.int64, out=buffer[: words * 8].view(torch.int64))

    host = allocate_host_buffer(nbytes, fill=fill, huge_pages=huge_pages, read_only=False)
    return host, host.tensor[:nbytes].view(num_rows, ROW_BYTES)


def draw_ids(rng: np.random.Generator, num_rows: int, count: int) -> torch.Tensor:
    """``count`` distinct ascending ids in ``[0, num_rows)``, int64 (as HostGather's dedup gives)."""
    return torch.from_numpy(np.sort(rng.choice(num_rows, size=count, replace=False)).astype(np.int64))


def configurations(table, out, threads_list, distances) -> list[dict]:
    """Every configuration to time: ``label``, ``threads``, ``run(ids)`` and its settings."""
    default_distance = native_gather.PREFETCH_DISTANCE
    default_locality = native_gather.PREFETCH_LOCALITY
    default_streaming = native_gather.STREAMING_STORES
    configs = []
    for threads in threads_list:
        def run_torch(ids, threads=threads):
            torch.set_num_threads(threads)
            torch.index_select(table, 0, ids, out=out)
        configs.append({"label": "torch", "threads": threads, "run": run_torch})
        settings = [(distance, default_locality, default_streaming) for distance in distances]
        settings += [(default_distance, locality, default_streaming) for locality in (0, 1, 2, 3)
                     if locality != default_locality]
        settings.append((default_distance, default_locality, not default_streaming))
        for distance, locality, streaming in settings:
            def run_c(ids, threads=threads, distance=distance, locality=locality, streaming=streaming):
                native_gather.gather_rows_prefetch(table, ids, out, threads, prefetch_distance=distance,
                                                   prefetch_locality=locality, streaming_stores=streaming)
            configs.append({"label": f"C d={distance} L{locality} {'nt' if streaming else 'st'}", "threads": threads,
                            "run": run_c, "prefetch_distance": distance, "prefetch_locality": locality,
                            "streaming_stores": streaming})

        def run_waves(ids, threads=threads):
            gathered = native_gather.start_gather_rows(table, ids, out, threads,
                                                       wave_ends=[ids.shape[0] * k // 4 for k in range(1, 5)])
            for wave in range(4):
                gathered.wait(wave)
        configs.append({"label": "C waves (defaults)", "threads": threads, "run": run_waves,
                        "prefetch_distance": default_distance, "prefetch_locality": default_locality,
                        "streaming_stores": default_streaming})
    return configs


def main(argv=None) -> dict:
    args = parse_args(argv)
    num_rows = int(args.gib * 2**30) // ROW_BYTES
    started = time.perf_counter()
    host, table = make_table(num_rows, args.huge_pages)
    info = machine()
    available, detail = native_gather.native_gather_status()
    print(f"{info['cpu']} ({info['cpus']} CPUs, {info['machine']}), torch {info['torch']}; table {args.gib:g} GiB "
          f"({num_rows:,} rows of {ROW_BYTES} B, huge pages {host.huge_pages}) filled in "
          f"{time.perf_counter() - started:.1f} s; C gather: {detail}", flush=True)
    if not available:
        raise SystemExit("the C gather is unavailable; nothing to compare")
    out = torch.empty(args.rows, ROW_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out.fill_(0)
    rng = np.random.default_rng(args.seed)

    check_ids = draw_ids(rng, num_rows, args.rows)
    native_gather.gather_rows_prefetch(table, check_ids, out, max(args.threads))
    if not torch.equal(out, torch.index_select(table, 0, check_ids)):
        raise SystemExit("the C gather differs from torch.index_select")

    configs = configurations(table, out, args.threads, args.distances)
    warm_until = time.perf_counter() + args.warmup_s  # a freshly filled table reads slowly for a while
    while time.perf_counter() < warm_until:
        native_gather.gather_rows_prefetch(table, draw_ids(rng, num_rows, args.rows), out, max(args.threads))
    print(f"load average {os.getloadavg()[0]:.2f}; {len(configs)} configurations, {args.repeats} rounds", flush=True)
    times: list[list[float]] = [[] for _ in configs]
    for _round in range(args.repeats + 1):
        for config, samples in zip(configs, times):
            ids = draw_ids(rng, num_rows, args.rows)
            time.sleep(args.gap_ms / 1000)
            begin = time.perf_counter()
            config["run"](ids)
            samples.append(time.perf_counter() - begin)

    gathered_bytes = args.rows * ROW_BYTES
    torch_times = {config["threads"]: samples[1:] for config, samples in zip(configs, times)
                   if config["label"] == "torch"}
    results = []
    print(f"load average {os.getloadavg()[0]:.2f} (other processes on this machine disturb the numbers)")
    print(f"{'path':<24}{'threads':>8}{'median ms':>11}{'GB/s':>8}{'min ms':>9}{'max ms':>9}{'x torch':>9}", flush=True)
    for config, samples in zip(configs, times):
        samples = samples[1:]  # round 0: warm-up
        median = statistics.median(samples)
        # Paired by round (the same moment of the machine): robust to a round that ran slow.
        speedup = statistics.median(t / s for t, s in zip(torch_times[config["threads"]], samples))
        print(f"{config['label']:<24}{config['threads']:>8}{median * 1e3:>11.2f}{gathered_bytes / median / 1e9:>8.1f}"
              f"{min(samples) * 1e3:>9.2f}{max(samples) * 1e3:>9.2f}{speedup:>9.2f}", flush=True)
        results.append({**{key: value for key, value in config.items() if key != "run"},
                        "median_ms": median * 1e3, "gb_per_s": gathered_bytes / median / 1e9,
                        "speedup_vs_torch_same_threads": speedup, "times_ms": [t * 1e3 for t in samples]})
    report = {"machine": info, "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "table_rows": num_rows, "row_bytes": ROW_BYTES, "huge_pages": host.huge_pages,
              "defaults": {"prefetch_distance": native_gather.PREFETCH_DISTANCE,
                           "prefetch_locality": native_gather.PREFETCH_LOCALITY,
                           "streaming_stores": native_gather.STREAMING_STORES,
                           "block_rows": native_gather.BLOCK_ROWS},
              "results": results}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
