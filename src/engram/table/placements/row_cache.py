"""The HBM row cache of placement ``"cached"``: a fixed-size set-associative index, its
between-steps update (set-associative LRU, or frequency-based replacement with aging; static
hot sets), and a plain-torch reference of the lookup.

State (all fixed-size, updated in place, so a lookup captured in a CUDA graph sees every
update; each tensor has one extra *trash* entry at the end that masked-off writes go to
and lookups never read):

* ``slot_rows uint8 [slots + 1, row_bytes]``: cached rows packed as in
  :mod:`engram.table.host_memory.rows` (``[D E4M3 | D / 32 UE8M0 | pad]``);
* ``tags int64 [num_sets, ways]`` (a view of ``slots + 1`` entries): local row id held by
  slot ``set * ways + way``, -1 when empty; local row ``r`` may live only in set
  ``r % num_sets``, in at most one way;
* ``counters int32 [num_sets, ways]``: the held rows' scores (0 when empty).

Update rule (:meth:`RowCache.update`, one call per engine step ``k = 0, 1, ...`` with the
step's ids), exactly the ``dynamic`` policy of :mod:`engram.tools.cache_policy` (which
replays it on recorded text; ``tests/placements/test_cached_placement.py`` checks that both serve the
same hits), in one of two scores:

* frequency (``recency=False``; placement policy ``"dynamic"``): when ``k > 0`` is a multiple
  of ``aging_interval`` all scores are halved (``c >>= 1``) first; each read of a held row
  adds 1 (saturating at ``2**30``); a missed row's score is ``n``, its reads in the step;
* recency (``recency=True``; placement policy ``"set-lru"``): a held row read in the step
  scores ``k + 1``, and so does a missed row: set-associative LRU, no aging.

Then the missed rows, deduplicated, are ranked per set by score (descending, ties by row
id); the set's ways by score (ascending, empty ways first as -1, ties by way); the ``k``-th
candidate replaces the ``k``-th way when its score is at least that way's (empty ways:
always), and the new row keeps its score.

No step writes a slot twice, so the result does not depend on the order of the writes.
On CUDA (and under the interpreter) an update is three fixed-size launches, four with the
frequency score (:mod:`engram.table.kernels.cache_admission`: a count of the step's distinct rows
in a hash table, a per-set top list of candidates built with atomics, the admission per touched
set), with no sort, no host sync and a device step counter, so a CUDA graph can capture it;
:meth:`RowCache.update_with_torch` is their reference (a sort of the step's ids plus fixed-size
gathers and scatters). Both read only the admitted rows from the backing rows (on the GPU those
rows are in host memory) and write each admitted slot's tag into its row's last 4 bytes.

:attr:`RowCache.version` counts the calls that may change the content (``update``,
``load_hot``, ``clear``): a lookup split in two launches (probe, then merge; see
:mod:`engram.table.placements.cached`) checks it to know its probe still describes the slots.

References of the split lookup: :func:`cached_probe_reference` (slot per row, -1 unless a
hit or ``-2 - row`` for a miss of the direct class, and the miss ids),
:func:`cached_direct_reference` (the direct class's rows) and :func:`checked_merge_reference` (a
hit from its slot, a direct miss from the direct reads, anything else from the host gather's
rows through ``inverse``, each only where it was read for the lookup's row, else the backing row).
"""

from __future__ import annotations

import torch

from engram.checks import check_bool, check_int
from engram.table.fp8 import BLOCK_SIZE
from engram.table.host_memory.rows import TAG_BYTES, packed_row_bytes

__all__ = ["RowCache", "check_ways", "cached_lookup_reference", "cached_probe_reference", "cached_direct_reference",
           "checked_merge_reference", "direct_class"]

COUNTER_MAX = 2**30


def check_ways(ways, name: str = "ways") -> int:
    """Slots per set: a power of two, at most 64."""
    check_int(name, ways, 1)
    if ways & (ways - 1) or ways > 64:
        raise ValueError(f"{name}: expected a power of two at most 64, found {ways}")
    return ways


class RowCache:
    """A set-associative cache of table rows on ``device``.

    Args:
        num_slots: rows the cache can hold; rounded down to a multiple of ``ways`` (at least ``ways``).
        head_dim: ``D`` of the table (a multiple of 32).
        device: where the slots and the index live (the lookup's device).
        ways: slots per set (a power of two; 8: one 64-byte read of tags per lookup row).
        aging_interval: frequency scores are halved every this many :meth:`update` calls.
        recency: score rows by the last step that read them (set-associative LRU) instead of
            by aged read counts.
    """

    def __init__(self, num_slots: int, head_dim: int, device: torch.device | str, *, ways: int = 8,
                 aging_interval: int = 16, recency: bool = False):
        self.recency = check_bool("recency", recency)
        ways = check_ways(ways)
        num_slots = check_int("num_slots", num_slots, 1)
        head_dim = check_int("head_dim", head_dim, 1)
        if head_dim % BLOCK_SIZE:
            raise ValueError(f"head_dim: expected a multiple of {BLOCK_SIZE}, found {head_dim}")
        self.aging_interval = check_int("aging_interval", aging_interval, 1)
        self.ways = ways
        self.num_sets = max(1, num_slots // ways)
        self.head_dim = head_dim
        slots = self.num_sets * ways
        device = torch.device(device)
        self.slot_rows = torch.zeros(slots + 1, packed_row_bytes(head_dim), dtype=torch.uint8, device=device)
        # Each slot row's last 4 bytes: the row whose bytes it holds (-1: none). Every writer of a slot's bytes
        # writes them too; the update kernels copy a slot's bytes where the slot's tag differs from them.
        self.slot_rows[:, -TAG_BYTES:].view(torch.int32).fill_(-1)
        self._tags = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
        self._counters = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.updates = 0
        self.version = 0
        """Bumped (on the host) by every call that may change the content: ``update``, ``load_hot``, ``clear``."""
        self._admission = None  # the update kernels' work buffers, made at the first update
        # Views made once (the tensors are fixed-size, changed in place): a decode lookup's host time.
        self._tags_view = self._tags[:-1].view(self.num_sets, ways)
        self._slot_values = self.slot_rows[:-1, :head_dim]
        self._slot_scales = self.slot_rows[:-1, head_dim: head_dim + head_dim // BLOCK_SIZE]
        self.launch_constants: dict = {}
        """The lookup launchers' checked integers per backing layout (:mod:`engram.table.kernels.cache_gather`)."""
        self._stats = torch.zeros(4, dtype=torch.int64, device=device)
        self._beside = None  # UpdatesBeside once run_updates_beside() turned it on

    # ---- updates beside the step (CUDA) ---------------------------------------
    def run_updates_beside(self) -> bool:
        """Run later eager :meth:`update` calls on a stream of their own
        (:mod:`engram.table.placements.updates_beside`); every later access waits for them. Returns whether
        it is on (CUDA with the driver's stream memory operations)."""
        from engram.table.placements.updates_beside import UpdatesBeside, updates_beside_available

        if self._beside is None and updates_beside_available(self.device):
            self._beside = UpdatesBeside(self.device)
        return self._beside is not None

    @property
    def updates_beside(self):
        """The :class:`~engram.table.placements.updates_beside.UpdatesBeside` of this cache, or None."""
        return self._beside

    def settle(self) -> None:
        """Order the current stream's later work after every update run beside (under graph capture: a
        captured wait on its idle word). Nothing when updates run inline."""
        if self._beside is not None:
            self._beside.order()

    def _settled(self) -> None:
        # The eager part of settle(), for the views: an event wait once an update ran beside.
        beside = self._beside
        if beside is not None and beside.done is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(beside.done)

    # ---- views ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._tags.device

    @property
    def num_slots(self) -> int:
        return self.num_sets * self.ways

    # The views order the current stream after updates run beside (eager; see settle()).
    @property
    def tags(self) -> torch.Tensor:
        """``int64 [num_sets, ways]``: local row id per slot, -1 when empty."""
        self._settled()
        return self._tags_view

    @property
    def counters(self) -> torch.Tensor:
        """``int32 [num_sets, ways]``: aged read counts per slot."""
        self._settled()
        return self._counters[:-1].view(self.num_sets, self.ways)

    @property
    def slot_values(self) -> torch.Tensor:
        """``uint8 [slots, D]``: E4M3 bytes of the cached rows (strided view)."""
        self._settled()
        return self._slot_values

    @property
    def slot_scales(self) -> torch.Tensor:
        """``uint8 [slots, D // 32]``: UE8M0 bytes of the cached rows (strided view)."""
        self._settled()
        return self._slot_scales

    @property
    def stats(self) -> torch.Tensor:
        """``int64 [4]`` summed over :meth:`update` calls: reads (ids inside the table), reads that hit,
        distinct rows per step, distinct missed rows per step (the host rows a step moves after
        deduplication). Zero it in place to restart."""
        self._settled()
        return self._stats

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots and the index."""
        return self.slot_rows.numel() + self._tags.numel() * 8 + self._counters.numel() * 4

    def held_rows(self) -> torch.Tensor:
        """``int64 [K]``: the local row ids held, ascending (a host sync; for tests and reports)."""
        tags = self.tags.reshape(-1)
        return tags[tags >= 0].sort().values

    def clear(self) -> None:
        """Empty every slot (in place)."""
        self.settle()
        self.version += 1
        self._tags.fill_(-1)
        self._counters.zero_()

    # ---- probing -------------------------------------------------------------
    def probe(self, local_ids: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``local_ids int [N]`` -> ``(hit bool [N], slot int64 [N])``: whether row ``local_ids[i]`` (in
        ``[0, num_rows)``) is held, and its slot (the trash slot ``num_slots`` when not)."""
        ids = local_ids.reshape(-1).to(torch.int64)
        valid = (ids >= 0) & (ids < num_rows)
        row_set = torch.where(valid, ids, 0) % self.num_sets
        match = (self.tags[row_set] == ids[:, None]) & valid[:, None]  # [N, ways]
        hit = match.any(dim=1)
        way = match.to(torch.int8).argmax(dim=1)
        slot = torch.where(hit, row_set * self.ways + way, self.num_slots)
        return hit, slot

    @property
    def tags_with_trash(self) -> torch.Tensor:
        """``int64 [slots + 1]``: :attr:`tags` flat, then the trash entry (the update kernels' view)."""
        return self._tags

    @property
    def counters_with_trash(self) -> torch.Tensor:
        """``int32 [slots + 1]``: :attr:`counters` flat, then the trash entry."""
        return self._counters

    # ---- updates (between steps, never inside a lookup) ------------------------
    def update(self, local_ids: torch.Tensor, back_values: torch.Tensor, back_scales: torch.Tensor,
               staged: torch.Tensor | None = None, inverse: torch.Tensor | None = None) -> None:
        """One step of the policy (module docstring) for the reads ``local_ids int [...]`` (local row ids;
        those outside ``[0, rows)`` are ignored), copying admitted rows from ``back_values uint8 [rows, D]`` /
        ``back_scales uint8 [rows, D // 32]``. Adds the step's reads to :attr:`stats` (as the step's lookups
        saw the cache, when called after them with the same ids). No host sync, no sort: on CUDA (and the
        CPU under ``TRITON_INTERPRET=1``) the fixed-size launches of :func:`~engram.table.kernels.cache_admission.admit_step`,
        capturable in a CUDA graph once :meth:`admission_buffers` fit the step (the step number then lives on
        the device: replays advance it, :attr:`updates` counts eager calls); elsewhere
        :meth:`update_with_torch`, its reference, with the same result.

        ``staged uint8 [S, row_bytes]`` / ``inverse int32 [...]`` (as many as ``local_ids``), optional: the
        step's lookup's staging (tagged packed rows) and each id's row in it; ``staged`` alone (``S >= N``):
        id ``i``'s row is staging row ``i`` (a one-kernel lookup's, :func:`~engram.table.kernels.cache_gather.cached_gather_rows`). The kernels copy an admitted
        row from there when that staging row's tag is the row's own index, else from the backing rows: the
        same bytes, without reading host memory again. The caller orders the staging's next write after
        this call's stream work."""
        ids = local_ids.reshape(-1)
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"local_ids: expected int32 or int64 row ids, found {ids.dtype}")
        if back_values.shape[0] >= 2**31:
            raise ValueError(f"back_values: expected fewer than 2**31 rows, found {back_values.shape[0]}")
        if staged is None and inverse is not None:
            raise ValueError("staged, inverse: expected inverse only with staged")
        if not _updates_with_kernels(self.device):
            return self.update_with_torch(local_ids, back_values, back_scales)
        from engram.table.kernels.cache_admission import admit_step

        ids = ids.to(self.device).contiguous()
        if staged is not None:
            inverse = self._check_staging(staged, inverse, ids.numel())

        def admit(beside: bool) -> None:
            admit_step(self, ids, back_values, back_scales, staged, inverse, beside=beside)

        try:
            if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
                with torch.cuda.device(self.device):  # Triton launches on the current device
                    self._run_update(admit, ids, staged, inverse)
            else:
                self._run_update(admit, ids, staged, inverse)
        finally:  # a failure part-way may still have changed the content: no earlier probe holds
            self.version += 1
        self.updates += 1

    def _run_update(self, admit, *used) -> None:
        """Run the update kernels: beside (an eager step with updates beside on) or on the current stream."""
        if self._beside is not None and not torch.cuda.is_current_stream_capturing():
            self._beside.run(lambda: admit(True), tuple(tensor for tensor in used if tensor is not None))
        else:
            self.settle()  # captured, or inline: after any update still running beside
            admit(False)

    def _check_staging(self, staged: torch.Tensor, inverse: torch.Tensor | None, num_ids: int) -> torch.Tensor | None:
        """``inverse`` flat (None: none given), after checking ``staged`` / ``inverse`` against the cache and the
        step's ids."""
        row_bytes = self.slot_rows.shape[1]
        if (staged.dtype != torch.uint8 or staged.dim() != 2 or staged.shape[1] != row_bytes or staged.shape[0] < 1
                or staged.stride(1) != 1 or staged.device != self.device or staged.stride(0) % TAG_BYTES
                or staged.data_ptr() % TAG_BYTES):
            raise ValueError(f"staged: expected uint8 [S >= 1, {row_bytes}] rows on {self.device} (row-contiguous, "
                             f"4-byte aligned), found {staged.dtype} {list(staged.shape)} strides {staged.stride()} "
                             f"on {staged.device}")
        if inverse is None:  # staging row i holds id i's row (a one-kernel lookup's staging)
            if staged.shape[0] < num_ids:
                raise ValueError(f"staged: expected at least {num_ids} rows (one per id, no inverse given), found "
                                 f"{staged.shape[0]}")
            return None
        flat = inverse.reshape(-1)
        if flat.dtype != torch.int32 or flat.numel() != num_ids or flat.device != self.device:
            raise ValueError(f"inverse: expected int32 [{num_ids}] (one per id) on {self.device}, found "
                             f"{flat.dtype} {list(inverse.shape)} on {inverse.device}")
        return flat.contiguous()

    def admission_buffers(self, num_ids: int):
        """The :class:`~engram.table.kernels.cache_admission.AdmissionBuffers` of the update kernels for a step of
        ``num_ids`` ids: kept while they fit (and no step's launches failed half-way); otherwise made anew,
        keeping the device step counter. Refused under CUDA-graph capture when they do not fit (a graph must
        not bake in buffers made during its capture)."""
        from engram.table.kernels.cache_admission import AdmissionBuffers

        buffers = self._admission
        if buffers is not None and buffers.capacity >= num_ids and not buffers.dirty:
            return buffers
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = 0 if buffers is None else buffers.capacity
            raise RuntimeError(f"update_cache under CUDA-graph capture: the cache's update buffers hold {have} ids "
                               f"and this step has {num_ids}; run one update_cache of at least {num_ids} ids "
                               "eagerly before capturing")
        fresh = AdmissionBuffers(self, max(num_ids, 1), self.updates)
        if buffers is not None:
            fresh.step.copy_(buffers.step)  # replays of a captured update advanced it on the device
        self._admission = fresh
        return fresh

    def update_with_torch(self, local_ids: torch.Tensor, back_values: torch.Tensor, back_scales: torch.Tensor) -> None:
        """:meth:`update` in plain torch ops (a sort of the step's ids, fixed-size gathers and scatters, no host
        sync): the reference of the update kernels, and the CPU path."""
        num_rows = back_values.shape[0]
        ids = local_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        sentinel = num_rows  # sorts after every real row
        ids = torch.where((ids >= 0) & (ids < num_rows), ids, sentinel).sort().values
        valid = ids < sentinel
        counts = (torch.searchsorted(ids, ids, right=True) - torch.searchsorted(ids, ids)).to(torch.int64)
        first = torch.ones_like(valid)
        first[1:] = ids[1:] != ids[:-1]
        first &= valid
        hit, slot = self.probe(ids, num_rows)
        candidate = first & ~hit
        self._stats += torch.stack([valid.sum(), hit.sum(), first.sum(), candidate.sum()])
        step = self.updates
        self.updates += 1
        self.version += 1
        if self.recency:  # held rows read now, and the candidates, score step + 1
            score = min(step + 1, COUNTER_MAX)
            self._counters.index_fill_(0, slot, score)
            counts = torch.full_like(counts, score)
        else:
            if step > 0 and step % self.aging_interval == 0:
                self._counters.bitwise_right_shift_(1)
            self._counters.index_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
            # Saturate only the slots read (a clamp of every counter cost O(slots) per step).
            self._counters.index_copy_(0, slot, self._counters[slot].clamp(max=COUNTER_MAX))
        self._counters[-1:].zero_()  # a kernel: assigning a Python 0 would copy it from the host (a sync)
        self._admit(ids, counts, candidate, back_values, back_scales)

    def load_hot(self, local_row_ids: torch.Tensor, back_values: torch.Tensor, back_scales: torch.Tensor,
                 *, counter: int = 1) -> int:
        """Static hot set: empty the cache, then hold the rows ``local_row_ids int [K]`` (hottest first;
        ids outside ``[0, rows)`` ignored, duplicates refused). A set offered more than ``ways`` rows keeps
        its first ``ways``. Held rows start with counter ``counter`` (1..2**30). Returns the rows held
        (a host sync: this runs once, at setup)."""
        counter = check_int("counter", counter, 1)
        if counter > COUNTER_MAX:
            raise ValueError(f"counter: expected at most {COUNTER_MAX}, found {counter}")
        ids = local_row_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        valid = (ids >= 0) & (ids < back_values.shape[0])
        kept = ids[valid]
        if kept.numel() != kept.unique().numel():
            raise ValueError("local_row_ids: expected distinct row ids, found duplicates")
        self.clear()
        # Priority: earlier rows rank first within their set (larger pseudo count).
        priority = torch.arange(ids.numel(), 0, -1, device=self.device, dtype=torch.int64)
        self._admit(ids, priority, valid, back_values, back_scales)
        held = self.tags >= 0
        self._counters[:-1].view(self.num_sets, self.ways).masked_fill_(held, counter)
        return int(held.sum())

    def _admit(self, ids: torch.Tensor, counts: torch.Tensor, candidate: torch.Tensor,
               back_values: torch.Tensor, back_scales: torch.Tensor) -> None:
        """Place the distinct rows ``ids[candidate]`` (none held now) by the replacement rule:
        the ``k``-th candidate of a set by ``counts`` (descending) takes the ``k``-th way by counter
        (ascending, empty first) when its count is at least that counter."""
        count_total = ids.numel()
        if count_total == 0:
            return
        num_sets, ways = self.num_sets, self.ways
        candidate_set = torch.where(candidate, ids % num_sets, num_sets)  # non-candidates: set num_sets (last)
        # Sort by (set, count descending, id): one int64 key over two stable sorts.
        order = torch.argsort(ids, stable=True)
        order = order[torch.argsort(-counts[order], stable=True)]
        order = order[torch.argsort(candidate_set[order], stable=True)]
        sorted_set, sorted_id, sorted_count = candidate_set[order], ids[order], counts[order]
        rank = torch.arange(count_total, device=self.device) - torch.searchsorted(sorted_set, sorted_set)
        usable = (sorted_set < num_sets) & (rank < ways)
        safe_set = torch.where(usable, sorted_set, 0)
        safe_rank = torch.where(usable, rank, 0)[:, None]
        # The ways of each candidate's set by counter, ascending, empty first: sorted per candidate
        # ([N, ways]) rather than for every set of the cache (O(slots) per step).
        set_tags, set_counters = self.tags[safe_set], self.counters[safe_set]
        victim_key = torch.where(set_tags >= 0, set_counters.to(torch.int64), -1)
        victim_key, victim_way = torch.sort(victim_key, dim=1, stable=True)
        admit = usable & (sorted_count >= victim_key.gather(1, safe_rank)[:, 0])
        slot = torch.where(admit, safe_set * ways + victim_way.gather(1, safe_rank)[:, 0], self.num_slots)
        row = torch.where(admit, sorted_id, -1)
        values, scales = _read_rows(back_values, back_scales, row)
        head_dim = self.head_dim
        self.slot_rows[:, :head_dim].index_copy_(0, slot, values)
        self.slot_rows[:, head_dim: head_dim + head_dim // BLOCK_SIZE].index_copy_(0, slot, scales)
        self.slot_rows[:, -TAG_BYTES:].index_copy_(0, slot, row.to(torch.int32)[:, None].view(torch.uint8))
        self._tags.index_copy_(0, slot, row)
        self._counters.index_copy_(0, slot, sorted_count.clamp(max=COUNTER_MAX).to(torch.int32))
        self._tags[-1:].fill_(-1)  # kernels, not host-to-device copies of Python scalars (syncs)
        self._counters[-1:].zero_()


def _read_rows(back_values: torch.Tensor, back_scales: torch.Tensor, rows: torch.Tensor):
    """``rows int64 [N]`` (-1: none) -> ``(uint8 [N, D], uint8 [N, D // 32])``, zeros for -1. On CUDA (or
    the interpreter) through the gather kernel, which reads only the named rows (no traffic for -1: the
    backing rows may be host memory); on the CPU by indexing."""
    if rows.is_cuda or (rows.device.type == "cpu" and _interpreting()):
        from engram.table.kernels.gather import gather_rows_packed

        values, scales = gather_rows_packed(back_values, back_scales, rows[None, :])
        return values[0], scales[0]
    safe = rows.clamp(min=0)
    keep = (rows >= 0)[:, None]
    return back_values[safe] * keep, back_scales[safe] * keep


def _updates_with_kernels(device: torch.device) -> bool:
    """Whether :meth:`RowCache.update` runs the update kernels: on CUDA, or on the CPU under the interpreter."""
    from engram.triton_launch import triton_available

    return device.type == "cuda" or (device.type == "cpu" and _interpreting() and triton_available())


def _interpreting() -> bool:
    from engram.triton_launch import interpreting, triton_available

    return triton_available() and interpreting()


def cached_lookup_reference(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor,
                            hash_ids: torch.Tensor, row_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of the cached lookup: ``hash_ids int [T, C]`` -> ``(values uint8 [T, C, D],
    scales uint8 [T, C, D // 32])``: the slot's bytes on a hit, ``back_*[r]`` on a miss, zeros outside
    ``[0, rows)`` (``r = hash_ids - row_start``). Dequantize with :func:`engram.table.fp8.dequantize_rows`."""
    tokens, columns = hash_ids.shape
    local = hash_ids.reshape(-1).to(torch.int64) - row_start
    num_rows = back_values.shape[0]
    inside = (local >= 0) & (local < num_rows)
    hit, slot = cache.probe(local, num_rows)
    safe = torch.where(inside, local, 0)
    safe_slot = torch.where(hit, slot, 0)
    values = torch.where(hit[:, None], cache.slot_values[safe_slot], back_values[safe])
    scales = torch.where(hit[:, None], cache.slot_scales[safe_slot], back_scales[safe])
    values = values * inside[:, None]
    scales = scales * inside[:, None]
    head_dim = cache.head_dim
    return values.view(tokens, columns, head_dim), scales.view(tokens, columns, head_dim // BLOCK_SIZE)


def direct_class(local_ids: torch.Tensor, threshold: int) -> torch.Tensor:
    """``bool [...]``: rows read directly when missed (:func:`engram.table.kernels.cache_gather.cached_probe`'s
    ``direct_share``, ``threshold = round(256 * direct_share)``): ``((r * 0x9E3779B1) >> 16) % 256 < threshold``
    for local ids ``0 <= r < 2**31`` (int64)."""
    return ((local_ids.to(torch.int64) * 0x9E3779B1) >> 16) % 256 < threshold


def cached_probe_reference(cache: RowCache, num_rows: int, hash_ids: torch.Tensor, row_start: int = 0,
                           direct_threshold: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`engram.table.kernels.cache_gather.cached_probe`: ``hash_ids int [T, C]`` ->
    ``(slot int32 [T, C], miss int32 [T, C])``: with ``r = hash_ids - row_start``, ``slot`` = the cache slot
    holding ``r``, else ``-2 - r`` for a miss of :func:`direct_class` ``(r, direct_threshold)``, else -1;
    ``miss = r`` for the other misses (``0 <= r < num_rows``, not held), else -1."""
    local = hash_ids.reshape(-1).to(torch.int64) - row_start
    inside = (local >= 0) & (local < num_rows)
    hit, slot = cache.probe(local, num_rows)
    missed = inside & ~hit
    direct = missed & direct_class(torch.where(inside, local, 0), direct_threshold)
    slot = torch.where(hit, slot, torch.where(direct, -2 - local, -1))
    miss = torch.where(missed & ~direct, local, -1)
    return slot.to(torch.int32).view(hash_ids.shape), miss.to(torch.int32).view(hash_ids.shape)


def cached_direct_reference(slot: torch.Tensor, back_values: torch.Tensor, back_scales: torch.Tensor,
                            out: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference of :func:`engram.table.kernels.cache_gather.cached_direct_reads`: a copy of ``out uint8
    [T, C, W]`` whose rows with ``slot <= -2`` hold ``back_values[r]`` then ``back_scales[r]`` (``r = -2 - slot``;
    zeros when ``r`` is outside the rows), the rest of them unchanged."""
    head_dim, groups = back_values.shape[1], back_scales.shape[1]
    result = out.clone()
    flat = result.view(-1, out.shape[2])
    slot = slot.reshape(-1).to(torch.int64)
    wanted = slot <= -2
    local = -2 - slot
    read = wanted & (local >= 0) & (local < back_values.shape[0])
    safe = torch.where(read, local, 0)
    flat[wanted, :head_dim] = (back_values[safe] * read[:, None])[wanted]
    flat[wanted, head_dim: head_dim + groups] = (back_scales[safe] * read[:, None])[wanted]
    return result


def checked_merge_reference(hash_ids: torch.Tensor, row_start: int, back_values: torch.Tensor,
                            back_scales: torch.Tensor, staged: torch.Tensor, inverse: torch.Tensor,
                            cache: RowCache | None = None, slot: torch.Tensor | None = None,
                            direct: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`engram.table.kernels.cache_gather.checked_merge_rows_packed`: ``hash_ids int
    [T, C]``, backing ``uint8 [rows, D]`` / ``[rows, D // 32]``, ``staged uint8 [S, packed_row_bytes(D)]`` (tagged
    packed rows), ``inverse int [T, C]``, optional ``cache`` with its probe's ``slot int [T, C]`` and ``direct uint8
    [T, C, >= D + D // 32]`` -> ``(values uint8 [T, C, D], scales uint8 [T, C, D // 32])``: with ``r = hash_ids -
    row_start``, the bytes of slot ``slot`` if its tag is ``r``, else of ``direct[t, j]`` if ``slot == -2 - r``,
    else of ``staged[clamp(inverse, 0, S - 1)]`` if its tag is ``r``, else of backing row ``r``; zeros where ``r``
    is outside ``[0, rows)``. Whatever the copies hold, the bytes equal backing row ``r``'s."""
    tokens, columns = hash_ids.shape
    head_dim, groups = back_values.shape[1], back_values.shape[1] // BLOCK_SIZE
    local = hash_ids.reshape(-1).to(torch.int64) - row_start
    inside = (local >= 0) & (local < back_values.shape[0])
    local = torch.where(inside, local, 0)
    hit = torch.zeros_like(inside)
    from_direct = torch.zeros_like(inside)
    if cache is not None:
        probed = slot.reshape(-1).to(torch.int64)
        held = inside & (probed >= 0) & (probed < cache.num_slots)
        safe_slot = torch.where(held, probed, 0)
        hit = held & (cache.tags.reshape(-1)[safe_slot] == local)
        if direct is not None:
            from_direct = inside & ~hit & (probed == -2 - local)
    position = inverse.reshape(-1).to(torch.int64).clamp(0, staged.shape[0] - 1)
    staged_rows = staged[position]
    staged_tags = staged_rows[:, -4:].contiguous().view(torch.int32)[:, 0].to(torch.int64)
    from_staging = inside & ~hit & ~from_direct & (staged_tags == local)
    values = torch.where(from_staging[:, None], staged_rows[:, :head_dim], back_values[local])
    scales = torch.where(from_staging[:, None], staged_rows[:, head_dim: head_dim + groups], back_scales[local])
    if cache is not None:
        values = torch.where(hit[:, None], cache.slot_values[safe_slot], values)
        scales = torch.where(hit[:, None], cache.slot_scales[safe_slot], scales)
        if direct is not None:
            direct_rows = direct.reshape(-1, direct.shape[2])
            values = torch.where(from_direct[:, None], direct_rows[:, :head_dim], values)
            scales = torch.where(from_direct[:, None], direct_rows[:, head_dim: head_dim + groups], scales)
    keep = inside[:, None]
    return (values * keep).view(tokens, columns, head_dim), (scales * keep).view(tokens, columns, groups)
