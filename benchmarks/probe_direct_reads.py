"""Direct reads of host rows by the GPU at larger T: launch shape and table size (issue 11).

The direct path (the gather kernel reading pinned host memory over PCIe) reaches ~24 GB/s of rows
at T = 64 (1,536 rows) but ~7.5 GB/s from T = 1024 up on the H200 (bench_host.py), where it runs the
gather's default launch shape; the one-row-per-warp decode shape was only timed at T = 64. This times
T in {64, 1024, 8192} x launch shapes, on a small and a large table (does the rate fall with the
table's size, i.e. with address-translation misses on the host side, or with T?). Uniform ids,
V4.1-Flash rows (272 B packed), graph-replayed up to T = 1024, events beyond. Prints a table;
``--json PATH`` writes the rows.

    PYTHONPATH=src python benchmarks/probe_direct_reads.py [--gib 4,32] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_table_fixture import COLUMNS, gpu_us, host_table  # noqa: E402

SHAPES = (None, (1, 1, 16), (2, 1, 16), (4, 2, 16), (8, 4, 16))  # None: the path's own choice


def main() -> None:
    from engram.table.kernels.gather import GatherConfig
    from engram.table.host_memory.rows import packed_row_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", default="4,32")
    parser.add_argument("--tokens", default="64,1024,8192")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    row_bytes = packed_row_bytes(256)
    rng = np.random.default_rng(7)
    results = []
    for gib in (float(g) for g in args.gib.split(",")):
        rows = int(gib * 2**30) // row_bytes
        table = host_table(rows)
        storage = table.storage
        storage.direct_max_rows = 10**12  # every size through the direct path
        for tokens in (int(t) for t in args.tokens.split(",")):
            ids = torch.from_numpy(rng.integers(0, rows, (tokens, COLUMNS)).astype(np.int32)).cuda()
            expected = None
            for shape in SHAPES:
                storage.direct_config = None if shape is None else GatherConfig(
                    block_rows=shape[0], num_warps=shape[1], vector=shape[2])
                found = table.lookup_packed(ids)
                if expected is None:
                    expected = found
                elif not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(found, expected)):
                    raise AssertionError(f"shape {shape} read other bytes than the default at T = {tokens}")
                us = gpu_us(lambda: table.lookup_packed(ids), graph=tokens <= 1024)
                row = {"table_GiB": gib, "T": tokens, "shape": shape, "us": us,
                       "GBps": tokens * COLUMNS * row_bytes / us / 1e3}
                results.append(row)
                print(row, flush=True)
        storage.direct_config = None
        del table, storage
        gc.collect()
    print(f"\n{'GiB':>5} {'T':>6} {'shape (rows, warps, vector)':>28} {'us':>9} {'GB/s':>6}")
    for row in results:
        print(f"{row['table_GiB']:>5.0f} {row['T']:>6} {str(row['shape'] or 'default'):>28} {row['us']:9.1f} "
              f"{row['GBps']:6.1f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": results}, indent=2))


if __name__ == "__main__":
    main()
