"""Where does issue 11's overlap slowdown come from: the gather's length, or the prefetch's host time?

``bench_host.py``'s overlap run calls ``prefetch`` for both layers before the first decoder GEMM is
enqueued, so the GPU idles for the prefetch calls' host time, then the caller blocks in layer 1's
lookup (after 2 GEMMs) until that layer's copies are enqueued. This times, on a host table of
``--gib`` GiB (272 B rows, uniform ids, T = 8192 x 24):

* ``prefetch_host_us``: what one ``prefetch`` costs the calling thread (the call alone, median),
  and ``distinct_rows_host_us``, its dedup launches alone;
* the overlap run in two orders, each against the same 12 GEMMs alone: ``prefetch_first`` (as
  ``bench_host.py``) and ``gemm_first`` (GEMM 0 enqueued, then both prefetches, then the rest:
  the prefetch issued while the main stream runs, as an engine whose thread runs ahead of the GPU).

    PYTHONPATH=src python benchmarks/probe_prefetch_overlap.py [--gib 17] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_host import overlap  # noqa: E402
from host_table_fixture import COLUMNS, host_table  # noqa: E402
from wall_clock import median_wall_us  # noqa: E402

def prefetch_host_us(table, ids, repeats: int = 15) -> float:
    samples = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        table.prefetch(ids)
        samples.append((time.perf_counter() - start) * 1e6)
        table.lookup(ids)
    torch.cuda.synchronize()
    return float(np.median(samples[2:]))


def main() -> None:
    from engram.table.kernels.dedup import distinct_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=17.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = int(args.gib * 2**30) // 272
    table = host_table(rows)
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(rng.integers(0, rows, (8192, COLUMNS)).astype(np.int32)).cuda()
    table.storage.direct_max_rows = 0
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "table_rows": rows}
    zero_row = table.storage.rows.packed.shape[0] - 1
    report["distinct_rows_host_us"] = median_wall_us(lambda: distinct_rows(ids, 0, zero_row), repeats=15,
                                                     until_device_done=False)
    report["prefetch_host_us"] = prefetch_host_us(table, ids)
    print(f"prefetch host time {report['prefetch_host_us']:.0f} us (dedup launches alone "
          f"{report['distinct_rows_host_us']:.0f} us)", flush=True)
    for order in ("prefetch_first", "gemm_first", "prefetch_first", "gemm_first"):
        result = overlap(table, rng, rows, prefetch_before_gemm=0 if order == "prefetch_first" else 1)
        report.setdefault(order, []).append(result)
        print(f"{order:15s}: GEMMs alone {result['gemm_loop_us']:.0f} us, with prefetch "
              f"{result['with_prefetch_us']:.0f} us, slowdown {result['overlap_slowdown_pct']:.1f}%", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
