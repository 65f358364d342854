"""Disk-tier benchmark (CPU, no GPU needed): the row file reader against the disk's random-read ceiling.

Makes (or reuses) a row file of ``--gib`` GiB of random packed rows at V4.1-Flash row shape (272-byte
rows, 15 a 4 KiB page; ``engram.table.disk.row_file``) in ``--directory``, then at each thread count:

* the ceiling: ``disk_read_ceiling.c`` (plain C, pthreads: random 4 KiB O_DIRECT preads over the file's
  pages for ``--seconds``), compiled here with ``cc``;
* the tier's reader: ``engram.table.disk.RowReader`` (``disk_reads.c``'s page reads by a pool of that many
  threads) on fresh uniform random row ids, ``--batch`` ids a call, for ``--seconds``; its rate is distinct
  pages read per second (each a 4 KiB read), the unit of the ceiling.

Prints a table of reads/s of both and ``disk_reads_vs_ceiling`` (reader / ceiling) per thread count, and
writes ``disk-<device>.json`` to ``$OUT`` (or benchmarks/results/): device, torch/Triton versions,
commit, date, the file system of the directory.

    PYTHONPATH=src ENGRAM_COMMIT=<sha> python benchmarks/disk/bench_disk.py --gib 20 --directory /nvme/bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

from engram.table.disk.reads import RowReader, _file_system  # noqa: E402
from engram.table.disk.row_file import (RowFile, RowFileHeader, RowFileLayout, open_row_file,  # noqa: E402
                                        row_file_fingerprint)

PROBE_SOURCE = HERE / "disk_read_ceiling.c"
HEAD_DIM = 256
CHUNK_PAGES = 16384   # 64 MiB of pages generated and written at a time


def bench_layout(gib: float) -> RowFileLayout:
    """The layout of a row file of about ``gib`` GiB (whole pages, at least one)."""
    per_page = RowFileLayout(0, HEAD_DIM).rows_per_page
    pages = max(1, int(gib * 2**30) // 4096)
    return RowFileLayout(pages * per_page - 1, HEAD_DIM)


def make_row_file(directory: Path, gib: float, seed: int = 0) -> tuple[RowFile, bool]:
    """``(checked row file, reused)``: a row file of random rows (tags their index), reused when valid."""
    layout = bench_layout(gib)
    key = f"bench_disk random rows {layout.num_rows} seed {seed}"
    fingerprint = row_file_fingerprint(key, layout)
    path = directory / f"bench-disk-{layout.num_rows}-{fingerprint.hex()[:16]}.engram-rows"
    try:
        return open_row_file(path, fingerprint, layout.num_rows, HEAD_DIM), True
    except ValueError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    header = RowFileHeader(layout, fingerprint, key, "bench_disk random rows", (), False, 0, os.getpid(), time.time())
    rng = np.random.default_rng(seed)
    per_page, row_bytes = layout.rows_per_page, layout.row_bytes
    started = time.perf_counter()
    with open(temporary, "wb") as file:
        file.write(header.encode().ljust(layout.rows_offset, b"\0"))
        for first_page in range(0, layout.num_pages, CHUNK_PAGES):
            pages = min(CHUNK_PAGES, layout.num_pages - first_page)
            block = np.zeros((pages, 4096), dtype=np.uint8)
            rows = block[:, :per_page * row_bytes].reshape(pages, per_page, row_bytes)
            rows[:, :, :HEAD_DIM] = rng.integers(0, 0x7F, (pages, per_page, HEAD_DIM), dtype=np.uint8)
            rows[:, :, HEAD_DIM:HEAD_DIM + HEAD_DIM // 32] = rng.integers(100, 127, (pages, per_page, HEAD_DIM // 32),
                                                                          dtype=np.uint8)
            tags = np.arange(first_page * per_page, (first_page + pages) * per_page, dtype=np.int32)
            rows[:, :, row_bytes - 4:] = tags.view(np.uint8).reshape(pages, per_page, 4)
            file.write(block.tobytes())
        file.flush()
        os.fsync(file.fileno())
        file.seek(0)
        file.write(RowFileHeader(layout, fingerprint, key, "bench_disk random rows", (), True, layout.stored_rows,
                                 os.getpid(), time.time()).encode())
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    print(f"wrote {path} ({layout.file_bytes / 2**30:.2f} GiB) in {time.perf_counter() - started:.1f} s", flush=True)
    return open_row_file(path, fingerprint, layout.num_rows, HEAD_DIM), False


def probe_ceiling(path: Path, layout: RowFileLayout, threads: list[int], seconds: float) -> dict:
    """The C probe's rows by thread count (``{"skipped": why}`` without a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return {"skipped": "no C compiler (cc) on this machine"}
    with tempfile.TemporaryDirectory() as directory:
        program = Path(directory) / "disk_read_ceiling"
        built = subprocess.run([compiler, "-O2", "-pthread", "-o", str(program), str(PROBE_SOURCE)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return {"skipped": f"cc failed: {built.stderr.strip()[:300]}"}
        ran = subprocess.run([str(program), str(path), str(seconds), ",".join(map(str, threads)),
                              str(layout.rows_offset)], capture_output=True, text=True,
                             timeout=60 + 3 * seconds * len(threads))
    if ran.returncode != 0:
        return {"skipped": f"exit {ran.returncode}: {(ran.stderr or ran.stdout).strip()[:300]}"}
    return {int(row["threads"]): row for row in map(json.loads, ran.stdout.splitlines())}


def reader_rate(row_file: RowFile, threads: int, seconds: float, batch: int, seed: int, backend: str) -> dict:
    """Distinct 4 KiB pages the tier's reader reads per second on fresh uniform ids, ``batch`` ids a call."""
    layout = row_file.layout
    rng = np.random.default_rng(seed)
    out = torch.empty(batch, layout.row_bytes, dtype=torch.uint8)
    pages = calls = 0
    elapsed = 0.0
    with RowReader(row_file, threads, backend=backend) as reader:
        while elapsed < seconds:
            ids = rng.integers(0, layout.num_rows, batch)
            distinct = np.unique(ids // layout.rows_per_page).size
            started = time.perf_counter()
            reader.read(ids, out)
            elapsed += time.perf_counter() - started
            pages, calls = pages + distinct, calls + 1
        checked = bool(np.array_equal(out[:, -4:].contiguous().view(torch.int32).flatten().numpy(), ids))
        direct, used = reader.direct, reader.backend
    return {"threads": threads, "reads": pages, "calls": calls, "seconds": elapsed, "reads_per_s": pages / elapsed,
            "GBps": pages * 4096 / elapsed / 1e9, "direct": direct, "backend": used, "tags_checked": checked}


def _versions() -> dict:
    from common import versions   # torch and Triton (None where absent)

    return versions(torch.device("cpu"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=20.0, help="size of the row file (default 20 GiB)")
    parser.add_argument("--directory", type=Path, default=Path.cwd() / ".bench-disk",
                        help="where the row file goes (default ./.bench-disk/)")
    parser.add_argument("--threads", default="1,8,32,128", help="thread counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of reads per thread count and reader")
    parser.add_argument("--batch", type=int, default=4096, help="row ids per call of the tier's reader")
    parser.add_argument("--backend", choices=("auto", "native", "python"), default="auto")
    args = parser.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads: expected comma-separated integers, found {args.threads!r}")
    if not threads or min(threads) < 1 or args.gib <= 0 or args.seconds <= 0 or args.batch < 1:
        parser.error("--threads, --gib, --seconds and --batch must be positive")
    row_file, reused = make_row_file(args.directory, args.gib)
    path, layout = row_file.path, row_file.layout
    ceiling = probe_ceiling(path, layout, threads, args.seconds)
    rows = []
    for count in threads:
        tier = reader_rate(row_file, count, args.seconds, args.batch, seed=count, backend=args.backend)
        probe = ceiling.get(count) if "skipped" not in ceiling else None
        rows.append({"threads": count, "ceiling_reads_per_s": probe["reads_per_s"] if probe else None,
                     "ceiling_direct": bool(probe["direct"]) if probe else None,
                     "reader_reads_per_s": tier["reads_per_s"], "reader": tier,
                     "disk_reads_vs_ceiling": tier["reads_per_s"] / probe["reads_per_s"] if probe else None})
    print(f"{'threads':>8} {'ceiling reads/s':>16} {'reader reads/s':>15} {'disk_reads_vs_ceiling':>22}")
    for row in rows:
        ceiling_text = f"{row['ceiling_reads_per_s']:16,.0f}" if row["ceiling_reads_per_s"] else f"{'-':>16}"
        ratio = f"{row['disk_reads_vs_ceiling']:22.2f}" if row["disk_reads_vs_ceiling"] else f"{'-':>22}"
        print(f"{row['threads']:8d} {ceiling_text} {row['reader_reads_per_s']:15,.0f} {ratio}")
    report = {"benchmark": "bench_disk",
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **_versions(),
              "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "file": str(path), "file_bytes": layout.file_bytes, "file_reused": reused,
              "file_system": _file_system(path), "cpus": os.cpu_count(), "seconds": args.seconds,
              "batch": args.batch, "ceiling": ceiling if "skipped" in ceiling else list(ceiling.values()),
              "rows": rows}
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "cpu" if report["device"] == "cpu" else report["device"].lower().replace("nvidia", "").strip().replace(" ", "-")
    (out_dir / f"disk-{slug}.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
