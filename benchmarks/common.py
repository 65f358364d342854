"""Helpers shared by the GPU benchmarks: the HBM copy ceiling, host-clock and device timing, and
host tables at V4.1-Flash row shape (bench_host.py, bench_cache.py, bench_step.py).

* :func:`copy_ceiling_gbps`: the HBM copy ceiling every kernel benchmark reports against;
* :func:`median_wall_us`: host-clock timing of host work, or of host + device work;
* :func:`gpu_us`: median device time of a call (optionally a CUDA-graph replay);
* :func:`host_table`: a placement "host" table of random rows in host memory (2 MiB pages
  where the OS gives them, as a loaded table has), filled from the GPU in 1 GiB pieces;
* :func:`table_over_rows`: another placement over the same pinned rows, without a copy;
* :func:`fold_ids`: hash ids of a real table folded into a smaller table's row range;
* :func:`host_gather_ceiling`: the host's random-row gather rate, by the plain C program
  ``host_gather_ceiling.c`` (pthreads, no Python; 196,608 = 8192 x 24 rows of 272 B, fresh sorted ids
  per gather), compiled with ``cc`` here and run over thread counts and prefetch distances; best median;
* :func:`host_path_alone`: the library's host path end to end at ``T`` tokens, measured alone: one
  layer's ``prefetch`` to its rows on the device (``lookup_packed`` and a sync), wall clock;
* for the parallel benchmarks: :func:`small_spec` (a CPU-sized geometry), :class:`StageTimer` (the same
  number of calls on every rank), :func:`device_slug` and :func:`versions` (report names and facts).
"""

from __future__ import annotations

import datetime
import inspect
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import engram
from engram.layout import EngramLayout
from engram.table.host_memory.rows import PackedRows, packed_row_bytes, write_row_tags

HEAD_DIM, COLUMNS = 256, 24  # V4.1-Flash: 256 E4M3 values + 8 UE8M0 scales per row, 24 columns per token
ROW_BYTES_ON_DISK = HEAD_DIM + HEAD_DIM // 32  # 264


def copy_ceiling_gbps(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy of ``num_bytes`` random bytes: (read + written) / median time."""
    import triton.testing

    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    milliseconds = triton.testing.do_bench(lambda: target.copy_(source), warmup=50, rep=300, return_mode="median")
    return 2 * num_bytes / (milliseconds * 1e-3) / 1e9


def median_wall_us(call, repeats: int = 30, warmup: int = 3, *, until_device_done: bool = True) -> float:
    """Median microseconds of ``call()``, each run alone after a device sync. With
    ``until_device_done`` the clock stops after a second sync (the call's whole latency);
    without, when the call returns (the host time an engine's thread pays)."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if until_device_done:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_us(call, graph: bool = False) -> float:
    """Median microseconds of ``call()`` on the device (triton's do_bench); with ``graph`` the
    call is captured once in a CUDA graph and its replays are timed."""
    import triton.testing

    if not graph:
        return triton.testing.do_bench(call, warmup=10, rep=100, return_mode="median") * 1e3
    return triton.testing.do_bench(captured_graph(call)[0].replay, warmup=10, rep=100, return_mode="median") * 1e3


def captured_graph(body, capture_error_mode: str = "global"):
    """``(graph, body())``: ``body`` run once on a side stream (kernels compiled, buffers grown outside the
    capture), then captured in a CUDA graph. ``capture_error_mode="thread_local"`` where other threads (the host
    gather's workers) may touch CUDA while this one captures."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        output = body()
    return graph, output


def host_table(rows: int, head_dim: int = HEAD_DIM, seed: int = 0,
               distinct_rows: int | None = None) -> engram.EngramTable:
    """A placement "host" table of ``rows`` random rows (E4M3 bytes below NaN, scales 0..126) on
    ``cuda``; its rows stay alive with the table (``table.storage.host_buffer``). ``distinct_rows``:
    draw only that many random rows and repeat them through the table (the fill is then host-to-host
    copies, without a device-to-host copy per GiB; reads move the same bytes), else every row is drawn."""
    from engram.table.host_memory.buffers import allocate_host_buffer

    started = time.perf_counter()
    row_bytes = packed_row_bytes(head_dim)
    generator = torch.Generator("cuda").manual_seed(seed)

    def random_rows(count: int) -> torch.Tensor:
        return torch.randint(0, 0x7F, (count, row_bytes), dtype=torch.uint8, device="cuda", generator=generator)

    def fill(buffer: torch.Tensor) -> None:
        packed = PackedRows.view_of(buffer, rows, head_dim).packed
        pattern = None if distinct_rows is None else random_rows(min(rows, distinct_rows)).cpu()
        piece = (1 << 30) // row_bytes if pattern is None else pattern.shape[0]
        for first in range(0, rows, piece):
            last = min(rows, first + piece)
            packed[first:last].copy_(random_rows(last - first).cpu() if pattern is None else pattern[:last - first])
        packed[:-1, head_dim + head_dim // 32:].zero_()
        write_row_tags(packed)  # the copies above overwrote each row's tag (its index, in its last 4 bytes)

    nbytes = (rows + 1) * row_bytes
    buffer = allocate_host_buffer(nbytes, fill=fill, read_only=False)
    packed = PackedRows(buffer.tensor[:nbytes].view(rows + 1, row_bytes), head_dim)
    table = engram.EngramTable(packed.values, packed.scales, placement="host", device="cuda", validate=False,
                               check_values=False)  # finite by construction; a scan of ~100 GB is not timed
    table.storage.host_buffer = buffer
    print(f"host table: {rows:,} rows, {nbytes / 2**30:.1f} GiB, huge pages {buffer.huge_pages} "
          f"({buffer.huge_page_bytes / 2**30:.1f} GiB), built in {time.perf_counter() - started:.1f} s", flush=True)
    return table


def table_over_rows(host: engram.EngramTable, placement: str, **placement_options) -> engram.EngramTable:
    """Placement ``placement`` over the rows of the host table ``host``: ``"host"`` and ``"cached"``
    share its pinned rows; ``"device"`` gets one copy of the packed rows in HBM (one contiguous
    transfer, the values and scales strided views of it)."""
    rows = host.storage.rows
    if placement == "device":
        packed = rows.packed.to("cuda")
        head_dim = rows.head_dim
        values, scales = packed[:-1, :head_dim], packed[:-1, head_dim: head_dim + head_dim // 32]
        return engram.EngramTable(values, scales, placement="device", device="cuda", validate=False,
                                  check_values=False)
    return engram.EngramTable(rows.values, rows.scales, placement=placement, device="cuda", validate=False,
                              placement_options=placement_options or None, check_values=False)


def fold_ids(ids: np.ndarray, rows: int) -> np.ndarray:
    """Hash ids of a larger table folded into ``[0, rows)`` (``id % rows``), int32."""
    return (np.asarray(ids, dtype=np.int64) % rows).astype(np.int32)


# ---- ceilings and the host path alone, measured beside bench_step.py's steps -------------------
HERE = Path(__file__).resolve().parent
CEILING_SOURCE = HERE / "host" / "host_gather_ceiling.c"
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
    rows of the lookup, T x C, over the median), and ``stages``: medians (us from the prefetch call) of
    when each part was done (:func:`_path_stages`)."""
    samples, rows, rows_bytes, stages = [], 0, 0, []
    takes_ticket = "prefetch" in inspect.signature(table.lookup_packed).parameters
    gather = getattr(table.storage, "host_gather", None)
    for repeat in range(repeats + 1):
        ids = make_ids()
        torch.cuda.synchronize()
        marks = {name: torch.cuda.Event(enable_timing=True) for name in ("start", "enqueued", "copied", "read")}
        started = time.monotonic_ns()
        marks["start"].record()
        ticket = table.prefetch(ids)
        prefetched = time.monotonic_ns()
        marks["enqueued"].record()  # the caller's stream after the prefetch: dedup and the ids' copy
        if gather is not None:
            marks["copied"].record(gather.copy_stream)  # the copy stream after the gather's last copy
        handed = {"prefetch": ticket} if ticket is not None and takes_ticket else {}
        values, _ = table.lookup_packed(ids, **handed)
        looked_up = time.monotonic_ns()
        marks["read"].record()
        torch.cuda.synchronize()
        ended = time.monotonic_ns()
        if repeat:  # the first one grows the staging buffers
            samples.append((ended - started) / 1e3)
            stages.append(_path_stages(started, prefetched, looked_up, ended, marks, gather))
        rows, rows_bytes = ids.numel(), ids.numel() * CEILING_ROW_BYTES
        del values
    median = statistics.median(samples)
    names = [name for name in stages[0] if all(name in stage for stage in stages)]
    return {"median_us": median, "min_us": min(samples), "rows": rows,
            "GBps": rows_bytes / (median * 1e-6) / 1e9, "repeats": repeats,
            "gather_threads": getattr(gather, "gather_threads", None), "worker": getattr(gather, "worker", None),
            "stages": {name: round(statistics.median(stage[name] for stage in stages), 1) for name in names}}


def _path_stages(started: int, prefetched: int, looked_up: int, ended: int, marks: dict, gather) -> dict:
    """One host path's parts, us after ``started`` (``time.monotonic_ns``): ``host_prefetch`` and
    ``host_lookup`` (the calls returned), ``gpu_enqueued`` (the caller's stream done with the prefetch's
    work: dedup, ids' copy), ``worker_ids_seen``, ``worker_staging_free``, ``worker_wave_<k>`` and
    ``worker_done`` (the native worker's clock of the same job), ``gpu_copied`` (the copy stream's last
    copy), ``gpu_read`` (the lookup's rows on the device), ``total``. GPU marks count from an event
    recorded as the clock started (the queue empty, so within a launch of it)."""
    stage = {"host_prefetch": (prefetched - started) / 1e3, "host_lookup": (looked_up - started) / 1e3,
             "gpu_enqueued": marks["start"].elapsed_time(marks["enqueued"]) * 1e3,
             "gpu_read": marks["start"].elapsed_time(marks["read"]) * 1e3, "total": (ended - started) / 1e3}
    if gather is not None:
        stage["gpu_copied"] = marks["start"].elapsed_time(marks["copied"]) * 1e3
    service = getattr(gather, "native_service", None) if getattr(gather, "worker", None) == "native" else None
    timeline = service.last_job() if service is not None else None
    if timeline is not None and timeline["ids_ready_ns"] >= started:
        stage["worker_ids_seen"] = (timeline["ids_ready_ns"] - started) / 1e3
        stage["worker_staging_free"] = (timeline["staging_free_ns"] - started) / 1e3
        for wave, end in enumerate(timeline["wave_end_ns"]):
            stage[f"worker_wave_{wave}"] = (end - started) / 1e3
        stage["worker_done"] = (timeline["done_ns"] - started) / 1e3
        stage["worker_leader_chunk_share"] = timeline["leader_chunks"] / max(1, timeline["chunks"])
    return stage


# ---- the parallel benchmarks (bench_parallel.py and its node section, parallel_node.py) -------------
V41_CONFIG = Path(__file__).resolve().parents[1] / "src" / "engram" / "configs" / "deepseek-v4.1-flash.json"
ID_SETS = 4
LAYER_INDEX = 0  # Engram layer 1, 384,006,168 rows
L2_FLUSH_BYTES = 256 << 20


def small_spec() -> engram.EngramSpec:
    """A CPU-sized geometry with V4.1's 24 columns and hc 4: head_dim 64, hidden 256, buckets near 1009."""
    config = {
        "engram_layer_ids": [1], "engram_num_embeddings": [1], "engram_max_ngram_size": 4, "engram_n_heads": 8,
        "engram_head_dim": 64, "engram_vocab_size": 1009, "engram_compressed_vocab_size": 40,
        "engram_pad_token_id": 2, "hidden_size": 256, "hc_mult": 4, "rms_norm_eps": 1e-6,
    }
    spec = engram.EngramSpec.from_hf_config(config, check_rows=False)
    config["engram_num_embeddings"] = EngramLayout(spec).num_embeddings
    return engram.EngramSpec.from_hf_config(config)


class StageTimer:
    """Times a call the same number of times on every rank (see the module docstring)."""

    def __init__(self, device: torch.device, iterations: int, warmup: int):
        self.device, self.iterations, self.warmup = device, iterations, warmup
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if self.cuda else None
        self.token = torch.zeros(1, dtype=torch.float32, device=device)

    def _line_up(self) -> None:
        if self.cuda:
            dist.all_reduce(self.token)  # on the current stream: ranks leave it together
        else:
            dist.barrier()

    def time(self, call, collective: bool) -> dict:
        """``call(i)`` for ``i`` in 0.. -> ``{"us", "us_p10", "us_p90"}`` over ``iterations`` calls."""
        for i in range(self.warmup):
            call(i)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.iterations)]
            for i, (start, end) in enumerate(events):
                self.flush.zero_()
                if collective:
                    self._line_up()
                start.record()
                call(i)
                end.record()
            torch.cuda.synchronize(self.device)
            times = [start.elapsed_time(end) * 1e3 for start, end in events]
        else:
            times = []
            for i in range(self.iterations):
                if collective:
                    self._line_up()
                started = time.perf_counter()
                call(i)
                times.append((time.perf_counter() - started) * 1e6)
        quantiles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        return {"us": statistics.median(times), "us_p10": quantiles[0], "us_p90": quantiles[-1]}


def device_slug(device: torch.device) -> str:
    """``h200`` for "NVIDIA H200", ``cpu`` for the CPU: the device part of the JSON's name."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


def report_header(mode: str | None, device: torch.device, options: dict, world_size: int) -> dict:
    """The fields a parallel benchmark's report opens with: what ran, where, on which versions and
    commit, when, and the NCCL environment the ranks inherited."""
    from engram.parallel import NCCL_ENVIRONMENT

    header = {"benchmark": "bench_parallel", **({"mode": mode} if mode else {}),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **versions(device), "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "backend": options["backend"], "world_size": world_size, "small": options["small"],
              "environment": {key: os.environ.get(key) for key in NCCL_ENVIRONMENT}}
    return header


def versions(device: torch.device) -> dict:
    """torch, Triton, and on CUDA the NCCL and CUDA versions, for a report."""
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
        versions["cuda"] = torch.version.cuda
    return versions
