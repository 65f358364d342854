"""Read path (b) of host tables: rows gathered on the host, moved by the copy engine.

The caller's stream finds the lookup's distinct rows (:mod:`engram.table.host_dedup`, no
sync), copies them with their count to a pinned buffer and records an event; a worker
thread waits for that event (the caller never does), gathers each distinct row once into
pinned staging in waves, and after each wave enqueues its host-to-device copy on a copy
stream, so the copy of one wave overlaps the gather of the next. The consumer makes its
stream wait on the last copy's event and reads the rows from the device staging buffer
through the lookup's ``inverse``.

The rows are copied by the prefetching C gather (:mod:`engram.table.native_gather`) on
``GATHER_THREADS`` pool threads, all waves started at once and waited for in order (the
worker only waits and enqueues copies); without a C compiler, by ``index_select`` on the
worker's ``GATHER_THREADS`` intra-op threads, one wave after the other.

Buffers are persistent (grown, never shrunk) and guarded by events: the host staging
is rewritten only after the previous copies finished, the device staging only after
the previous reader ran.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from dataclasses import dataclass

import torch

from ..common import next_power_of_2
from .host_dedup import distinct_rows
from .native_gather import gather_rows_prefetch, start_gather_rows

__all__ = ["HostGather", "GatherTicket", "gather_packed_rows_host", "GATHER_THREADS"]

# The gather runs in waves (each wave's copy overlaps the next wave's gather) over the
# distinct rows, ascending. H200 host (16 cores, KVM), 196,608 distinct rows of 272 B from
# DRAM (probe_host_pipeline.py, NOTES "Host tables v2"): torch index_select, one call 2.4 ms
# (22 GB/s, bound by DRAM latency: one row in flight per thread), 4 waves 0.75-0.85 ms each;
# 14 threads beat 16 (the caller's thread and the CUDA driver's keep their cores); the copy
# of all rows 1.0 ms. The C gather prefetches rows ahead instead: 1.7x index_select per thread
# on a 2-vCPU AMD KVM (probe_row_gather.py, NOTES "Host tables v3"); not yet measured on the H200.
_MIN_WAVE_ROWS = 16384
_MAX_WAVES = 4
GATHER_THREADS = max(1, len(os.sched_getaffinity(0)) - 2) if hasattr(os, "sched_getaffinity") else 1


def gather_packed_rows_host(packed: torch.Tensor, global_ids: torch.Tensor, row_start: int,
                            out: torch.Tensor) -> None:
    """``out[i] = packed[global_ids[i] - row_start]``, the zero row (``packed[-1]``) for ids
    outside the table. ``packed uint8 [rows + 1, row_bytes]``, ``global_ids`` int ``[N]``,
    ``out uint8 [N, row_bytes]``, all on the CPU. Copied by the C gather on ``GATHER_THREADS``
    threads when ``packed`` and ``out`` are contiguous, else by ``index_select``."""
    zero_row = packed.shape[0] - 1
    local = global_ids.reshape(-1).to(torch.int64) - row_start
    local = torch.where((local >= 0) & (local < zero_row), local, torch.full_like(local, zero_row))
    if packed.is_contiguous() and out.is_contiguous():
        gather_rows_prefetch(packed, local, out, GATHER_THREADS)
    else:
        torch.index_select(packed, 0, local, out=out)


_WORKER: list[concurrent.futures.ThreadPoolExecutor] = []
def _shared_worker() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for every table of the process: gathers run one at a time, in
    the order they were started (layer by layer), each on ``GATHER_THREADS`` threads (the C
    gather's pool; on the torch fallback, this thread's intra-op threads), instead of
    several gathers fighting over the cores. With the C gather the worker itself only
    waits and enqueues copies: its OpenMP team runs no parallel region, so it never spins
    on the cores the pool copies on."""
    if not _WORKER:
        _WORKER.append(concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engram-host-gather",
            initializer=torch.set_num_threads, initargs=(GATHER_THREADS,)))  # this thread's OpenMP team only
    return _WORKER[0]


@dataclass
class GatherTicket:
    """One started gather: ``future`` returns the event of its last copy once every copy is
    enqueued; ``inverse`` (int32 on the device, the lookup's shape) maps each lookup to its
    row in the device staging."""

    future: concurrent.futures.Future
    inverse: torch.Tensor


class HostGather:
    """Path (b) for one table: ``start`` on the caller's stream, ``finish`` where the rows
    are needed (see the module docstring).

    ``packed``: pinned CPU ``uint8 [rows + 1, row_bytes]`` (last row zero); ``device``:
    where the rows land.
    """

    def __init__(self, packed: torch.Tensor, device: torch.device):
        self.packed = packed
        self.device = device
        self.row_bytes = packed.shape[1]
        self.capacity = 0
        self.copy_stream = torch.cuda.Stream(device)
        self._worker = _shared_worker()
        self._copies_done: torch.cuda.Event | None = None  # the last copies: host staging free after it
        self._consumed: torch.cuda.Event | None = None     # the last reader: device staging free after it
        self._last_future: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def _ensure_capacity(self, num_rows: int) -> None:
        if num_rows <= self.capacity:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"host gather of {num_rows} rows needs larger staging buffers, which cannot be "
                               "allocated during CUDA-graph capture: run one eager step of this size first")
        # Grown buffers replace ones a pending gather or reader may still use: let them finish.
        if self._last_future is not None:
            self._last_future.result()
        for event in (self._copies_done, self._consumed):
            if event is not None:
                event.synchronize()
        capacity = next_power_of_2(num_rows)
        self.staging_host = torch.empty(capacity, self.row_bytes, dtype=torch.uint8, pin_memory=True)
        self.staging_device = torch.empty(capacity, self.row_bytes, dtype=torch.uint8, device=self.device)
        self.capacity = capacity

    def start(self, global_ids: torch.Tensor, row_start: int, stream: torch.cuda.Stream) -> GatherTicket:
        """Begin gathering the rows of ``global_ids`` (int32/int64, any shape, at least one id, on
        the device; ``packed[0]`` is row ``row_start``): enqueues the dedup and the id copy on
        ``stream`` and returns at once."""
        num_ids = global_ids.numel()
        if num_ids == 0:
            raise ValueError("global_ids: the host gather needs at least one id, found an empty tensor")
        with self._lock:
            self._ensure_capacity(num_ids)
            # A pinned id buffer per gather (torch's caching host allocator): the worker may
            # still be reading the previous one.
            ids_host = torch.empty(num_ids + 1, dtype=torch.int32, pin_memory=True)
            ids_ready = torch.cuda.Event()
            with torch.cuda.stream(stream):
                distinct = distinct_rows(global_ids, row_start, self.packed.shape[0] - 1)
                ids_host.copy_(distinct.rows_and_count, non_blocking=True)
                ids_ready.record(stream)
            if self._consumed is not None:  # the device staging's last reader runs first
                self.copy_stream.wait_event(self._consumed)
            future = self._worker.submit(self._gather, ids_host, ids_ready)
            self._last_future = future
            return GatherTicket(future, distinct.inverse.view(global_ids.shape))

    def _gather(self, ids_host: torch.Tensor, ids_ready: torch.cuda.Event) -> torch.cuda.Event:
        """Worker thread (one; tasks run in order): wait for the ids and for the previous
        task's copies (the host staging is then free), start the gather of every wave (the C
        gather's pool threads take the blocks in order), enqueue each wave's copy as soon as
        it is gathered."""
        ids_ready.synchronize()
        if self._copies_done is not None:
            self._copies_done.synchronize()
        num_ids = ids_host.numel() - 1
        num_rows = min(max(int(ids_host[num_ids]), 1), num_ids)  # clamped: the count came from the device
        rows = ids_host[:num_rows]
        num_waves = max(1, min(_MAX_WAVES, num_rows // _MIN_WAVE_ROWS))
        bounds = [num_rows * k // num_waves for k in range(num_waves + 1)]
        gathered = start_gather_rows(self.packed, rows, self.staging_host[:num_rows], GATHER_THREADS,
                                     wave_ends=bounds[1:])
        try:
            with torch.cuda.device(self.device):
                for wave, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                    gathered.wait(wave)
                    with torch.cuda.stream(self.copy_stream):
                        self.staging_device[begin:end].copy_(self.staging_host[begin:end], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
        except BaseException:
            gathered.join()  # no pool thread may still write the staging once this task ends
            raise
        self._copies_done = done
        return done

    def finish(self, ticket: GatherTicket, stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, inverse)``: the gathered distinct rows ``uint8 [capacity, row_bytes]`` on the
        device, ordered after the copies on ``stream``, and the lookup's ``inverse`` into them.
        Blocks the calling thread only until the worker has enqueued the copies (never until
        they run). Call :meth:`consumed` once their reader is enqueued."""
        done = ticket.future.result()
        stream.wait_event(done)
        return self.staging_device, ticket.inverse

    def consumed(self, stream: torch.cuda.Stream) -> None:
        """Mark the device staging free once ``stream``'s work so far has run."""
        event = torch.cuda.Event()
        event.record(stream)
        self._consumed = event

    def wait_idle(self) -> None:
        """Block until every started gather has enqueued its copies (tests, shutdown)."""
        if self._last_future is not None:
            self._last_future.result()
