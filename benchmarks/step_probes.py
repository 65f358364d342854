"""Ceilings measured beside ``bench_step.py``'s steps, in the same run:

* :func:`host_gather_ceiling`: the host's random-row gather rate, by the plain C program
  ``host_gather_ceiling.c`` (pthreads, no Python; 196,608 = 8192 x 24 rows of 272 B, fresh sorted ids
  per gather), compiled with ``cc`` here and run over thread counts and prefetch distances; best median;
* :func:`host_path_alone`: the library's host path end to end at ``T`` tokens, measured alone: one
  layer's ``prefetch`` to its rows on the device (``lookup_packed`` and a sync), wall clock.

The copy engine's host-to-device rate is ``bench_host.copy_engine_gbps``.
"""

from __future__ import annotations

import inspect
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CEILING_SOURCE = HERE / "host_gather_ceiling.c"
CEILING_ROWS, CEILING_ROW_BYTES = 196_608, 272  # the C program's GATHER_ROWS and ROW_BYTES
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def parse_ceiling_output(text: str) -> list[dict]:
    """The C program's result rows: ``{threads, distance, median_ms, min_ms, GBps, printed_GBps}``;
    ``GBps`` is the row bytes over the median, from its printed ms (the printed rate has one decimal)."""
    rows = []
    for line in text.splitlines():
        found = _ROW.match(line)
        if found:
            threads, distance, median_ms, min_ms, gbps = found.groups()
            rows.append({"threads": int(threads), "distance": int(distance), "median_ms": float(median_ms),
                         "min_ms": float(min_ms),
                         "GBps": CEILING_ROWS * CEILING_ROW_BYTES / (float(median_ms) * 1e-3) / 1e9,
                         "printed_GBps": float(gbps)})
    return rows


def host_gather_ceiling(table_gib: int, threads: str, distances: str, timeout_s: float = 120) -> dict:
    """Compile and run the C ceiling; ``{"best_GBps", "best", "rows", "output"}``, or ``{"skipped": why}``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return {"skipped": "no C compiler (cc) on this machine"}
    with tempfile.TemporaryDirectory() as directory:
        program = Path(directory) / "host_gather_ceiling"
        built = subprocess.run([compiler, "-O3", "-pthread", "-o", str(program), str(CEILING_SOURCE)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return {"skipped": f"cc failed: {built.stderr.strip()[:300]}"}
        started = time.perf_counter()
        ran = subprocess.run([str(program), str(table_gib), threads, distances], capture_output=True, text=True,
                             timeout=timeout_s)
    rows = parse_ceiling_output(ran.stdout)
    if ran.returncode != 0 or not rows:
        return {"skipped": f"exit {ran.returncode}: {(ran.stderr or ran.stdout).strip()[:300]}"}
    best = max(rows, key=lambda row: row["GBps"])
    return {"best_GBps": best["GBps"], "best": best, "rows": rows, "table_gib": table_gib,
            "gather_rows": CEILING_ROWS, "row_bytes": CEILING_ROW_BYTES, "seconds": time.perf_counter() - started,
            "output": ran.stdout[-4000:]}


def host_path_alone(table, make_ids, repeats: int = 10) -> dict:
    """One layer's host path measured alone: ``table.prefetch(ids)`` then ``table.lookup_packed(ids)`` and
    a device sync, wall clock from the prefetch, for fresh ``ids = make_ids()`` (``[T, C]`` on the device)
    each time (made before the clock starts). Returns the median, min and the row rate (packed 272-byte
    rows of the lookup, T x C, over the median)."""
    samples, rows, rows_bytes = [], 0, 0
    takes_ticket = "prefetch" in inspect.signature(table.lookup_packed).parameters
    for repeat in range(repeats + 1):
        ids = make_ids()
        torch.cuda.synchronize()
        started = time.perf_counter()
        ticket = table.prefetch(ids)
        handed = {"prefetch": ticket} if ticket is not None and takes_ticket else {}
        values, _ = table.lookup_packed(ids, **handed)
        torch.cuda.synchronize()
        if repeat:  # the first one grows the staging buffers
            samples.append((time.perf_counter() - started) * 1e6)
        rows, rows_bytes = ids.numel(), ids.numel() * CEILING_ROW_BYTES
        del values
    median = statistics.median(samples)
    return {"median_us": median, "min_us": min(samples), "rows": rows,
            "GBps": rows_bytes / (median * 1e-6) / 1e9, "repeats": repeats}
