"""Load one layer's table from a checkpoint into its placement.

The loader names no placement: it describes the rank's rows as a :class:`TableSource` and asks
the placement class to fill its storage from it (``TablePlacement.load_storage``). The default
allocates storage (``TablePlacement.allocate_storage``: CPU, CUDA or pinned memory) and streams
the rows in, each byte written once; placement ``"cpu"`` maps the files instead (zero copy), the
host placements fill packed rows in private or node-shared host memory. A registered storage
allocator (:func:`register_storage_allocator`) overrides where the default puts the bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engram import mapped
from engram.layout import ColumnShard, EngramLayout
from engram.table import BLOCK_SIZE, EngramTable, available_placements
from engram.checks import check_bool, check_positive_int
from engram.table.placement import check_host_table_shared
from engram.table.table import placement_class
from engram.checkpoint.reading import (DEFAULT_CHUNK_BYTES, ByteProgress, SafetensorsCheckpoint, TensorInfo, copy_checked_rows,
                      expected_layer_tensors, map_table_rows, table_progress)

__all__ = ["TableSource", "LoadedStorage", "load_engram_table", "allocate_table_storage",
           "register_storage_allocator", "host_share_key"]

StorageAllocator = Callable[[int, int, torch.device], torch.Tensor]
_STORAGE_ALLOCATORS: dict[str, StorageAllocator] = {}


def register_storage_allocator(placement: str, allocate: StorageAllocator) -> None:
    """Tell the loader where placement ``placement`` keeps its bytes:
    ``allocate(num_rows, width, device) -> uint8 [num_rows, width]`` (e.g. pinned or
    huge-page host memory for a host placement). Loading then writes each byte once, there."""
    if not isinstance(placement, str) or not placement or not callable(allocate):
        raise ValueError(f"register_storage_allocator: expected a placement name and a callable, "
                         f"found {placement!r}, {allocate!r}")
    _STORAGE_ALLOCATORS[placement] = allocate


def allocate_table_storage(placement: str, num_rows: int, head_dim: int, device: torch.device | None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``uint8 [num_rows, head_dim]`` (E4M3 values) and ``[num_rows, head_dim // 32]``
    (UE8M0 scales) where the placement keeps its bytes: a registered allocator, else the
    placement class's ``allocate_storage``."""
    allocate = _STORAGE_ALLOCATORS.get(placement)
    if allocate is not None:
        return allocate(num_rows, head_dim, device), allocate(num_rows, head_dim // BLOCK_SIZE, device)
    return placement_class(placement).allocate_storage(num_rows, head_dim, device)


def host_share_key(values_info: TensorInfo, scales_info: TensorInfo, row_start: int, row_end: int,
                   head_dim: int) -> str:
    """What names a table's node-shared bytes: the files (path, size, mtime), tensors, row
    range and packed row format."""
    from engram.table.host_memory.rows import packed_row_bytes

    parts = []
    for info in (values_info, scales_info):
        stat = os.stat(info.file)
        parts.append(f"{os.path.realpath(info.file)}:{stat.st_size}:{stat.st_mtime_ns}:{info.name}")
    return f"{'|'.join(parts)}|rows {row_start}-{row_end}|packed {packed_row_bytes(head_dim)}"


@dataclass
class LoadedStorage:
    """What a placement's ``load_storage`` made: the storage ``values uint8 [rows, D]`` and ``scales
    uint8 [rows, D // 32]``, and attributes the placement keeps once built (``keep``: the mapping
    that holds the bytes, the files they are mapped from, ...)."""

    values: torch.Tensor
    scales: torch.Tensor
    keep: dict = field(default_factory=dict)


@dataclass
class TableSource:
    """The rows ``[row_start, row_end)`` of one layer's table in a checkpoint, and how to read them.

    ``values_info`` / ``scales_info``: the ``embed.weight`` / ``embed.scale`` tensors; ``chunk_bytes``,
    ``progress`` (None or an object with ``update(bytes)``) and ``check_values`` as
    :func:`load_engram_table` takes them; ``share``: keep the bytes once per node where the
    placement can (host memory)."""

    checkpoint: SafetensorsCheckpoint
    values_info: TensorInfo
    scales_info: TensorInfo
    row_start: int
    row_end: int
    head_dim: int
    description: str
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    progress: ByteProgress | None = None
    check_values: bool = True
    share: bool = False
    placement_options: dict | None = None
    """The table's ``placement_options`` (placement ``"node"`` reads its group from them)."""

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def nbytes(self) -> int:
        """Bytes of the rows: values and scales."""
        return self.num_rows * (self.head_dim + self.head_dim // BLOCK_SIZE)

    @property
    def files(self) -> tuple[str, str]:
        return self.values_info.file, self.scales_info.file

    def read_into(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        """``values[:]`` / ``scales[:]`` = the rows (any row stride, any device), each chunk checked for
        NaN bytes (E4M3 values unless ``check_values`` is False; UE8M0 scales always) and the scales
        for a byte that makes a finite value of its block infinite (always)."""
        for info, target, kind in ((self.values_info, values, "e4m3"), (self.scales_info, scales, "ue8m0")):
            check = kind if (kind == "ue8m0" or self.check_values) else None
            overflow = self.values_info if kind == "ue8m0" else None
            if target.device.type == "cpu" and not target.is_contiguous():  # packed host rows: through a map
                copy_checked_rows(info, target, self.row_start, self.row_end, self.chunk_bytes, self.progress, check,
                                  overflow_values=overflow)
            else:  # chunks read by the checkpoint's reader (staged on the host for device memory)
                self.checkpoint.read_rows_into(info, target, self.row_start,
                                               chunk_rows=max(1, self.chunk_bytes // target.shape[1]),
                                               progress=self.progress, check_e4m3=check == "e4m3",
                                               check_ue8m0=check == "ue8m0", overflow_values=overflow)

    def map_read_only(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(values, scales, files)``: the rows as views of private memory maps of the files (no copy),
        checked in one pass, and the :class:`engram.mapped.MappedFiles` whose changes a reader detects."""
        files = mapped.MappedFiles(list(self.files))
        values, scales = map_table_rows(self.values_info, self.scales_info, self.row_start, self.row_end,
                                        self.chunk_bytes, self.progress, self.check_values, self.description,
                                        self.nbytes)
        return values, scales, files

    def share_key(self) -> str:
        return host_share_key(self.values_info, self.scales_info, self.row_start, self.row_end, self.head_dim)


def load_engram_table(
    checkpoint: SafetensorsCheckpoint,
    layout: EngramLayout,
    layer_index: int,
    shard: ColumnShard | None = None,
    *,
    placement: str = "cpu",
    device: torch.device | str | int | None = None,
    validate: bool | None = None,
    progress: ByteProgress | bool | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    check_values: bool = True,
    backend: str = "auto",
    share_host_table: bool = False,
    placement_options: dict | None = None,
) -> EngramTable:
    """The :class:`EngramTable` of layer ``layout.spec.layer_ids[layer_index]``: the whole
    table (``shard`` None) or the rows ``shard.row_ranges[layer_index]`` of one
    tensor-parallel rank, filled by the placement from the memory-mapped checkpoint
    (module docstring), read in chunks of about ``chunk_bytes``.

    ``progress``: True for a bar of its own, or an object with ``update(bytes)``
    (one bar shared by several tables), or None/False.

    ``check_values``: refuse E4M3 NaN value bytes (0x7F, 0xFF) while streaming, naming the
    tensor, row and file (about one extra pass over each chunk while it is in cache); False
    skips it for trusted checkpoints. Scale byte 255 (UE8M0 NaN) and a scale byte that makes a finite
    value of its block infinite are always refused. The table built is not scanned again.

    ``backend``: the table's lookup backend (:class:`EngramTable`).

    ``share_host_table`` (placements ``"host"`` and ``"cached"``): keep the rows in one shared-memory
    file per node (``/dev/shm``), filled by the first process that loads them and mapped by every
    other process of the node that loads the same rows of the same files (one copy per node;
    :mod:`engram.table.host_memory.buffers`; mapped read-only, only files of this user). The file outlives
    the processes: ``engram shm list|remove`` lists and removes them.

    ``placement_options``: keyword arguments of the placement (``EngramTable(placement_options=)``).
    """
    spec = layout.spec
    if placement not in available_placements():
        raise ValueError(f"placement: expected one of {list(available_placements())}, found {placement!r}")
    check_positive_int("chunk_bytes", chunk_bytes)
    check_bool("check_values", check_values)
    if share_host_table:
        check_host_table_shared("share_host_table", placement)
    cls = placement_class(placement)
    storage_device = cls.storage_device(device)
    layer_id = spec.layer_ids[layer_index]
    expected = expected_layer_tensors(spec, layout, layer_index)
    values_info = checkpoint.check(checkpoint.name(layer_id, "embed.weight"), *expected["embed.weight"])
    scales_info = checkpoint.check(checkpoint.name(layer_id, "embed.scale"), *expected["embed.scale"])
    row_start, row_end = (0, layout.num_embeddings[layer_index]) if shard is None else shard.row_ranges[layer_index]
    description = f"layer {layer_id} table"
    own_bar = progress is True
    source = TableSource(checkpoint, values_info, scales_info, row_start, row_end, spec.head_dim, description,
                         chunk_bytes, None, check_values, bool(share_host_table), placement_options)
    bar = table_progress(source.nbytes, description) if own_bar else (progress or None)
    source.progress = bar
    try:
        if placement in _STORAGE_ALLOCATORS:  # the caller says where the bytes go: the default fill
            values, scales = allocate_table_storage(placement, source.num_rows, source.head_dim, storage_device)
            source.read_into(values, scales)
            loaded = LoadedStorage(values, scales)
        else:
            loaded = LoadedStorage(*cls.load_storage(source, storage_device))
    finally:
        if own_bar:
            bar.close()
    # The bytes were checked while they streamed in (or the caller trusts them): not scanned again.
    table = EngramTable.from_layout(layout, layer_index, shard, loaded.values, loaded.scales, placement=placement,
                                    device=storage_device, validate=validate, backend=backend,
                                    placement_options=placement_options, check_values=False)
    table.storage.adopt(loaded.keep)
    return table
