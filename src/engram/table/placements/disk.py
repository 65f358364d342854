"""Placement ``"disk"``: the table in a row file on local disk, under a RAM cache and an HBM cache of its rows.

The rows live in one row file per table (:mod:`engram.table.disk.row_file`) in ``directory``: loading from a
checkpoint reuses a valid one or writes it (:func:`~engram.table.disk.writing.ensure_row_file`, with
progress, room checked first), and nothing holds the whole table in memory. A lookup takes each distinct
id once: hits from the RAM cache (:mod:`engram.table.disk.ram_cache`, ``set-lru``), misses read from disk
(:mod:`engram.table.disk.reads`) and admitted, then the rows in lookup order, unpacked to the bytes every
placement returns. Ids outside the table's rows read the row file's zero row. With ``cache_fraction`` > 0 an
HBM cache (:mod:`engram.table.disk.hbm_cache`, ``set-lru``, its index on the host) sits above the RAM cache:
its hits are copied on the device, the RAM cache sees only its misses, and the rows a lookup read from RAM
or disk are admitted into it on the device.

:meth:`DiskPlacement.prefetch` (on a GPU or the CPU) copies the ids to host memory (pinned, on the current
stream, an event after the copy) and hands a job to the placement's reader thread
(:mod:`engram.table.disk.read_worker`), which reads the rows into the job's own staging. The lookup given
that prefetch copies its own ids to the host too, waits (bounded) for the job, and serves a staged row only
where the row's tag (its own index, stored in the row) and the job's id both equal the lookup's id at that
position; every other position is read again. With an HBM cache the prefetch reads only the ids that are
not in it when the read starts, and the lookup takes each of its ids from the HBM cache as the cache holds
them at the lookup, else from a checked staged row, else from RAM or disk. Ids edited in place after the
prefetch, under ``torch.inference_mode()`` included, cost reads, never rows. Lookups are host work:
CUDA-graph capture is refused.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from engram.checks import DISK_READ_BACKENDS, check_choice, check_int
from engram.common import resolve_cuda_device
from engram.table.disk.cached_reads import CachedRowReader
from engram.table.disk.hbm_cache import HbmRowCache
from engram.table.disk.ram_cache import DEFAULT_WAYS
from engram.table.disk.read_worker import ReadJob, ReadWorker, wait_event
from engram.table.disk.reads import MAX_THREADS
from engram.table.disk.row_file import RowFile, open_row_file
from engram.table.disk.writing import ROW_FILE_ATTRIBUTE, row_file_placeholders
from engram.table.fp8 import BLOCK_SIZE, dequantize_rows
from engram.table.host_memory.rows import row_tags
from engram.table.prefetch import capturing
from engram.table.table import TablePlacement, register_placement

__all__ = ["DiskPlacement", "DiskOptions", "ROW_FILE_ATTRIBUTE"]



@dataclass(frozen=True)
class DiskOptions:
    """Options of placement ``"disk"`` (keyword arguments of :class:`DiskPlacement`, described there)."""

    directory: str | os.PathLike | None = None
    ram_cache_fraction: float = 0.1
    ram_cache_ways: int = DEFAULT_WAYS
    read_threads: int = 8
    read_backend: str = "auto"
    read_timeout_s: float = 120.0
    cache_fraction: float = 0.0
    cache_ways: int = DEFAULT_WAYS
    serving_fields: ClassVar[dict] = {}

    def __post_init__(self):
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise ValueError(f"directory: expected a path (str or os.PathLike), found {self.directory!r}")
        for name in ("ram_cache_fraction", "cache_fraction"):
            fraction = getattr(self, name)
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise ValueError(f"{name}: expected a number in [0, 1], found {fraction!r}")
        check_int("ram_cache_ways", self.ram_cache_ways, 1)
        check_int("cache_ways", self.cache_ways, 1)
        check_int("read_threads", self.read_threads, 0, maximum=MAX_THREADS, note=" (0: the calling thread reads)")
        check_choice("read_backend", self.read_backend, DISK_READ_BACKENDS)
        timeout = self.read_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"read_timeout_s: expected a number of seconds > 0, found {timeout!r}")

    def required_directory(self) -> str | os.PathLike:
        if self.directory is None:
            raise ValueError("directory: placement 'disk' needs the directory of its row files "
                             "(placement_options={'directory': ...}), found None")
        return self.directory

    @classmethod
    def of(cls, options: dict | None) -> "DiskOptions":
        """The options among ``options`` (a placement's keyword arguments; others ignored), checked."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in (options or {}).items() if key in names})


def _target(device) -> torch.device:
    if device is None or torch.device(device).type == "cpu":
        return torch.device("cpu")
    return resolve_cuda_device(device, "placement 'disk'")


@register_placement
class DiskPlacement(TablePlacement):
    """Rows in a row file in ``directory`` under a RAM cache (module docstring); ``device``: the CPU (default)
    or a CUDA device, where ids are given and rows land.

    Options (``placement_options``):
        directory: where the row files live (required): written there when the table is built from
            tensors or loaded from a checkpoint without a valid row file.
        ram_cache_fraction: rows held in RAM, as a fraction of the table's rows, in [0, 1] (0: none).
        ram_cache_ways: ways per set of the RAM cache.
        read_threads: threads reading pages at once (0: the calling thread).
        read_backend: ``"auto"``, ``"native"`` (O_DIRECT reads by C threads) or ``"python"`` (``os.pread``).
        read_timeout_s: the longest a lookup waits for its prefetched read, or a reader for the ids' copy.
        cache_fraction: rows held in the HBM cache above the RAM cache, as a fraction of the table's rows, in
            [0, 1] (0, the default: none; on the CPU it is a second cache in host memory).
        cache_ways: ways per set of the HBM cache.
    """

    name = "disk"
    serves_cpu = True
    starts_reads = True
    options_type = DiskOptions
    no_host_table_reason = "its rows live in a row file on local disk under a RAM cache of its own"

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None, *,
                 directory: str | os.PathLike | None = None, ram_cache_fraction: float = 0.1,
                 ram_cache_ways: int = DEFAULT_WAYS, read_threads: int = 8, read_backend: str = "auto",
                 read_timeout_s: float = 120.0, cache_fraction: float = 0.0, cache_ways: int = DEFAULT_WAYS):
        options = DiskOptions(directory=directory, ram_cache_fraction=ram_cache_fraction,
                              ram_cache_ways=ram_cache_ways, read_threads=read_threads, read_backend=read_backend,
                              read_timeout_s=read_timeout_s, cache_fraction=cache_fraction, cache_ways=cache_ways)
        directory = options.required_directory()
        target = _target(device)
        head_dim = value_bytes.shape[1]
        row_file = getattr(value_bytes, ROW_FILE_ATTRIBUTE, None)
        if row_file is None:   # built from tensors: their row file, written once
            from engram.table.disk.writing import TensorTableSource, source_fingerprint, write_row_file

            source = TensorTableSource(value_bytes.cpu(), scale_bytes.cpu())
            path = write_row_file(source, directory, progress=False)
            row_file = open_row_file(path, source_fingerprint(source), source.num_rows, head_dim)
        if not isinstance(row_file, RowFile):
            raise ValueError(f"values: expected the row file placement 'disk' loaded, found {row_file!r}")
        empty = torch.empty(0, head_dim, dtype=torch.uint8)
        super().__init__(empty, torch.empty(0, head_dim // BLOCK_SIZE, dtype=torch.uint8), target)
        self.options = options
        self.row_file = row_file
        self._rows = row_file.layout.num_rows
        self.reads = CachedRowReader(row_file, ram_cache_fraction=ram_cache_fraction, ways=ram_cache_ways,
                                     read_threads=read_threads, read_backend=read_backend)
        self.hbm_cache = HbmRowCache.for_fraction(cache_fraction, self._rows, self.reads.row_bytes, cache_ways, target)
        """The HBM cache above the RAM cache (None: ``cache_fraction`` 0)."""
        hbm_cache, reads = self.hbm_cache, self.reads   # not self: the worker thread must not keep the table alive
        read = None if hbm_cache is None else (lambda job: _read_outside(job, hbm_cache, reads))
        self.worker = ReadWorker(self.reads, read_timeout_s, read=read)
        self._closer = weakref.finalize(self, _close, self.worker, self.reads, hbm_cache)
        self.stats = {"prefetched_rows": 0, "reread_rows": 0, "direct_reads": 0}

    # ---- loading from a checkpoint ---------------------------------------------------
    @classmethod
    def storage_device(cls, device) -> torch.device | None:
        target = _target(device)
        return None if target.type == "cpu" else target

    @classmethod
    def load_storage(cls, source, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The row file of ``source`` in the option ``directory``: reused when valid, else written (with
        progress; room checked first). Returns placeholders ``[rows, D]`` / ``[rows, D // 32]`` that hold no
        rows (one row, expanded), the values' carrying the checked row file for :meth:`__init__`."""
        from engram.progress import shows_progress
        from engram.table.disk.writing import ensure_row_file, source_fingerprint

        options = DiskOptions.of(source.placement_options)   # bad options refused before any read
        path = ensure_row_file(source, options.required_directory(), progress=shows_progress(source.progress))
        row_file = open_row_file(path, source_fingerprint(source), source.num_rows, source.head_dim)
        return (*row_file_placeholders(row_file), {})

    # ---- what it holds ---------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self._rows

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the table takes: its RAM cache (the rows stay on disk)."""
        return self.reads.cache.nbytes

    @property
    def cache_nbytes(self) -> int:
        """Bytes of the HBM cache's rows on :attr:`device` (0 without one)."""
        return 0 if self.hbm_cache is None else self.hbm_cache.nbytes

    @property
    def file_bytes(self) -> int:
        return self.row_file.layout.file_bytes

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def close(self) -> None:
        """Stop the reader thread (queued reads end with an error), close the file and drop the RAM cache.
        Lookups and prefetches afterwards raise."""
        self._closer()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"placement 'disk' ({self.row_file.path}): {what} after close()")

    def _refuse_capture(self, what: str) -> None:
        if capturing():
            raise RuntimeError(f"placement 'disk': {what} reads rows from disk on host threads, which a CUDA graph "
                               "cannot capture; run lookups of disk tables outside graph capture (eagerly)")

    # ---- ids and rows ----------------------------------------------------------------
    def _local_ids(self, global_ids: torch.Tensor, row_start: int) -> torch.Tensor:
        """``int64 [N]`` row ids in the file: ``global - row_start``, the zero row for ids outside the table."""
        local = global_ids.reshape(-1).to(torch.int64) - row_start
        inside = (local >= 0) & (local < self._rows)
        return torch.where(inside, local, torch.full_like(local, self._rows))

    def _host_buffer(self, shape, dtype) -> torch.Tensor:
        # Never an inference tensor: the reader thread, outside inference mode, writes it.
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _to_host(self, local: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A host copy of ``local``, and the event after which it holds the ids (None: at once)."""
        host = self._host_buffer(local.shape, torch.int64)
        if self.device.type != "cuda":
            return host.copy_(local), None
        host.copy_(local, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return host, ready

    def _on_device(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.device, non_blocking=True) if self.device.type == "cuda" else rows

    def _rows_out(self, rows: torch.Tensor, shape: tuple[int, int], packed: bool):
        """Packed rows ``uint8 [N, row_bytes]`` (host or device) as the lookup's result on :attr:`device`."""
        rows = self._on_device(rows)
        head_dim = self.head_dim
        values = rows[:, :head_dim].reshape(*shape, head_dim).view(torch.float8_e4m3fn)
        scales = rows[:, head_dim: head_dim + head_dim // BLOCK_SIZE].reshape(*shape, head_dim // BLOCK_SIZE)
        if packed:
            return values.contiguous(), scales.contiguous()
        return dequantize_rows(values, scales, torch.bfloat16)

    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``int64 [N]`` ids in ``[0, rows)`` -> ``(uint8 [N, D], uint8 [N, D // 32])`` on :attr:`device` (a read now)."""
        self._check_open("a lookup")
        self._refuse_capture("a lookup")
        staging = self._host_buffer((local_row_ids.numel(), self.reads.row_bytes), torch.uint8)
        self.reads.read(local_row_ids.reshape(-1).cpu().numpy(), staging)
        rows = staging.to(self.device, non_blocking=True) if self.device.type == "cuda" else staging
        head_dim = self.head_dim
        return rows[:, :head_dim], rows[:, head_dim: head_dim + head_dim // BLOCK_SIZE]

    # ---- prefetch and lookup ---------------------------------------------------------
    def prefetch(self, global_ids: torch.Tensor, row_start: int) -> ReadJob | None:
        """Start reading the rows of ``global_ids int [T, C_local]``: ids copied to host memory on the current
        stream, then read by the reader thread into the job's staging; the job (None for no ids)."""
        self._check_open("a prefetch")
        self._refuse_capture("a prefetch")
        if global_ids.numel() == 0:
            return None
        host, ready = self._to_host(self._local_ids(global_ids, row_start))
        staging = self._host_buffer((host.numel(), self.reads.row_bytes), torch.uint8)
        return self.worker.submit(ReadJob(host, ready, staging))

    def prefetch_captured(self, global_ids: torch.Tensor, row_start: int):
        self._refuse_capture("a prefetch")

    def prefetch_starts(self, num_ids: int) -> bool:
        return num_ids > 0

    def prefetch_usable(self, pending: ReadJob) -> bool:
        return not self.closed

    def finish_waits(self, pending: ReadJob) -> bool:
        return True

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool, pending: ReadJob | None = None):
        """``global_ids int [T, C_local]`` -> ``bfloat16 [T, C_local, D]`` (or, ``packed``, ``(float8_e4m3fn
        [T, C_local, D], uint8 [T, C_local, D // 32])``) on :attr:`device`; zeros outside the table's rows.
        With ``pending`` (this table's prefetch) its staged rows serve the positions whose ids match."""
        self._check_open("a lookup")
        self._refuse_capture("a lookup")
        shape = (global_ids.shape[0], global_ids.shape[1])
        local = self._local_ids(global_ids, row_start)
        if self.hbm_cache is not None:
            return self._rows_out(self._through_hbm_cache(local, pending), shape, packed)
        if pending is None:
            self.stats["direct_reads"] += 1
            staging = self._host_buffer((local.numel(), self.reads.row_bytes), torch.uint8)
            self.reads.read(local.cpu().numpy(), staging)
            return self._rows_out(staging, shape, packed)
        own, ready = self._to_host(local)
        staging = self.worker.wait(pending)   # bounded; the job's read error raised here
        wait_event(ready, self.worker.timeout_s, str(self.row_file.path))
        own_ids = own.numpy()
        if staging.shape[0] != own_ids.size:
            staging = self._host_buffer((own_ids.size, self.reads.row_bytes), torch.uint8)
            stale = np.arange(own_ids.size)
        else:
            tags = row_tags(staging).numpy().astype(np.int64)
            stale = np.flatnonzero((tags != own_ids) | (pending.host_ids.numpy() != own_ids))
        if stale.size:   # rows read for other ids: read this lookup's own
            fresh = self.reads.read(own_ids[stale])
            staging[torch.from_numpy(stale)] = fresh
        self.stats["prefetched_rows"] += own_ids.size - stale.size
        self.stats["reread_rows"] += stale.size
        return self._rows_out(staging, shape, packed)


    def _through_hbm_cache(self, local: torch.Tensor, pending: ReadJob | None) -> torch.Tensor:
        """``uint8 [N, row_bytes]`` on :attr:`device`: the rows of ``local int64 [N]``, each distinct id from the
        HBM cache as it holds them now, else from ``pending``'s staging where a staged row was read for it
        (its tag and the job's id both equal it), else from RAM or disk."""
        own, ready = self._to_host(local)
        staging = None if pending is None else self.worker.wait(pending)   # bounded; its read error raised here
        wait_event(ready, self.worker.timeout_s, str(self.row_file.path))
        own_ids = own.numpy()
        distinct, inverse = np.unique(own_ids, return_inverse=True)
        inverse = inverse.reshape(-1)
        source = np.full(distinct.size, -1, dtype=np.int64)   # per distinct id: a staged row read for it
        if staging is not None and staging.shape[0] == own_ids.size:
            valid = (row_tags(staging).numpy().astype(np.int64) == own_ids) & (pending.host_ids.numpy() == own_ids)
            if pending.read_mask is not None:
                valid &= pending.read_mask
            positions = np.flatnonzero(valid)
            source[inverse[positions]] = positions
        if pending is None:
            self.stats["direct_reads"] += 1

        def read(miss_positions: np.ndarray) -> torch.Tensor:
            rows = self._host_buffer((miss_positions.size, self.reads.row_bytes), torch.uint8)
            staged_at = source[miss_positions]
            have, need = np.flatnonzero(staged_at >= 0), np.flatnonzero(staged_at < 0)
            if have.size:
                rows[torch.from_numpy(have)] = staging[torch.from_numpy(staged_at[have])]
            if need.size:
                rows[torch.from_numpy(need)] = self.reads.read(distinct[miss_positions[need]])
            if pending is not None:
                self.stats["prefetched_rows"] += int(have.size)
                self.stats["reread_rows"] += int(need.size)
            return self._on_device(rows)

        rows = self.hbm_cache.serve(distinct, read)
        return rows.index_select(0, torch.from_numpy(inverse).to(rows.device, non_blocking=True))


def _read_outside(job: ReadJob, hbm_cache: HbmRowCache, reads: CachedRowReader) -> None:
    """A prefetch's read under an HBM cache: the rows of the ids the cache does not hold now, into their
    positions of the job's staging (``job.read_mask`` says which)."""
    ids = job.host_ids.numpy()
    outside = ~hbm_cache.cached(ids)
    positions = np.flatnonzero(outside)
    if positions.size == ids.size:
        reads.read(ids, job.staging)
    elif positions.size:
        job.staging[torch.from_numpy(positions)] = reads.read(ids[positions])
    job.read_mask = outside


def _close(worker: ReadWorker, reads: CachedRowReader, hbm_cache: HbmRowCache | None) -> None:
    worker.close()
    reads.close()
    if hbm_cache is not None:
        hbm_cache.close()
