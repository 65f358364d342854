"""Why the host gather is slow from a worker thread (GPU host): the same 196,608-row gather
(T = 8192 x 24 columns of 272 B rows, 17 GiB table) timed several ways. A diagnostic for
benchmarks/NOTES.md "Host tables".

- one ``index_select`` on the main thread / on a worker thread, at several intra-op thread counts;
- the worker's gather while the main thread spins in ``torch.cuda.synchronize``;
- a pool of Python threads, each gathering its piece with one intra-op thread (GIL released);
- that pool with each piece's host-to-device copy issued as soon as the piece is gathered.

    PYTHONPATH=src python benchmarks/probe_gather_threads.py
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engram.table.host_memory.buffers import allocate_host_buffer  # noqa: E402
from engram.table.host_memory.rows import PackedRows, register_with_cuda  # noqa: E402

ROWS = 64 * 2**20
N = 8192 * 24


def median_us(call, repeats=9):
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e6


def main():
    print(subprocess.run("lscpu | head -20; numactl --hardware 2>/dev/null | head -4", shell=True,
                         capture_output=True, text=True).stdout, flush=True)
    nbytes = (ROWS + 1) * 272
    started = time.perf_counter()
    host = allocate_host_buffer(nbytes, fill=lambda b: b.fill_(7), read_only=False)
    packed = PackedRows.view_of(host.tensor[:nbytes], ROWS, 256).packed
    release = register_with_cuda(packed)
    print(f"table {nbytes / 2**30:.1f} GiB, huge pages {host.huge_pages}, {time.perf_counter() - started:.1f} s; "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}", flush=True)
    ids = torch.randint(0, ROWS, (N,), dtype=torch.int64)
    sorted_ids = ids.sort().values
    out = torch.empty(N, 272, dtype=torch.uint8, pin_memory=True)
    device_out = torch.empty(N, 272, dtype=torch.uint8, device="cuda")
    mb = N * 272 / 1e6

    def report(name, us):
        print(f"{name:70s} {us:8.0f} us  {mb / us * 1e3:6.1f} GB/s", flush=True)

    default_threads = torch.get_num_threads()
    for threads in (default_threads, 14, 8):
        torch.set_num_threads(threads)
        report(f"main thread index_select, {threads} intra-op threads",
               median_us(lambda: torch.index_select(packed, 0, ids, out=out)))
    torch.set_num_threads(default_threads)
    report("main thread index_select, sorted ids", median_us(lambda: torch.index_select(packed, 0, sorted_ids, out=out)))

    worker = concurrent.futures.ThreadPoolExecutor(1)
    for threads in (default_threads, 14, 8):
        worker.submit(torch.set_num_threads, threads).result()
        report(f"worker index_select, {threads} intra-op threads",
               median_us(lambda: worker.submit(torch.index_select, packed, 0, ids, out=out).result()))

    # The worker's gather while the main thread spins on the GPU (as a caller waiting on a step).
    worker.submit(torch.set_num_threads, default_threads).result()
    for threads in (default_threads, 14):
        worker.submit(torch.set_num_threads, threads).result()

        def while_spinning():
            torch.cuda._sleep(50_000_000)
            future = worker.submit(torch.index_select, packed, 0, ids, out=out)
            started = time.perf_counter()
            future.result()
            elapsed = time.perf_counter() - started
            torch.cuda.synchronize()
            return elapsed

        timings = [while_spinning() for _ in range(7)]
        report(f"worker index_select ({threads} threads), main thread in cuda sync",
               float(np.median(timings)) * 1e6)

    for pool_size in (8, 12, 14, 16):
        pool = concurrent.futures.ThreadPoolExecutor(pool_size)
        list(pool.map(lambda _: torch.set_num_threads(1), range(pool_size * 4)))
        bounds = [N * k // pool_size for k in range(pool_size + 1)]
        pieces = list(zip(bounds[:-1], bounds[1:]))

        def piece_gather(piece, source_ids=ids):
            begin, end = piece
            torch.index_select(packed, 0, source_ids[begin:end], out=out[begin:end])

        report(f"pool of {pool_size} Python threads, 1 intra-op thread each",
               median_us(lambda: list(pool.map(piece_gather, pieces))))
        report(f"pool of {pool_size} Python threads, sorted ids",
               median_us(lambda: list(pool.map(lambda p: piece_gather(p, sorted_ids), pieces))))
        packed_np, out_np, ids_np = packed.numpy(), out.numpy(), ids.numpy()

        def piece_take(piece):
            begin, end = piece
            np.take(packed_np, ids_np[begin:end], axis=0, out=out_np[begin:end])

        report(f"pool of {pool_size} Python threads, numpy take",
               median_us(lambda: list(pool.map(piece_take, pieces))))

        copy_stream = torch.cuda.Stream()
        for waves in (1, 4, 8):
            # Pieces in wave order, all submitted at once: a thread takes the next piece when free.
            flat = [(begin + (end - begin) * w // waves, begin + (end - begin) * (w + 1) // waves)
                    for w in range(waves) for begin, end in pieces]

            def piece_then_copy(piece):
                piece_gather(piece)
                begin, end = piece
                with torch.cuda.stream(copy_stream):
                    device_out[begin:end].copy_(out[begin:end], non_blocking=True)

            def pipelined():
                list(pool.map(piece_then_copy, flat))
                copy_stream.synchronize()

            report(f"pool of {pool_size}: {waves} pieces per thread, each copied when gathered (end to end)",
                   median_us(pipelined))
        pool.shutdown()
    report("copy alone (pinned -> device)",
           median_us(lambda: (device_out.copy_(out, non_blocking=True), torch.cuda.synchronize())))
    release()


if __name__ == "__main__":
    main()
