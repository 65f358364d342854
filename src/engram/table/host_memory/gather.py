"""Read path (b) of host tables: rows gathered on the host, moved by the copy engine.

The caller's stream finds the lookup's distinct rows (:mod:`engram.table.kernels.dedup`, no
sync) and copies them with their count to a pinned buffer; a worker gathers each distinct row
once into pinned staging in waves on ``gather_threads`` threads, and each wave's host-to-device
copy on a copy stream overlaps the gather of the next. The consumer's stream waits on the last
copy and reads the rows from the device staging through the lookup's ``inverse``.

The protocol between the GPU, this module and the native worker: docs/design.md, "The host-gather
protocol" (constants, job record and comparison rule in :mod:`~engram.table.host_memory.gather_protocol`).

Two workers (``worker=``):

* ``"native"`` (default where a C compiler and the driver's stream memory operations are found):
  :mod:`~engram.table.host_memory.native_worker`, threads in C that make no CUDA call and take no
  GIL. ``start`` enqueues everything at once: on the caller's stream the dedup, the ids' copy and a
  write of "ids ready" (:mod:`~engram.table.host_memory.stream_memory_ops`); on the copy stream, per
  wave, a wait for the worker's "wave done" word and the wave's copy (sized for every id, as the
  distinct count is known only on the device). No thread ever waits for a gather: ``finish`` only
  makes the stream wait. With ``dedup`` ``"never"`` (or ``"auto"`` while the table's lookups repeat
  few rows) the sort is skipped: one launch writes every lookup's row in lookup order, the worker
  copies them all and the inverse is the identity.
* ``"python"``: a Python worker thread waits for the ids' event, copies rows with ``index_select``
  (:mod:`~engram.table.host_memory.row_copy`) and enqueues each wave's copy; ``finish`` blocks the
  caller until the worker has enqueued them (not until they ran). A stream waiting on a word that
  this worker writes deadlocked on the H200 behind a module load (benchmarks/NOTES.md "Host gather:
  the consumer's wait"): its next CUDA call waited for the device, which waited for it.

Every :meth:`HostGather.start` makes the tickets of earlier gathers stale (they share the
staging): :meth:`HostGather.current` tells, and a stale ticket is never finished.

Under CUDA-graph capture, :meth:`HostGather.start_replayed` captures a gather into the graph (native
worker only): buffers of its own, fixed for the graph's life, and a replayed job of the worker
(gather_protocol, "Replayed jobs"), so every replay gathers that replay's ids with nothing from the
caller's thread. A replay that the worker does not take within :data:`REPLAY_BOUND_S` (held up, paused,
stopped) is answered by the worker's watchdog with the staging unwritten: the consumer's per-row id check
then reads those rows from host memory directly, so the graph finishes with exact rows either way.

Buffers are persistent (grown, never shrunk) and guarded: the host staging is rewritten only after
the previous copies ran (an event, or the GPU's "staging free" word), the device staging only after
the previous reader ran.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from engram.checks import HOST_GATHER_DEDUP, HOST_GATHER_WORKERS, check_choice, check_int
from engram.common import next_power_of_2
from engram.environment import local_world_size
from engram.table.kernels.dedup import distinct_rows, rows_in_lookup_order
from engram.table.host_memory import native_worker, openmp_team, stream_memory_ops
from engram.table.host_memory.gather_protocol import FLAG_WORDS, JOB_DONE, MAX_WAVES, STAGING_FREE, WAVES_DONE
from engram.table.host_memory.rows import row_tags
from engram.table.host_memory.row_copy import gather_rows, start_gather_rows
from engram.tuning import tuning

__all__ = ["HostGather", "GatherTicket", "gather_packed_rows_host", "default_gather_threads", "check_gather_options"]

# Read once from the device kind's tuning file (engram.tuning, keys host_gather.*; each cites its
# measurement). The gather runs in waves (each wave's copy overlaps the next wave's gather) over the
# distinct rows, ascending: at most _MAX_WAVES of at least _MIN_WAVE_ROWS rows. The native worker has no
# barrier between waves, so more of them (_MAX_WAVES_NATIVE) only shorten the last copy; its waves shrink
# by _WAVE_SHRINK from one to the next, so that the last one, whose copy nothing hides, is small while
# each wave's copy still ends before the next, smaller one is gathered.
# host_gather_dedup="auto": sort while the share of repeated rows, measured on every _DEDUP_REMEASURE-th
# gather of the table, is at least _DEDUP_MIN_REPEATS (the sort's GPU and host time against copying
# every row).
_TUNED = tuning().host_gather
_MIN_WAVE_ROWS = _TUNED.min_wave_rows
_MAX_WAVES = _TUNED.max_waves
_MAX_WAVES_NATIVE = _TUNED.max_waves_native
_WAVE_SHRINK = _TUNED.wave_shrink
_DEDUP_MIN_REPEATS = _TUNED.dedup_min_repeats
_DEDUP_REMEASURE = _TUNED.dedup_remeasure
if _MAX_WAVES_NATIVE > MAX_WAVES:
    raise ValueError(f"tuning: host_gather.max_waves_native: expected at most the native protocol's MAX_WAVES = "
                     f"{MAX_WAVES}, found {_MAX_WAVES_NATIVE}")
_ID_BUFFERS = 4  # pinned id buffers per table for the native worker, each reused once its job is done


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_gather_threads(processes_per_node: int | None = None) -> int:
    """Host-gather threads of one process: its usable cores divided by the processes sharing the
    node (``processes_per_node``, else ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1), at least 1.
    Eight ranks on one node then split its cores instead of each taking all of them."""
    sharing = processes_per_node if processes_per_node is not None else (local_world_size() or 1)
    return max(1, _usable_cores() // max(1, sharing))


def check_gather_options(gather_threads, worker, dedup) -> None:
    """The host gather's options as a caller gives them: ``gather_threads`` None or an integer >= 1,
    ``host_gather_worker`` one of :data:`~engram.checks.HOST_GATHER_WORKERS`, ``host_gather_dedup`` one
    of :data:`~engram.checks.HOST_GATHER_DEDUP`."""
    check_int("gather_threads", gather_threads, 1, optional=True)
    check_choice("host_gather_worker", worker, HOST_GATHER_WORKERS)
    check_choice("host_gather_dedup", dedup, HOST_GATHER_DEDUP)


_WARNED: list[str] = []


def _resolve_worker(worker: str, device: torch.device) -> str:
    """``"native"`` or ``"python"`` for ``worker`` on ``device`` (``"auto"``: native where it can run,
    with one warning per process where it cannot)."""
    if worker == "python":
        return worker
    reason = native_worker.unavailable_reason()
    if reason is None and not stream_memory_ops.available(device):
        reason = f"the CUDA driver does not run stream memory operations on {device}"
    if reason is None:
        return "native"
    if worker == "native":
        raise RuntimeError(f"host_gather_worker='native': {reason}")
    if not _WARNED:
        _WARNED.append(reason)
        warnings.warn(f"host gather: the native worker is unavailable ({reason}); using the Python worker, whose "
                      "consumer waits on its thread until each gather's copies are enqueued", RuntimeWarning,
                      stacklevel=3)
    return "python"


def _num_waves(num_rows: int, most: int = _MAX_WAVES) -> int:
    return max(1, min(most, num_rows // _MIN_WAVE_ROWS))


def shrinking_wave_ends(num_rows: int, num_waves: int, shrink: float = _WAVE_SHRINK) -> list[int]:
    """Ends ``[e_1, ..., e_W = num_rows]`` of ``num_waves`` waves (``<= num_rows``) whose sizes fall
    geometrically, wave ``k`` about ``shrink**k`` times the first, each at least one row; ``shrink``
    in ``(0, 1]`` (1: even waves)."""
    if not 0 < shrink <= 1:
        raise ValueError(f"shrink: expected a number in (0, 1], found {shrink!r}")
    if shrink == 1:
        return native_worker.even_wave_ends(num_rows, num_waves)
    total = 1 - shrink**num_waves
    ends, previous = [], 0
    for wave in range(1, num_waves + 1):
        end = round(num_rows * (1 - shrink**wave) / total)
        previous = min(max(end, previous + 1), num_rows - (num_waves - wave))
        ends.append(previous)
    return ends


def gather_packed_rows_host(packed: torch.Tensor, global_ids: torch.Tensor, row_start: int,
                            out: torch.Tensor, threads: int | None = None) -> None:
    """``out[i] = packed[global_ids[i] - row_start]``, the zero row (``packed[-1]``) for ids
    outside the table. ``packed uint8 [rows + 1, row_bytes]``, ``global_ids`` int ``[N]``,
    ``out uint8 [N, row_bytes]``, all on the CPU. Copied on ``threads`` threads (default
    :func:`default_gather_threads`) when ``packed`` and ``out`` are contiguous, else by ``index_select``."""
    zero_row = packed.shape[0] - 1
    local = global_ids.reshape(-1).to(torch.int64) - row_start
    local = torch.where((local >= 0) & (local < zero_row), local, torch.full_like(local, zero_row))
    if packed.is_contiguous() and out.is_contiguous():
        gather_rows(packed, local, out, default_gather_threads() if threads is None else threads)
    else:
        torch.index_select(packed, 0, local, out=out)


def _as_int32(value: int) -> int:
    """``value`` as the int32 whose bits are ``value mod 2**32`` (job numbers grow past 2**31; the words hold
    their low 32 bits and compare wrap-aware)."""
    return ((value + 2**31) % 2**32) - 2**31


# A wait on the worker or the GPU that has not ended after this long is an error, not a hang.
WAIT_IDLE_TIMEOUT_S = 120.0
# A replayed gather's copy stream waits at most about this long for the worker (plus the watchdog's 1 ms look):
# the worker takes a replay within microseconds unless a gather before it is still copying (a few ms at
# T = 8192 on the H200's host); past it the rows are read directly, exact and slower.
REPLAY_BOUND_S = 0.05

_NATIVE_ENQUEUE_LOCK = threading.Lock()
_FLAG_WORDS_KEPT: list[torch.Tensor] = []
_WORKER: list[tuple[concurrent.futures.ThreadPoolExecutor, int]] = []  # (worker, process id)
_WORKER_LOCK = threading.Lock()


def _shared_worker() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for every table of the process: gathers run one at a time, in the order
    they were started (layer by layer), instead of several gathers fighting over the cores. The
    worker waits, copies rows on its own OpenMP team of ``gather_threads`` and enqueues copies; it
    changes no thread setting of the process or of any other thread (:mod:`openmp_team`). A forked
    child gets its own (the parent's thread does not exist there)."""
    with _WORKER_LOCK:
        if not _WORKER or _WORKER[0][1] != os.getpid():
            _WORKER[:] = [(concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix="engram-host-gather",
                                                                 initializer=openmp_team.mark_owned),
                           os.getpid())]
        return _WORKER[0][0]


@dataclass(eq=False)
class GatherTicket:
    """One started gather: ``number`` (its place among the table's gathers), ``inverse`` (int32 on the
    device, the lookup's shape) mapping each lookup to its row in the device staging, and either
    ``done`` (native worker: the event of the last copy, enqueued at start) or ``future`` (Python
    worker: its task, which returns that event once every copy is enqueued)."""

    number: int
    future: concurrent.futures.Future | None
    inverse: torch.Tensor
    done: torch.cuda.Event | None = None
    finished: bool = field(default=False)
    staging: torch.Tensor | None = None  # a replayed gather's own device staging (None: the table's)
    keep: tuple = field(default=(), repr=False)  # a replayed gather's other buffers, read at every replay

    @property
    def replayed(self) -> bool:
        """Whether this is a gather captured in a CUDA graph (:meth:`HostGather.start_replayed`)."""
        return self.staging is not None


class HostGather:
    """Path (b) for one table: ``start`` on the caller's stream, ``finish`` where the rows
    are needed (see the module docstring).

    ``packed``: pinned CPU ``uint8 [rows + 1, row_bytes]`` (last row zero); ``device``:
    where the rows land; ``gather_threads``: threads copying rows on the host; ``worker``: one of
    :data:`~engram.checks.HOST_GATHER_WORKERS` (see the module docstring; :attr:`worker` is the one chosen);
    ``dedup``: one of :data:`~engram.checks.HOST_GATHER_DEDUP`, whether a native gather copies each distinct row once (sorted) or every
    lookup's row in lookup order (the Python worker always dedups); :attr:`repeat_share` is the share
    of repeated rows last measured.
    """

    def __init__(self, packed: torch.Tensor, device: torch.device, gather_threads: int | None = None,
                 worker: str = "auto", dedup: str = "auto"):
        self.packed = packed
        self.device = device
        check_gather_options(gather_threads, worker, dedup)
        self.gather_threads = default_gather_threads() if gather_threads is None else gather_threads
        self.worker = _resolve_worker(worker, device)
        self.dedup = dedup
        self.repeat_share: float | None = None  # of the last measured gather (1 - distinct rows / ids)
        self._since_measured = 0                # native gathers since the last one that sorted
        self._measuring: tuple | None = None    # (id buffer slot, job number, ids) of a sorted gather to read
        self.native_gathers = {"sorted": 0, "lookup_order": 0}  # how the native gathers ran
        self.row_bytes = packed.shape[1]
        self.capacity = 0
        self.copy_stream = torch.cuda.Stream(device)
        self.replay_stream = torch.cuda.Stream(device) if self.worker == "native" else None  # replayed gathers' copies
        self.replayed: list[GatherTicket] = []  # every replayed gather's ticket (its buffers live as long as graphs)
        if self.worker == "native":
            self.native_service = native_worker.shared_service(self.gather_threads)
            self._flags = torch.zeros(FLAG_WORDS, dtype=torch.int32, pin_memory=True)
            # The copy stream writes these words after the worker is done (no torch op records that use),
            # so they are never freed: 256 bytes per table.
            _FLAG_WORDS_KEPT.append(self._flags)
            self._flags_view = self._flags.numpy()
            self._flags_device = stream_memory_ops.device_address(self._flags, device)
            self._waves = 0                                  # waves submitted (the next job's WAVES_DONE base)
            self._broken: str | None = None                  # a failed enqueue: later gathers could wait forever
        else:
            self._worker = _shared_worker()
        self._copies_done: torch.cuda.Event | None = None  # the last copies: host staging free after it
        self._consumed: torch.cuda.Event | None = None     # the last reader: device staging free after it
        self._last_future: concurrent.futures.Future | None = None
        self._started = 0                                   # gathers started (the last ticket's number)
        self._failure: BaseException | None = None          # a worker failure not yet reported
        self._lock = threading.Lock()
        self.gather_rows = start_gather_rows                # the host copy (tests wrap it)

    def _ensure_capacity(self, num_rows: int) -> None:
        if num_rows <= self.capacity:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"host gather of {num_rows} rows needs larger staging buffers, which cannot be "
                               "allocated during CUDA-graph capture: run one eager step of this size first")
        # Grown buffers replace ones a pending gather or reader may still use: let them finish
        # (warm-up only: buffers grow to the largest batch and stay).
        self.wait_idle()
        for event in (self._copies_done, self._consumed):
            if event is not None:
                event.synchronize()
        # Everything is allocated before anything is replaced: a growth that fails part-way (CUDA OOM, Ctrl-C)
        # leaves the old buffers, the worker's view of them and the capacity as they were.
        capacity = next_power_of_2(num_rows)
        with torch.inference_mode(False):  # persistent buffers: never inference tensors, whatever mode grows them
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        staging_host = torch.empty(capacity, self.row_bytes, dtype=torch.uint8, pin_memory=True)
        staging_device = torch.empty(capacity, self.row_bytes, dtype=torch.uint8, device=self.device)
        # No staged row is ever served unless its tag names the lookup's row: a never-written row tags -1.
        row_tags(staging_host).fill_(-1)
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            row_tags(staging_device).fill_(-1)
        id_buffers = identity = job_buffers = None
        if self.worker == "native":  # id buffers reused once the worker is done with them (no pinned allocation per call)
            id_buffers = [self._id_buffer(capacity) for _ in range(_ID_BUFFERS)]
            # the inverse of a gather in lookup order (row i of the staging is lookup i's); filled on the calling
            # stream and read on others (a memory's prefetch stream, the layers' stream): filled before either
            identity = torch.arange(capacity, dtype=torch.int32, device=self.device)
        filled = torch.cuda.Event()
        filled.record(stream)
        filled.synchronize()
        if self.worker == "native":
            job_buffers = self.native_service.prepare(table=self.packed, staging=staging_host, flags=self._flags)
        staging_device.record_stream(self.copy_stream)  # freed only once the copies into it have run
        self.staging_host, self.staging_device = staging_host, staging_device
        if self.worker == "native":
            self._id_buffers, self._identity, self._job_buffers = id_buffers, identity, job_buffers
            self._id_buffer_jobs = [self._started] * _ID_BUFFERS
            self._measuring = None  # its count was in a buffer just replaced
        self.capacity = capacity

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise RuntimeError(f"an earlier host gather of this table (a prefetch no lookup took) failed on its "
                               f"worker thread: {failure!r}") from failure

    def current(self, ticket: GatherTicket) -> bool:
        """Whether ``ticket`` is the latest gather started here and not yet finished (its rows are the
        ones the staging will hold)."""
        return ticket.number == self._started and not ticket.finished

    def is_latest(self, number: int) -> bool:
        """Whether gather ``number`` is the last one started here (no later copies into the staging)."""
        return number == self._started

    def start(self, global_ids: torch.Tensor, row_start: int, stream: torch.cuda.Stream) -> GatherTicket:
        """Begin gathering the rows of ``global_ids`` (int32/int64, any shape, at least one id, on
        the device; ``packed[0]`` is row ``row_start``): enqueues the dedup and the id copy on
        ``stream`` (and, with the native worker, the copies) and returns at once. Earlier tickets
        become stale."""
        num_ids = global_ids.numel()
        if num_ids == 0:
            raise ValueError("global_ids: the host gather needs at least one id, found an empty tensor")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the host gather needs host threads and cannot run during CUDA-graph capture "
                               "(lookups under capture read host rows directly)")
        if self.worker == "native":
            return self._start_native(global_ids, row_start, stream)
        with self._lock:
            self._raise_failure()
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
            self._started += 1
            number = self._started
            future = self._worker.submit(self._gather, ids_host, ids_ready, number)
            self._last_future = future
            return GatherTicket(number, future, distinct.inverse.view(global_ids.shape))

    def _id_buffer(self, num_ids: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A pinned int32 buffer for ``num_ids`` ids and their count, its "ids ready" word (written by the
        GPU after the ids, so a job never depends on another job's stream) and that word's device address."""
        buffer = torch.empty(num_ids + 2 + 15, dtype=torch.int32, pin_memory=True)
        ready = buffer[-16:-15]  # after the ids and the count
        ready.fill_(_as_int32(self._started))  # below every later job's number (words compare wrap-aware)
        return buffer, ready, stream_memory_ops.device_address(buffer, self.device) + 4 * (buffer.numel() - 16)

    def _start_native(self, global_ids: torch.Tensor, row_start: int, stream: torch.cuda.Stream) -> GatherTicket:
        """:meth:`start` with the native worker: the caller's thread enqueues every step of the gather."""
        num_ids = global_ids.numel()
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"this table's host gather is unusable after an earlier failure: {self._broken}")
            self._ensure_capacity(num_ids)
            number = self._started + 1
            sort = self._sort_next(number)
            reused = self._reuse_id_buffer(number, sort, num_ids)
            # None: the worker is _ID_BUFFERS gathers behind: a buffer of its own (the service holds it)
            buffer, ready, ready_address = reused if reused is not None else self._id_buffer(num_ids)
            ids_host = buffer[:num_ids + 1]
            with torch.cuda.stream(stream):
                if sort:
                    distinct = distinct_rows(global_ids, row_start, self.packed.shape[0] - 1)
                    rows_and_count, inverse = distinct.rows_and_count, distinct.inverse
                else:
                    rows_and_count = rows_in_lookup_order(global_ids, row_start, self.packed.shape[0] - 1)
                    inverse = self._identity[:num_ids]
                ids_host.copy_(rows_and_count, non_blocking=True)
            num_waves = _num_waves(num_ids, _MAX_WAVES_NATIVE)
            wave_ends = shrinking_wave_ends(num_ids, num_waves)
            bounds = [0, *wave_ends]
            try:
                # Every stream operation on the table's device context, whatever device is current (a write on
                # the default stream's handle 0 under another current device would go to that device's stream).
                with _NATIVE_ENQUEUE_LOCK, torch.cuda.device(self.device):  # job order = order of the ids' enqueue
                    stream_memory_ops.write_value(stream, ready_address, number)
                    self.native_service.submit_prepared(self._job_buffers, ids=ids_host, ready=ready, ids_ready=number,
                                                        staging_free=number - 1, waves_base=self._waves,
                                                        num_waves=num_waves, job_done=number, wave_ends=wave_ends)
                if self._consumed is not None:  # the device staging's last reader runs first
                    self.copy_stream.wait_event(self._consumed)
                # Raw driver copies between the staging buffers (both persistent, guarded by the events
                # above): 5 us of host time each on the H200's host, against 15-20 for a slice's copy_.
                waves_done = self._flags_device + 4 * WAVES_DONE
                host_address, device_address = self.staging_host.data_ptr(), self.staging_device.data_ptr()
                with torch.cuda.device(self.device):
                    for wave, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                        stream_memory_ops.wait_value(self.copy_stream, waves_done, self._waves + wave + 1)
                        offset = begin * self.row_bytes
                        stream_memory_ops.copy_to_device(self.copy_stream, device_address + offset,
                                                         host_address + offset, (end - begin) * self.row_bytes)
                    stream_memory_ops.write_value(self.copy_stream, self._flags_device + 4 * STAGING_FREE, number)
                    done = torch.cuda.Event()
                    done.record(self.copy_stream)
            except BaseException as failure:
                self._broken = repr(failure)
                self._started = number  # no earlier ticket is current: some of this job's copies may be queued
                raise
            self._started = number
            self._waves += num_waves
            self._copies_done = done
            self.native_gathers["sorted" if sort else "lookup_order"] += 1
            return GatherTicket(number, None, inverse.view(global_ids.shape), done)

    @property
    def replays(self) -> bool:
        """Whether :meth:`start_replayed` can capture a gather here (the native worker)."""
        return self.worker == "native"

    def start_replayed(self, global_ids: torch.Tensor, row_start: int, stream: torch.cuda.Stream,
                       bound_s: float = REPLAY_BOUND_S) -> GatherTicket:
        """Capture, on ``stream`` (capturing), a gather of ``global_ids`` that runs at every replay of the graph
        (module docstring): buffers of its own, made now and kept for the process's life; returns its ticket
        for :meth:`finish` in the same capture. Rows in lookup order (with ``dedup="always"`` sorted and
        deduplicated). ``bound_s``: how long a replay waits for the worker before the watchdog answers it."""
        from engram.table.host_memory.replayed_gather import start_replayed

        return start_replayed(self, global_ids, row_start, stream, bound_s)

    def _reuse_id_buffer(self, number: int, sort: bool, num_ids: int):
        """The pinned id buffer of slot ``number % _ID_BUFFERS`` for gather ``number`` when the worker is done
        with its last job, else None; with ``dedup="auto"`` a sorted gather's buffer is remembered for its
        count (:meth:`_sort_next`). A measurement whose buffer is reused here is forgotten: its job may have
        finished after :meth:`_sort_next` looked, and the new ids overwrite its count."""
        slot = number % _ID_BUFFERS
        if not native_worker.flags_reached(self._flags_view, JOB_DONE, self._id_buffer_jobs[slot]):
            return None
        self._id_buffer_jobs[slot] = number
        if self._measuring is not None and self._measuring[0] == slot:
            self._measuring = None
        if sort and self.dedup == "auto" and self._measuring is None:
            self._measuring = (slot, number, num_ids)  # read at a later start
        return self._id_buffers[slot]

    def _sort_next(self, number: int) -> bool:
        """Whether native gather ``number`` sorts and dedups: by :attr:`dedup`; for ``"auto"``, first reads
        the repeat share of the last sorted gather if it is done (its count is still in its id buffer: a
        slot is reused only once its job is done, and this runs before the reuse), then sorts on every
        ``_DEDUP_REMEASURE``-th gather and while the share is at least ``_DEDUP_MIN_REPEATS``."""
        if self.dedup != "auto":
            return self.dedup == "always"
        if self._measuring is not None and native_worker.flags_reached(self._flags_view, JOB_DONE, self._measuring[1]):
            slot, _, num_ids = self._measuring
            self._measuring = None
            count = int(self._id_buffers[slot][0][num_ids])
            if 1 <= count <= num_ids:
                self.repeat_share = 1.0 - count / num_ids
        self._since_measured += 1
        sort = (self.repeat_share is None or self._since_measured >= _DEDUP_REMEASURE
                or self.repeat_share >= _DEDUP_MIN_REPEATS)
        if sort:
            self._since_measured = 0
        return sort

    def _gather(self, ids_host: torch.Tensor, ids_ready: torch.cuda.Event, number: int) -> torch.cuda.Event:
        """Worker thread (one; tasks run in order): wait for the ids and for the previous task's
        copies (the host staging is then free), start the gather of every wave, enqueue each wave's
        copy as soon as it is gathered. A failure is raised by the consumer's :meth:`finish`."""
        with torch.inference_mode():  # grad mode is per thread: the caller's tensors may be inference tensors
            return self._gather_rows(ids_host, ids_ready)

    def _gather_rows(self, ids_host: torch.Tensor, ids_ready: torch.cuda.Event) -> torch.cuda.Event:
        gathered = None
        try:
            ids_ready.synchronize()
            if self._copies_done is not None:
                self._copies_done.synchronize()
            num_ids = ids_host.numel() - 1
            num_rows = min(max(int(ids_host[num_ids]), 1), num_ids)  # clamped: the count came from the device
            rows = ids_host[:num_rows]
            num_waves = _num_waves(num_rows)
            bounds = [0, *native_worker.even_wave_ends(num_rows, num_waves)]
            gathered = self.gather_rows(self.packed, rows, self.staging_host[:num_rows], self.gather_threads,
                                        wave_ends=bounds[1:])
            with torch.cuda.device(self.device):
                for wave, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                    gathered.wait(wave)
                    with torch.cuda.stream(self.copy_stream):
                        self.staging_device[begin:end].copy_(self.staging_host[begin:end], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            self._copies_done = done
            return done
        except BaseException as failure:
            if gathered is not None:
                gathered.join()  # no pool thread may still write the staging once this task ends
            self._failure = failure
            raise

    def finish(self, ticket: GatherTicket, stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, inverse)``: the gathered distinct rows ``uint8 [capacity, row_bytes]`` on the
        device, ordered after the copies on ``stream``, and the lookup's ``inverse`` into them.
        Blocks the calling thread until the worker has enqueued the copies (never until they run).
        Call :meth:`consumed` once their reader is enqueued. ``ticket`` must be :meth:`current`."""
        if ticket.replayed:  # its own buffers, ordered by the graph
            if not torch.cuda.is_current_stream_capturing():
                raise ValueError("ticket: a gather captured in a CUDA graph is finished only in that capture")
            stream.wait_event(ticket.done)
            return ticket.staging, ticket.inverse
        with self._lock:  # a start on another thread cannot reuse the staging between the check and the wait
            if not self.current(ticket):
                raise ValueError(f"ticket: gather {ticket.number} is stale (gather {self._started} started since, "
                                 "or it was finished already): its rows are no longer in the staging")
            ticket.finished = True
            if ticket.done is not None:  # native worker: everything is enqueued already
                stream.wait_event(ticket.done)
                return self.staging_device, ticket.inverse
        return self._finish_python(ticket, stream)

    def _finish_python(self, ticket: GatherTicket, stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            done = ticket.future.result(timeout=WAIT_IDLE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"host gather: the Python worker did not enqueue gather {ticket.number}'s copies within "
                               f"{WAIT_IDLE_TIMEOUT_S:g} s (its ids' event never completed)") from None
        except BaseException as failure:
            self._failure = None
            raise RuntimeError(f"the host gather failed on its worker thread: {failure!r}") from failure
        stream.wait_event(done)
        return self.staging_device, ticket.inverse

    def consumed(self, stream: torch.cuda.Stream) -> None:
        """Mark the device staging free once ``stream``'s work so far has run."""
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._consumed = event

    @property
    def idle(self) -> bool:
        """Whether the worker is done with every started gather (native: its rows copied to the host
        staging; Python: its copies enqueued)."""
        if self.worker == "native":
            return native_worker.flags_reached(self._flags_view, JOB_DONE, self._started)
        return self._last_future is None or self._last_future.done()

    def wait_idle(self, timeout_s: float = WAIT_IDLE_TIMEOUT_S) -> None:
        """Block until the worker is done with every started gather: its copies enqueued (Python
        worker), its rows copied to the host staging (native worker; the GPU's part runs meanwhile).
        Raises RuntimeError after ``timeout_s`` seconds (a worker or a GPU that never gets there: a sticky
        CUDA error, a stream held forever), naming the gather it waited for."""
        deadline = time.monotonic() + timeout_s
        if self.worker == "native":
            while not (native_worker.flags_reached(self._flags_view, JOB_DONE, self._started)
                       or self.native_service.stopped):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"host gather: gather {self._started} of this table was not done after {timeout_s:g} s "
                        f"(job-done word {int(self._flags_view[JOB_DONE])}): its ids never reached the worker "
                        "(a CUDA error, or the stream that writes them is held)")
                time.sleep(0.0002)
        elif self._last_future is not None:
            done, _ = concurrent.futures.wait([self._last_future], timeout=timeout_s)
            if not done:
                raise RuntimeError(f"host gather: the Python worker's gather {self._started} of this table was not "
                                   f"done after {timeout_s:g} s (its ids' event never completed)")
