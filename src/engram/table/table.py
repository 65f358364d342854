"""EngramTable: one Engram layer's FP8 table, or one tensor-parallel rank's shard of it.

A table holds the rows ``[row_start, row_start + num_rows)`` of a layer's table
(docs/design.md §2) and serves the hash columns ``[column_start, column_end)``; under
tensor parallelism those are the whole columns a rank owns and the contiguous
row range they span (:meth:`EngramLayout.shard`).

Where the bytes live is a *placement* (docs/design.md §3): a :class:`TablePlacement` owns
the storage and gathers rows by local row id onto the device lookups run on.
The placement ABC and registry are :mod:`engram.table.placement`; each placement lives in its own
module of :mod:`engram.table.placements` and registers itself:
``"cpu"`` (:mod:`engram.table.placements.cpu`), ``"device"`` (:mod:`engram.table.placements.device`),
``"host"`` (:mod:`engram.table.placements.host`), ``"cached"`` (:mod:`engram.table.placements.cached`)
and ``"node"`` (:mod:`engram.table.placements.node`);
:func:`available_placements` lists them.
"""

from __future__ import annotations

import weakref


import torch

from engram.backends import resolve_backend
from engram.call_cache import CallCache, structure
from engram.checks import check_bool, check_hash_ids, check_int, same_device
from engram.common import HASH_ID_DTYPES
from engram.layout import ColumnShard, EngramLayout
from engram.table.fp8 import BLOCK_SIZE, as_scale_bytes, as_value_bytes, check_table_values, dequantize_rows
from engram.table.placement import (TablePlacement, available_placements, make_placement, placement_class,
                                    register_placement)
from engram.table.prefetch import IdsIdentity, PrefetchState, TablePrefetch, capturing, claim

__all__ = [
    "EngramTable",
    "TablePlacement",
    "register_placement",
    "available_placements",
    "make_placement",
    "placement_class",
    "TablePrefetch",
    "PrefetchState",
]

# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------
class EngramTable:
    """One layer's FP8 rows (or one rank's shard of whole hash columns), with lookups.

    Args:
        values: ``float8_e4m3fn [rows, D]`` (``uint8`` bit patterns accepted): table rows
            ``[row_start, row_start + rows)``.
        scales: ``uint8 [rows, D // 32]`` UE8M0 bytes (``float8_e8m0fnu`` accepted).
        column_start, column_end: the hash columns this table serves; ``column_end``
            defaults to ``num_columns_total``, or when that is unknown too, to the
            width of the hash ids of each lookup.
        row_start: global row id of ``values[0]``.
        num_columns_total: hash columns of the layer (``C``); when given, hash ids
            must be ``[T, C]``.
        num_rows_total: rows of the layer's whole table, the bound of validation.
            Default: ``rows`` when the table is a whole layer (``row_start == 0``,
            ``column_start == 0``, ``column_end`` None or ``num_columns_total``);
            otherwise unknown and validation checks only ``id >= 0``.
        placement: ``"cpu"``, ``"device"``, ``"host"``, ``"cached"`` or ``"node"`` (see :func:`available_placements`).
        device: the CUDA device of placement ``"device"`` (default: current).
        validate: check hash ids on every lookup (a host sync); default on for the
            CPU and off for CUDA.
        backend: ``"auto"`` (default), ``"triton"`` or ``"torch"`` (:mod:`engram.backends`),
            resolved once here: placements with a Triton lookup (``"device"``) use the kernel
            for ``"auto"`` on CUDA; the others always run torch and refuse ``"triton"``.
        placement_options: keyword arguments of the placement, e.g. ``{"cache_fraction": 0.02,
            "policy": "set-lru"}`` for ``"cached"`` (:class:`engram.table.placements.cached.CachedPlacement`).
        options: a :class:`~engram.options.ServingOptions`: its backend, validation and placement fields
            for the arguments left at their defaults (``placement_options`` entries win).
        check_values: refuse bytes that decode to NaN or infinity (:func:`engram.table.fp8.check_table_values`) [True].
    """

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        *,
        column_start: int = 0,
        column_end: int | None = None,
        row_start: int = 0,
        num_columns_total: int | None = None,
        num_rows_total: int | None = None,
        placement: str = "cpu",
        device: torch.device | str | int | None = None,
        validate: bool | None = None,
        backend: str = "auto",
        placement_options: dict | None = None,
        options=None,
        check_values: bool = True,
    ):
        if options is not None:  # a ServingOptions: defaults for the arguments left at theirs
            from engram.options import ServingOptions

            if not isinstance(options, ServingOptions):
                raise ValueError(f"options: expected a ServingOptions or None, found {type(options).__name__}")
            backend = options.backend if backend == "auto" else backend
            validate = options.validate if validate is None else validate
            if placement_options is not None and not isinstance(placement_options, dict):
                raise ValueError(f"placement_options: expected a dict of keyword arguments, found {placement_options!r}")
            placement_options = {**options.placement_options(placement), **(placement_options or {})}
        value_bytes = as_value_bytes(values, "values")
        scale_bytes = as_scale_bytes(scales, "scales")
        if value_bytes.dim() != 2:
            raise ValueError(f"values: expected shape [rows, head_dim], found {list(value_bytes.shape)}")
        num_rows, head_dim = value_bytes.shape
        if num_rows < 1:
            raise ValueError(f"values: expected at least one row, found shape {list(value_bytes.shape)}")
        if head_dim == 0 or head_dim % BLOCK_SIZE:
            raise ValueError(f"values: head_dim must be a positive multiple of {BLOCK_SIZE}, found shape {list(value_bytes.shape)}")
        if tuple(scale_bytes.shape) != (num_rows, head_dim // BLOCK_SIZE):
            raise ValueError(
                f"scales: expected shape {[num_rows, head_dim // BLOCK_SIZE]} (one byte per {BLOCK_SIZE} values "
                f"of values {list(value_bytes.shape)}), found {list(scale_bytes.shape)}"
            )
        if value_bytes.device != scale_bytes.device:
            raise ValueError(f"scales: expected the device of values ({value_bytes.device}), found {scale_bytes.device}")

        column_start = check_int("column_start", column_start, 0)
        row_start = check_int("row_start", row_start, 0)
        if num_columns_total is not None:
            num_columns_total = check_int("num_columns_total", num_columns_total, column_start + 1)
        if column_end is not None:
            column_end = check_int("column_end", column_end, column_start + 1)
            if num_columns_total is not None and column_end > num_columns_total:
                raise ValueError(f"column_end: expected at most num_columns_total = {num_columns_total}, found {column_end}")
        elif num_columns_total is not None:
            column_end = num_columns_total
        whole_layer = row_start == 0 and column_start == 0 and (
            column_end is None or column_end == num_columns_total)
        if num_rows_total is not None:
            num_rows_total = check_int("num_rows_total", num_rows_total, row_start + num_rows)
        elif whole_layer:
            num_rows_total = num_rows
        check_bool("validate", validate, optional=True)
        check_bool("check_values", check_values)
        if check_values:  # before the placement copies anything: a NaN or infinite row is refused here
            check_table_values(value_bytes, scale_bytes, values_name="values", scales_name="scales")  # rows of values

        self._storage = make_placement(placement, value_bytes, scale_bytes, device, placement_options)
        self._checked_ids = CallCache(64)  # hash-id structures checked by _local_columns
        self._prefetch_serial = 0          # prefetches made; only the latest may be served
        self._latest_prefetch: TablePrefetch | None = None
        self.prefetches = {"served": 0, "dropped": 0}
        """Prefetches that a lookup served, and those never served (stale, superseded, mismatched ids,
        under graph capture); host-side counts for tests and benchmarks."""
        self._column_start = column_start
        self._column_end = column_end
        self._row_start = row_start
        self._num_columns_total = num_columns_total
        self._num_rows_total = num_rows_total
        self.validate = self._storage.device.type == "cpu" if validate is None else validate
        if self._storage.has_triton_lookup:
            self._storage.backend = resolve_backend(backend, self._storage.device, "EngramTable lookups")
        elif backend == "triton":
            raise ValueError(f"backend: placement {placement!r} has no Triton lookup; expected 'auto' or 'torch'")
        else:
            resolve_backend(backend, torch.device("cpu"), "EngramTable lookups")  # checks the value only

    @property
    def backend(self) -> str:
        """``"triton"`` or ``"torch"``: what the lookups run (decided when the table was built)."""
        return self._storage.backend

    @classmethod
    def from_layout(
        cls,
        layout: EngramLayout,
        layer_index: int,
        shard: ColumnShard | None,
        values: torch.Tensor,
        scales: torch.Tensor,
        placement: str = "cpu",
        device: torch.device | str | int | None = None,
        validate: bool | None = None,
        backend: str = "auto",
        placement_options: dict | None = None,
        check_values: bool = True,
    ) -> "EngramTable":
        """The table of layer ``layout.spec.layer_ids[layer_index]``, whole (``shard`` None)
        or one rank's shard; ``values``/``scales`` hold exactly the rows of that range
        (``shard.row_ranges[layer_index]``), checked against the layout (and their bytes with
        ``check_values``, as :class:`EngramTable` does)."""
        spec = layout.spec
        check_int("layer_index", layer_index, 0, below=layout.num_layers)
        num_columns, head_dim = layout.num_columns, spec.head_dim
        num_rows_total = layout.num_embeddings[layer_index]
        if shard is None:
            column_start, column_end, row_start, row_end = 0, num_columns, 0, num_rows_total
            what = f"layer index {layer_index} (layer {spec.layer_ids[layer_index]})"
        else:
            if not isinstance(shard, ColumnShard):
                raise ValueError(f"shard: expected a ColumnShard or None, found {type(shard).__name__}")
            try:
                expected_shard = layout.shard(shard.rank, shard.world_size)
            except ValueError as error:
                raise ValueError(f"shard: {shard} does not belong to this layout: {error}") from None
            if shard != expected_shard:
                raise ValueError(f"shard: {shard} does not belong to this layout, which gives {expected_shard}")
            column_start, column_end = shard.column_start, shard.column_end
            row_start, row_end = shard.row_ranges[layer_index]
            what = (f"layer index {layer_index} (layer {spec.layer_ids[layer_index]}), rank {shard.rank} of "
                    f"{shard.world_size}, rows [{row_start}, {row_end})")
        num_rows = row_end - row_start
        for name, tensor, expected in (("values", values, (num_rows, head_dim)),
                                       ("scales", scales, (num_rows, head_dim // BLOCK_SIZE))):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, found {type(tensor).__name__}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name}: expected shape {list(expected)} for {what}, found {list(tensor.shape)}")
        return cls(values, scales, column_start=column_start, column_end=column_end, row_start=row_start,
                   num_columns_total=num_columns, num_rows_total=num_rows_total,
                   placement=placement, device=device, validate=validate, backend=backend,
                   placement_options=placement_options, check_values=check_values)

    # ---- properties ----------------------------------------------------------
    @property
    def collective(self) -> bool:
        """Whether every lookup is a collective that every rank of the placement's group must call."""
        return self._storage.collective

    @property
    def storage(self) -> TablePlacement:
        """The placement object that owns the bytes."""
        return self._storage

    @property
    def placement(self) -> str:
        return self._storage.name

    @property
    def device(self) -> torch.device:
        """Device of the hash ids a lookup takes and of the rows it returns."""
        return self._storage.device

    @property
    def num_rows(self) -> int:
        """Rows held by this table (the shard's row range length)."""
        return self._storage.num_rows

    @property
    def head_dim(self) -> int:
        return self._storage.head_dim

    @property
    def nbytes(self) -> int:
        """Bytes of the held rows: ``num_rows * (head_dim + head_dim // 32)``."""
        return self._storage.nbytes

    @property
    def row_start(self) -> int:
        return self._row_start

    @property
    def row_end(self) -> int:
        return self._row_start + self.num_rows

    @property
    def column_start(self) -> int:
        return self._column_start

    @property
    def column_end(self) -> int | None:
        """End of the served columns; None means "the last column of the hash ids"."""
        return self._column_end

    @property
    def num_columns_total(self) -> int | None:
        return self._num_columns_total

    @property
    def num_rows_total(self) -> int | None:
        return self._num_rows_total

    # ---- lookups -------------------------------------------------------------
    def _local_columns(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Check ``hash_ids [T, C]`` (once per structure) and return its columns
        ``[column_start, column_end)`` (``hash_ids`` itself when those are all of them)."""
        key = structure(hash_ids)
        served = self._checked_ids.get(key)
        if served is None:
            served = self._checked_ids.put(key, self._check_hash_ids(hash_ids))
        start, end = served
        return hash_ids if start == 0 and end == hash_ids.shape[1] else hash_ids[:, start:end]

    def close(self) -> None:
        """Release what the placement holds beyond memory Python frees by itself: placement ``"node"`` with
        lookup ``"peer"`` drops its mappings of the other ranks' rows (a collective of its group; lookups
        are refused afterwards). A no-op for the other placements."""
        self._storage.close()

    def refuse_lookup(self) -> None:
        """Collective tables (:attr:`collective`): this rank will not run the lookup its group expects
        now (its caller refused its arguments); the group's other ranks raise instead of waiting.
        A no-op for other tables."""
        if self._storage.collective:
            self._storage.refuse_lookup()

    def _lookup_ids(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """The served columns of ``hash_ids``, checked (ids too with :attr:`validate`). A collective
        placement's rank that refuses its ids still joins the lookup's first collective, to tell the
        others (they raise too, naming it) instead of leaving them waiting."""
        try:
            global_ids = self._local_columns(hash_ids)
            if self.validate:
                self._check_ids(global_ids)
        except ValueError:
            if self._storage.collective:
                self._storage.refuse_lookup()
            raise
        return global_ids

    def _check_hash_ids(self, hash_ids: torch.Tensor) -> tuple[int, int]:
        """Check ``hash_ids [T, C]``; the columns ``(start, end)`` it serves."""
        check_hash_ids(hash_ids, device=self.device, device_note=" (the table's)")
        width = hash_ids.shape[1]
        if self._num_columns_total is not None and width != self._num_columns_total:
            raise ValueError(f"hash_ids: expected {self._num_columns_total} columns (shape [T, {self._num_columns_total}]), "
                             f"found shape {list(hash_ids.shape)}")
        column_end = width if self._column_end is None else self._column_end
        if column_end > width or column_end <= self._column_start:
            raise ValueError(f"hash_ids: this table serves columns [{self._column_start}, {column_end}), "
                             f"found shape {list(hash_ids.shape)}")
        return self._column_start, column_end

    def _check_ids(self, global_ids: torch.Tensor) -> None:
        """Raise for ids < 0 or >= num_rows_total (a host sync)."""
        bound = self._num_rows_total
        bad = global_ids < 0
        if bound is not None:
            bad = bad | (global_ids >= bound)
        if bool(bad.any()):
            token, local_column = (int(i) for i in torch.nonzero(bad)[0].tolist())
            found = int(global_ids[token, local_column])
            bound_text = f"[0, {bound})" if bound is not None else "[0, ...) (num_rows_total unknown)"
            raise ValueError(
                f"hash_ids column {self._column_start + local_column} (token {token}): id {found} is outside "
                f"the layer's table rows {bound_text}"
            )

    def lookup_packed(self, hash_ids: torch.Tensor, prefetch: TablePrefetch | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw FP8 rows for an FP8 consumer.

        ``hash_ids`` int32/int64 ``[T, C]`` (global row ids) ->
        ``(values float8_e4m3fn [T, C_local, D], scales uint8 [T, C_local, D // 32])``,
        ``C_local = column_end - column_start``: row ``hash_ids[t, column_start + j] - row_start``;
        ids outside this table's rows read all-zero bytes (value +0, scale byte 0).
        ``prefetch``: the handle :meth:`prefetch` returned for these ids (see :meth:`lookup`).
        """
        global_ids = self._lookup_ids(hash_ids)  # [T, C_local]
        pending = self._claim(prefetch, hash_ids)
        fused = self._storage.gather_fused(global_ids, self._row_start, packed=True, pending=pending)
        if fused is not None:
            value_bytes, scale_bytes = fused
            return value_bytes.view(torch.float8_e4m3fn), scale_bytes
        return self._gather_packed(global_ids)

    def _gather_packed(self, global_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path of :meth:`lookup_packed` on checked ``global_ids [T, C_local]``."""
        tokens, local_columns = global_ids.shape
        local_ids = global_ids.to(torch.int64).reshape(-1) - self._row_start  # [T * C_local]
        inside = (local_ids >= 0) & (local_ids < self.num_rows)
        safe_ids = torch.where(inside, local_ids, torch.zeros_like(local_ids))
        value_bytes, scale_bytes = self._storage.gather(safe_ids)
        outside = ~inside.unsqueeze(-1)
        value_bytes = value_bytes.masked_fill(outside, 0)
        scale_bytes = scale_bytes.masked_fill(outside, 0)
        head_dim = self.head_dim
        return (value_bytes.view(torch.float8_e4m3fn).reshape(tokens, local_columns, head_dim),
                scale_bytes.reshape(tokens, local_columns, head_dim // BLOCK_SIZE))

    def rows_in_place(self, hash_ids: torch.Tensor):
        """The stored rows for a kernel that reads them by id itself (the fused wkv paths):
        ``(values uint8 [rows, D], scales uint8 [rows, D // 32], ids [T, C_local], row_start)``
        with ``ids`` the served columns of ``hash_ids`` (a view, checked as :meth:`lookup` does),
        or None when the bytes do not live on :attr:`device` (host placements) or this process
        holds only some of the rows (``"node"``): use :meth:`lookup_packed`."""
        global_ids = self._local_columns(hash_ids)
        storage = self._storage
        if not same_device(storage.value_bytes.device, self.device) or storage.value_bytes.shape[0] != self.num_rows:
            return None  # the bytes live elsewhere, or this process holds only some of the rows ("node")
        if self.validate:
            self._check_ids(global_ids)
        return storage.value_bytes, storage.scale_bytes, global_ids, self._row_start

    def prefetch(self, hash_ids: torch.Tensor) -> TablePrefetch:
        """Start reading the rows of ``hash_ids [T, C]`` now (placements that read host memory) and
        return the handle that the lookup of exactly this tensor passes as ``prefetch=``. An earlier
        handle of this table that no lookup consumed is dropped, never served. Under CUDA-graph capture
        only a read the placement captures into the graph starts (placement ``"host"``, large lookups: a
        host gather replayed with the graph, :meth:`TablePlacement.prefetch_captured`); nothing starts where
        the rows live on the device (the handle then serves nothing and the lookup runs as without it)."""
        global_ids = self._local_columns(hash_ids)
        if self._latest_prefetch is not None:
            self._latest_prefetch.drop(PrefetchState.STALE)  # no-op when a lookup took it
        self._prefetch_serial += 1
        captured = capturing()
        start = self._storage.prefetch_captured if captured else self._storage.prefetch
        pending = start(global_ids, self._row_start)
        self._latest_prefetch = TablePrefetch(weakref.ref(self), self._prefetch_serial, IdsIdentity.of(hash_ids),
                                              pending, captured=captured)
        return self._latest_prefetch

    def _claim(self, prefetch: TablePrefetch | None, hash_ids: torch.Tensor):
        """The placement's pending state of ``prefetch`` when the lookup of ``hash_ids`` should try it
        (:func:`engram.table.prefetch.claim`), else None; the handle is closed either way."""
        return claim(prefetch, self, self._prefetch_serial, hash_ids)

    @staticmethod
    def _refuse_under_capture(what: str) -> None:
        if capturing():
            raise RuntimeError(f"{what}: changes the table's cache on the host side, which a CUDA graph being "
                               "captured cannot record; call it between graph replays, outside the capture")

    def update_cache(self, hash_ids: torch.Tensor) -> None:
        """Between engine steps: let a placement with a row cache (``"cached"``) learn from the
        reads of ``hash_ids [T, C]`` (admit missed rows, count hits, age). A no-op for the others.
        Placement ``"cached"`` on CUDA updates in fixed-size launches that a CUDA graph may capture (after
        one eager call of at least this many ids); other placements with a cache refuse it under capture.
        Lookups captured before keep serving the new content."""
        global_ids = self._local_columns(hash_ids)
        if not getattr(self._storage, "captures_updates", False):
            self._refuse_under_capture("update_cache")
        self._storage.update(global_ids, self._row_start)

    def load_hot_rows(self, global_row_ids: torch.Tensor) -> int:
        """Placement ``"cached"``: make the rows ``global_row_ids int [K]`` (hottest first; ids outside
        this table's rows ignored) the cache's content; returns the rows held. Other placements refuse."""
        self._refuse_under_capture("load_hot_rows")
        load_hot = self._storage.load_hot
        if not isinstance(global_row_ids, torch.Tensor) or global_row_ids.dtype not in HASH_ID_DTYPES:
            raise ValueError(f"global_row_ids: expected an int32/int64 tensor, found "
                             f"{getattr(global_row_ids, 'dtype', type(global_row_ids).__name__)}")
        if global_row_ids.dim() != 1:
            raise ValueError(f"global_row_ids: expected a 1-D tensor [K], found shape {list(global_row_ids.shape)}")
        # Rows of other ranks are ignored; a row of no rank (negative, past the layer's rows) is an error.
        bound = self._num_rows_total
        bad = (global_row_ids < 0) if bound is None else (global_row_ids < 0) | (global_row_ids >= bound)
        if bool(bad.any()):
            index = int(torch.nonzero(bad)[0, 0])
            rows = f"[0, {bound})" if bound is not None else "[0, ...)"
            raise ValueError(f"global_row_ids[{index}] = {int(global_row_ids[index])} is outside the layer's table "
                             f"rows {rows}")
        return load_hot(global_row_ids.to(torch.int64) - self._row_start)

    def lookup(self, hash_ids: torch.Tensor, prefetch: TablePrefetch | None = None) -> torch.Tensor:
        """Dequantized rows: ``hash_ids`` int32/int64 ``[T, C]`` -> ``bfloat16 [T, C_local, D]``,
        ``out[t, j] = e4m3 * 2**(b - 127)`` of row ``hash_ids[t, column_start + j]``; +0 outside the table's rows.

        ``prefetch``: the handle :meth:`prefetch` returned for this very tensor; its rows are served only
        when it is still valid (:mod:`engram.table.prefetch`), else the lookup reads them itself. Without
        a handle nothing prefetched is ever used."""
        global_ids = self._lookup_ids(hash_ids)  # [T, C_local]
        pending = self._claim(prefetch, hash_ids)
        fused = self._storage.gather_fused(global_ids, self._row_start, packed=False, pending=pending)
        if fused is not None:
            return fused
        values, scales = self._gather_packed(global_ids)
        return dequantize_rows(values, scales, torch.bfloat16)

    __call__ = lookup

    def prepare_lookup(self, hash_ids: torch.Tensor, *, flat: bool = False):
        """``prepared(hash_ids) -> rows`` equal to :meth:`lookup` (``flat``: ``[T, C_local * D]``)
        for every call whose ``hash_ids`` have this one's structure, checked and planned once; None
        where there is no such path (validation on: ids are checked per call; placements whose
        lookups need more than one launch). The prepared call reads the storage of now: prepare
        again after the table's storage changes."""
        start, end = self._check_hash_ids(hash_ids)
        if self.validate:
            return None
        return self._storage.prepare_gather(hash_ids, self._row_start, start, end, flat)

    def __repr__(self) -> str:
        return (f"EngramTable(rows=[{self.row_start}, {self.row_end}), head_dim={self.head_dim}, "
                f"columns=[{self.column_start}, {self.column_end}), placement={self.placement!r}, "
                f"device={self.device}, validate={self.validate})")
