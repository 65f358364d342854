"""Where the host gather's time goes (GPU): each stage of HostGather timed alone and inside
the pipeline, on a 4 GiB pinned table. A diagnostic for benchmarks/NOTES.md.

    PYTHONPATH=src python benchmarks/probe_host_gather.py
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engram.table import host_gather  # noqa: E402
from engram.table.host_gather import HostGather, gather_packed_rows_host  # noqa: E402
from engram.table.host_rows import PackedRows, register_with_cuda  # noqa: E402
from wall_clock import median_wall_us  # noqa: E402


def timed(call, repeats=20):
    return median_wall_us(call, repeats, warmup=0)


def main():
    from engram.table.host_memory import allocate_host_buffer

    rows = 64 * 2**20  # 17 GiB: far past every cache and TLB reach
    nbytes = (rows + 1) * 272
    host = allocate_host_buffer(nbytes, fill=lambda b: b.fill_(7), read_only=False)
    packed = PackedRows.view_of(host.tensor[:nbytes], rows, 256).packed
    release = register_with_cuda(packed)
    print("threads", torch.get_num_threads(), "huge pages", host.huge_pages, flush=True)
    for n in (24, 196608):
        ids = torch.randint(0, rows, (n,), dtype=torch.int32)
        out = torch.empty(n, 272, dtype=torch.uint8, pin_memory=True)
        print(f"n={n}: index_select main thread {timed(lambda: gather_packed_rows_host(packed, ids, 0, out)):.0f} us",
              flush=True)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        print(f"n={n}: index_select worker thread "
              f"{timed(lambda: pool.submit(gather_packed_rows_host, packed, ids, 0, out).result()):.0f} us; "
              f"threads there {pool.submit(torch.get_num_threads).result()}", flush=True)
        device_out = torch.empty(n, 272, dtype=torch.uint8, device="cuda")
        print(f"n={n}: H2D copy {timed(lambda: device_out.copy_(out, non_blocking=True)):.0f} us", flush=True)
        gpu_ids = ids.cuda()
        print(f"n={n}: pinned alloc + D2H ids "
              f"{timed(lambda: torch.empty(n, dtype=torch.int32, pin_memory=True).copy_(gpu_ids, non_blocking=True)):.0f} us",
              flush=True)
        for waves in (1, 2, 4):
            host_gather._MAX_WAVES = waves
            probe = HostGather(packed, torch.device("cuda"))
            stream = torch.cuda.current_stream()

            def run_waves():
                ticket = probe.start(gpu_ids, 0, stream)
                probe.finish(ticket, stream)
                probe.consumed(stream)

            print(f"n={n}: HostGather with at most {waves} waves {timed(run_waves):.0f} us", flush=True)
        host_gather._MAX_WAVES = 2
        pipeline = HostGather(packed, torch.device("cuda"))
        stream = torch.cuda.current_stream()

        def whole():
            ticket = pipeline.start(gpu_ids, 0, stream)
            pipeline.finish(ticket, stream)
            pipeline.consumed(stream)

        print(f"n={n}: HostGather start+finish {timed(whole):.0f} us", flush=True)
        stamps = []
        original = host_gather.gather_packed_rows_host

        def traced(*args):
            stamps.append(("gather in", time.perf_counter()))
            original(*args)
            stamps.append(("gather out", time.perf_counter()))

        host_gather.gather_packed_rows_host = traced
        torch.cuda.synchronize()
        begin = time.perf_counter()
        ticket = pipeline.start(gpu_ids, 0, stream)
        stamps.append(("started", time.perf_counter()))
        pipeline.finish(ticket, stream)
        stamps.append(("finished (copies enqueued)", time.perf_counter()))
        torch.cuda.synchronize()
        stamps.append(("synchronized", time.perf_counter()))
        host_gather.gather_packed_rows_host = original
        print("  " + ", ".join(f"{name} +{(t - begin) * 1e6:.0f}" for name, t in stamps), flush=True)
    release()


if __name__ == "__main__":
    main()
