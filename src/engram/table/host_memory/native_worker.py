"""The host gather's native worker (``native_gather.c``): row copies no Python thread or CUDA call can hold up.

The package's build compiles the C source at install time into :data:`BUILT_LIBRARY`, next to this
module (``setup.py``; an editable install puts it into the source tree), which is loaded with ``ctypes``
once it reports the constants, source digest and job-record layout this module expects. Only without
it (a plain source tree, an install that found no C compiler) or where it is refused (built from
another source or protocol), the source is compiled once per process at first use, with a warning
saying so, by the same command (:func:`~engram.table.host_memory.gather_protocol.build_command`) and
the system's C compiler (``$CC``, else ``cc`` / ``gcc``: the one Triton uses for its launchers) into a
private temporary directory (mode 0700, removed once loaded, so no other user can plant the library).
:func:`unavailable_reason` says why not where neither can be.

A :class:`NativeGatherService` is a team of ``threads`` native threads that runs jobs in the order
submitted (the protocol: docs/design.md, "The host-gather protocol", and its constants, job record and
comparison rule in :mod:`~engram.table.host_memory.gather_protocol`). Python keeps every
buffer a job touches alive until its "job done" word says the worker has finished with it, so a
table, staging or id buffer dropped by its owner is never freed under the worker. One service per
thread count and process (:func:`shared_service`); a forked child makes its own; services stop at
interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import dataclasses
import functools
import os
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from engram.checks import check_int
from engram.environment import c_compiler, compile_library
from engram.table.host_memory.gather_protocol import (FLAG_WORDS, IDS_READY, JOB_DONE, MAX_REPLAYED, MAX_WAVES,
                                                      POSTED, SHARED_CONSTANTS, SOURCE, STAGING_FREE, TIMED_WAVES, TIMELINE_WORDS, WAVES_DONE,
                                                      JobRecord, build_command, build_identity, reached, word)

__all__ = ["NativeGatherService", "shared_service", "unavailable_reason", "load_library", "BUILT_LIBRARY",
           "even_wave_ends", "FLAG_WORDS", "IDS_READY", "STAGING_FREE", "WAVES_DONE", "JOB_DONE", "POSTED"]

_SOURCE = SOURCE
# Where the package's build puts the worker (setup.py: the extension engram.table.host_memory._native_gather).
BUILT_LIBRARY = Path(__file__).with_name("_native_gather" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))

_u32p = ctypes.c_void_p


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.engram_gather_create.argtypes = [ctypes.c_int]
    lib.engram_gather_create.restype = ctypes.c_void_p
    lib.engram_gather_submit.argtypes = [ctypes.c_void_p, ctypes.POINTER(JobRecord)]
    lib.engram_gather_submit.restype = ctypes.c_int
    lib.engram_gather_hold_next.argtypes = [ctypes.c_void_p, _u32p, ctypes.c_int64]
    lib.engram_gather_hold_next.restype = None
    lib.engram_gather_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    lib.engram_gather_stats.restype = None
    lib.engram_gather_last_job.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    lib.engram_gather_last_job.restype = ctypes.c_int
    lib.engram_gather_stop.argtypes = [ctypes.c_void_p]
    lib.engram_gather_stop.restype = None
    lib.engram_gather_add_replayed.argtypes = [ctypes.c_void_p, ctypes.POINTER(JobRecord), ctypes.c_int64]
    lib.engram_gather_add_replayed.restype = ctypes.c_int
    lib.engram_gather_pause_replays.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.engram_gather_pause_replays.restype = None
    lib.engram_gather_replay_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    lib.engram_gather_replay_stats.restype = None
    return lib


def _int64_words(function, count: int) -> list[int]:
    function.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    function.restype = ctypes.c_int
    out = (ctypes.c_int64 * count)()
    return list(out[:function(out, count)])


def _mismatch(lib: ctypes.CDLL) -> str | None:
    """Why ``lib`` was not built from this ``native_gather.c`` with this protocol, or None when it was."""
    if not hasattr(lib, "engram_gather_protocol"):
        return "it reports no protocol (built from an older native_gather.c)"
    expected = build_identity()
    found = _int64_words(lib.engram_gather_protocol, len(expected) + 1)
    if found != expected:
        names = [*SHARED_CONSTANTS, "source digest"]
        differ = [f"{name} {have} (expected {want})" for name, have, want in zip(names, found, expected)
                  if have != want]
        if len(found) != len(expected):
            differ.append(f"{len(found)} words (expected {len(expected)})")
        return f"it was built with {', '.join(differ)}"
    layout = [ctypes.sizeof(JobRecord)] + [getattr(JobRecord, name).offset for name, _ in JobRecord._fields_]
    found = _int64_words(lib.engram_gather_record_layout, len(layout) + 1)
    if found != layout:
        return f"its job record is laid out {found}, gather_protocol.JobRecord {layout}"
    return None


def _compile() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = compile_library(build_command, "native_gather.so", "engram-native-", "worker")
    if lib is None:
        return None, reason
    refused = _mismatch(lib)
    if refused is not None:
        return None, f"the worker compiled from {SOURCE.name} does not match gather_protocol.py: {refused}"
    return _declare(lib), ""


def load_library(built: str | Path = BUILT_LIBRARY) -> tuple[ctypes.CDLL | None, str]:
    """``(library, "")``: ``built`` where it exists and :func:`_mismatch` finds nothing, else ``native_gather.c``
    compiled now, with a warning that says why; ``(None, why not)`` where neither can be."""
    if os.path.exists(built):
        try:
            lib = ctypes.CDLL(os.fspath(built))
            refused = _mismatch(lib)
        except OSError as error:
            refused = f"it did not load: {error}"
        if refused is None:
            return _declare(lib), ""
        why = f"the built library {os.fspath(built)} is refused: {refused}"
    else:
        why = f"no built library at {os.fspath(built)} (a source tree, or an install that found no C compiler)"
    if c_compiler() is None:
        return None, f"{why}, and no C compiler found ($CC, cc or gcc) to build it at first use"
    warnings.warn(f"host gather's native worker: {why}; building it from source ({SOURCE.name}) at first use",
                  RuntimeWarning, stacklevel=2)
    return _compile()


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    return load_library(BUILT_LIBRARY)


def unavailable_reason() -> str | None:
    """None when the native worker can run in this process, else why not (one line)."""
    lib, reason = _library()
    return None if lib is not None else reason


def even_wave_ends(num_rows: int, num_waves: int) -> list[int]:
    """The ends ``[e_1, ..., e_W = num_rows]`` of ``num_waves`` waves of (nearly) equal size."""
    return [num_rows * (wave + 1) // num_waves for wave in range(num_waves)]


def _word(tensor: torch.Tensor, index: int) -> int:
    return tensor.data_ptr() + 4 * index


_TIMED_WAVES = TIMED_WAVES
_TIMELINE_WORDS = TIMELINE_WORDS
_reached = reached


def record_layout() -> list[int] | None:
    """The compiled worker's ``JobRecord`` layout: ``[sizeof, offset of each field]`` (None without the worker)."""
    lib, _ = _library()
    if lib is None:
        return None
    out = (ctypes.c_int64 * (len(JobRecord._fields_) + 1))()
    written = lib.engram_gather_record_layout(out, len(out))
    return list(out[:written])


@dataclasses.dataclass(frozen=True, eq=False)
class JobBuffers:
    """What :meth:`NativeGatherService.prepare` checked once: the tensors (kept alive by every job that
    uses them) and their addresses."""

    table: torch.Tensor
    staging: torch.Tensor
    flags: torch.Tensor
    flags_view: np.ndarray
    table_args: tuple[int, int, int]  # address, rows, row bytes
    staging_address: int
    staging_rows: int
    words: tuple[int, int, int]       # addresses of STAGING_FREE, WAVES_DONE, JOB_DONE


class NativeGatherService:
    """``threads`` native copying threads running submitted jobs in order (see the module docstring)."""

    def __init__(self, threads: int):
        lib, reason = _library()
        if lib is None:
            raise RuntimeError(f"the host gather's native worker is unavailable: {reason}")
        check_int("threads", threads, 1, maximum=256)
        self._lib = lib
        self.threads = threads
        self._handle = lib.engram_gather_create(threads)
        if not self._handle:
            raise RuntimeError(f"the host gather's native worker could not start {threads} threads")
        self._lock = threading.Lock()
        self._retained: collections.deque = collections.deque()  # (flags numpy view, value, buffers), in job order
        self._replayed: list = []  # every replayed job's buffers: a captured graph may replay at any time
        self._stopped_handle = None  # a stopped service that keeps its watchdog (it had replayed jobs)
        self._last_replay_stats = {"replayed_jobs": 0, "replays_copied": 0, "replays_released": 0}
        self._pid = os.getpid()

    def submit(self, *, table: torch.Tensor, ids: torch.Tensor, staging: torch.Tensor, flags: torch.Tensor,
               ready: torch.Tensor, ids_ready: int, staging_free: int, waves_base: int, num_waves: int,
               job_done: int, wave_ends: Sequence[int] | None = None) -> None:
        """Queue one job: ``staging[i] = table[ids[i]]`` for ``i < ids[-1]`` (the count), once the word
        ``ready[0]`` (int32, the job's own: the GPU writes it after this job's ids) has reached ``ids_ready``
        and ``flags[STAGING_FREE]`` ``staging_free``; stores
        ``waves_base + k + 1`` in ``flags[WAVES_DONE]`` after wave ``k`` of ``num_waves`` and ``job_done`` in
        ``flags[JOB_DONE]`` at the end. Wave ``k`` covers staging rows ``[wave_ends[k - 1], wave_ends[k])``
        (``wave_ends``: ``num_waves`` increasing ints, the last ``N``; default :func:`even_wave_ends`).
        ``table`` uint8 ``[rows, row_bytes]`` (last row the zero row), ``ids``
        int32 ``[N + 1]``, ``staging`` uint8 ``[>= N, row_bytes]``, ``flags`` int32 ``[FLAG_WORDS]``: contiguous
        CPU tensors, kept alive here until the job is done. :meth:`prepare` + :meth:`submit_prepared`."""
        self.submit_prepared(self.prepare(table=table, staging=staging, flags=flags), ids=ids, ready=ready,
                             ids_ready=ids_ready, staging_free=staging_free, waves_base=waves_base,
                             num_waves=num_waves, job_done=job_done, wave_ends=wave_ends)

    @staticmethod
    def prepare(*, table: torch.Tensor, staging: torch.Tensor, flags: torch.Tensor) -> "JobBuffers":
        """The buffers every job of one table and staging shares, checked once (see :meth:`submit`)."""
        if table.dtype != torch.uint8 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"table: expected contiguous uint8 [rows, row_bytes], found {table.dtype} "
                             f"{list(table.shape)}")
        if (staging.dtype != torch.uint8 or staging.dim() != 2 or staging.shape[1] != table.shape[1]
                or not staging.is_contiguous()):
            raise ValueError(f"staging: expected contiguous uint8 [N, {table.shape[1]}], found "
                             f"{staging.dtype} {list(staging.shape)}")
        if flags.dtype != torch.int32 or flags.shape != (FLAG_WORDS,) or not flags.is_contiguous():
            raise ValueError(f"flags: expected contiguous int32 [{FLAG_WORDS}], found {flags.dtype} {list(flags.shape)}")
        return JobBuffers(table, staging, flags, flags.numpy(),
                          (table.data_ptr(), table.shape[0], table.shape[1]), staging.data_ptr(), staging.shape[0],
                          (_word(flags, STAGING_FREE), _word(flags, WAVES_DONE), _word(flags, JOB_DONE)))

    def submit_prepared(self, buffers: "JobBuffers", *, ids: torch.Tensor, ready: torch.Tensor, ids_ready: int,
                        staging_free: int, waves_base: int, num_waves: int, job_done: int,
                        wave_ends: Sequence[int] | None = None) -> None:
        """:meth:`submit` over buffers from :meth:`prepare`: only the job's own ids and word are checked."""
        record = _record(buffers, ids, ready, num_waves, wave_ends)
        record.ids_ready_value, record.staging_free_value = word(ids_ready), word(staging_free)
        record.waves_base, record.job_done_value = word(waves_base), word(job_done)
        with self._lock:
            if self._handle is None:
                raise RuntimeError("the host gather's native worker was stopped")
            if self._pid != os.getpid():  # its threads live in the parent: a queued job would never run
                raise RuntimeError("the host gather's native worker belongs to the parent process; make the table "
                                   "in this process")
            self.prune()
            status = self._lib.engram_gather_submit(self._handle, ctypes.byref(record))
            if status != 0:
                raise RuntimeError("the host gather's native worker refused a job (out of memory?)")
            self._retained.append((buffers.flags_view, word(job_done), (buffers, ids, ready)))

    def add_replayed(self, buffers: "JobBuffers", *, ids: torch.Tensor, ready: torch.Tensor, num_waves: int,
                     wave_ends: Sequence[int] | None = None, bound_s: float) -> None:
        """Register a replayed job (a gather captured in a CUDA graph: gather_protocol's "Replayed jobs"):
        each time ``ready[0]`` becomes :data:`~engram.table.host_memory.gather_protocol.POSTED`, copy
        ``staging[i] = table[ids[i]]`` for ``i < ids[-1]`` in waves as :meth:`submit` does (``waves_done``
        from 0, ``job_done`` + 1 per replay), or, left posted for ``bound_s`` seconds (or once the service is
        stopped), store every wave done without copying. Its buffers are kept for the service's life; the
        service itself, stopped, keeps its watchdog answering replays until the process exits."""
        if not 0 < bound_s <= 3600:
            raise ValueError(f"bound_s: expected seconds in (0, 3600], found {bound_s!r}")
        record = _record(buffers, ids, ready, num_waves, wave_ends)
        with self._lock:
            if self._handle is None:
                raise RuntimeError("the host gather's native worker was stopped")
            if self._pid != os.getpid():
                raise RuntimeError("the host gather's native worker belongs to the parent process; make the table "
                                   "in this process")
            index = self._lib.engram_gather_add_replayed(self._handle, ctypes.byref(record), int(bound_s * 1e9))
            if index < 0:
                raise RuntimeError(f"the host gather's native worker refused a replayed job ({MAX_REPLAYED} "
                                   "registered already, or its watchdog thread could not start)")
            self._replayed.append((buffers, ids, ready))
            _REPLAYED_BUFFERS.append((buffers, ids, ready))

    def pause_replays(self, paused: bool) -> None:
        """Test hook: while ``paused``, the worker leaves every replay to the watchdog (a worker held up)."""
        if self._handle is not None:
            self._lib.engram_gather_pause_replays(self._handle, int(bool(paused)))

    def replay_stats(self) -> dict[str, int]:
        """Replayed jobs registered, replays the worker copied, replays the watchdog answered (after the
        service stopped: the last counts seen before)."""
        with self._lock:
            if self._handle is not None or self._stopped_handle is not None:
                values = (ctypes.c_int64 * 3)()
                self._lib.engram_gather_replay_stats(self._handle or self._stopped_handle, values)
                self._last_replay_stats = dict(zip(("replayed_jobs", "replays_copied", "replays_released"), values))
            return dict(self._last_replay_stats)

    def prune(self) -> None:
        """Drop the buffers of the jobs done (in order: jobs finish in the order submitted)."""
        while self._retained and _reached(self._retained[0][0][JOB_DONE], self._retained[0][1]):
            self._retained.popleft()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` ran (no job will be done any more)."""
        return self._handle is None

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet known done."""
        with self._lock:
            self.prune()
            return len(self._retained)

    def hold_next(self, latch: torch.Tensor, timeout_ms: int) -> None:
        """Test hook: the next job to start waits, once its ids are ready, until ``latch`` (a CPU int32
        tensor, kept alive here until the next hold) is nonzero, at most ``timeout_ms``."""
        self._latch = latch
        self._lib.engram_gather_hold_next(self._handle, latch.data_ptr(), int(timeout_ms))

    def stats(self) -> dict[str, int]:
        """Counters: jobs done, holds released, holds timed out, flag waits that slept."""
        values = (ctypes.c_int64 * 4)()
        self._lib.engram_gather_stats(self._handle, values)
        return dict(zip(("jobs_done", "holds_released", "holds_timed_out", "waits_slept"), values))

    def last_job(self) -> dict | None:
        """The timeline of the last finished job, or None before the first: ``job`` (its ``job_done`` value),
        ``ids_ready_ns`` and ``staging_free_ns`` (when the worker saw them), ``wave_end_ns`` (one per wave, the
        first 16), ``done_ns``, all on the clock of :func:`time.monotonic_ns`; ``leader_chunks`` and ``chunks``
        (of 512 rows: how many the leading thread copied itself, out of all)."""
        words = (ctypes.c_int64 * _TIMELINE_WORDS)()
        with self._lock:
            if self._handle is None:
                return None
            self._lib.engram_gather_last_job(self._handle, words, _TIMELINE_WORDS)
        if words[1] == 0:
            return None
        waves = [value for value in words[3:3 + _TIMED_WAVES] if value]
        return {"job": words[0], "ids_ready_ns": words[1], "staging_free_ns": words[2], "wave_end_ns": waves,
                "done_ns": words[3 + _TIMED_WAVES], "leader_chunks": words[4 + _TIMED_WAVES],
                "chunks": words[5 + _TIMED_WAVES]}

    def stop(self) -> None:
        """Stop the threads and free the service. Jobs not done are dropped with their words written (a
        stream waiting on one goes on, its staging unwritten: the consumers' per-row id check reads those
        rows from the table); their buffers stay referenced here."""
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is not None and self._replayed:
                self._stopped_handle = handle  # not freed: its watchdog answers replays to the end
        if handle is not None and self._pid == os.getpid():
            self._lib.engram_gather_stop(handle)


# Every replayed job's buffers, for the process's life: the C side reads them as long as the process runs
# (a stopped service's watchdog included), whatever happens to the Python objects that registered them.
_REPLAYED_BUFFERS: list = []


def _record(buffers: "JobBuffers", ids: torch.Tensor, ready: torch.Tensor, num_waves: int,
            wave_ends: Sequence[int] | None) -> JobRecord:
    """The job record of ``ids`` over ``buffers``, its ids, word and waves checked (values left 0)."""
    num_ids = ids.numel() - 1
    if ids.dtype != torch.int32 or ids.dim() != 1 or num_ids < 1 or not ids.is_contiguous():
        raise ValueError(f"ids: expected contiguous int32 [N + 1] with N >= 1, found {ids.dtype} {list(ids.shape)}")
    if num_ids > buffers.staging_rows:
        raise ValueError(f"staging: expected at least {num_ids} rows (one per id), found {buffers.staging_rows}")
    if ready.dtype != torch.int32 or ready.numel() < 1 or ready.device.type != "cpu":
        raise ValueError(f"ready: expected an int32 CPU tensor of at least one word, found {ready.dtype} "
                         f"{list(ready.shape)} on {ready.device}")
    if not 1 <= num_waves <= min(num_ids, MAX_WAVES):
        raise ValueError(f"num_waves: expected 1 <= num_waves <= {min(num_ids, MAX_WAVES)} (the ids, at most "
                         f"{MAX_WAVES}), found {num_waves}")
    if wave_ends is None:
        wave_ends = even_wave_ends(num_ids, num_waves)
    elif (len(wave_ends) != num_waves or wave_ends[-1] != num_ids
          or any(not b > a for a, b in zip([0, *wave_ends[:-1]], wave_ends))):
        raise ValueError(f"wave_ends: expected {num_waves} increasing row counts ending at {num_ids} (the ids), "
                         f"found {list(wave_ends)}")
    staging_free_word, waves_done_word, job_done_word = buffers.words
    table_address, table_rows, row_bytes = buffers.table_args
    record = JobRecord(table=table_address, table_rows=table_rows, row_bytes=row_bytes, ids=ids.data_ptr(),
                       num_ids=num_ids, staging=buffers.staging_address, ids_ready=ready.data_ptr(),
                       staging_free=staging_free_word, waves_done=waves_done_word, num_waves=num_waves,
                       job_done=job_done_word)
    record.wave_ends[:num_waves] = list(wave_ends)
    return record


_SERVICES: dict[tuple[int, int], NativeGatherService] = {}  # (process id, threads)
_SERVICES_LOCK = threading.Lock()


def shared_service(threads: int) -> NativeGatherService:
    """The process's service of ``threads`` threads (made at first use): every table with that thread
    count shares it, so gathers run one at a time in the order started instead of fighting over cores.
    A stopped service is replaced by a new one (a table's gather made after :meth:`NativeGatherService.stop`)."""
    key = (os.getpid(), threads)
    with _SERVICES_LOCK:
        service = _SERVICES.get(key)
        if service is None or service.stopped:
            service = _SERVICES[key] = NativeGatherService(threads)
        return service


@atexit.register
def _stop_services() -> None:
    with _SERVICES_LOCK:
        services = [service for (pid, _), service in _SERVICES.items() if pid == os.getpid()]
        _SERVICES.clear()
    for service in services:
        service.stop()


def flags_reached(flags: torch.Tensor | np.ndarray, index: int, value: int) -> bool:
    """Whether ``flags[index]`` has reached ``value`` (:func:`~engram.table.host_memory.gather_protocol.reached`)."""
    return reached(int(flags[index]), word(value))
