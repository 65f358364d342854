"""NgramHasher: hash ids of an engine's batch, exact under any batching (docs/design.md §2).

Previous tokens of each request come, in priority order, from (1) the same
request earlier in the batch, (2) the caller's lookback window, (3) a history
store on the device: the paged slot cache or the per-request history. The
result equals :func:`engram.hashing.reference.hash_ngrams` on the whole sequence.
"""

from __future__ import annotations

from typing import Hashable, Iterable, NamedTuple

import numpy as np
import torch

from engram.layout import EngramLayout
from engram.vocab import TokenCompressor
from engram.backends import resolve_backend
from engram.call_cache import CallCache, structure
from engram.checks import check_bool
from engram.common import IdsIdentity, cuda_capturing, resolve_device
from engram import ops
from engram.ops import compiling
from engram.hashing.launch import (LAUNCH_OVERRIDE, HashConstants, launch_hash_kernels, plan_hash_launch, prepare_hash_launch,
                     run_hash_launch)
from engram.hashing.ops import block_windows, hash_windows
from engram.hashing.stores import DEAD, UNWRITTEN, RequestHistory, SlotCache, fixed_address
from engram.hashing.validation import BatchMetadata, check_shapes, validate_batch

__all__ = ["NgramHasher"]

_INT32_MAX = 2**31 - 1


class NgramHasher:
    """Hash ids ``[T, L, C]`` for a flat batch of requests.

    ``hasher = NgramHasher(layout, vocab, device="cuda")``;
    ``ids = hasher(input_ids, positions, query_start_loc, ...)``.

    ``validate``: ``None`` (default) checks every batch when its tensors live on
    the CPU and skips the checks (which sync) on a GPU; ``True``/``False`` force it.
    With checks off, malformed metadata gives wrong ids (unavailable history hashes
    as pad), never an out-of-bounds access or a hang; shapes, dtypes and devices are
    checked on every call (no sync).

    ``backend``: ``"auto"`` (default) runs the Triton kernels (one launch hashes every
    layer) on CUDA tensors and torch ops elsewhere; ``"torch"``/``"triton"`` force one
    (the Triton kernels also run on the CPU under ``TRITON_INTERPRET=1``). Decided
    once, here.

    Sharing. A call enqueues its launches on the current stream and returns; the
    launches of one call are ordered by that stream, and no program waits on another.
    Hashers share nothing but compiled kernels, so any number of them may run on any
    streams at once. The stores (:meth:`bind_slot_cache`, :meth:`bind_request_history`)
    belong to one hasher: calls that use them must be ordered (one stream, or the
    engine's own events), as the engine orders its writes to its KV cache. Calls from
    several host threads need a lock around the call (the history rows' name table is
    plain Python).
    """

    def __init__(self, layout: EngramLayout, vocab: TokenCompressor, device: torch.device | str = "cpu",
                 validate: bool | None = None, backend: str = "auto"):
        spec = layout.spec
        if vocab.size != spec.compressed_vocab_size:
            raise ValueError(
                f"vocab: compresses to {vocab.size} ids, config field 'engram_compressed_vocab_size' is {spec.compressed_vocab_size}"
            )
        if spec.pad_token_id >= vocab.vocab_size:
            raise ValueError(f"config field 'engram_pad_token_id' = {spec.pad_token_id} is beyond the tokenizer's {vocab.vocab_size} ids")
        self.layout = layout
        self.vocab = vocab
        self.device = resolve_device(device, "NgramHasher")
        self.validate = validate
        self._backend = backend
        self.history_length = spec.max_ngram_size - 1
        self.pad_id = int(vocab.token_map[spec.pad_token_id])
        self.token_map = vocab.device_map(self.device)
        self.multipliers = torch.as_tensor(layout.multipliers, dtype=torch.int64, device=self.device)
        self.column_primes = torch.as_tensor(layout.column_primes, device=self.device)
        self.column_offsets = torch.as_tensor(layout.column_offsets, device=self.device)
        # The kernel's exact remainder: Barrett multipliers floor((2**64 - 1) / prime), uint64 bits.
        barrett = np.array([(2**64 - 1) // int(p) for p in layout.column_primes.reshape(-1)], dtype=np.uint64)
        self.barrett_multipliers = torch.from_numpy(barrett.view(np.int64).reshape(layout.column_primes.shape)).to(self.device)
        self.out_dtype = torch.int32 if max(layout.num_embeddings) <= _INT32_MAX else torch.int64
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self.kernel_constants = HashConstants(
            self.token_map, self.multipliers, self.column_primes, self.barrett_multipliers, self.column_offsets,
            vocab.vocab_size, self.pad_id, spec.num_layers, spec.max_ngram_size, spec.n_heads,
            max(self._device_index, 0))
        self._decide_backend()
        self.slot_cache: SlotCache | None = None
        self.request_history: RequestHistory | None = None
        # Per batch structure, with checks off: the launch plan (shapes already checked).
        self._plans = CallCache()
        self.calls = 0
        """Calls made (batches hashed); :class:`~engram.memory.EngramMemory` keys its prefetches by it."""
        self.marks_ready = False
        """Whether eager CUDA calls record when their ids are ready (:meth:`ready_event`; about one event
        record of host time a call): :class:`~engram.memory.EngramMemory` turns it on for tables whose
        prefetch starts reads."""
        self._ready_event: torch.cuda.Event | None = None
        self._ready: tuple | None = None  # (call count, IdsIdentity) of the call _ready_event marks
        self.op_key = ops.register(self)  # names this hasher in engram::hash_batch
        self.empty_stores = (fixed_address(torch.empty(0, dtype=torch.int32, device=self.device)),
                             fixed_address(torch.empty(0, dtype=torch.int64, device=self.device)))  # for no store

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, backend: str) -> None:
        self._backend = backend
        self._decide_backend()

    @property
    def validate(self) -> bool | None:
        return self._validate_setting

    @validate.setter
    def validate(self, validate: bool | None) -> None:
        self._validate_setting = check_bool("validate", validate, optional=True, note=" (checks on for CPU tensors)")
        self._validating = validate if validate is not None else self.device.type == "cpu"

    def _decide_backend(self) -> None:
        """Whether calls run the Triton kernels: decided when the backend is set, not per call
        (:func:`engram.backends.resolve_backend`; hash ids beyond int32 take the torch path)."""
        chosen = resolve_backend(self._backend, self.device, "NgramHasher")
        if chosen == "triton" and self.out_dtype != torch.int32:
            if self._backend == "triton":
                raise ValueError("backend: 'triton' hashes into int32 ids, but a table of this layout has "
                                 f"{max(self.layout.num_embeddings)} rows; use backend='torch'")
            chosen = "torch"
        self._triton = chosen == "triton"

    # ---- history stores ------------------------------------------------------
    def bind_slot_cache(self, num_slots: int, block_size: int, fused_write: bool = False) -> SlotCache:
        """Bind (or re-bind, dropping all history) a slot cache of ``num_slots`` slots.

        ``fused_write``: write and read the cache in one GPU launch; only for engines
        where no request reads history that the same batch writes (see :class:`SlotCache`).
        """
        self.slot_cache = SlotCache(num_slots, block_size, self.device, fused_write=fused_write)
        return self.slot_cache

    def bind_request_history(self, max_requests: int, max_draft_tokens: int = 8) -> RequestHistory:
        """Bind (or re-bind, dropping all history) ``max_requests`` per-request rows.

        ``max_draft_tokens``: the most speculative tokens a request carries in one step.
        """
        self.request_history = RequestHistory(max_requests, self.history_length, max_draft_tokens, self.device)
        return self.request_history

    def request_rows(self, request_ids: Iterable[Hashable]) -> torch.Tensor:
        """Rows of the per-request history for the engine's request ids (new ids get empty rows)."""
        return self._history().rows(request_ids)

    def release_requests(self, request_ids: Iterable[Hashable]) -> None:
        """Free the history rows of finished requests."""
        self._history().release(request_ids)

    def _history(self) -> RequestHistory:
        if self.request_history is None:
            raise ValueError("no request history is bound: call bind_request_history(max_requests) first")
        return self.request_history

    # ---- hashing -------------------------------------------------------------
    def __call__(self, input_ids, positions, query_start_loc, dead_mask=None, lookback_token_ids=None,
                 lookback_dead_mask=None, slot_mapping=None, block_table=None, request_rows=None) -> torch.Tensor:
        """Hash ids of the batch: int32 ``[T, L, C]`` (int64 if a table exceeds int32); see
        :meth:`hash_eagerly` for the arguments. Under ``torch.compile`` the call is the custom op
        ``engram::hash_batch`` (:mod:`engram.ops`), whose checks run when the graph runs."""
        if compiling():
            return ops.hash_batch(self, input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                                  lookback_dead_mask, slot_mapping, block_table, request_rows)
        return self.hash_eagerly(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                                  lookback_dead_mask, slot_mapping, block_table, request_rows)

    def hash_eagerly(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        dead_mask: torch.Tensor | None = None,
        lookback_token_ids: torch.Tensor | None = None,
        lookback_dead_mask: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        request_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hash ids of the batch: int32 ``[T, L, C]`` (int64 if a table exceeds int32).

        Args:
            input_ids: int ``[T]`` raw token ids, requests laid end to end.
            positions: int ``[T]`` position of each token in its request's sequence.
            query_start_loc: int ``[R + 1]`` first token of each request; tokens past
                ``query_start_loc[-1]`` are padding (hashed as dead, never stored).
            dead_mask: bool ``[T]``, tokens that take no part in n-grams.
            lookback_token_ids: int ``[R, N-1]``, column ``j`` = raw id at position
                ``start - 1 - j``; ``-1`` = unknown (falls through to a store).
            lookback_dead_mask: bool ``[R, N-1]``.
            slot_mapping: int ``[T]`` KV slot of each token (``-1`` = none); written
                into the bound slot cache before hashing.
            block_table: int ``[R, max_blocks]``; row ``k`` pages request ``k``'s slots.
            request_rows: int ``[R]`` rows of the bound request history
                (see :meth:`request_rows`); read before, written after hashing.
        """
        ids = self._hash_eagerly(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                                 lookback_dead_mask, slot_mapping, block_table, request_rows)
        if self.marks_ready and ids.is_cuda and not cuda_capturing():
            self._mark_ready(ids)
        return ids

    def _mark_ready(self, ids: torch.Tensor) -> None:
        """Record, on the current stream, the point at which this call's ``ids`` hold their values."""
        if self._ready_event is None:
            self._ready_event = torch.cuda.Event()
        self._ready_event.record(torch.cuda.current_stream(ids.device))
        self._ready = (self.calls, IdsIdentity.of(ids))

    def ready_event(self, ids: torch.Tensor) -> "torch.cuda.Event | None":
        """The event after which ``ids`` hold their values, when ``ids`` is the unchanged output of this
        hasher's latest eager call on CUDA outside graph capture (and :attr:`marks_ready` was on then),
        else None. Waiting on it orders work after that hashing only, not after whatever the caller
        enqueued since (:meth:`EngramMemory.prefetch <engram.memory.EngramMemory.prefetch>`)."""
        ready = self._ready
        if ready is None or ready[0] != self.calls or not ready[1].matches(ids):
            return None
        return self._ready_event

    def _hash_eagerly(self, input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                      lookback_dead_mask, slot_mapping, block_table, request_rows) -> torch.Tensor:
        self.calls += 1  # a step counter: prefetches made before this call are of another step
        if self._triton and not self._validating and not LAUNCH_OVERRIDE:
            # An eager step's path: checks and launch decisions made once per batch structure.
            key = (structure(input_ids), structure(positions), structure(query_start_loc), structure(dead_mask),
                   structure(lookback_token_ids), structure(lookback_dead_mask), structure(slot_mapping),
                   structure(block_table), structure(request_rows))
            entry = self._plans.get(key)
            if entry is not None and entry[1] is self.slot_cache and entry[2] is self.request_history:
                prepared = entry[3]
                if prepared is not None:
                    return prepared(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                                    lookback_dead_mask, slot_mapping, block_table, request_rows)
        batch = BatchMetadata(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                              lookback_dead_mask, slot_mapping, block_table, request_rows)
        if self._triton and not self._validating and not LAUNCH_OVERRIDE:
            return self._launch_planned(batch, key, entry)
        check_shapes(batch, self.history_length, self._device_index, self.device)
        self._check_stores_bound(batch)
        validate = self._validating
        if validate:
            validate_batch(
                batch,
                token_vocab_size=self.vocab.vocab_size,
                history_length=self.history_length,
                num_slots=self.slot_cache.num_slots if self.slot_cache else None,
                block_size=self.slot_cache.block_size if self.slot_cache else None,
                fused_slot_write=bool(self.slot_cache and self.slot_cache.fused_write),
                max_requests=self.request_history.max_requests if self.request_history else None,
            )
        if batch.num_tokens == 0:
            spec = self.layout.spec
            return torch.empty((0, spec.num_layers, spec.num_columns), dtype=self.out_dtype, device=self.device)
        if self._triton:
            if not validate:
                return launch_hash_kernels(self.kernel_constants, batch, self.slot_cache, self.request_history,
                                           bool(self.slot_cache and self.slot_cache.fused_write))
            return self._hash_triton_validated(batch)  # writes the request history too
        ids = self._hash_torch(batch, validate)
        if request_rows is not None:
            self._write_request_history(batch)
        return ids

    def _use_triton(self) -> bool:
        return self._triton

    def _check_stores_bound(self, batch: BatchMetadata) -> None:
        if batch.slot_mapping is not None and self.slot_cache is None:
            raise ValueError("slot_mapping: given, but no slot cache is bound (call bind_slot_cache first)")
        if batch.block_table is not None and self.slot_cache is None:
            raise ValueError("block_table: given, but no slot cache is bound (call bind_slot_cache first)")
        if batch.request_rows is not None and self.request_history is None:
            raise ValueError("request_rows: given, but no request history is bound (call bind_request_history first)")

    def _launch_planned(self, batch: BatchMetadata, key: tuple, entry: tuple | None) -> torch.Tensor:
        """The Triton path without value checks: the batch's shape checks and launch decisions
        are made on the first call of its structure (``key``) and kept (:mod:`engram.call_cache`),
        with a :class:`~engram.hashing.launch.PreparedHash` that later calls go straight to."""
        slot_cache, history = self.slot_cache, self.request_history
        if entry is None or entry[1] is not slot_cache or entry[2] is not history:
            check_shapes(batch, self.history_length, self._device_index, self.device)
            self._check_stores_bound(batch)
            plan = plan_hash_launch(self.kernel_constants, batch, slot_cache, history,
                                    bool(slot_cache and slot_cache.fused_write))
            prepared = prepare_hash_launch(plan, self.kernel_constants, slot_cache, history)
            entry = self._plans.put(key, (plan, slot_cache, history, prepared))
        return run_hash_launch(entry[0], self.kernel_constants, batch, slot_cache, history)

    def _slot_writes(self, batch: BatchMetadata) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slots, values) the slot cache receives: lookback seeds, then the batch's tokens."""
        writes = []
        if self.slot_cache is None:
            return writes
        if batch.lookback_token_ids is not None and batch.block_table is not None:
            seeds = self._lookback_seeds(batch)
            writes.append((self._seed_slots(batch, seeds), seeds.stored.reshape(-1)))
        if batch.slot_mapping is not None:
            writes.append((batch.slot_mapping.long(), self._stored_values(batch, self._locate_tokens(batch))))
        return writes

    def _hash_triton_validated(self, batch: BatchMetadata) -> torch.Tensor:
        """The kernels, with every store restored if some history was unknown."""
        slots = [slots for slots, _ in self._slot_writes(batch)]
        saved = [self.slot_cache.saved(s) for s in slots]
        history_saved = None
        if self.request_history is not None and batch.request_rows is not None:
            history_saved = self.request_history.saved(batch.request_rows)
        missing_shift = torch.zeros(batch.num_tokens, dtype=torch.int8, device=self.device)
        ids = launch_hash_kernels(self.kernel_constants, batch, self.slot_cache, self.request_history,
                                  bool(self.slot_cache and self.slot_cache.fused_write), missing_shift)
        if bool((missing_shift > 0).any()):
            for target, previous in reversed(list(zip(slots, saved))):
                self.slot_cache.restore(target, previous)
            if history_saved is not None:
                self.request_history.restore(batch.request_rows, history_saved)
            token = int((missing_shift > 0).nonzero()[0, 0])
            raise self._missing_history_error(batch, self._locate_tokens(batch), token, int(missing_shift[token]))
        return ids

    def _hash_torch(self, batch: BatchMetadata, validate: bool) -> torch.Tensor:
        """The torch path: write the slot cache, gather windows of source ids, blocked shifts
        to pad, rolling hash."""
        tokens = self._locate_tokens(batch)
        writes = self._slot_writes(batch)
        saved = [self.slot_cache.saved(slots) for slots, _ in writes] if validate else []
        for slots, values in writes:
            self.slot_cache.write(slots, values)
        compressed = self._compressed(batch)
        dead = self._dead(batch, tokens)
        windows, window_dead, missing = self._gather_windows(batch, tokens, compressed, dead)
        # Missing history matters only where no earlier shift is blocked already.
        blocked_before = torch.cummax(window_dead.to(torch.int8), dim=1).values.bool()
        blocked_before = torch.cat([torch.zeros_like(blocked_before[:, :1]), blocked_before[:, :-1]], dim=1)
        missing = missing & ~blocked_before
        if validate and bool(missing.any()):
            for (slots, _), previous in reversed(list(zip(writes, saved))):
                self.slot_cache.restore(slots, previous)
            token, shift = (int(x) for x in missing.nonzero()[0])
            raise self._missing_history_error(batch, tokens, token, shift)
        return hash_windows(block_windows(windows, window_dead | missing, self.pad_id),
                            self.multipliers, self.column_primes, self.column_offsets, self.out_dtype)

    def _compressed(self, batch: BatchMetadata) -> torch.Tensor:
        return self.token_map[batch.input_ids.long().clamp(0, self.vocab.vocab_size - 1)].long()

    def _dead(self, batch: BatchMetadata, tokens: "_TokenPlaces") -> torch.Tensor:
        """Dead flag per token; padding past ``query_start_loc[-1]`` counts as dead."""
        return tokens.padding if batch.dead_mask is None else (batch.dead_mask | tokens.padding)

    def _stored_values(self, batch: BatchMetadata, tokens: "_TokenPlaces") -> torch.Tensor:
        """What the stores hold for each batch token: its compressed id, or ``DEAD``."""
        compressed = self._compressed(batch)
        return torch.where(self._dead(batch, tokens), torch.full_like(compressed, DEAD), compressed)

    # ---- stages --------------------------------------------------------------
    def _locate_tokens(self, batch: BatchMetadata) -> "_TokenPlaces":
        """Per token: its request (clamped into range), index inside the request, padding flag."""
        starts = batch.query_start_loc.long().clamp(0, batch.num_tokens)  # any value stays in bounds
        token_index = torch.arange(batch.num_tokens, device=self.device)
        request = torch.searchsorted(starts[1:].contiguous(), token_index, right=True)
        padding = request >= batch.num_requests
        request = request.clamp(max=max(batch.num_requests - 1, 0))
        return _TokenPlaces(request, token_index - starts[request], padding)

    def _lookback_seeds(self, batch: BatchMetadata) -> "_LookbackSeeds":
        """The known lookback entries as (position, stored value) per request ``[R, N-1]``.

        Stores are seeded with them, so a request that arrives with only a lookback
        window (a decode instance after a prefill/decode split) keeps its history.
        """
        starts = batch.query_start_loc.long().clamp(0, batch.num_tokens)  # any value stays in bounds
        has_tokens = starts[1:] > starts[:-1]
        first_position = batch.positions.long()[starts[:-1].clamp(0, max(batch.num_tokens - 1, 0))]
        columns = torch.arange(self.history_length, device=self.device)
        positions = first_position[:, None] - 1 - columns                          # [R, N-1]
        raw = batch.lookback_token_ids.long()
        known = (raw >= 0) & (positions >= 0) & has_tokens[:, None]
        compressed = self.token_map[raw.clamp(0, self.vocab.vocab_size - 1)].long()
        dead = batch.lookback_dead_mask if batch.lookback_dead_mask is not None else torch.zeros_like(known)
        stored = torch.where(dead, torch.full_like(compressed, DEAD), compressed)
        return _LookbackSeeds(positions.clamp(min=0), stored, known)

    def _seed_slots(self, batch: BatchMetadata, seeds: "_LookbackSeeds") -> torch.Tensor:
        """Slot of each known lookback entry, ``-1`` where unknown: int64 ``[R * (N-1)]``."""
        table_rows = batch.block_table.long()[: batch.num_requests]
        slots = self.slot_cache.slots_of(table_rows, seeds.positions)
        return torch.where(seeds.known, slots, torch.full_like(slots, -1)).reshape(-1)

    def _gather_windows(self, batch: BatchMetadata, tokens: "_TokenPlaces", compressed: torch.Tensor,
                        dead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Source id ``[T, N]`` int64 per shift, its dead flag, and where no source knows it.

        A source earlier in the batch counts only if its position is ``position - shift``: positions
        that repeat or skip inside a request (token-tree drafts) make it unknown, and the shifts
        after it are blocked, so history before the request is read only behind consecutive ones."""
        shifts = torch.arange(self.history_length + 1, device=self.device)
        positions = batch.positions.long()
        source_position = positions[:, None] - shifts                                # [T, N]
        in_batch = tokens.offset_in_request[:, None] >= shifts
        before_sequence = source_position < 0
        source_token = (torch.arange(batch.num_tokens, device=self.device)[:, None] - shifts).clamp(min=0)
        values = compressed[source_token]
        source_dead = dead[source_token]
        out_of_sequence = in_batch & ~tokens.padding[:, None] & (positions[source_token] != source_position)

        outside = ~in_batch & ~before_sequence  # needs a source before the batch
        known = torch.zeros_like(outside)
        request = tokens.request[:, None].expand_as(source_position)
        if batch.lookback_token_ids is not None and batch.num_requests > 0:
            # Lookback column j holds position (first position - 1 - j).
            column = (shifts - tokens.offset_in_request[:, None] - 1).clamp(0, self.history_length - 1)
            raw = batch.lookback_token_ids.long()[request, column]
            use = outside & (raw >= 0)
            lookback_dead = (batch.lookback_dead_mask[request, column] if batch.lookback_dead_mask is not None
                             else torch.zeros_like(use))
            values = torch.where(use, self.token_map[raw.clamp(0, self.vocab.vocab_size - 1)].long(), values)
            source_dead = torch.where(use, lookback_dead, source_dead)
            known = use
        for store_values in self._store_reads(batch, request, source_position.clamp(min=0)):
            use = outside & ~known & (store_values != UNWRITTEN)
            values = torch.where(use, store_values, values)
            source_dead = torch.where(use, store_values == DEAD, source_dead)
            known = known | use
        return values.clamp(min=0), before_sequence | source_dead, (outside & ~known) | out_of_sequence

    def _store_reads(self, batch: BatchMetadata, request: torch.Tensor, position: torch.Tensor):
        """What each bound store holds for ``position`` ``[T, N]``, in priority order."""
        if batch.num_requests == 0:
            return
        if self.slot_cache is not None and batch.block_table is not None:
            table_rows = batch.block_table.long()[request[:, 0]]                      # [T, max_blocks]
            yield self.slot_cache.values[self.slot_cache.slots_of(table_rows, position)].long()
        if self.request_history is not None and batch.request_rows is not None:
            yield self.request_history.read(batch.request_rows.long()[request], position)

    def _write_request_history(self, batch: BatchMetadata) -> None:
        """After hashing: store the known lookback entries, then the last ``width`` tokens
        of each request (drafts included), position-tagged. A separate step from the
        hash because a step reads and writes the same ring cells. A request whose kept tokens
        are not at consecutive positions after its first one (positions that repeat or skip, as
        token-tree drafts give) would write a cell twice or tag a token with a position it does
        not hold: its row is cleared instead, so later reads of it are reported missing."""
        history = self.request_history
        if batch.num_requests == 0:
            return
        rows = batch.request_rows.long()
        tokens = self._locate_tokens(batch)
        starts = batch.query_start_loc.long().clamp(0, batch.num_tokens)  # any value stays in bounds
        length = (starts[1:] - starts[:-1])[tokens.request]
        keep = ~tokens.padding & (tokens.offset_in_request >= length - history.width)
        positions = batch.positions.long()
        first_position = positions[starts[:-1].clamp(max=max(batch.num_tokens - 1, 0))]  # [R]
        out_of_sequence = keep & (positions != first_position[tokens.request] + tokens.offset_in_request)
        cleared = torch.zeros(batch.num_requests, dtype=torch.bool, device=self.device)
        cleared[tokens.request[out_of_sequence]] = True
        if bool(cleared.any()):
            history.reset(rows[cleared].clamp(0, history.max_requests))  # out-of-range rows: the spare one
        if batch.lookback_token_ids is not None:
            seeds = self._lookback_seeds(batch)
            seed_rows = rows[:, None].expand_as(seeds.positions)
            history.write(seed_rows.reshape(-1), seeds.positions.reshape(-1), seeds.stored.reshape(-1),
                          (seeds.known & ~cleared[:, None]).reshape(-1))
        history.write(rows[tokens.request], positions, self._stored_values(batch, tokens),
                      keep & ~cleared[tokens.request])

    def _missing_history_error(self, batch: BatchMetadata, tokens: "_TokenPlaces", token: int, shift: int) -> ValueError:
        k = int(tokens.request[token])
        first = int(batch.positions[token]) - int(tokens.offset_in_request[token])
        position = int(batch.positions[token]) - shift
        sources = []
        if batch.lookback_token_ids is not None:
            sources.append(f"lookback_token_ids[{k}] = {batch.lookback_token_ids[k].tolist()}")
        if self.slot_cache is not None and batch.block_table is not None:
            sources.append("the slot cache never had that slot written since bind_slot_cache")
        if self.request_history is not None and batch.request_rows is not None:
            sources.append(f"request history row {int(batch.request_rows[k])} holds no entry for that position")
        why = "; ".join(sources) if sources else "no lookback and no bound history store"
        return ValueError(
            f"request {k} starts at position {first}, but the token at position {position} is unknown "
            f"({why}); hashing it as pad would be silently wrong"
        )


class _LookbackSeeds(NamedTuple):
    positions: torch.Tensor  # int64 [R, N-1], position of each lookback column (clamped at 0)
    stored: torch.Tensor     # int64 [R, N-1], compressed id or DEAD
    known: torch.Tensor      # bool [R, N-1], a real token at a real position


class _TokenPlaces(NamedTuple):
    request: torch.Tensor            # int64 [T], clamped into [0, R)
    offset_in_request: torch.Tensor  # int64 [T]
    padding: torch.Tensor            # bool [T], tokens past query_start_loc[-1]
