"""Placement ``"cached"``: a host table (placement ``"host"``) plus an HBM cache of hot rows.

The rows live in pinned host memory exactly as with ``"host"``; a
:class:`~engram.table.placements.row_cache.RowCache` of ``cache_fraction * rows`` slots on the device
holds copies of hot rows. Results equal the ``device`` placement's bit for bit whatever the
cache holds. Two read paths, chosen per lookup as the host placement chooses its own:

* **one kernel** (lookups of at most :attr:`CachedPlacement.direct_max_rows` rows, default the
  host placement's ``DIRECT_MAX_ROWS``, and every lookup under CUDA-graph capture):
  :func:`~engram.table.kernels.cache_gather.cached_gather_rows`: per row one read of its set's tags,
  then the row from HBM on a hit or from host memory over the direct path (the CUDA alias of
  the pinned rows) on a miss. No host thread, no sync: the decode path.
* **misses through the host gather** (larger lookups): :func:`~engram.table.kernels.cache_gather.cached_probe`
  writes each row's slot (-1 unless a hit) and the miss ids (-1 for hits and ids outside the
  table, which the host gather reads as its zero row: at most one extra distinct row); the host
  placement's :class:`~engram.table.host_memory.gather.HostGather` deduplicates the misses on the
  device and gathers them on the host into pinned staging for the copy engine; then
  :func:`~engram.table.kernels.cache_gather.checked_merge_rows` reads each hit from its slot and every
  other row from the device staging through the dedup's ``inverse``, each only where its tag names the
  lookup's row (any other row is read from host memory directly, in the same launch). Host bytes moved: the
  distinct missed rows (+1). No host sync on the caller's thread. Optionally
  (:attr:`CachedPlacement.direct_share`, default 0) a hash class of the missed rows is left out of
  the host gather and read directly from host memory (:func:`~engram.table.kernels.cache_gather.cached_direct_reads`,
  on a side stream) while the host gathers the rest: both transports at once.

:meth:`CachedPlacement.prefetch` starts the second path early (probe and host gather), as
``"host"`` does, and returns its pending state; the lookup given it (through
:class:`~engram.table.table.TablePrefetch`) then only waits, on the GPU, for its copies and
merges. The probe's slots must still hold the same rows when the merge runs: a change of the
cache's content between the two (``update_cache``, ``load_hot_rows``; the
:attr:`RowCache.version <engram.table.placements.row_cache.RowCache.version>` tells), or a later host
gather of the same table, makes the prefetch unusable, and the lookup probes and gathers again
itself (right, but the prefetch's head start is lost): call ``update_cache`` after a step's
lookups, not between a layer's prefetch and its lookup.

Three policies, the same rules as those of :mod:`engram.tools.cache_policy` (which
``engram profile eval`` replays on recorded text; its default is this placement's):

* ``"set-lru"`` (default): the engine calls :meth:`EngramTable.update_cache` with each
  step's hash ids between steps; missed rows replace their set's least recently read rows
  (set-associative LRU, :mod:`engram.table.placements.row_cache`). Chosen on held-out text
  (``benchmarks/NOTES.md``, "HBM cache policies on real text"): 36.9-52.6% of reads at 2% of
  rows, 2.3-3.9 points above ``"dynamic"`` there.
* ``"dynamic"``: as ``"set-lru"``, with frequency-based replacement and aging instead of
  recency (better only at about 0.1% of rows).
* ``"static"``: the hot set given (``hot_rows=`` or :meth:`EngramTable.load_hot_rows`)
  stays; :meth:`update` does nothing.

With ``"set-lru"`` and ``"dynamic"`` a hot set, when given, is the starting content.

The index is fixed-size and updated in place, so a lookup captured in a CUDA graph keeps
serving the current content across updates. Without CUDA the placement is refused,
except under ``TRITON_INTERPRET=1`` with ``device="cpu"`` (the backing rows are then a CPU
tensor): that is how the CPU tests run the kernels; there the second path gathers the
misses synchronously (same dedup, same host gather of packed rows, no threads or streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engram.common import cuda_capturing
from engram.checks import CACHE_POLICIES, check_bool, check_choice, check_fraction, check_int
from engram.triton_launch import interpreting, triton_available
from engram.table.placements.host import (DIRECT_MAX_ROWS, HOST_SERVING_FIELDS, HostPlacement,
                                          check_host_gather_options)
from engram.table.placements.row_cache import check_ways
from engram.table.graph_buffers import kept_for_graph
from engram.table.host_memory.gather import GatherTicket, gather_packed_rows_host
from engram.table.host_memory.rows import PackedRows, pack_rows
from engram.table.table import TablePlacement, register_placement
from engram.tuning import tuning

__all__ = ["CachedPlacement", "CachedOptions", "DEFAULT_CACHE_FRACTION"]

# 2% of rows: the size evaluated on held-out text (engram.tuning, serving.cache_fraction; benchmarks/NOTES.md).
DEFAULT_CACHE_FRACTION = tuning().serving.cache_fraction
UPDATED_POLICIES = ("set-lru", "dynamic")  # the policies that update_cache changes

# Whether an update copies the rows it admits from the last lookup's staging (RowCache.update's staged=: the host
# gather's after a large lookup, the lookup's own after a one-kernel one) rather than reading them from host memory
# again: 190 k rows a table at T = 8192 on uniform ids, 17-20 ms of PCIe-bound GPU time for two 25.5 GiB tables on
# the H200 (benchmarks/NOTES.md "An HBM cache beside the step"); 46 us of a decode update's 84 at T = 64.
ADMIT_FROM_STAGING = True


@dataclass(frozen=True)
class CachedOptions:
    """Options of placement ``"cached"`` (keyword arguments of :class:`CachedPlacement`, described there;
    ``hot_rows``, a tensor per table, is not one). :class:`~engram.options.ServingOptions` fills
    ``cache_fraction``, ``policy`` (its ``cache_policy``), ``ways`` (``cache_ways``) and the host gather's."""

    cache_fraction: float = DEFAULT_CACHE_FRACTION
    ways: int = 8
    aging_interval: int = 16
    policy: str = "set-lru"
    direct_max_rows: int = DIRECT_MAX_ROWS
    gather_threads: int | None = None
    host_gather_worker: str = "auto"
    host_gather_dedup: str = "auto"
    update_beside: bool = True
    serving_fields: ClassVar[dict] = {"cache_fraction": "cache_fraction", "cache_policy": "policy",
                                      "cache_ways": "ways", **{name: name for name in HOST_SERVING_FIELDS}}

    def __post_init__(self):
        check_fraction("cache_fraction", self.cache_fraction)
        check_ways(self.ways)
        check_int("aging_interval", self.aging_interval, 1)
        check_choice("policy", self.policy, CACHE_POLICIES)
        check_host_gather_options(self.direct_max_rows, self.gather_threads, self.host_gather_worker,
                                  self.host_gather_dedup)
        check_bool("update_beside", self.update_beside)


@register_placement
class CachedPlacement(TablePlacement):
    """Host rows plus an HBM row cache.

    Args (after the storage and ``device`` every placement takes; pass them through
    ``EngramTable(..., placement="cached", placement_options={...})``):
        cache_fraction: fraction of the table's rows the cache holds, in ``(0, 1]``
            (rounded down to whole sets of ``ways`` slots; at least one set).
        ways: slots per set (power of two, at most 64).
        aging_interval: policy ``"dynamic"``: scores halve every this many updates.
        policy: ``"set-lru"`` (default), ``"dynamic"`` or ``"static"``.
        hot_rows: optional local row ids ``int [K]`` (hottest first) loaded as the starting content.
        direct_max_rows: lookups of at most this many rows take the one-kernel path, larger ones send
            their misses through the host gather (0: every lookup outside CUDA-graph capture does).
        gather_threads: host threads of the host gather (as placement ``"host"``'s option).
        host_gather_worker: who copies the host gather's rows (as placement ``"host"``'s option).
        host_gather_dedup: whether the host gather copies each distinct row once (as placement ``"host"``'s option).
        update_beside: on CUDA, run eager updates (:meth:`update`) on a stream of their own, beside the rest of
            the step (:mod:`engram.table.placements.updates_beside`; every later access of the cache waits for
            them, captured graphs included); False: on the caller's stream.
    """

    name = "cached"
    has_triton_lookup = True
    starts_reads = True
    options_type = CachedOptions
    keeps_host_table = True

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None, *,
                 cache_fraction: float = DEFAULT_CACHE_FRACTION, ways: int = 8, aging_interval: int = 16,
                 policy: str = "set-lru", hot_rows: torch.Tensor | None = None,
                 direct_max_rows: int = DIRECT_MAX_ROWS, gather_threads: int | None = None,
                 host_gather_worker: str = "auto", host_gather_dedup: str = "auto", update_beside: bool = True):
        CachedOptions(cache_fraction=cache_fraction, ways=ways, aging_interval=aging_interval, policy=policy,
                      direct_max_rows=direct_max_rows, gather_threads=gather_threads,
                      host_gather_worker=host_gather_worker, host_gather_dedup=host_gather_dedup,
                      update_beside=update_beside)  # checked first
        if torch.cuda.is_available():
            self.host = HostPlacement(value_bytes, scale_bytes, device, gather_threads=gather_threads,
                                      host_gather_worker=host_gather_worker, host_gather_dedup=host_gather_dedup)
            target = self.host.device
            self._back_values, self._back_scales = self.host.direct_values, self.host.direct_scales
            self._packed = self.host.rows.packed
            super().__init__(self.host.value_bytes, self.host.scale_bytes, target)
        elif interpreting() and triton_available() and (device is None or torch.device(device).type == "cpu"):
            rows = PackedRows.matching(value_bytes, scale_bytes) or pack_rows(value_bytes.cpu(), scale_bytes.cpu())
            self.host = None
            self._back_values, self._back_scales = rows.values, rows.scales
            self._packed = rows.packed
            super().__init__(rows.values, rows.scales, torch.device("cpu"))
        else:
            raise ValueError("placement 'cached' keeps the table in host memory for a CUDA device to read, and "
                             "this machine has no CUDA device; use placement='cpu' (tables served from the CPU)")
        from engram.table.placements.row_cache import RowCache

        # The last change of the cache's content (load_hot, update), on the stream it ran on: a probe on
        # another stream (a memory's prefetch stream) waits for it.
        self._content_changed: torch.cuda.Event | None = None
        num_rows = self.num_rows
        self.policy = policy
        self.cache_fraction = float(cache_fraction)
        self.cache = RowCache(max(1, int(num_rows * cache_fraction)), self.head_dim, self.device, ways=ways,
                              aging_interval=aging_interval, recency=policy == "set-lru")
        if update_beside and self.host is not None:
            self.cache.run_updates_beside()
        if hot_rows is not None:
            self.load_hot(hot_rows)
        self.direct_max_rows = direct_max_rows
        """Lookups of at most this many rows take the one-kernel path, larger ones send their misses
        through the host gather."""
        self.direct_share = 0.0
        """Share (0..1) of a large lookup's missed rows (a hash class of row ids) read directly from host
        memory, on a side stream, while the host gathers the others; 0 (default): every miss goes
        through the host gather. Two transports at once (GPU reads over PCIe, CPU gather + copy engine)."""
        self.lookups = {"one_kernel": 0, "host_gather": 0}
        """Lookups served by each path since construction (host-side counts, for tests and benchmarks)."""
        self._direct_stream = None
        # The last lookup's staging (_Staging): the next update copies the rows it admits from there rather than
        # from host memory (each staging row checked by its tag). A large lookup's is the host gather's; a
        # one-kernel lookup's is a buffer of this placement's (eager) or of the graph capturing it.
        self._last_staging = None
        self._eager_stagings: dict[int, torch.Tensor] = {}  # per stream: lookups on two streams at once never share
        self._captured_stagings: list[torch.Tensor] = []  # each capture's own, read at every replay

    # Loaded as placement "host" is: packed host rows, private or node-shared.
    allocate_storage = classmethod(HostPlacement.allocate_storage.__func__)
    load_storage = classmethod(HostPlacement.load_storage.__func__)

    @property
    def backing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uint8 [rows, D], uint8 [rows, D // 32])`` on :attr:`device`: the host rows as the
        lookup kernel reads them on a miss (the CUDA alias of pinned host memory)."""
        return self._back_values, self._back_scales

    @property
    def nbytes(self) -> int:
        """Host bytes of the rows (as placement ``"host"``)."""
        return self.host.nbytes if self.host is not None else self.num_rows * (self.head_dim + self.head_dim // 32)

    @property
    def cache_nbytes(self) -> int:
        """Device bytes of the cache (slots and index)."""
        return self.cache.nbytes

    # ---- cache maintenance (between steps) -----------------------------------------
    def load_hot(self, local_row_ids: torch.Tensor) -> int:
        """Replace the cache's content by the rows ``local_row_ids int [K]`` (hottest first); returns
        the rows held (a set keeps at most ``ways`` of them)."""
        if not isinstance(local_row_ids, torch.Tensor) or local_row_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"hot_rows: expected an int32/int64 tensor of local row ids, found "
                             f"{getattr(local_row_ids, 'dtype', type(local_row_ids).__name__)}")
        held = self.cache.load_hot(local_row_ids, *self.backing)
        self._mark_content_changed()
        return held

    def _mark_content_changed(self) -> None:
        if self.host is not None:
            if self._content_changed is None:
                self._content_changed = torch.cuda.Event()
            self._content_changed.record(torch.cuda.current_stream(self.device))

    @property
    def captures_updates(self) -> bool:
        """Whether :meth:`update` may run under CUDA-graph capture: its fixed-size launches on CUDA."""
        return self.host is not None

    def update(self, global_ids: torch.Tensor, row_start: int) -> None:
        """The policy's step for the reads ``global_ids int [T, C_local]`` (on :attr:`device`);
        nothing for policy ``"static"``. Call between steps (after their lookups); a prefetch started before
        it is discarded (its probe may name replaced slots). On CUDA it can be captured in a graph (the
        decode step's): the graph then updates the cache at every replay. The merge checks each slot's tag,
        so a prefetch made across a replayed update costs reads, never rows."""
        last, self._last_staging = self._last_staging, None
        if self.policy not in UPDATED_POLICIES:
            return
        capturing = cuda_capturing()
        staged = inverse = None
        if ADMIT_FROM_STAGING and last is not None and self._staging_holds(last, global_ids, capturing):
            staged, inverse = last.rows, last.inverse
        beside = self.cache.updates_beside
        try:
            self.cache.update(global_ids.to(torch.int64) - row_start, *self.backing, staged=staged, inverse=inverse)
        finally:  # also after a failure part-way: some of the update's reads may be enqueued
            # A one-kernel lookup's staging needs nothing here: the next such lookup settles (waits for this
            # update) before it writes the staging again.
            if staged is not None and self.host is not None and last.number is not None:
                # The staging's next copy waits for this update's reads, on the stream they ran on (an eager
                # update runs beside whenever the cache has a stream for it).
                stream = beside.stream if beside is not None else torch.cuda.current_stream(self.device)
                staged.record_stream(stream)
                self.host.host_gather.consumed(stream)
        if capturing:  # an event of the capture cannot be waited on outside
            return
        if beside is not None and beside.done is not None:
            self._content_changed = beside.done  # it ran beside
        else:
            self._mark_content_changed()

    def _staging_holds(self, last: "_Staging", global_ids: torch.Tensor, capturing: bool) -> bool:
        """Whether the last lookup's staging may serve this update: made as this update runs (both captured in
        a graph, or both eager), one staging row (one-kernel lookup) or ``inverse`` entry (host gather) per id,
        the same stream as that lookup; a host gather's only eagerly and with no gather started since (its
        copies would overwrite the staging)."""
        if last.captured != capturing:
            return False
        if last.number is None:  # a one-kernel lookup's own staging: row i for id i
            if last.rows.shape[0] != global_ids.numel():
                return False
        elif capturing or last.inverse.numel() != global_ids.numel():
            return False
        if self.host is None:
            return True
        if last.stream != torch.cuda.current_stream(self.device):
            return False
        return last.number is None or self.host.host_gather.is_latest(last.number)

    def _lookup_staging(self, num_rows: int, stream, captured: bool) -> torch.Tensor | None:
        """``uint8 [num_rows, row_bytes]`` for a one-kernel lookup on ``stream`` (None on the CPU) to stage its rows
        in, or None (nothing to admit from it: an update-less policy, or staging off). When ``captured`` (under
        CUDA-graph capture) a buffer of that graph's own (outside its memory pool), kept for the process;
        eagerly this placement's for that stream, grown as
        needed (lookups on two streams at once, as in two micro-batches overlapped, never write one buffer; an
        update takes a staging only from a lookup on its own stream, and a lookup on that stream waits for
        the updates before it writes the staging again)."""
        if not ADMIT_FROM_STAGING or self.policy not in UPDATED_POLICIES or num_rows == 0:
            return None
        if captured:
            staging = self._new_staging(num_rows)
            if staging is not None:
                self._captured_stagings.append(staging)
            return staging
        key = stream.cuda_stream if stream is not None else 0
        staging = self._eager_stagings.get(key)
        if staging is None or staging.shape[0] < num_rows:
            if len(self._eager_stagings) >= 8:  # a few streams at most; a freed one is kept by its readers
                self._eager_stagings.clear()
            self._eager_stagings.pop(key, None)
            staging = self._new_staging(num_rows)
            if staging is None:
                return None
            self._eager_stagings[key] = staging
        return staging[:num_rows]

    def _new_staging(self, num_rows: int) -> torch.Tensor | None:
        """A fresh ``uint8 [num_rows, row_bytes]`` on the device, or None where the allocation fails: the lookup
        then stages nothing and the update reads host memory (a failed staging costs reads, never the lookup)."""
        try:  # under capture outside the graph's memory pool: the graph keeps it
            return kept_for_graph((num_rows, self._packed.shape[1]), torch.uint8, self.device)
        except torch.OutOfMemoryError:
            return None

    # ---- lookups ------------------------------------------------------------------
    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: :func:`~engram.table.placements.row_cache.cached_lookup_reference` (same bytes)."""
        from engram.table.placements.row_cache import cached_lookup_reference

        values, scales = cached_lookup_reference(self.cache, *self.backing, local_row_ids.reshape(1, -1), 0)
        return values[0], scales[0]

    def _use_one_kernel(self, global_ids: torch.Tensor) -> bool:
        return (global_ids.numel() <= self.direct_max_rows or global_ids.numel() == 0
                or (self.host is not None and torch.cuda.is_current_stream_capturing()))

    def _start_misses(self, global_ids: torch.Tensor, row_start: int) -> "_Pending":
        """Probe ``global_ids [T, C_local]`` and start the host gather of its misses (local ids) on the current
        stream, and the direct reads of the direct share's misses on a side stream; returns at once on CUDA
        (the CPU form does it all now)."""
        from engram.table.kernels.cache_gather import cached_direct_reads, cached_probe

        share = self.direct_share
        self.cache.settle()  # after updates still running beside (captured: a wait on their idle word)
        if self._content_changed is not None:  # the probe reads the content as the last change left it
            torch.cuda.current_stream(self.device).wait_event(self._content_changed)
        slot, miss = cached_probe(self.cache, self.num_rows, global_ids, row_start, direct_share=share)
        if self.host is None:
            direct = cached_direct_reads(slot, *self.backing) if share > 0 else None
            return _Pending(slot, _gather_now(self._packed, miss), None, self.cache.version, direct, None)
        stream = torch.cuda.current_stream(self.device)
        ticket = self.host.host_gather.start(miss, 0, stream)
        direct = direct_done = None
        if share > 0:  # after the host gather's dedup: its start is the longer pipeline
            direct = torch.empty(*slot.shape, self._packed.shape[1], dtype=torch.uint8, device=self.device)
            if self._direct_stream is None:
                self._direct_stream = torch.cuda.Stream(self.device)
            side = self._direct_stream
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                cached_direct_reads(slot, *self.backing, out=direct)
            slot.record_stream(side)
            direct.record_stream(side)
            direct_done = torch.cuda.Event()
            direct_done.record(side)
        return _Pending(slot, ticket, stream, self.cache.version, direct, direct_done)

    def _finish_misses(self, pending: "_Pending", global_ids: torch.Tensor, row_start: int, packed: bool):
        """Merge the hits (from the probe's slots) with the gathered and the directly read misses, on the
        current stream, for the lookup's own ``global_ids``: each copy is served only where it was read for
        that position's row, every other row is read from the backing rows in the same launch."""
        from engram.table.kernels.cache_gather import checked_merge_rows, checked_merge_rows_packed

        stream = None
        if self.host is None:
            staged, inverse = pending.ticket
        else:
            stream = torch.cuda.current_stream(self.device)
            staged, inverse = self.host.host_gather.finish(pending.ticket, stream)
            if pending.direct_done is not None:
                stream.wait_event(pending.direct_done)
            if stream != pending.stream:  # prefetched on another stream: keep its tensors until the merge ran
                for tensor in (pending.slot, inverse, pending.direct):
                    if tensor is not None:
                        tensor.record_stream(stream)
        merge = checked_merge_rows_packed if packed else checked_merge_rows
        self.cache.settle()
        out = merge(global_ids, row_start, *self.backing, staged, inverse, cache=self.cache, slot=pending.slot,
                    direct=pending.direct)
        if stream is not None:
            self.host.host_gather.consumed(stream)
        number = 0 if self.host is None else pending.ticket.number
        self._last_staging = _Staging(staged, inverse, stream, number, False)
        self.lookups["host_gather"] += 1
        return out

    def prefetch(self, global_ids: torch.Tensor, row_start: int) -> "_Pending | None":
        """Start the large-lookup path for ``global_ids [T, C_local]`` (on :attr:`device`) now: the probe
        and the host gather of the misses; returns the pending state for the lookup of exactly these
        ids. Lookups that take the one-kernel path (decode sizes, CUDA-graph capture) need no prefetch:
        nothing is started (None)."""
        if self.backend != "triton" or self._use_one_kernel(global_ids):
            return None
        return self._start_misses(global_ids, row_start)

    def prefetch_starts(self, num_ids: int) -> bool:
        return self.backend == "triton" and num_ids > self.direct_max_rows

    def finish_waits(self, pending: "_Pending") -> bool:
        """Whether the merge of the prefetch blocks the caller (a host gather of the Python worker)."""
        return isinstance(pending.ticket, GatherTicket) and pending.ticket.future is not None

    def prefetch_usable(self, pending: "_Pending") -> bool:
        """Whether a prefetch's probe and gathered misses still hold: the cache's content is the one the
        probe saw, and no later host gather reused the staging."""
        if pending.version != self.cache.version:
            return False
        return self.host is None or self.host.host_gather.current(pending.ticket)

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool,
                     pending: "_Pending | None" = None):
        if self.backend != "triton":
            return None
        if pending is None:
            if self._use_one_kernel(global_ids):
                from engram.table.kernels.cache_gather import cached_gather_rows, cached_gather_rows_packed

                self.lookups["one_kernel"] += 1
                self.cache.settle()  # also orders this lookup's writes of its staging after an update's reads
                stream = None if self.host is None else torch.cuda.current_stream(self.device)
                captured = cuda_capturing()
                staging = self._lookup_staging(global_ids.numel(), stream, captured)
                lookup = cached_gather_rows_packed if packed else cached_gather_rows
                out = lookup(self.cache, *self.backing, global_ids, row_start, staged=staging)
                self._last_staging = None if staging is None else _Staging(staging, None, stream, None, captured)
                return out
            pending = self._start_misses(global_ids, row_start)
        return self._finish_misses(pending, global_ids, row_start, packed)

    def __repr__(self) -> str:
        return (f"CachedPlacement(rows={self.num_rows}, head_dim={self.head_dim}, device={self.device}, "
                f"slots={self.cache.num_slots}, ways={self.cache.ways}, policy={self.policy!r})")


@dataclass
class _Staging:
    """A lookup's staged rows for the next update: ``rows uint8 [S, row_bytes]`` (tagged packed rows), the
    lookup's ``inverse`` into them (None: row ``i`` for id ``i``, a one-kernel lookup's), the stream it ran on
    (None on the CPU), the host gather's number (None for a one-kernel lookup's staging; 0 on the CPU) and
    whether it was made under CUDA-graph capture."""

    rows: torch.Tensor
    inverse: torch.Tensor | None
    stream: object
    number: int | None
    captured: bool


@dataclass
class _Pending:
    """A large lookup between its probe and its merge: the probe's ``slot int32 [T, C_local]``, the host
    gather's ticket (on the CPU: ``(staged rows, inverse)`` already gathered), the stream it started on,
    the cache's :attr:`~engram.table.placements.row_cache.RowCache.version` the probe saw, and with a direct share the
    direct reads ``uint8 [T, C_local, row_bytes]`` and the event after them (None on the CPU)."""

    slot: torch.Tensor
    ticket: GatherTicket | tuple[torch.Tensor, torch.Tensor]
    stream: object
    version: int
    direct: torch.Tensor | None = None
    direct_done: object = None


def _gather_now(packed: torch.Tensor, miss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU form of the host gather (interpreter tests): ``(staged uint8 [count, row_bytes], inverse int32
    [T, C])`` for ``miss int32 [T, C]`` local ids (-1: the zero row ``packed[-1]``), as
    :class:`~engram.table.host_memory.gather.HostGather` computes them, synchronously."""
    from engram.table.kernels.dedup import distinct_rows

    distinct = distinct_rows(miss, 0, packed.shape[0] - 1)
    count = min(max(int(distinct.rows_and_count[-1]), 1), miss.numel())
    staged = torch.empty(count, packed.shape[1], dtype=torch.uint8)
    gather_packed_rows_host(packed, distinct.rows_and_count[:count], 0, staged)
    return staged, distinct.inverse.view(miss.shape)
