"""The HBM row cache's between-steps update (GPU, one call): the fixed-size kernels against the torch path.

A :class:`RowCache` the size of placement ``"cached"``'s on V4.1's layer-1 table (2% of 384,006,168 rows:
7.68 M slots in 960 k sets of 8 ways, 2.1 GB of HBM) over backing rows in pinned host memory (read through
their CUDA alias, as the placement admits rows), ``--backing-rows`` of them. Each step's ids: T tokens x 24
columns, half from a hot pool (so rows repeat and hit) and half uniform. Per policy (``set-lru``,
``dynamic``) and T in {64, 8192}, after ``--warm-steps`` steps:

* ``host_us``: the update call's host time, until it returns (median);
* ``gpu_us``: CUDA events around it (median; includes launch gaps the host leaves);
* ``graph_us`` (kernels only): the update captured in a CUDA graph, replayed with fresh ids (do_bench median).

Paths: ``kernels`` (admitted rows read from host memory), ``staged`` (the kernels given the step's staging,
as placement ``"cached"`` hands them the last large lookup's: the step's distinct rows, tagged, on the
device; admitted rows copied from there) and ``torch`` (the reference).

Both paths start from the same content and are checked to leave the same tags after the last step.
Also the device copy ceiling of the same run (the cache's update is latency-bound: the ceiling shows
the card). Writes ``cache-update-h200.json`` to ``$OUT`` (or benchmarks/results/).

    PYTHONPATH=src ENGRAM_COMMIT=<sha> python benchmarks/cache/bench_cache_update.py
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

from common import copy_ceiling_gbps, versions  # noqa: E402

from engram.table.host_memory.rows import cuda_alias, pack_rows  # noqa: E402
from engram.table.placements.row_cache import RowCache  # noqa: E402

V41_ROWS = 384_006_168
COLUMNS = 24


def _step_ids(rng: np.random.Generator, tokens: int, backing_rows: int, hot: np.ndarray) -> torch.Tensor:
    count = tokens * COLUMNS
    ids = np.where(rng.random(count) < 0.5, hot[rng.integers(0, hot.size, count)],
                   rng.integers(0, backing_rows, count))
    return torch.from_numpy(ids.astype(np.int64)).cuda()


def _staging(ids: torch.Tensor, packed_alias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A lookup's staging for ``ids``: its distinct rows as tagged packed rows on the device, and ``inverse``."""
    distinct, inverse = torch.unique(ids, return_inverse=True)
    return packed_alias[distinct], inverse.to(torch.int32)


def _time_update(update, ids_of_step, steps: int) -> dict:
    host, gpu = [], []
    for step in range(steps):
        ids = ids_of_step(step)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        started = time.perf_counter()
        update(ids)
        host.append((time.perf_counter() - started) * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu)}


def _kernel_us(run, count: int) -> dict[str, float]:
    """GPU time per call of each kernel ``run(i)`` launches, ``i < count`` (torch.profiler, CUDA activity only;
    kernels replayed inside a CUDA graph are listed where the profiler sees them)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for i in range(count):
            run(i)
        torch.cuda.synchronize()
    times = {}
    for event in trace.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = getattr(event, "cuda_time_total", 0)
        if total > 0:
            times[event.key] = round(total / count, 2)
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def _graph_replay_us(cache: RowCache, steps: list[torch.Tensor], back_values, back_scales) -> tuple[float, dict]:
    """Median device time of the update captured in a CUDA graph, each replay after fresh ids were copied
    into its input (outside the timed span), over the first half of ``steps``; its kernels' GPU time over the
    second half."""
    static_ids = steps[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cache.update(static_ids, back_values, back_scales)
    torch.cuda.current_stream().wait_stream(stream)
    samples = []
    timed, profiled = steps[:len(steps) // 2], steps[len(steps) // 2:]
    for ids in timed:
        static_ids.copy_(ids)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)

    def replay(i):
        static_ids.copy_(profiled[i])
        graph.replay()
    return statistics.median(samples), _kernel_us(replay, len(profiled))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backing-rows", type=int, default=16 << 20, help="pinned host rows admitted from")
    parser.add_argument("--warm-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per path, policy and T")
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--policies", default="set-lru,dynamic", help="comma-separated: set-lru, dynamic")
    parser.add_argument("--tokens", default="64,8192", help="comma-separated step sizes T (tokens)")
    args = parser.parse_args()
    policies = [policy for policy in args.policies.split(",") if policy]
    if not policies or any(policy not in ("set-lru", "dynamic") for policy in policies):
        parser.error(f"--policies: expected set-lru and/or dynamic, found {args.policies!r}")
    try:
        token_counts = [int(count) for count in args.tokens.split(",")]
    except ValueError:
        token_counts = []
    if not token_counts or min(token_counts) < 1:
        parser.error(f"--tokens: expected positive integers separated by commas, found {args.tokens!r}")
    if not torch.cuda.is_available():
        print("bench_cache_update.py: needs a CUDA device", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    values = torch.randint(0, 0x7E, (args.backing_rows, 256), dtype=torch.uint8)
    scales = torch.randint(100, 140, (args.backing_rows, 8), dtype=torch.uint8)
    rows = pack_rows(values, scales)
    del values, scales
    packed = rows.packed.pin_memory()
    del rows
    alias = cuda_alias(packed, torch.device("cuda"))  # the pinned rows as a CUDA tensor (reads over PCIe)
    back_values, back_scales = alias[:-1, :256], alias[:-1, 256:264]
    hot = rng.integers(0, args.backing_rows, 200_000)
    num_slots = int(V41_ROWS * 0.02)
    results = {}
    for policy in policies:
        for tokens in token_counts:
            caches = {path: RowCache(num_slots, 256, "cuda", ways=8, recency=policy == "set-lru")
                      for path in ("kernels", "staged", "torch")}
            steps = [_step_ids(rng, tokens, args.backing_rows, hot) for _ in range(args.warm_steps + args.steps)]
            # Fresh ids for the graph replays and the kernel profile (ids a cache saw would mostly hit there)
            graph_steps = [_step_ids(rng, tokens, args.backing_rows, hot) for _ in range(20)]
            profile_steps = [_step_ids(rng, tokens, args.backing_rows, hot) for _ in range(10)]
            stagings = {id(ids): _staging(ids, alias) for ids in steps + profile_steps}
            row, updates = {}, {}
            for path, cache in caches.items():
                def update(ids, cache=cache, path=path):
                    if path == "torch":
                        return cache.update_with_torch(ids, back_values, back_scales)
                    staged, inverse = stagings[id(ids)] if path == "staged" else (None, None)
                    return cache.update(ids, back_values, back_scales, staged=staged, inverse=inverse)
                for ids in steps[:args.warm_steps]:
                    update(ids)
                row[path] = _time_update(update, lambda step: steps[args.warm_steps + step], args.steps)
                updates[path] = update
            buffers = caches["staged"].admission_buffers(1)
            row["staged"]["rows_from_staging"] = int(buffers.from_staging)
            # slots whose tag differs from the torch reference's, per path, and slots whose bytes differ between paths
            for path in ("kernels", "staged"):
                row[path]["tags_differ"] = int((caches[path].tags != caches["torch"].tags).sum())
            differ = (caches["kernels"].slot_rows != caches["staged"].slot_rows)
            row["slot_bytes_differ"] = int(differ.any(1).sum())
            if row["slot_bytes_differ"]:
                where = torch.nonzero(differ.any(1))[:4, 0].tolist()
                print(f"  slots whose bytes differ (of {num_slots}; the last is the trash slot): {where}, byte columns "
                      f"{torch.nonzero(differ[where[0]])[:, 0].tolist()[:12]}, tags there {caches['kernels'].tags_with_trash[where].tolist()}; "
                      f"staged equals torch there: {[bool(torch.equal(caches['staged'].slot_rows[i], caches['torch'].slot_rows[i])) for i in where]}; "
                      f"kernels' tag bytes {caches['kernels'].slot_rows[where, -4:].view(torch.int32).tolist()}, staged's "
                      f"{caches['staged'].slot_rows[where, -4:].view(torch.int32).tolist()}", flush=True)
            row["slot_bytes_differ_from_torch"] = int((caches["kernels"].slot_rows[:-1]
                                                       != caches["torch"].slot_rows[:-1]).any(1).sum())
            same = (row["kernels"]["tags_differ"] == row["staged"]["tags_differ"] == 0
                    and row["slot_bytes_differ"] == 0 and row["slot_bytes_differ_from_torch"] == 0)
            row["kernels"]["graph_us"], row["kernels"]["graph_kernel_us"] = _graph_replay_us(
                caches["kernels"], graph_steps, back_values, back_scales)
            for path in ("kernels", "staged"):  # after the checks: where an eager update's GPU time goes
                row[path]["kernel_us"] = _kernel_us(lambda i, update=updates[path]: update(profile_steps[i]), 10)
            row["tags_equal"] = same
            row["speedup_gpu"] = row["torch"]["gpu_us"] / row["kernels"]["gpu_us"]
            results[f"{policy}_T{tokens}"] = row
            print(f"{policy:8} T={tokens:5}: kernels host {row['kernels']['host_us']:7.1f} us, gpu "
                  f"{row['kernels']['gpu_us']:7.1f} us, graph {row['kernels']['graph_us']:7.1f} us | staged host "
                  f"{row['staged']['host_us']:6.1f} us, gpu {row['staged']['gpu_us']:7.1f} us | torch host "
                  f"{row['torch']['host_us']:8.1f} us, gpu {row['torch']['gpu_us']:8.1f} us | "
                  f"{row['speedup_gpu']:.0f}x, tags and bytes equal {same} (tags differ: kernels "
                  f"{row['kernels']['tags_differ']}, staged {row['staged']['tags_differ']}; bytes differ: kernels/staged "
                  f"{row['slot_bytes_differ']}, kernels/torch {row['slot_bytes_differ_from_torch']})", flush=True)
            for what, times in (("eager kernels", row["kernels"]["kernel_us"]), ("eager staged", row["staged"]["kernel_us"]),
                                ("graph kernels", row["kernels"]["graph_kernel_us"])):
                print(f"    {what} per call: " + ", ".join(f"{name[:40]} {us:.1f} us" for name, us in list(times.items())[:8]),
                      flush=True)
    report = {"benchmark": "bench_cache_update", "device": torch.cuda.get_device_name(), **versions(torch.device("cuda")),
              "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "slots": num_slots, "ways": 8, "backing_rows": args.backing_rows, "columns": COLUMNS,
              "copy_ceiling_GBps": copy_ceiling_gbps(1 << 30), "results": results}
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cache-update-h200.json").write_text(json.dumps(report, indent=2))
    return 0 if all(row["tags_equal"] for row in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
