"""EngramMemory: every Engram layer of a model, loaded from its checkpoint directory.

``EngramMemory.from_pretrained(model_dir)`` reads ``config.json`` (:class:`EngramSpec`),
the tokenizer (:class:`TokenCompressor`, checked against the config), and from the
safetensors shards only this tensor-parallel rank's table rows, streamed into
the placement (docs/design.md §3). It builds per layer an :class:`EngramTable` and an
:class:`Engram` module, and one :class:`NgramHasher` on the compute device for
all layers (hash once per step, then run each layer with its slice of the ids).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from engram.checkpoint import (SafetensorsCheckpoint, expected_layer_tensors, file_problem,
                         load_engram_layer_weights, load_engram_table, table_progress)
from engram.checks import check_bool, check_hash_ids
from engram.common import IdsIdentity, as_device, cuda_capturing, resolve_cuda_device
from engram.hashing import NgramHasher
from engram.layer import Engram
from engram.layout import ColumnShard, EngramLayout
from engram import ops
from engram.ops import compiling
from engram.options import ServingOptions
from engram.spec import EngramSpec
from engram.table import EngramTable, available_placements
from engram.table.placement import placement_class
from engram.step_prefetch import StepPrefetch
from engram.vocab import TokenCompressor

__all__ = ["EngramMemory", "StepPrefetch", "StepPlan", "resolve_placement"]


# "auto" keeps the tables in HBM when they take at most this fraction of the free device
# memory (the rest of the model needs the remainder), else in host memory.
AUTO_DEVICE_FRACTION = 0.5


def resolve_placement(placement: str, device: torch.device | str | int | None = None,
                      table_bytes: int | None = None) -> tuple[str, torch.device]:
    """``(placement, compute device)``: where lookups, wkv and gate run.

    ``"auto"``: ``"cpu"`` for a CPU ``device`` or on a machine without CUDA; on a CUDA
    device ``"device"`` when ``table_bytes`` (this rank's tables) fit in
    :data:`AUTO_DEVICE_FRACTION` of its free memory (or are unknown), else ``"host"``.
    ``"cpu"`` runs on the CPU; ``"node"`` and ``"disk"`` (placements that set ``serves_cpu``) on the CPU for a
    CPU ``device`` (or without CUDA; ``"node"``: a gloo group),
    else like every other placement (``"device"``, ``"host"``, ``"cached"``) on a CUDA device, ``device``
    or the current one. Errors name the placement the caller gave and the device.
    """
    asked = placement
    if placement == "auto":
        wanted = None if device is None else as_device(device)
        if (wanted is None and not torch.cuda.is_available()) or (wanted is not None and wanted.type == "cpu"):
            placement = "cpu"
        else:
            target = resolve_cuda_device(device, "placement 'auto'")
            placement = "device"
            if table_bytes is not None and "host" in available_placements():
                free, _ = torch.cuda.mem_get_info(target)
                if table_bytes > AUTO_DEVICE_FRACTION * free:
                    placement = "host"
    available = available_placements()
    if placement not in available:
        raise ValueError(f"placement: expected 'auto' or one of {list(available)}, found {placement!r}")
    if placement == "cpu":
        if device is not None and as_device(device).type != "cpu":
            raise ValueError(f"device: placement 'cpu' runs on the CPU, found device {device!r}")
        return placement, torch.device("cpu")
    if placement_class(placement).serves_cpu and ((device is None and not torch.cuda.is_available())
                                                  or (device is not None and as_device(device).type == "cpu")):
        return placement, torch.device("cpu")
    if placement in ("host", "cached") and not torch.cuda.is_available():
        raise ValueError(f"placement: {placement!r} keeps the tables in host memory for a CUDA device to read, and "
                         "this machine has no CUDA device; use placement='cpu' (tables served from the CPU)")
    return placement, resolve_cuda_device(device, f"placement {asked!r}")


class StepPlan:
    """Every Engram layer's :class:`~engram.layer.plan.LayerPlan` for one step structure
    (:meth:`EngramMemory.plan`). ``run(layer_id, hidden_states, hash_ids, token_mask=None,
    prefetch=None)`` equals :meth:`EngramMemory.forward_layer` bit for bit and only launches (with
    validation on it still checks each layer's ids against its columns, a host sync)."""

    def __init__(self, memory: "EngramMemory", plans: dict):
        self.memory, self.plans = memory, dict(plans)

    def run(self, layer_id: int, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
            token_mask: torch.Tensor | None = None, prefetch: "StepPrefetch | None" = None) -> torch.Tensor:
        layer_ids, layer_prefetch, kv = self.memory._layer_inputs(layer_id, hash_ids, prefetch)
        return self.plans[layer_id].run(hidden_states, layer_ids, token_mask, layer_prefetch, kv)


def _read_spec(model_dir: Path) -> EngramSpec:
    config_path = model_dir / "config.json"
    problem = file_problem(config_path, "config file")  # missing, a directory, not a regular file
    if problem is not None:
        raise ValueError(problem)
    try:
        return EngramSpec.from_hf_config(config_path)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if str(config_path) in message else f"config file {str(config_path)!r}: {message}") from None


def _read_vocab(model_dir: Path, spec: EngramSpec) -> TokenCompressor:
    """The token map of ``model_dir/tokenizer.json``, checked against the config."""
    tokenizer_path, config_path = model_dir / "tokenizer.json", model_dir / "config.json"
    problem = file_problem(tokenizer_path, "tokenizer file")
    if problem is not None:
        raise ValueError(problem)
    vocab = TokenCompressor.from_tokenizer(tokenizer_path)  # an unreadable file is its own error
    try:
        vocab.check_spec(spec)
    except ValueError as error:
        raise ValueError(f"tokenizer file {str(tokenizer_path)!r} and config file {str(config_path)!r} "
                         f"disagree: {error}") from None
    model_vocab = spec.extra.get("vocab_size", (spec.extra.get("text_config") or {}).get("vocab_size"))
    if isinstance(model_vocab, int) and vocab.vocab_size > model_vocab:
        raise ValueError(f"tokenizer file {str(tokenizer_path)!r} and config file {str(config_path)!r} disagree: "
                         f"config field 'vocab_size' is {model_vocab}, the tokenizer has {vocab.vocab_size} ids")
    return vocab


def _tensor_parallel_rank(tp_group: Any) -> tuple[int, int]:
    """(rank, world size) in ``tp_group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tp_group: expected a process group of an initialized torch.distributed, "
                         "found torch.distributed not initialized")
    try:
        rank, world_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"tp_group: expected a torch.distributed ProcessGroup, found {tp_group!r} ({error})") from None
    if rank < 0:
        raise ValueError("tp_group: expected a group this process belongs to")
    return rank, world_size


class EngramMemory:
    """All Engram layers of one model (one tensor-parallel rank's share of the tables).

    Attributes:
        spec, layout, vocab: the model's :class:`EngramSpec`, :class:`EngramLayout`, :class:`TokenCompressor`.
        hasher: :class:`NgramHasher` on :attr:`device`; its ids ``[T, L, C]`` feed :meth:`forward_layer`.
        layer_ids: the Engram layer ids, in config order (``L`` of them).
        tables: layer id -> :class:`EngramTable`.
        placement: where the table bytes live (``"cpu"``, ``"device"``, ...).
        device: where lookups, wkv and gate run.
        shard: this rank's :class:`ColumnShard`, or None without tensor parallelism.
    """

    def __init__(self, spec: EngramSpec, layout: EngramLayout, vocab: TokenCompressor, hasher: NgramHasher,
                 layers: Mapping[int, Engram], tables: Mapping[int, EngramTable], *, placement: str,
                 device: torch.device, shard: ColumnShard | None = None, model_dir: Path | None = None):
        if tuple(layers) != spec.layer_ids or tuple(tables) != spec.layer_ids:
            raise ValueError(f"layers, tables: expected one entry per Engram layer {list(spec.layer_ids)}, "
                             f"found {list(layers)} and {list(tables)}")
        self.spec, self.layout, self.vocab, self.hasher = spec, layout, vocab, hasher
        self._layers = dict(layers)
        self.tables = dict(tables)
        self.placement, self.device, self.shard = placement, device, shard
        self.model_dir = model_dir
        self.options: ServingOptions | None = None  # what from_pretrained served these layers with
        self.op_key = ops.register(self)  # names this memory in engram::prefetch and engram::layer
        self._prefetch_stream: torch.cuda.Stream | None = None  # made at the first prefetch that starts reads
        # The hasher marks when its ids are ready, so that a prefetch called later than right after it
        # waits for the hashing only (prefetch_eagerly).
        if device.type == "cuda" and self._starts_reads():
            hasher.marks_ready = True

    # ---- loading -------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        placement: str = "auto",
        device: torch.device | str | int | None = None,
        tp_group: Any = None,
        validate: bool | None = None,
        progress: bool | None = None,
        *,
        sequence_parallel: bool = False,
        sp_group: Any = None,
        chunk_bytes: int | None = None,
        check_values: bool | None = None,
        backend: str | None = None,
        share_host_tables: bool | None = None,
        placement_options: dict | None = None,
        options: ServingOptions | None = None,
    ) -> "EngramMemory":
        """Load every Engram layer of the checkpoint in ``model_dir``.

        Args:
            model_dir: holds ``config.json``, ``tokenizer.json`` and the safetensors
                shards (with or without ``model.safetensors.index.json``).
            placement: ``"auto"`` (:func:`resolve_placement`: ``"device"`` when the tables fit
                in half the free HBM, else ``"host"``; ``"cpu"`` without CUDA), ``"cpu"``,
                ``"device"`` (HBM), ``"host"`` (pinned host memory read by the GPU; see
                :meth:`prefetch`) or ``"cached"`` (``"host"`` plus an HBM cache of hot rows; see
                :meth:`update_cache` and ``placement_options``), or ``"node"`` (each table's rows
                spread over ``placement_options["group"]``, lookups exchanged by collectives: every
                rank of the group runs every layer, with no tokens too, in the same order; give
                ``device="cpu"`` for a gloo group).
            device: the CUDA device of a GPU placement (default: the current one).
            tp_group: tensor-parallel ``ProcessGroup``: this rank reads and keeps only the
                rows of its hash columns (:meth:`EngramLayout.shard`); the layers gather
                the other ranks' rows in forward.
            validate: check hash ids on every lookup and batch (None: on for the CPU, off for CUDA).
            progress: a byte progress bar (tqdm, on stderr) while the tables stream in
                (on tensor-parallel rank 0 only).
            sequence_parallel, sp_group: passed to every :class:`Engram` module.
            chunk_bytes: bytes read per memory-mapped slice.
            check_values: refuse table rows holding E4M3 NaN bytes while they stream in, and any
                non-finite value of the ``wkv``, ``q_weight`` and ``k_weight`` tensors (False skips
                both on trusted checkpoints).
            backend: ``"auto"`` (default), ``"triton"`` or ``"torch"`` for the table
                lookups and the gate of every layer (:mod:`engram.backends`).
            share_host_tables: with placement ``"host"``, one copy of each table per node in
                shared memory, filled by the first process and mapped by the others (one
                process per GPU); see :func:`engram.checkpoint.load_engram_table`. Also for ``"cached"``.
            placement_options: keyword arguments of the placement, the same for every layer, e.g.
                ``{"cache_fraction": 0.02}`` for ``"cached"`` (:class:`engram.table.placements.cached.CachedPlacement`;
                per-layer hot sets: ``memory.table(layer_id).load_hot_rows(ids)``); they win over
                ``options``' placement fields.
            options: a :class:`~engram.options.ServingOptions` holding every knob (default:
                ``ServingOptions.from_environment()``); the keyword arguments above, where given
                (not None), win over its fields. Kept as :attr:`options`.

        Every tensor's dtype and shape is checked against the config before any
        table row is read. Errors are ``ValueError`` naming the tensor or field and the file.
        """
        if options is not None and not isinstance(options, ServingOptions):
            raise ValueError(f"options: expected a ServingOptions or None, found {type(options).__name__}")
        # Every knob checked before any byte is read.
        options = (options or ServingOptions.from_environment()).replace(
            validate=validate, progress=progress, chunk_bytes=chunk_bytes, check_values=check_values, backend=backend,
            share_host_tables=share_host_tables)
        validate, progress, chunk_bytes = options.validate, options.progress, options.chunk_bytes
        check_values, backend, share_host_tables = options.check_values, options.backend, options.share_host_tables
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"model_dir {str(model_dir)!r} is not a directory")
        spec = _read_spec(model_dir)
        layout = EngramLayout(spec)
        vocab = _read_vocab(model_dir, spec)
        shard = None
        if tp_group is not None:
            rank, world_size = _tensor_parallel_rank(tp_group)
            shard = layout.shard(rank, world_size)
        rows = [layout.num_embeddings[i] if shard is None else shard.num_rows(i) for i in range(spec.num_layers)]
        placement, compute_device = resolve_placement(placement, device, table_bytes=sum(rows) * spec.row_bytes)
        if placement_options is not None and not isinstance(placement_options, dict):
            raise ValueError(f"placement_options: expected a dict of keyword arguments, found {placement_options!r}")
        placement_options = {**options.placement_options(placement), **(placement_options or {})}

        checkpoint = SafetensorsCheckpoint(model_dir)
        # Check every tensor header first: a bad tensor fails before gigabytes are read.
        for index, layer_id in enumerate(spec.layer_ids):
            expected = expected_layer_tensors(spec, layout, index)
            for kind in ("embed.weight", "embed.scale"):
                checkpoint.check(checkpoint.name(layer_id, kind), *expected[kind])
        weights = [load_engram_layer_weights(checkpoint, spec, layout, index, check_values=check_values)
                   for index in range(spec.num_layers)]

        what = "engram tables" if shard is None else f"engram tables (rank {shard.rank} of {shard.world_size})"
        # One bar per group: tensor-parallel ranks other than 0 stream silently.
        bar = table_progress(sum(rows) * spec.row_bytes, what, enabled=progress and (shard is None or shard.rank == 0))
        tables: dict[int, EngramTable] = {}
        try:
            for index, layer_id in enumerate(spec.layer_ids):
                tables[layer_id] = load_engram_table(
                    checkpoint, layout, index, shard, placement=placement,
                    device=None if placement == "cpu" else compute_device, validate=validate, progress=bar,
                    chunk_bytes=chunk_bytes, check_values=check_values, backend=backend,
                    share_host_table=share_host_tables, placement_options=placement_options)
        finally:
            bar.close()

        layers: dict[int, Engram] = {}
        for (layer_id, table), weight in zip(tables.items(), weights):
            scale = None if weight.wkv_scale is None else weight.wkv_scale.to(compute_device)
            layers[layer_id] = Engram.from_weights(
                spec, table, wkv_weight=weight.wkv_weight.to(compute_device), wkv_scale=scale,
                q_weight=weight.q_weight.to(compute_device), k_weight=weight.k_weight.to(compute_device),
                tp_group=tp_group, sequence_parallel=sequence_parallel, sp_group=sp_group, gate_backend=backend,
                wkv_backend=options.wkv_backend, wkv_small_m=options.wkv_small_m)
        hasher = NgramHasher(layout, vocab, device=compute_device, validate=validate, backend=backend)
        memory = cls(spec, layout, vocab, hasher, layers, tables, placement=placement, device=compute_device,
                     shard=shard, model_dir=model_dir)
        memory.options = options
        return memory

    # ---- access --------------------------------------------------------------
    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.spec.layer_ids

    @property
    def nbytes(self) -> int:
        """Table bytes this rank holds (E4M3 values + UE8M0 scales, all layers)."""
        return sum(table.nbytes for table in self.tables.values())

    def _index(self, layer_id: int) -> int:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id not in self.spec.layer_ids:
            raise ValueError(f"layer_id {layer_id!r} is not an Engram layer of this model; "
                             f"expected one of {list(self.spec.layer_ids)}")
        return self.spec.layer_ids.index(layer_id)

    def layer(self, layer_id: int) -> Engram:
        """The :class:`Engram` module of decoder layer ``layer_id``."""
        return self._layers[self.spec.layer_ids[self._index(layer_id)]]

    def table(self, layer_id: int) -> EngramTable:
        """The :class:`EngramTable` (this rank's rows) of decoder layer ``layer_id``."""
        return self.tables[self.spec.layer_ids[self._index(layer_id)]]

    # ---- running -------------------------------------------------------------
    def _check_step_ids(self, hash_ids: torch.Tensor) -> None:
        """``hash_ids`` of a step: an int32/int64 tensor ``[T, L, C]`` of this model's layers and columns."""
        check_hash_ids(hash_ids, layers=self.spec.num_layers, columns=self.spec.num_columns)

    def prefetch(self, hash_ids: torch.Tensor, *, sp_token_counts: Sequence[int] | None = None,
                 kv_ahead: bool = False):
        """Start reading every layer's rows of ``hash_ids [T, L, C]`` now, in layer order, and return
        the step's handle for ``forward_layer(..., prefetch=handle)``. Call it after hashing and before
        the first Engram layer, with the stream that runs the layers current. With placement ``"host"``
        large batches are gathered on the host and copied by the copy engine while the decoder runs
        (``"cached"``: only the rows its HBM cache misses; call :meth:`update_cache` after the step's
        layers, not between this and them); each :meth:`forward_layer` given the handle waits, on the
        GPU, for its own layer's rows only.

        Where a table starts reads (``"host"``, ``"cached"``, on CUDA, outside graph capture) the
        prefetch's device work runs on the memory's own stream, after the hashing of ``hash_ids`` when
        they are :attr:`hasher`'s latest output, unchanged (:meth:`NgramHasher.ready_event`), else after
        the current stream's work so far. So an engine may call it once it has enqueued the decoder
        layers before the first Engram layer: its host time (0.25-0.6 ms a host table at T = 8192 on the
        H200's hosts) then overlaps their GPU work instead of delaying their launch, and the rows still
        start as soon as the hashing is done.
        Under sequence parallelism each rank fetches exactly the rows it looks up (give the same
        ``sp_token_counts`` as to :meth:`forward_layer`).

        The handle serves only this step: a layer's rows are used at most once, by the lookup of this
        very ``hash_ids`` tensor, unrefilled, before the hasher runs again and before the next prefetch;
        otherwise the layer reads its rows itself (correct, without the head start). Returns at once
        (no host sync); nothing is started where the rows already live on the device, for
        decode-sized batches (read directly, graph-capturable) and for placement ``"node"`` (its lookups
        exchange the rows, on every rank). While a CUDA graph is being captured, placement ``"host"``
        captures the host gather of lookups over ``graph_direct_max_rows`` rows into the graph (gathered
        afresh at every replay, docs/design.md "Replayed gathers"); nothing else starts.

        ``kv_ahead``: also compute each layer's ``kv = wkv(rows)`` now (on CUDA on a side stream per
        layer, after its rows; :meth:`Engram.kv_ahead`), so ``forward_layer`` given the handle runs only
        the gate; bit-identical to computing it there. Off by default: it pays only where the step
        measures it faster (``benchmarks/step/bench_step.py``). A layer whose rows come through a host gather
        (placement ``"host"`` or ``"cached"``, large batches) keeps that gather's prefetch and computes
        its kv in ``forward_layer``, so this call never waits for a gather. Single-process layers, not
        placement ``"node"``. Under ``torch.inference_mode()`` no kv is computed ahead: inference tensors
        keep no version counter, so an in-place edit of ``hash_ids`` after this call could not be seen, and
        a kv (unlike a row, which the lookup checks against its id) cannot be checked.

        Under ``torch.compile`` this is the custom op ``engram::prefetch`` (:mod:`engram.ops`) and the
        handle is an int64 ticket tensor, passed to ``forward_layer`` the same way."""
        check_bool("kv_ahead", kv_ahead)
        if compiling():
            if sp_token_counts is not None or kv_ahead:
                raise ValueError("sp_token_counts, kv_ahead: not supported under torch.compile; prefetch eagerly")
            return ops.prefetch(self, hash_ids)
        return self.prefetch_eagerly(hash_ids, sp_token_counts, kv_ahead)

    def prefetch_eagerly(self, hash_ids: torch.Tensor, sp_token_counts: Sequence[int] | None = None,
                         kv_ahead: bool = False) -> "StepPrefetch":
        """:meth:`prefetch` outside ``torch.compile`` (the body of the custom op ``engram::prefetch``)."""
        self._check_step_ids(hash_ids)
        if kv_ahead and sp_token_counts is not None:
            raise ValueError("kv_ahead: single-process layers only; found sp_token_counts")
        if kv_ahead and any(getattr(table, "collective", False) for table in self.tables.values()):
            raise ValueError(f"kv_ahead: placement {self.placement!r} serves lookups as collectives; expected "
                             "kv_ahead=False (a layer that could not use its kv ahead would look up alone)")
        stream = self._prefetch_stream_after(hash_ids)
        if stream is None:
            tables, kv = self._start_prefetches(hash_ids, sp_token_counts, kv_ahead)
            prepared = None
        else:
            with torch.cuda.stream(stream):
                tables, kv = self._start_prefetches(hash_ids, sp_token_counts, kv_ahead)
            hash_ids.record_stream(stream)  # read there: not reused before that work has run
            prepared = torch.cuda.Event()
            prepared.record(stream)
        handle = StepPrefetch(self, self.hasher.calls, IdsIdentity.of(hash_ids), tables, kv, prepared)
        self._op_ticket = handle  # the custom op names it by a ticket tensor: kept until the next prefetch
        return handle

    def _starts_reads(self, num_ids: int | None = None) -> bool:
        """Whether some layer's table may start reads at a prefetch (placements ``"host"``, ``"cached"``), of
        ``num_ids`` ids a layer (at most; None: of any size)."""
        if num_ids is None:
            return any(table.storage.starts_reads for table in self.tables.values())
        return any(table.storage.prefetch_starts(num_ids) for table in self.tables.values())

    def _prefetch_stream_after(self, hash_ids: torch.Tensor) -> "torch.cuda.Stream | None":
        """The stream a prefetch of ``hash_ids`` runs its device work on, already ordered after the point
        where the ids hold their values, or None (the current stream, as it is: on the CPU, under CUDA-graph
        capture, or where no table may start a read of this many ids). That point is the hasher's own mark
        when ``hash_ids`` is its latest output, unchanged (:meth:`NgramHasher.ready_event`), so a prefetch
        called after the engine has enqueued more work (its first decoder layers) does not wait for that
        work; else it is the current stream now."""
        if (self.device.type != "cuda" or not hash_ids.is_cuda or cuda_capturing()
                or not self._starts_reads(hash_ids.shape[0] * hash_ids.shape[2])):
            return None
        if self._prefetch_stream is None:
            # High priority: its few small launches (the row list or dedup, the ids' copy) go ahead of the
            # CTAs of decoder GEMMs waiting beside them, so the host gather starts as soon as it can.
            self._prefetch_stream = torch.cuda.Stream(self.device, priority=-1)
            self.hasher.marks_ready = True  # also where tables that start reads were put in after construction
        stream = self._prefetch_stream
        ready = self.hasher.ready_event(hash_ids)
        if ready is not None:
            stream.wait_event(ready)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return stream

    def _start_prefetches(self, hash_ids: torch.Tensor, sp_token_counts, kv_ahead: bool) -> tuple[dict, dict]:
        """Each layer's table prefetch of ``hash_ids [T, L, C]`` and, with ``kv_ahead``, its kv, started on
        the current stream: ``({layer id: TablePrefetch or None}, {layer id: KvAhead})``."""
        tables = {layer_id: self._layers[layer_id].prefetch(hash_ids[:, index, :], sp_token_counts=sp_token_counts)
                  for index, layer_id in enumerate(self.spec.layer_ids)}
        kv = {}
        # A kv computed ahead is a product of rows, not rows: no per-row id check can tell it stale. Only ids
        # whose in-place edits the identity sees get one (not inference tensors: the layers compute kv there).
        if kv_ahead and IdsIdentity.of(hash_ids).sees_edits:  # each layer's rows taken by its kv now, in layer order
            for index, layer_id in enumerate(self.spec.layer_ids):
                table_prefetch = tables[layer_id]
                if table_prefetch is not None and table_prefetch.finish_waits:
                    # A host gather of the Python worker: its kv now would wait on this thread for the
                    # gather (H200, T = 8192: kv ahead +4.4% over device, prefetch alone +2.2%; NOTES
                    # "The served decoder step"). The layer keeps the gather and computes kv itself.
                    # The native worker's gathers only make the side stream wait.
                    continue
                kv[layer_id] = self._layers[layer_id].kv_ahead(hash_ids[:, index, :], tables.pop(layer_id))
        return tables, kv

    def update_cache(self, hash_ids: torch.Tensor) -> None:
        """Once the step's last Engram layer is enqueued, with the step's ``hash_ids [T, L, C]``: placement
        ``"cached"`` admits missed rows into each layer's HBM cache (counts hits, ages counters); a no-op for
        the other placements. On CUDA an eager call runs beside the rest of the step, on a stream of its own
        (every later access of the cache waits for it, graph replays included); inside a graph capture it is
        captured on the caller's stream. Captured lookups serve the updated content."""
        self._check_step_ids(hash_ids)
        for index, layer_id in enumerate(self.spec.layer_ids):
            self.tables[layer_id].update_cache(hash_ids[:, index, :])

    def wait_cache_updates(self) -> None:
        """Order the current stream's later work after every cache update still running beside it (the caches'
        own accesses wait by themselves: for timing a whole step, or before another library reads the cache)."""
        for layer_id in self.spec.layer_ids:
            cache = getattr(self.tables[layer_id].storage, "cache", None)
            if cache is not None and hasattr(cache, "settle"):
                cache.settle()

    def close(self) -> None:
        """Release each layer's table (:meth:`EngramTable.close`), in layer order: with placement ``"node"``
        and lookup ``"peer"`` a collective of the group, so every rank calls it at teardown."""
        for layer_id in self.spec.layer_ids:
            self.tables[layer_id].close()

    def forward_layer(self, layer_id: int, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                      token_mask: torch.Tensor | None = None, *,
                      sp_token_counts: Sequence[int] | None = None,
                      prefetch: "StepPrefetch | None" = None) -> torch.Tensor:
        """Run layer ``layer_id``: ``out [n, hc, D] = h + g * value``.

        Args:
            hidden_states: bf16 ``[T, hc, D]`` (with sequence parallelism this rank's ``n`` tokens).
            hash_ids: int32/int64 ``[T, L, C]`` from :attr:`hasher` (all layers); the
                layer's slice ``[:, index, :]`` is used.
            token_mask: bool ``[T]`` (False = dead token, output = input bit for bit) or None.
            sp_token_counts: see :meth:`Engram.forward`.
            prefetch: the handle :meth:`prefetch` returned for this step's ``hash_ids``, or None;
                only its own layer's rows are used, and only while the handle is valid.
        """
        if compiling():
            return ops.layer(self, layer_id, hidden_states, hash_ids, token_mask, prefetch)
        return self.layer_eagerly(layer_id, hidden_states, hash_ids, token_mask, prefetch, sp_token_counts)

    def layer_eagerly(self, layer_id: int, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                      token_mask: torch.Tensor | None, prefetch, sp_token_counts=None) -> torch.Tensor:
        """:meth:`forward_layer` outside ``torch.compile`` (the body of the custom op ``engram::layer``)."""
        self._check_step_ids(hash_ids)
        layer_ids, layer_prefetch, kv = self._layer_inputs(layer_id, hash_ids, prefetch)
        if kv is not None:
            return self._layers[layer_id](hidden_states, layer_ids, token_mask, kv_ahead=kv)
        return self._layers[layer_id](hidden_states, layer_ids, token_mask, sp_token_counts=sp_token_counts,
                                      prefetch=layer_prefetch)

    def _layer_inputs(self, layer_id: int, hash_ids: torch.Tensor, prefetch):
        """``(ids [T, C], table handle or None, kv ahead or None)`` of layer ``layer_id`` for this step's
        ``hash_ids [T, L, C]``: the ids checked against the layer's columns under validation, and what
        ``prefetch`` (this memory's step handle, or None) holds for them."""
        index = self._index(layer_id)
        layer_ids = hash_ids[:, index, :]
        if self.tables[layer_id].validate:
            self._check_columns(index, layer_ids)
        if prefetch is None:
            return layer_ids, None, None
        if not isinstance(prefetch, StepPrefetch) or prefetch.memory is not self:
            raise ValueError(f"prefetch: expected the handle this EngramMemory's prefetch() returned, or None, "
                             f"found {type(prefetch).__name__}")
        return (layer_ids, prefetch.take(layer_id, hash_ids, self.hasher.calls),
                prefetch.take_kv(layer_id, hash_ids, self.hasher.calls))

    def plan(self, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
             token_mask: torch.Tensor | None = None) -> "StepPlan":
        """A :class:`StepPlan` for steps whose arguments have these structures (``hidden_states [T, hc, D]``,
        ``hash_ids [T, L, C]``, ``token_mask [T]`` or None): every layer's checks and choices made now,
        so ``plan.run(layer_id, ...)`` only launches. Single-process layers (no tensor or sequence
        parallelism)."""
        self._check_step_ids(hash_ids)
        return StepPlan(self, {layer_id: self._layers[layer_id].plan(hidden_states, hash_ids[:, index, :], token_mask)
                               for index, layer_id in enumerate(self.spec.layer_ids)})

    def _check_columns(self, index: int, hash_ids: torch.Tensor) -> None:
        """Each column's ids must lie in that column's rows ``[offset, offset + prime)`` of layer
        ``index`` (``hash_ids [T, C]``); an id of another column or layer is named (a host sync)."""
        layer_id = self.spec.layer_ids[index]
        low = torch.as_tensor(self.layout.column_offsets[index], dtype=torch.int64, device=hash_ids.device)
        high = low + torch.as_tensor(self.layout.column_primes[index], dtype=torch.int64, device=hash_ids.device)
        ids = hash_ids.to(torch.int64)
        bad = (ids < low) | (ids >= high)
        if not bool(bad.any()):
            return
        token, column = (int(i) for i in torch.nonzero(bad)[0].tolist())
        found = int(ids[token, column])
        owner = int(torch.searchsorted(low.cpu(), torch.tensor(found), right=True)) - 1
        if 0 <= owner and found < int(high[owner]):
            where = f"it is a row of column {owner}: hash ids of another column, or of another layer's table?"
        else:
            where = f"it is outside the layer's {self.layout.num_embeddings[index]} table rows"
        raise ValueError(f"hash_ids[{token}, {index}, {column}] = {found}: column {column} of layer {layer_id} owns "
                         f"rows [{int(low[column])}, {int(high[column])}); {where}")

    def __repr__(self) -> str:
        shard = "" if self.shard is None else f", rank={self.shard.rank}/{self.shard.world_size}"
        return (f"EngramMemory(layers={list(self.layer_ids)}, placement={self.placement!r}, device={self.device}, "
                f"table_bytes={self.nbytes:,}{shard})")
