"""Where a host-gather lookup's time goes at T = 8192 (GPU host): HostGather's start and
worker steps replayed with time stamps, in a process whose main thread has (or has not)
run torch's CPU threads, for 1, 2 and 4 waves. A diagnostic for benchmarks/NOTES.md.

libgomp spins between parallel regions only while the process has no more OpenMP threads
than CPUs; a main-thread team (16) plus the gather worker's (14) pass that, and then
every region wakes its threads from sleep.

    PYTHONPATH=src python benchmarks/probe_host_pipeline.py [--main-team]
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engram.table.kernels.dedup import distinct_rows  # noqa: E402
from engram.table.host_memory.gather import GATHER_THREADS  # noqa: E402

ROWS = 64 * 2**20
N_TOKENS, COLUMNS, ROW_BYTES = 8192, 24, 272


def main(main_team: bool) -> None:
    worker = concurrent.futures.ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(GATHER_THREADS,))
    nbytes = (ROWS + 1) * ROW_BYTES
    table = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # 17 GiB, pinned (registered) host memory
    filler = (lambda: table.fill_(7)) if main_team else (lambda: worker.submit(table.fill_, 7).result())
    filler()
    packed = table.view(ROWS + 1, ROW_BYTES)
    if main_team:
        torch.index_select(packed, 0, torch.arange(1000), out=torch.empty(1000, ROW_BYTES, dtype=torch.uint8))
    staging_host = torch.empty(N_TOKENS * COLUMNS, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    staging_device = torch.empty_like(staging_host, device="cuda")
    copy_stream = torch.cuda.Stream()
    generator = torch.Generator("cuda").manual_seed(0)
    print(f"main-thread OpenMP team: {main_team}; gather threads {GATHER_THREADS}", flush=True)

    def gather(ids_host, ids_ready, waves, stamps):
        stamps["worker starts"] = time.perf_counter()
        ids_ready.synchronize()
        stamps["ids on host"] = time.perf_counter()
        count = int(ids_host[-1])
        rows = ids_host[:count]
        bounds = [count * k // waves for k in range(waves + 1)]
        for wave, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            torch.index_select(packed, 0, rows[begin:end], out=staging_host[begin:end])
            stamps[f"wave {wave} gathered"] = time.perf_counter()
            with torch.cuda.stream(copy_stream):
                staging_device[begin:end].copy_(staging_host[begin:end], non_blocking=True)
            stamps[f"wave {wave} copy issued"] = time.perf_counter()
        done = torch.cuda.Event()
        done.record(copy_stream)
        done.synchronize()
        stamps["copies done"] = time.perf_counter()

    for waves in (1, 2, 4):
        samples = []
        for _ in range(8):
            ids = torch.randint(0, ROWS, (N_TOKENS, COLUMNS), device="cuda", dtype=torch.int32, generator=generator)
            torch.cuda.synchronize()
            time.sleep(0.02)  # a step's gap: the gather threads fall asleep
            stamps = {}
            begin = time.perf_counter()
            ids_host = torch.empty(ids.numel() + 1, dtype=torch.int32, pin_memory=True)
            stamps["pinned buffer"] = time.perf_counter()
            distinct = distinct_rows(ids, 0, ROWS)
            stamps["dedup launched"] = time.perf_counter()
            ids_host.copy_(distinct.rows_and_count, non_blocking=True)
            ids_ready = torch.cuda.Event()
            ids_ready.record()
            stamps["id copy launched"] = time.perf_counter()
            future = worker.submit(gather, ids_host, ids_ready, waves, stamps)
            stamps["submitted"] = time.perf_counter()
            future.result()
            samples.append({name: (t - begin) * 1e6 for name, t in sorted(stamps.items(), key=lambda kv: kv[1])})
        names = list(samples[-1])
        print(f"{waves} waves: " + ", ".join(f"{name} {np.median([s[name] for s in samples[1:]]):.0f}" for name in names),
              flush=True)


if __name__ == "__main__":
    main("--main-team" in sys.argv)
