"""Host-table benchmark (GPU, one call): placement "host" at V4.1-Flash row shape.

A host table of ``ROWS`` packed rows (272 B each, >= 32 GiB, pinned), read at T in
{1, 64, 1024, 8192, 32768} tokens x 24 columns, uniform ids and ids hashed from real
text (.bench-data/real_ids_v41.npy from ``real_text.py ids``, folded into the table's
rows), by both read paths side by side:

* direct: the gather kernel reading host memory over PCIe (median of events;
  graph replays up to T = 1024);
* host gather: ids to the host, torch's ``index_select`` (``row_copy``) into pinned
  staging, chunked copy-engine transfers, dequantize on the device: wall time from the start of the
  lookup to its rows on the device (synchronized), median.

Reported against the copy-engine ceiling measured in the same run (one 256 MiB
pinned -> device copy), as unique-row bytes (264 B per distinct row, the bytes a
perfect fetch must move) and moved bytes (272 B per row read) per second. Also: the
load rate of a checkpoint from disk into placement "host", and an overlap run (both
layers prefetched at T = 8192 while the main stream runs decoder-sized bf16 GEMMs).
Writes ``host-h200.json`` to ``$OUT`` (or benchmarks/results/).

    PYTHONPATH=src ENGRAM_COMMIT=<sha> python benchmarks/host/bench_host.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import engram  # noqa: E402
from common import COLUMNS, ROW_BYTES_ON_DISK, fold_ids, gpu_us, host_table, median_wall_us  # noqa: E402
from real_text import REAL_IDS_PATH  # noqa: E402

ROWS = 128 * 2**20  # 128 Mi rows x 272 B = 34.2 GiB
TOKENS = (1, 64, 1024, 8192, 32768)


def copy_engine_gbps(nbytes: int = 256 << 20) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    seconds = triton.testing.do_bench(lambda: target.copy_(source, non_blocking=True), warmup=5, rep=100,
                                      return_mode="median") / 1e3
    return nbytes / seconds / 1e9


def id_sets(rng: np.random.Generator, rows: int, real_path: Path = REAL_IDS_PATH) -> dict[str, np.ndarray]:
    """``{"uniform": int32 [max(TOKENS), 24], "real_text": int32 [T, 24]}`` ids in ``[0, rows)``; the
    real-text ids are layer 1's of ``real_path`` (``real_text.py ids``), folded, where that file exists."""
    sets = {"uniform": rng.integers(0, rows, (max(TOKENS), COLUMNS)).astype(np.int32)}
    if real_path.is_file():
        real = np.load(real_path)[:, 0, :]  # layer 1's ids, folded into this table's rows
        sets["real_text"] = fold_ids(real, rows)
    else:
        print(f"no {real_path}: real-text ids skipped (run `benchmarks/real_text.py ids` on a machine with the tokenizer first)", flush=True)
    return sets


def bench_paths(table, ids_sets, ceiling) -> list[dict]:
    storage = table.storage
    results = []
    for name, ids_all in ids_sets.items():
        for tokens in TOKENS:
            ids = torch.from_numpy(ids_all[:tokens]).cuda()
            unique = int(np.unique(ids_all[:tokens]).size)
            row = {"ids": name, "T": tokens, "rows": tokens * COLUMNS, "unique_rows": unique,
                   "unique_bytes": unique * ROW_BYTES_ON_DISK, "moved_bytes": tokens * COLUMNS * storage.rows.packed.shape[1]}
            storage.direct_max_rows = 10**12
            row["direct_us"] = gpu_us(lambda: table.lookup(ids), graph=tokens <= 1024)
            storage.direct_max_rows = 0
            row["host_gather_us"] = median_wall_us(lambda: table.lookup(ids), repeats=20 if tokens >= 8192 else 50)
            for path in ("direct", "host_gather"):
                seconds = row[f"{path}_us"] / 1e6
                row[f"{path}_unique_GBps"] = row["unique_bytes"] / seconds / 1e9
                row[f"{path}_moved_GBps"] = row["moved_bytes"] / seconds / 1e9
            row["best"] = "direct" if row["direct_us"] <= row["host_gather_us"] else "host_gather"
            results.append(row)
            print(f"{name:10s} T={tokens:6d}: direct {row['direct_us']:9.1f} us ({row['direct_unique_GBps']:5.1f} GB/s) "
                  f"| host gather {row['host_gather_us']:9.1f} us ({row['host_gather_unique_GBps']:5.1f} GB/s unique, "
                  f"{row['host_gather_moved_GBps']:5.1f} moved; ceiling {ceiling:.1f})", flush=True)
    storage.direct_max_rows = engram.table.placements.host.DIRECT_MAX_ROWS
    return results


def direct_configs(table, rng, rows) -> list[dict]:
    """The direct path at T = 64 (graph replay) over a few launch shapes: host-memory reads are
    latency-bound, so more, smaller programs may keep more PCIe reads in flight."""
    from engram.table.kernels.gather import GatherConfig

    storage = table.storage
    ids = torch.from_numpy(rng.integers(0, rows, (64, COLUMNS)).astype(np.int32)).cuda()
    results = []
    storage.direct_max_rows = 10**12
    for block_rows, num_warps, vector in ((8, 2, 16), (4, 2, 16), (2, 1, 16), (1, 1, 16), (4, 4, 8), (16, 4, 16)):
        storage.direct_config = GatherConfig(block_rows=block_rows, num_warps=num_warps, vector=vector)
        us = gpu_us(lambda: table.lookup(ids), graph=True)
        results.append({"block_rows": block_rows, "num_warps": num_warps, "vector": vector, "T64_us": us})
        print(f"direct T=64 block_rows={block_rows} num_warps={num_warps} vector={vector}: {us:.1f} us", flush=True)
    storage.direct_config = None
    storage.direct_max_rows = engram.table.placements.host.DIRECT_MAX_ROWS
    return results


def gather_stages(table, ids_all) -> dict:
    """Parts of the host gather at T = 8192, each alone: the dedup on the device (GPU time),
    the host gather of the distinct rows on the gather worker (torch index_select), the copy
    of them. Back to back over the same rows: part of them may stay in the host's last-level
    cache (NOTES "Host tables v2")."""
    from engram.table.kernels.dedup import distinct_rows
    from engram.table.host_memory.gather import _shared_worker

    storage = table.storage
    ids = torch.from_numpy(ids_all[:8192]).cuda()
    zero_row = storage.rows.packed.shape[0] - 1
    dedup_us = triton.testing.do_bench(lambda: distinct_rows(ids, 0, zero_row), warmup=5, rep=50,
                                       return_mode="median") * 1e3
    distinct = distinct_rows(ids, 0, zero_row)
    count = int(distinct.rows_and_count[-1])
    rows = distinct.rows_and_count[:count].cpu()
    staging = torch.empty(count, storage.rows.packed.shape[1], dtype=torch.uint8, pin_memory=True)
    worker = _shared_worker()
    gather_us = median_wall_us(lambda: worker.submit(torch.index_select, storage.rows.packed, 0, rows,
                                                     out=staging).result(), repeats=20)
    target = torch.empty_like(staging, device="cuda")
    copy_us = median_wall_us(lambda: target.copy_(staging, non_blocking=True), repeats=20)
    stages = {"distinct_rows": count, "dedup_gpu_us": dedup_us, "host_index_select_us": gather_us,
              "copy_us": copy_us}
    print(f"host gather stages at T=8192: {stages}", flush=True)
    return stages


def trace_gather(table, ids_all) -> dict:
    """One host-gather lookup at T = 8192 with time stamps (median of 7, us from the call):
    the call returns, the worker starts, the ids are on the host, the copies are enqueued,
    the copies are done, the lookup is done; for 2, 4 and 8 waves."""
    from engram.table.host_memory import gather as host_gather

    storage = table.storage
    storage.direct_max_rows = 0
    ids = torch.from_numpy(ids_all[:8192]).cuda()
    gather = storage._host_gather
    original = type(gather)._gather
    traces = {}
    for waves in (2, 4, 8):
        host_gather._MAX_WAVES = waves
        samples = []
        for _ in range(8):
            stamps = {}

            def traced(ids_host, ids_ready, stamps=stamps):
                stamps["worker starts"] = time.perf_counter()
                ids_ready.synchronize()
                stamps["ids on host"] = time.perf_counter()
                done = original(gather, ids_host, ids_ready)
                stamps["copies enqueued"] = time.perf_counter()
                done.synchronize()
                stamps["copies done"] = time.perf_counter()
                return done

            gather._gather = traced
            torch.cuda.synchronize()
            begin = time.perf_counter()
            table.lookup(ids)
            stamps["call returns"] = time.perf_counter()
            torch.cuda.synchronize()
            stamps["lookup done"] = time.perf_counter()
            samples.append({name: (t - begin) * 1e6 for name, t in stamps.items()})
        del gather._gather
        traces[waves] = {name: float(np.median([s[name] for s in samples[1:]])) for name in samples[0]}
        print(f"trace T=8192, {waves} waves: " + ", ".join(f"{k} {v:.0f}" for k, v in traces[waves].items()), flush=True)
    host_gather._MAX_WAVES = 4
    storage.direct_max_rows = engram.table.placements.host.DIRECT_MAX_ROWS
    return traces


def overlap(table, rng, rows, prefetch_before_gemm: int = 0) -> dict:
    """Main stream: decoder-sized bf16 GEMMs (8192 x 7168 x 7168, ~1 ms each), both layers
    prefetched at T = 8192 before GEMM ``prefetch_before_gemm`` (0: before any is enqueued),
    layer 1's rows used after 2 GEMMs and layer 14's after 8 (as a decoder reaches them),
    against the same GEMMs alone."""
    a = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(7168, 7168, device="cuda", dtype=torch.bfloat16)
    gemms = 12
    # A second placement over the same pinned rows: its own staging, as a second layer has.
    layers = [table, engram.EngramTable(table.storage.rows.values, table.storage.rows.scales, placement="host",
                                        device="cuda", validate=False, check_values=False)]
    ids = [torch.from_numpy(rng.integers(0, rows, (8192, COLUMNS)).astype(np.int32)).cuda() for _ in range(2)]
    uses = {2: 0, 8: 1}

    def alone():
        for _ in range(gemms):
            torch.mm(a, b)

    def with_prefetch():
        handles = [None, None]
        for k in range(gemms):
            if k == prefetch_before_gemm:
                handles = [layer.prefetch(layer_ids) for layer, layer_ids in zip(layers, ids)]
            if k in uses:
                layers[uses[k]].lookup(ids[uses[k]], prefetch=handles[uses[k]])
            torch.mm(a, b)

    time_alone = median_wall_us(alone, repeats=10)
    time_with = median_wall_us(with_prefetch, repeats=10)
    return {"gemm_loop_us": time_alone, "with_prefetch_us": time_with,
            "overlap_slowdown_pct": 100 * (time_with - time_alone) / time_alone, "gemms": gemms}


def load_rate(vocab_size: int = 120_000) -> dict:
    """Stream the tables of a synthetic V4.1-row checkpoint (written here, so read from the
    page cache, not the disk) into placement "host": table bytes per second of
    ``load_engram_table`` (checks included), without config, tokenizer or wkv."""
    from engram.checkpoint import SafetensorsCheckpoint, load_engram_table
    from engram.tools.testing import write_synthetic_checkpoint

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as directory:
        written = write_synthetic_checkpoint(directory, scale="wide", vocab_size=vocab_size, tokenizer="word")
        spec = engram.EngramSpec.from_hf_config(written.directory)
        layout = engram.EngramLayout(spec)
        checkpoint = SafetensorsCheckpoint(Path(written.directory))
        started = time.perf_counter()
        tables = [load_engram_table(checkpoint, layout, index, placement="host", device="cuda", progress=False)
                  for index in range(spec.num_layers)]
        seconds = time.perf_counter() - started
        table_bytes = sum(t.num_rows for t in tables) * ROW_BYTES_ON_DISK
        return {"table_bytes": table_bytes, "seconds": seconds, "load_GBps": table_bytes / seconds / 1e9}


def headline(paths: list[dict], overlap_run: dict) -> dict:
    """The report's headline keys from its ``paths`` rows and its ``overlap`` run: the faster path's time at
    T = 8192 and 64 (uniform ids), the unique-row rate at 8192, the overlap slowdown."""
    uniform = {r["T"]: r for r in paths if r["ids"] == "uniform"}
    keys = {"host_T8192_us": min(uniform[8192]["direct_us"], uniform[8192]["host_gather_us"]),
            "host_T64_us": min(uniform[64]["direct_us"], uniform[64]["host_gather_us"]),
            "overlap_slowdown_pct": overlap_run["overlap_slowdown_pct"]}
    keys["host_T8192_GBps"] = uniform[8192]["unique_bytes"] / (keys["host_T8192_us"] / 1e6) / 1e9
    return keys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (placement \"host\" reads pinned host memory from the GPU)")
    rng = np.random.default_rng(5)
    ceiling = copy_engine_gbps()
    print(f"copy engine (pinned -> device, 256 MiB): {ceiling:.1f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_engine_GBps": ceiling, "rows": ROWS, "threads": torch.get_num_threads(),
              "direct_max_rows_default": engram.table.placements.host.DIRECT_MAX_ROWS}
    try:
        report["load"] = load_rate()
        print(f"load into host: {report['load']}", flush=True)
    except Exception as error:  # keep the rest of the run
        report["load_error"] = f"{type(error).__name__}: {error}"
        print(report["load_error"], flush=True)
    table = host_table(ROWS)
    sets = id_sets(rng, ROWS)
    report["paths"] = bench_paths(table, sets, ceiling)
    report["direct_configs_T64"] = direct_configs(table, rng, ROWS)
    report["stages_T8192"] = {name: gather_stages(table, ids) for name, ids in sets.items()}
    report["trace_T8192"] = trace_gather(table, sets["uniform"])
    report["overlap"] = overlap(table, rng, ROWS)
    print(f"overlap: {report['overlap']}", flush=True)
    report.update(headline(report["paths"], report["overlap"]))
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host-h200.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("host_T8192_us", "host_T8192_GBps", "host_T64_us", "copy_engine_GBps",
                                             "overlap_slowdown_pct")}, indent=1))


if __name__ == "__main__":
    main()
