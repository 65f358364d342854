"""Placement ``"host"``: the table in pinned host memory, read by one CUDA device.

Two read paths, chosen per lookup by its row count (``direct_max_rows``):

* **direct** (a): the gather kernel reads the rows from host memory itself, over
  unified addressing (:func:`engram.table.host_memory.rows.cuda_alias`): no host thread, no
  sync, safe under CUDA-graph capture; latency-bound, for decode-sized batches.
* **host gather** (b): :class:`engram.table.host_memory.gather.HostGather`: the rows are
  deduplicated on the device, gathered on the host by torch's threads into pinned
  staging and moved by the copy engine in chunks; the gather kernel then reads them
  back in token order from the device staging.
  Under CUDA-graph capture a prefetched lookup of more than ``graph_direct_max_rows`` rows is
  gathered the same way by a gather captured into the graph, which the native worker answers at
  every replay (:meth:`HostPlacement.prefetch_captured`); a lookup without a prefetch reads directly.

:meth:`HostPlacement.prefetch` starts path (b) early (at the step's prefetch) and returns its
ticket; the lookup given that ticket (through :class:`~engram.table.table.TablePrefetch`) then
waits on that layer's copies only, on the GPU. Every path returns the bytes the ``device``
placement returns, bit for bit.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from engram.checks import check_int
from engram.common import resolve_cuda_device
from engram.options import DEFAULT_DIRECT_MAX_ROWS, DEFAULT_GRAPH_DIRECT_MAX_ROWS, DEFAULT_PREFETCH_DIRECT_MAX_ROWS
from engram.table.host_memory.gather import GatherTicket, HostGather, check_gather_options, gather_packed_rows_host
from engram.table.host_memory.rows import (PackedRows, cuda_alias, owns_its_pages, pack_rows_in_own_pages, packed_row_bytes,
                        register_with_cuda, row_tags_written)
from engram.table.table import TablePlacement, register_placement

__all__ = ["HostPlacement", "HostOptions", "DIRECT_MAX_ROWS"]

# Lookups of at most this many rows read host memory directly (path a), larger ones take the host
# gather (path b): ServingOptions.direct_max_rows's default, where its measurement is quoted.
DIRECT_MAX_ROWS = DEFAULT_DIRECT_MAX_ROWS

# Launch shape of direct reads of decode-sized lookups (at most DECODE_MAX_ROWS rows): one row
# per one-warp program keeps more PCIe reads in flight. H200, T = 64 (bench_host.py
# "direct_configs_T64", two runs): 17.7-18.0 us against 19.1-19.6 us for the gather's default
# (8 rows, 2 warps). Larger lookups keep the default (not measured with this shape).
DECODE_MAX_ROWS = 128 * 24
DECODE_DIRECT_SHAPE = {"block_rows": 1, "num_warps": 1, "vector": 16}


def _gather_launchers():
    from engram.table.kernels import gather  # imports Triton: only where a Triton path runs

    return gather


def _merge_launchers():
    from engram.table.kernels import cache_gather  # imports Triton: only where a Triton path runs

    return cache_gather


@functools.lru_cache(maxsize=1)
def _decode_direct_config():
    return _gather_launchers().GatherConfig(**DECODE_DIRECT_SHAPE)


def check_direct_max_rows(value, name: str = "direct_max_rows") -> int:
    """``direct_max_rows`` (or the option ``name``) as given by a caller: an integer >= 0."""
    return check_int(name, value, 0, note=" (0: every lookup takes the host gather)")


# ServingOptions fields the host placements take, under the same names.
HOST_SERVING_FIELDS = ("direct_max_rows", "gather_threads", "host_gather_worker", "host_gather_dedup")


def check_host_gather_options(direct_max_rows, gather_threads, host_gather_worker, host_gather_dedup) -> None:
    """The options both host placements take, each refused naming it."""
    check_direct_max_rows(direct_max_rows)
    check_gather_options(gather_threads, host_gather_worker, host_gather_dedup)


@dataclass(frozen=True)
class HostOptions:
    """Options of placement ``"host"`` (keyword arguments of :class:`HostPlacement`, described there);
    the :class:`~engram.options.ServingOptions` fields of the same names fill them."""

    direct_max_rows: int = DIRECT_MAX_ROWS
    prefetch_direct_max_rows: int = DEFAULT_PREFETCH_DIRECT_MAX_ROWS
    gather_threads: int | None = None
    host_gather_worker: str = "auto"
    host_gather_dedup: str = "auto"
    graph_direct_max_rows: int = DEFAULT_GRAPH_DIRECT_MAX_ROWS
    serving_fields: ClassVar[dict] = {name: name for name in HOST_SERVING_FIELDS + ("prefetch_direct_max_rows",
                                                                                    "graph_direct_max_rows")}

    def __post_init__(self):
        check_host_gather_options(self.direct_max_rows, self.gather_threads, self.host_gather_worker,
                                  self.host_gather_dedup)
        check_direct_max_rows(self.prefetch_direct_max_rows, "prefetch_direct_max_rows")
        check_direct_max_rows(self.graph_direct_max_rows, "graph_direct_max_rows")


@register_placement
class HostPlacement(TablePlacement):
    """Rows packed ``[D values | D / 32 scales | pad]`` (16-byte aligned, see
    :mod:`engram.table.host_memory.rows`) in pinned host memory; ``device`` is the CUDA device
    whose hash ids it takes and where rows land. Separate value / scale tensors are
    packed (one copy); the loader writes packed views directly (no copy).

    Options (``placement_options``):
        direct_max_rows: lookups of at most this many rows read host memory directly (path a),
            larger ones take the host gather (path b); 0 sends every lookup outside CUDA-graph
            capture through the host gather.
        prefetch_direct_max_rows: prefetched lookups of at most this many rows (and at most
            ``direct_max_rows``) take path (a); larger ones start path (b) at the prefetch.
        gather_threads: host threads copying rows for path (b) (default: the usable cores over
            the processes sharing the node, :func:`~engram.table.host_memory.gather.default_gather_threads`).
        host_gather_worker: ``"auto"``, ``"native"`` or ``"python"``: who copies path (b)'s rows
            (:mod:`engram.table.host_memory.gather`).
        host_gather_dedup: ``"auto"``, ``"always"`` or ``"never"``: whether path (b) copies each distinct
            row once (:mod:`engram.table.host_memory.gather`).
        graph_direct_max_rows: under CUDA-graph capture, prefetched lookups of more rows than this take a
            host gather captured with the graph (native worker: every replay gathers its own ids,
            :meth:`HostGather.start_replayed <engram.table.host_memory.gather.HostGather.start_replayed>`);
            the others, and every lookup without a prefetch, read host memory directly.
    """

    name = "host"
    has_triton_lookup = True
    starts_reads = True
    options_type = HostOptions
    keeps_host_table = True

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None, *,
                 direct_max_rows: int = DIRECT_MAX_ROWS, gather_threads: int | None = None,
                 host_gather_worker: str = "auto", prefetch_direct_max_rows: int = DEFAULT_PREFETCH_DIRECT_MAX_ROWS,
                 host_gather_dedup: str = "auto", graph_direct_max_rows: int = DEFAULT_GRAPH_DIRECT_MAX_ROWS):
        HostOptions(direct_max_rows=direct_max_rows, prefetch_direct_max_rows=prefetch_direct_max_rows,
                    gather_threads=gather_threads, host_gather_worker=host_gather_worker,
                    host_gather_dedup=host_gather_dedup,
                    graph_direct_max_rows=graph_direct_max_rows)  # every option checked before any work
        if not torch.cuda.is_available():
            raise ValueError("placement 'host' keeps the table in host memory for a CUDA device to read, and this "
                             "machine has no CUDA device; use placement='cpu' (tables served from the CPU)")
        target = resolve_cuda_device(device, "placement 'host'")
        rows = PackedRows.matching(value_bytes, scale_bytes)
        if rows is None or not owns_its_pages(rows):  # registered ranges may not share a page
            rows = pack_rows_in_own_pages(value_bytes.cpu(), scale_bytes.cpu())
        if not row_tags_written(rows.packed):
            warnings.warn("placement 'host': the packed rows carry no tags (each row's own index in its last 4 bytes, "
                          "written by PackedRows.view_of or write_row_tags; a copy of whole rows over them erases "
                          "them): rows stay exact, but every staged row is then read again from host memory "
                          "directly, at a fraction of the host gather's speed", RuntimeWarning, stacklevel=3)
        registration = self.registration = register_with_cuda(rows.packed, target)  # .close(): unregister now
        weakref.finalize(self, registration.close)  # else when the placement goes (before its rows are freed)
        super().__init__(rows.values, rows.scales, target)
        self.rows = rows
        self.direct_max_rows = direct_max_rows
        self.prefetch_direct_max_rows = prefetch_direct_max_rows
        self.graph_direct_max_rows = graph_direct_max_rows
        self.direct_config = None  # launch shape of the direct reads (None: by size, as above)
        head_dim = rows.head_dim
        alias = cuda_alias(rows.packed, target)  # [rows + 1, row_bytes], host memory, a CUDA tensor
        # uint8 [rows, D] / [rows, D / 32]: CUDA views of the host rows' values and scales (direct reads over PCIe)
        self.direct_values = alias[:-1, :head_dim]
        self.direct_scales = alias[:-1, head_dim: head_dim + head_dim // 32]
        self._host_gather = HostGather(rows.packed, target, gather_threads, host_gather_worker, host_gather_dedup)

    # ---- loading from a checkpoint ---------------------------------------------------
    @classmethod
    def allocate_storage(cls, num_rows: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows (:mod:`engram.table.host_memory.rows`): values and scales are views of one CPU buffer,
        which the placement pins in place (no second copy)."""
        buffer = torch.empty((num_rows + 1) * packed_row_bytes(head_dim), dtype=torch.uint8)
        rows = PackedRows.view_of(buffer, num_rows, head_dim)
        return rows.values, rows.scales

    @classmethod
    def load_storage(cls, source, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Packed rows streamed from the memory-mapped checkpoint straight into host memory (2 MiB pages
        where the OS gives them), private, or shared per node with ``source.share``
        (:mod:`engram.table.host_memory.buffers`: filled by the node's first process, mapped read-only by the
        others); kept: the mapping (``host_buffer``) and the share key."""
        from engram.table.host_memory.buffers import allocate_host_buffer

        num_rows, head_dim = source.num_rows, source.head_dim
        row_bytes = packed_row_bytes(head_dim)
        nbytes = (num_rows + 1) * row_bytes

        def fill(buffer: torch.Tensor) -> None:
            rows = PackedRows.view_of(buffer, num_rows, head_dim)
            source.read_into(rows.values, rows.scales)

        key = source.share_key() if source.share else None
        host_buffer = allocate_host_buffer(nbytes, fill=fill, share_key=key, read_only=False, row_bytes=row_bytes,
                                           sources=source.files if source.share else ())
        rows = PackedRows(host_buffer.tensor[:nbytes].view(num_rows + 1, row_bytes), head_dim)
        return rows.values, rows.scales, {"host_buffer": host_buffer, "share_key": key}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the table takes (packed rows and the zero row)."""
        return self.rows.packed.numel()

    @property
    def host_gather(self) -> HostGather:
        """The table's path (b) (:class:`~engram.table.host_memory.gather.HostGather` over :attr:`rows`); placement
        ``"cached"`` sends the misses of its large lookups through it (ids local: ``row_start`` 0)."""
        return self._host_gather

    # ---- torch path ----------------------------------------------------------
    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path (backend ``"torch"``): ids to the host (a sync), ``index_select`` there."""
        staged = torch.empty(local_row_ids.numel(), self.rows.packed.shape[1], dtype=torch.uint8)
        gather_packed_rows_host(self.rows.packed, local_row_ids.cpu(), 0, staged, self._host_gather.gather_threads)
        staged = staged.to(self.device)
        head_dim = self.rows.head_dim
        return staged[:, :head_dim], staged[:, head_dim: head_dim + head_dim // 32]

    # ---- Triton paths --------------------------------------------------------
    def _use_direct(self, global_ids: torch.Tensor) -> bool:
        return global_ids.numel() <= self.direct_max_rows or torch.cuda.is_current_stream_capturing()

    def prefetch(self, global_ids: torch.Tensor, row_start: int) -> GatherTicket | None:
        """Start the host gather of ``global_ids`` (``[T, C_local]`` on :attr:`device`) now and return
        its ticket, for the lookup of exactly these ids. Lookups of at most
        ``min(prefetch_direct_max_rows, direct_max_rows)`` rows (read directly) and lookups under
        CUDA-graph capture need no prefetch: nothing is started (None)."""
        if torch.cuda.is_current_stream_capturing() or not self.prefetch_starts(global_ids.numel()):
            return None
        return self._host_gather.start(global_ids, row_start, torch.cuda.current_stream(self.device))

    def prefetch_starts(self, num_ids: int) -> bool:
        return self.backend == "triton" and num_ids > min(self.prefetch_direct_max_rows, self.direct_max_rows)

    def prefetch_captured(self, global_ids: torch.Tensor, row_start: int) -> GatherTicket | None:
        """Under CUDA-graph capture: capture the host gather of ``global_ids`` into the graph
        (:meth:`HostGather.start_replayed <engram.table.host_memory.gather.HostGather.start_replayed>`) when
        the lookup has more than ``graph_direct_max_rows`` rows and the native worker runs, and return its
        ticket; else None (the captured lookup reads host memory directly)."""
        if (self.backend != "triton" or global_ids.numel() <= self.graph_direct_max_rows
                or not self._host_gather.replays):
            return None
        return self._host_gather.start_replayed(global_ids, row_start, torch.cuda.current_stream(self.device))

    def finish_waits(self, pending: GatherTicket) -> bool:
        """Whether finishing the prefetch blocks the caller: with the Python worker, until its copies are enqueued."""
        return pending.future is not None

    def release_captured(self, pending: GatherTicket) -> None:
        torch.cuda.current_stream(self.device).wait_event(pending.done)

    def prefetch_usable(self, pending: GatherTicket) -> bool:
        """Whether a prefetch's ticket still holds its rows (no later gather reused the staging); a captured
        gather's, only in its capture."""
        if pending.replayed:
            return torch.cuda.is_current_stream_capturing()
        return self._host_gather.current(pending)

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool,
                     pending: GatherTicket | None = None):
        if self.backend != "triton":
            return None
        gather = _gather_launchers()
        ticket = pending
        if ticket is None:
            if self._use_direct(global_ids):
                config = self.direct_config
                if config is None and global_ids.numel() <= DECODE_MAX_ROWS:
                    config = _decode_direct_config()
                if packed:
                    return gather.gather_rows_packed(self.direct_values, self.direct_scales, global_ids, row_start,
                                                     config=config)
                return gather.gather_rows(self.direct_values, self.direct_scales, global_ids, row_start,
                                          config=config)
            ticket = self._host_gather.start(global_ids, row_start, torch.cuda.current_stream(self.device))
        stream = torch.cuda.current_stream(self.device)
        staged, inverse = self._host_gather.finish(ticket, stream)
        if pending is not None and not pending.replayed:
            inverse.record_stream(stream)  # made on the prefetch's stream
        # Each staged row serves only the position whose id it was read for (its tag); any other position reads
        # its row from host memory directly in the same launch: ids edited since the prefetch, a stale or
        # never-written staging cost reads, never rows.
        merge = _merge_launchers()
        merge_rows = merge.checked_merge_rows_packed if packed else merge.checked_merge_rows
        out = merge_rows(global_ids, row_start, self.direct_values, self.direct_scales, staged, inverse)
        if not ticket.replayed:  # a replayed gather's staging is its own, reused only by the graph's next replay
            self._host_gather.consumed(stream)
        return out
