"""Read and write Engram tensors in the checkpoint's safetensors layout (docs/design.md §2
"Checkpoint tensors").

Per Engram layer ``i`` (names may carry a common prefix such as ``model.``)::

    layers.{i}.engram.embed.weight   F8_E4M3            [rows, head_dim]
    layers.{i}.engram.embed.scale    F8_E8M0            [rows, head_dim / 32]
    layers.{i}.engram.wkv.weight     F8_E4M3 or BF16    [(hc_mult + 1) * hidden, C * head_dim]
    layers.{i}.engram.wkv.scale      F8_E8M0            [ceil(out / br), ceil(in / bc)]   (FP8 wkv only;
                                                         br, bc = quantization_config.weight_block_size)
    layers.{i}.engram.q_weight       BF16               [hc_mult, hidden]
    layers.{i}.engram.k_weight       BF16               [hc_mult, hidden]

A checkpoint is a directory of ``*.safetensors`` shards, with or without
``model.safetensors.index.json`` (its ``weight_map`` names the file of each tensor).

Tables are ~100 GB each, so :func:`load_engram_table` reads them memory-mapped
(``safe_open(...).get_slice(name)[start:end]``), only the rows of one
tensor-parallel rank, in chunks copied straight into the placement's
preallocated storage (CPU memory, pinned host memory or CUDA memory). The ``cpu``
placement copies nothing: its rows are views of private memory maps of the files
(:mod:`engram.mapped`, served from the page cache), checked in one read-only pass.

Every error is a ``ValueError`` naming the tensor and the file, and the expected
and found dtype or shape. safetensors itself detects corrupt headers and
truncated files when a file is opened; scale byte 255 (NaN in UE8M0, never in a
table) and value bytes 0x7F/0xFF (NaN in E4M3, never in a table) are reported with
their row while streaming (``check_values=False`` skips the value check on trusted
checkpoints).

One place reads the safetensors format by hand: a torch without
``float8_e8m0fnu`` cannot turn an ``F8_E8M0`` tensor into a torch tensor through
safetensors' torch frontend (and its numpy frontend has no FP8 dtypes at all),
so there the tensor's bytes are memory-mapped with numpy at the offsets of the
file's JSON header (:func:`_raw_tensor_bytes`).
"""

from __future__ import annotations

import json
import math
import concurrent.futures
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import mapped
from .common import ceil_div, resolve_cuda_device
from .layout import ColumnShard, EngramLayout
from .spec import EngramSpec
from .table import BLOCK_SIZE, EngramTable, available_placements
from .table.fp8 import E8M0_DTYPE, first_nan_byte, nan_byte_error

__all__ = [
    "INDEX_FILE",
    "TENSOR_KINDS",
    "DEFAULT_CHUNK_BYTES",
    "engram_tensor_name",
    "TensorInfo",
    "SafetensorsCheckpoint",
    "EngramLayerWeights",
    "EngramLayerTensors",
    "expected_layer_tensors",
    "load_engram_layer_weights",
    "layer_weight_problems",
    "check_weight_values",
    "load_engram_table",
    "allocate_table_storage",
    "register_storage_allocator",
    "write_engram_checkpoint",
    "table_progress",
]

INDEX_FILE = "model.safetensors.index.json"
TENSOR_KINDS = ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight")
DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Bytes of E4M3 values read per chunk while streaming a table."""

# safetensors dtype strings -> bytes per element (for sizes in `engram info`).
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_TABLE_VALUE_DTYPES = ("F8_E4M3",)
_TABLE_SCALE_DTYPES = ("F8_E8M0", "U8")   # U8: the same UE8M0 bytes, as some converters store them
_WKV_DTYPES = ("F8_E4M3", "BF16")
_WKV_SCALE_DTYPES = ("F8_E8M0", "U8", "F32")
_GATE_DTYPES = ("BF16",)


def engram_tensor_name(layer_id: int, kind: str, prefix: str = "") -> str:
    """``{prefix}layers.{layer_id}.engram.{kind}``, ``kind`` one of :data:`TENSOR_KINDS`."""
    if kind not in TENSOR_KINDS:
        raise ValueError(f"kind: expected one of {TENSOR_KINDS}, found {kind!r}")
    return f"{prefix}layers.{layer_id}.engram.{kind}"


# ---------------------------------------------------------------------------
# the files of a checkpoint
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its file's header describes it: safetensors dtype string and shape."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BYTES.get(self.dtype, 1)

    def where(self) -> str:
        """``tensor 'name' in file 'path'``: the prefix of every error about this tensor."""
        return f"tensor {self.name!r} in file {str(self.file)!r}"


def _open(path: Path, purpose: str):
    """``safe_open`` of one file; a damaged file becomes a ValueError naming ``purpose`` and the file."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{purpose}: file {str(path)!r} is not a readable safetensors file, it may be truncated "
                         f"or corrupt ({error})") from None


class SafetensorsCheckpoint:
    """The safetensors shards of a model directory and which file holds which tensor.

    With ``model.safetensors.index.json`` its ``weight_map`` is the truth (files
    are opened only when a tensor of theirs is read); without it every
    ``*.safetensors`` file's header is read once. A file that cannot be opened
    is an error only when a tensor is looked for in it (or, without an index,
    when a tensor is found in no other file).

    Attributes:
        directory: the model directory.
        index_file: the index path, or None.
        weight_map: tensor name -> file path.
        prefix: what precedes ``layers.{i}.engram.`` in this checkpoint's names
            (``""`` or e.g. ``"model."``), detected from the names.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} does not exist")
        self.index_file: Path | None = self.directory / INDEX_FILE
        self._unreadable: dict[Path, str] = {}
        if self.index_file.is_file():
            self.weight_map = self._read_index(self.index_file)
        else:
            self.index_file = None
            self.weight_map = self._scan_files()
        self.prefix = self._detect_prefix()

    # ---- discovery -----------------------------------------------------------
    def _read_index(self, index_file: Path) -> dict[str, Path]:
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"index file {str(index_file)!r} is not valid JSON: {error}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"index file {str(index_file)!r}: expected an object with a 'weight_map' of "
                             f"tensor name -> file name, found {type(weight_map).__name__}")
        return {name: self.directory / file for name, file in weight_map.items()}

    def _scan_files(self) -> dict[str, Path]:
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint directory {str(self.directory)!r} holds no *.safetensors file "
                             f"and no {INDEX_FILE}")
        weight_map: dict[str, Path] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    names = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as error:
                self._unreadable[path] = str(error)
                continue
            for name in names:
                if name in weight_map:
                    raise ValueError(f"tensor {name!r} is in two files: {str(weight_map[name])!r} and {str(path)!r}")
                weight_map[name] = path
        return weight_map

    def _detect_prefix(self) -> str:
        prefixes = {name[: name.index("layers.")] for name in self.weight_map
                    if ".engram." in name and "layers." in name}
        if len(prefixes) > 1:
            raise ValueError(f"checkpoint {str(self.directory)!r}: Engram tensors with different name prefixes "
                             f"{sorted(prefixes)}; expected one")
        return prefixes.pop() if prefixes else ""

    # ---- queries -------------------------------------------------------------
    @property
    def unreadable_files(self) -> dict[Path, str]:
        """Files found without an index whose header could not be read -> the reader's error."""
        return dict(self._unreadable)

    @property
    def files(self) -> list[Path]:
        """The shard files, sorted (those of the index, or every ``*.safetensors``)."""
        return sorted(set(self.weight_map.values()) | set(self._unreadable))

    def name(self, layer_id: int, kind: str) -> str:
        """The full name of one Engram tensor in this checkpoint (with :attr:`prefix`)."""
        return engram_tensor_name(layer_id, kind, self.prefix)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        """The file holding ``name``; ValueError naming the tensor and where it was looked for."""
        path = self.weight_map.get(name)
        if path is not None:
            return path
        if self.index_file is not None:
            raise ValueError(f"tensor {name!r} is missing: the index file {str(self.index_file)!r} has no entry for it")
        if self._unreadable:
            path, error = next(iter(self._unreadable.items()))
            raise ValueError(f"tensor {name!r} is missing from the readable files; file {str(path)!r} is not a "
                             f"readable safetensors file, it may be truncated or corrupt ({error})")
        listed = ", ".join(repr(p.name) for p in self.files)
        raise ValueError(f"tensor {name!r} is missing: no file of {str(self.directory)!r} holds it (files: {listed})")

    def info(self, name: str) -> TensorInfo:
        """dtype string and shape of ``name`` from its file's header."""
        path = self.file_of(name)
        if not path.is_file():
            raise ValueError(f"tensor {name!r}: its file {str(path)!r} (named by {str(self.index_file)!r}) does not exist")
        with _open(path, f"tensor {name!r}") as handle:
            if name not in handle.keys():
                raise ValueError(f"tensor {name!r} is missing from file {str(path)!r}, where the index file "
                                 f"{str(self.index_file)!r} places it")
            tensor_slice = handle.get_slice(name)
            return TensorInfo(name, path, tensor_slice.get_dtype(), tuple(int(s) for s in tensor_slice.get_shape()))

    def engram_tensors(self) -> list[TensorInfo]:
        """Every tensor named ``*layers.{i}.engram.*``, in name order (header reads only)."""
        return [self.info(name) for name in sorted(self.weight_map) if ".engram." in name]

    # ---- reads ---------------------------------------------------------------
    def check(self, name: str, dtypes: Iterable[str], shape: Iterable[int] | None, why: str = "") -> TensorInfo:
        """The tensor's info after checking its dtype and shape against what is expected."""
        info = self.info(name)
        dtypes = tuple(dtypes)
        if info.dtype not in dtypes:
            raise ValueError(f"{info.where()}: expected dtype {' or '.join(dtypes)}, found {info.dtype}")
        if shape is not None and list(info.shape) != list(shape):
            raise ValueError(f"{info.where()}: expected shape {list(shape)}{f' ({why})' if why else ''}, "
                             f"found {list(info.shape)}")
        return info

    def read_tensor(self, info: TensorInfo) -> torch.Tensor:
        """The whole tensor (for the small ones: wkv, q/k weights) as a CPU tensor; UE8M0 tensors
        come as ``float8_e8m0fnu``, or as ``uint8`` bytes on a torch without that dtype."""
        if info.dtype == "F8_E8M0" and E8M0_DTYPE is None:
            return torch.from_numpy(np.array(_raw_tensor_bytes(info))).reshape(info.shape)
        with _open(info.file, f"tensor {info.name!r}") as handle:
            try:
                return handle.get_tensor(info.name)
            except (SafetensorError, RuntimeError) as error:
                raise ValueError(f"{info.where()}: could not be read ({error})") from None

    def read_rows_into(self, info: TensorInfo, out: torch.Tensor, row_start: int, *,
                       chunk_rows: int, progress: "ByteProgress | None" = None, check_ue8m0: bool = False,
                       check_e4m3: bool = False) -> None:
        """Copy rows ``[row_start, row_start + len(out))`` of a 2-D one-byte tensor into ``out``.

        Args:
            info: the tensor (``F8_E4M3``, ``F8_E8M0`` or ``U8``; its shape already checked).
            out: ``uint8 [rows, width]``, preallocated on any device (CPU, pinned, CUDA).
            row_start: first row of the file's tensor to read.
            chunk_rows: rows per memory-mapped slice read.
            progress: gets ``update(bytes)`` after each chunk.
            check_ue8m0: raise on byte 255 (UE8M0 NaN, never in a table), naming the row.
            check_e4m3: raise on bytes 0x7F/0xFF (E4M3 NaN, never in a table), naming the row.

        The checks look at each chunk as it passes (one temporary of the chunk's size), never at
        a second copy of the table.
        """
        num_rows = out.shape[0]
        raw = _raw_tensor_bytes(info).reshape(info.shape) if (info.dtype == "F8_E8M0" and E8M0_DTYPE is None) else None
        with _open(info.file, f"tensor {info.name!r}") as handle:
            tensor_slice = handle.get_slice(info.name) if raw is None else None
            for first in range(0, num_rows, chunk_rows):
                last = min(num_rows, first + chunk_rows)
                if raw is not None:
                    chunk = torch.from_numpy(np.array(raw[row_start + first: row_start + last]))
                else:
                    try:
                        chunk = tensor_slice[row_start + first: row_start + last]
                    except (SafetensorError, RuntimeError) as error:
                        raise ValueError(f"{info.where()}: rows [{row_start + first}, {row_start + last}) could not "
                                         f"be read ({error})") from None
                    chunk = chunk.view(torch.uint8)
                for enabled, kind in ((check_ue8m0, "ue8m0"), (check_e4m3, "e4m3")):
                    flat = first_nan_byte(chunk, kind) if enabled else None
                    if flat is not None:
                        row, column = divmod(flat, chunk.shape[1])
                        raise nan_byte_error(info.where(), row_start + first + row, column, int(chunk[row, column]),
                                             kind)
                out[first:last].copy_(chunk)
                if progress is not None:
                    progress.update(chunk.numel())

    def __repr__(self) -> str:
        return (f"SafetensorsCheckpoint({str(self.directory)!r}, files={len(self.files)}, "
                f"index={self.index_file is not None}, prefix={self.prefix!r})")


def _raw_tensor_bytes(info: TensorInfo) -> np.ndarray:
    """Read-only ``uint8`` memory map of one tensor's bytes, at the offsets of the file's
    header (8-byte little-endian length, then JSON). Used only where torch lacks the dtype."""
    try:
        with open(info.file, "rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_length))
        begin, end = header[info.name]["data_offsets"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{info.where()}: could not read its offsets from the header ({error})") from None
    if end - begin != info.nbytes:
        raise ValueError(f"{info.where()}: header gives {end - begin} bytes, expected {info.nbytes} for shape "
                         f"{list(info.shape)}")
    return np.memmap(info.file, dtype=np.uint8, mode="r", offset=8 + header_length + begin, shape=(end - begin,))


# ---------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------
class ByteProgress(Protocol):
    def update(self, n: int) -> Any: ...


def table_progress(total_bytes: int, description: str, enabled: bool = True):
    """A tqdm bar in bytes (scaled units, rate), disabled when ``enabled`` is False.
    Writes to stderr; works when it is not a terminal (plain lines, no cursor tricks)."""
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, dynamic_ncols=True, mininterval=0.5, leave=True)


# ---------------------------------------------------------------------------
# what a layer's tensors must look like
# ---------------------------------------------------------------------------
def expected_layer_tensors(spec: EngramSpec, layout: EngramLayout, layer_index: int
                           ) -> dict[str, tuple[tuple[str, ...], list[int], str]]:
    """Per tensor kind: (accepted dtypes, shape, where the shape comes from), from the config.

    ``wkv.scale`` appears only when the config has ``quantization_config.weight_block_size``
    (it is required exactly when ``wkv.weight`` is FP8).
    """
    rows, head_dim = layout.num_embeddings[layer_index], spec.head_dim
    in_features = spec.num_columns * head_dim
    expected = {
        "embed.weight": (_TABLE_VALUE_DTYPES, [rows, head_dim],
                         f"engram_num_embeddings[{layer_index}], engram_head_dim"),
        "embed.scale": (_TABLE_SCALE_DTYPES, [rows, head_dim // BLOCK_SIZE],
                        f"engram_num_embeddings[{layer_index}], engram_head_dim / {BLOCK_SIZE}"),
        "wkv.weight": (_WKV_DTYPES, [spec.kv_dim, in_features],
                       "(hc_mult + 1) * hidden_size, C * engram_head_dim"),
        "q_weight": (_GATE_DTYPES, [spec.hc_mult, spec.hidden_size], "hc_mult, hidden_size"),
        "k_weight": (_GATE_DTYPES, [spec.hc_mult, spec.hidden_size], "hc_mult, hidden_size"),
    }
    if spec.weight_block_size is not None:
        block_rows, block_cols = spec.weight_block_size
        expected["wkv.scale"] = (_WKV_SCALE_DTYPES, [ceil_div(spec.kv_dim, block_rows), ceil_div(in_features, block_cols)],
                                 f"ceil([{spec.kv_dim}, {in_features}] / weight_block_size {[block_rows, block_cols]})")
    return expected


@dataclass
class EngramLayerWeights:
    """The small tensors of one layer, as read (CPU): ``wkv_weight`` ``float8_e4m3fn`` or
    bf16 ``[(hc+1)*hidden, C*head_dim]``; ``wkv_scale`` UE8M0 (``float8_e8m0fnu``/``uint8``)
    or fp32 ``[ceil(out/br), ceil(in/bc)]`` or None; ``q_weight``, ``k_weight`` bf16 ``[hc, hidden]``."""

    wkv_weight: torch.Tensor
    wkv_scale: torch.Tensor | None
    q_weight: torch.Tensor
    k_weight: torch.Tensor


_CHECK_CHUNK_ELEMENTS = 1 << 22   # values per step of the weights' scan (a few MB of temporaries)


def check_weight_values(tensor: torch.Tensor, info: TensorInfo) -> None:
    """Refuse a non-finite value in one of a layer's small tensors, as read (CPU): E4M3 bytes
    0x7F/0xFF (NaN), UE8M0 byte 255 (NaN), a NaN or infinity in bf16/fp32. The error names the
    tensor, its file and the element's index ``[row, column]``."""
    if (E8M0_DTYPE is not None and tensor.dtype == E8M0_DTYPE) or info.dtype in ("F8_E8M0", "U8"):
        kinds = "ue8m0"
    elif tensor.dtype == torch.float8_e4m3fn:
        kinds = "e4m3"
    else:
        kinds = None
    width = tensor.shape[-1] if tensor.dim() else 1
    flat = tensor.reshape(-1)
    for first in range(0, flat.numel(), _CHECK_CHUNK_ELEMENTS):
        chunk = flat[first:first + _CHECK_CHUNK_ELEMENTS]
        if kinds is not None:
            bad = first_nan_byte(chunk.view(torch.uint8).contiguous(), kinds)
        else:
            found = torch.nonzero(~torch.isfinite(chunk))
            bad = int(found[0]) if len(found) else None
        if bad is None:
            continue
        row, column = divmod(first + bad, width)
        if kinds == "ue8m0":
            what = "scale byte 255 (UE8M0 NaN)"
        elif kinds == "e4m3":
            what = f"value byte {int(chunk.view(torch.uint8)[bad]):#04x} (E4M3 NaN)"
        else:
            what = f"{float(chunk[bad])} ({info.dtype})"
        raise ValueError(f"{info.where()}: element [{row}, {column}] is {what}; expected finite values, the file "
                         f"is corrupt (check_values=False skips this check on trusted checkpoints)")


def _read_weight(checkpoint: SafetensorsCheckpoint, info: TensorInfo, check_values: bool) -> torch.Tensor:
    tensor = checkpoint.read_tensor(info)
    if check_values:
        check_weight_values(tensor, info)
    return tensor


def _wkv_scale_info(checkpoint: SafetensorsCheckpoint, spec: EngramSpec, layout: EngramLayout, layer_index: int,
                    wkv_info: TensorInfo) -> TensorInfo | None:
    """The checked header of ``wkv.scale`` when ``wkv.weight`` (``wkv_info``) is FP8, None for a bf16
    weight; an error for an FP8 weight without scales, or scales beside a bf16 weight."""
    layer_id = spec.layer_ids[layer_index]
    expected = expected_layer_tensors(spec, layout, layer_index)
    scale_name = checkpoint.name(layer_id, "wkv.scale")
    if wkv_info.dtype == "F8_E4M3":
        if "wkv.scale" not in expected:
            raise ValueError(f"{wkv_info.where()} is F8_E4M3, but the config has no "
                             f"quantization_config.weight_block_size for its block scales")
        if scale_name not in checkpoint:
            raise ValueError(f"tensor {scale_name!r} is missing: {wkv_info.where()} is F8_E4M3 and needs its "
                             f"block scales")
        return checkpoint.check(scale_name, *expected["wkv.scale"])
    if scale_name in checkpoint:
        raise ValueError(f"tensor {scale_name!r} in file {str(checkpoint.file_of(scale_name))!r}: found block scales, "
                         f"but {wkv_info.where()} is {wkv_info.dtype}; expected scales only with an F8_E4M3 weight")
    return None


def load_engram_layer_weights(checkpoint: SafetensorsCheckpoint, spec: EngramSpec, layout: EngramLayout,
                              layer_index: int, *, check_values: bool = True) -> EngramLayerWeights:
    """Read and check ``wkv.weight`` (+ ``wkv.scale``), ``q_weight`` and ``k_weight`` of one layer:
    dtype and shape against the config, then (``check_values``) every value finite
    (:func:`check_weight_values`). An FP8 ``wkv`` comes as read: E4M3 weight and UE8M0 scales."""
    layer_id = spec.layer_ids[layer_index]
    expected = expected_layer_tensors(spec, layout, layer_index)

    def read(kind: str) -> torch.Tensor:
        info = checkpoint.check(checkpoint.name(layer_id, kind), *expected[kind])
        return _read_weight(checkpoint, info, check_values)

    wkv_info = checkpoint.check(checkpoint.name(layer_id, "wkv.weight"), *expected["wkv.weight"])
    scale_info = _wkv_scale_info(checkpoint, spec, layout, layer_index, wkv_info)
    wkv_scale = None if scale_info is None else _read_weight(checkpoint, scale_info, check_values)
    return EngramLayerWeights(_read_weight(checkpoint, wkv_info, check_values), wkv_scale, read("q_weight"),
                              read("k_weight"))


def layer_weight_problems(checkpoint: SafetensorsCheckpoint, spec: EngramSpec, layout: EngramLayout,
                          layer_index: int, *, check_values: bool = True) -> list[str]:
    """Every problem :func:`load_engram_layer_weights` would stop at, each tensor checked on its own."""
    layer_id = spec.layer_ids[layer_index]
    expected = expected_layer_tensors(spec, layout, layer_index)
    problems = []

    def attempt(check) -> Any:
        try:
            return check()
        except ValueError as error:
            problems.append(str(error))
            return None

    for kind in ("wkv.weight", "q_weight", "k_weight"):
        info = attempt(lambda: checkpoint.check(checkpoint.name(layer_id, kind), *expected[kind]))
        if info is None:
            continue
        attempt(lambda: _read_weight(checkpoint, info, check_values))
        if kind == "wkv.weight":
            scale_info = attempt(lambda: _wkv_scale_info(checkpoint, spec, layout, layer_index, info))
            if scale_info is not None:
                attempt(lambda: _read_weight(checkpoint, scale_info, check_values))
    return problems


# ---------------------------------------------------------------------------
# tables: allocate in the placement, stream the rank's rows in
# ---------------------------------------------------------------------------
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


def _default_allocator(placement: str) -> StorageAllocator:
    if placement == "cpu":
        return lambda rows, width, device: torch.empty(rows, width, dtype=torch.uint8)
    if placement == "device":
        return lambda rows, width, device: torch.empty(rows, width, dtype=torch.uint8, device=device)
    # Host-memory placements ("host", "cached"): pinned host memory the GPU can read.
    return lambda rows, width, device: torch.empty(rows, width, dtype=torch.uint8,
                                                   pin_memory=torch.cuda.is_available())


def allocate_table_storage(placement: str, num_rows: int, head_dim: int, device: torch.device
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``uint8 [num_rows, head_dim]`` (E4M3 values) and ``[num_rows, head_dim // 32]``
    (UE8M0 scales) where the placement keeps its bytes, so loading writes them there once.

    An allocator registered with :func:`register_storage_allocator` wins; otherwise
    ``"cpu"`` allocates CPU memory, ``"device"`` memory on ``device`` (CUDA), and any
    other placement (the host-memory ones) pinned host memory.
    """
    allocate = _STORAGE_ALLOCATORS.get(placement)
    if allocate is None and placement == "host":
        # Packed rows (engram.table.host_rows): values and scales are views of one buffer,
        # which the host placement pins in place (no second copy).
        from .table.host_rows import PackedRows, packed_row_bytes

        buffer = torch.empty((num_rows + 1) * packed_row_bytes(head_dim), dtype=torch.uint8)
        rows = PackedRows.view_of(buffer, num_rows, head_dim)
        return rows.values, rows.scales
    allocate = allocate or _default_allocator(placement)
    return allocate(num_rows, head_dim, device), allocate(num_rows, head_dim // BLOCK_SIZE, device)


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
    tensor-parallel rank, read memory-mapped in chunks of about ``chunk_bytes`` into
    storage allocated by :func:`allocate_table_storage`.

    ``progress``: True for a bar of its own, or an object with ``update(bytes)``
    (one bar shared by several tables), or None/False.

    ``check_values``: refuse E4M3 NaN value bytes (0x7F, 0xFF) while streaming, naming the
    tensor, row and file (about one extra pass over each chunk while it is in cache); False
    skips it for trusted checkpoints. Scale byte 255 (UE8M0 NaN) is always refused.

    ``backend``: the table's lookup backend (:class:`EngramTable`).

    ``share_host_table`` (placement ``"host"``): keep the rows in one shared-memory file per
    node (``/dev/shm``), filled by the first process that loads them and mapped by every
    other process of the node that loads the same rows of the same files (one copy per
    node; :mod:`engram.table.host_memory`; mapped read-only, only files of this user). The
    file outlives the processes: ``engram shm list|remove`` lists and removes them
    (:func:`engram.table.host_memory.remove_shared_buffer` with :func:`host_share_key`).
    Placement ``"cached"`` loads its host rows the same way.

    ``placement_options``: keyword arguments of the placement (``EngramTable(placement_options=)``).
    """
    spec = layout.spec
    if placement not in available_placements():
        raise ValueError(f"placement: expected one of {list(available_placements())}, found {placement!r}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected a positive integer, found {chunk_bytes!r}")
    if not isinstance(check_values, bool):
        raise ValueError(f"check_values: expected True or False, found {check_values!r}")
    layer_id = spec.layer_ids[layer_index]
    expected = expected_layer_tensors(spec, layout, layer_index)
    values_info = checkpoint.check(checkpoint.name(layer_id, "embed.weight"), *expected["embed.weight"])
    scales_info = checkpoint.check(checkpoint.name(layer_id, "embed.scale"), *expected["embed.scale"])
    row_start, row_end = (0, layout.num_embeddings[layer_index]) if shard is None else shard.row_ranges[layer_index]
    num_rows, head_dim = row_end - row_start, spec.head_dim

    if placement == "cpu" and "cpu" not in _STORAGE_ALLOCATORS:
        source_files = mapped.MappedFiles([values_info.file, scales_info.file])  # as they are when mapped
        value_bytes, scale_bytes = _map_cpu_table(values_info, scales_info, row_start, row_end, chunk_bytes,
                                                  progress, check_values, f"layer {layer_id} table",
                                                  num_rows * spec.row_bytes)
        table = EngramTable.from_layout(layout, layer_index, shard, value_bytes, scale_bytes, placement=placement,
                                        device=None, validate=validate, backend=backend,
                                        placement_options=placement_options)
        table.storage.source_files = source_files
        return table
    storage_device = (torch.device("cpu") if placement == "cpu"
                      else resolve_cuda_device(device, f"placement {placement!r}"))
    if placement in ("host", "cached") and placement not in _STORAGE_ALLOCATORS:
        return _load_host_table(checkpoint, layout, layer_index, shard, values_info, scales_info, storage_device,
                                validate, progress, chunk_bytes, check_values, backend, share_host_table,
                                placement, placement_options)
    value_bytes, scale_bytes = allocate_table_storage(placement, num_rows, head_dim, storage_device)
    own_bar = progress is True
    bar = table_progress(num_rows * spec.row_bytes, f"layer {layer_id} table") if own_bar else (progress or None)
    try:
        chunk_rows = max(1, chunk_bytes // head_dim)
        checkpoint.read_rows_into(values_info, value_bytes, row_start, chunk_rows=chunk_rows, progress=bar,
                                  check_e4m3=check_values)
        checkpoint.read_rows_into(scales_info, scale_bytes, row_start, chunk_rows=chunk_rows, progress=bar,
                                  check_ue8m0=True)
    finally:
        if own_bar:
            bar.close()
    return EngramTable.from_layout(layout, layer_index, shard, value_bytes, scale_bytes, placement=placement,
                                   device=None if placement == "cpu" else storage_device, validate=validate,
                                   backend=backend, placement_options=placement_options)


def host_share_key(values_info: TensorInfo, scales_info: TensorInfo, row_start: int, row_end: int,
                   head_dim: int) -> str:
    """What names a host table's shared bytes: the files (path, size, mtime), tensors, row
    range and packed row format."""
    from .table.host_rows import packed_row_bytes

    parts = []
    for info in (values_info, scales_info):
        stat = os.stat(info.file)
        parts.append(f"{os.path.realpath(info.file)}:{stat.st_size}:{stat.st_mtime_ns}:{info.name}")
    return f"{'|'.join(parts)}|rows {row_start}-{row_end}|packed {packed_row_bytes(head_dim)}"


def _load_host_table(checkpoint, layout, layer_index, shard, values_info, scales_info, device, validate, progress,
                     chunk_bytes, check_values, backend, share, placement="host",
                     placement_options=None) -> EngramTable:
    """Placements "host" and "cached": packed rows (engram.table.host_rows) streamed from the memory-mapped
    checkpoint straight into host memory (2 MiB pages where the OS gives them), private or
    shared per node; the placement pins them in place."""
    from .table.host_memory import allocate_host_buffer
    from .table.host_rows import PackedRows, packed_row_bytes

    spec = layout.spec
    row_start, row_end = (0, layout.num_embeddings[layer_index]) if shard is None else shard.row_ranges[layer_index]
    num_rows, head_dim = row_end - row_start, spec.head_dim
    row_bytes = packed_row_bytes(head_dim)
    nbytes = (num_rows + 1) * row_bytes
    own_bar = progress is True
    layer_id = spec.layer_ids[layer_index]

    def fill(buffer: torch.Tensor) -> None:
        rows = PackedRows.view_of(buffer, num_rows, head_dim)
        bar = table_progress(num_rows * spec.row_bytes, f"layer {layer_id} table") if own_bar else (progress or None)
        try:
            for info, target, kind in ((values_info, rows.values, "e4m3"), (scales_info, rows.scales, "ue8m0")):
                _copy_checked_rows(info, target, row_start, row_end, chunk_bytes, bar,
                                   kind if (kind == "ue8m0" or check_values) else None)
        finally:
            if own_bar:
                bar.close()

    key = host_share_key(values_info, scales_info, row_start, row_end, head_dim) if share else None
    host_buffer = allocate_host_buffer(nbytes, fill=fill, share_key=key, read_only=False, row_bytes=row_bytes,
                                       sources=(values_info.file, scales_info.file) if share else ())
    rows = PackedRows(host_buffer.tensor[:nbytes].view(num_rows + 1, row_bytes), head_dim)
    table = EngramTable.from_layout(layout, layer_index, shard, rows.values, rows.scales, placement=placement,
                                    device=device, validate=validate, backend=backend,
                                    placement_options=placement_options)
    table.storage.host_buffer = host_buffer  # keeps the mapping alive with the table
    table.storage.share_key = key
    return table


_LOAD_THREADS = max(1, min(8, os.cpu_count() or 1))


def _copy_checked_rows(info: TensorInfo, target: torch.Tensor, row_start: int, row_end: int, chunk_bytes: int,
                       progress, check: str | None) -> None:
    """``target[:] = file rows [row_start, row_end)`` of ``info`` (a one-byte 2-D tensor), read
    through a memory map (no intermediate copy), each chunk scanned for NaN bytes (``check``:
    ``"e4m3"``, ``"ue8m0"`` or None) while it is in cache, then copied into ``target`` (any
    row stride: the packed host rows)."""
    source = mapped.map_tensor_rows(mapped.tensor_location(info.file, info.name), row_start, row_end)
    width = source.shape[1]
    chunk_rows = max(1, chunk_bytes // width)

    def one_chunk(first: int) -> int:
        chunk = source[first:first + chunk_rows]
        if check is not None:
            flat = first_nan_byte(chunk, check)
            if flat is not None:
                row, column = divmod(flat, width)
                raise nan_byte_error(info.where(), row_start + first + row, column, int(chunk[row, column]), check)
        target[first:first + chunk.shape[0]].copy_(chunk)
        return chunk.numel()

    # Chunks in parallel (the scan is numpy, the copy torch: both release the GIL); results
    # in order, so the first bad row in file order is the one reported.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_LOAD_THREADS) as pool:
        for done in pool.map(one_chunk, range(0, source.shape[0], chunk_rows)):
            if progress is not None:
                progress.update(done)


def _map_cpu_table(values_info: TensorInfo, scales_info: TensorInfo, row_start: int, row_end: int,
                   chunk_bytes: int, progress: "ByteProgress | bool | None", check_values: bool,
                   description: str, total_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cpu`` placement's storage: rows ``[row_start, row_end)`` of the value and scale
    tensors as ``uint8 [rows, D]`` and ``[rows, D // 32]`` views of private memory maps of
    their files (:mod:`engram.mapped`; zero copy, the page cache holds the bytes), after one
    read-only pass that refuses NaN bytes as :meth:`SafetensorsCheckpoint.read_rows_into` does.
    Every accepted format (``F8_E4M3``, ``F8_E8M0``, ``U8``) is the bytes as stored, so no
    format needs a copy."""
    own_bar = progress is True
    bar = table_progress(total_bytes, description) if own_bar else (progress or None)
    try:
        tables = []
        for info, check in ((values_info, "e4m3"), (scales_info, "ue8m0")):
            rows = mapped.map_tensor_rows(mapped.tensor_location(info.file, info.name), row_start, row_end)
            mapped.check_table_rows(rows, info.where(), row_start, chunk_bytes=chunk_bytes, progress=bar,
                                    check_ue8m0=check == "ue8m0", check_e4m3=check == "e4m3" and check_values)
            tables.append(rows)
    finally:
        if own_bar:
            bar.close()
    return tables[0], tables[1]


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------
@dataclass
class EngramLayerTensors:
    """All checkpoint tensors of one layer, to write.

    ``embed_weight`` ``float8_e4m3fn [rows, head_dim]``; ``embed_scale`` UE8M0 ``uint8`` or
    ``float8_e8m0fnu`` ``[rows, head_dim / 32]``; ``wkv_weight`` ``float8_e4m3fn`` (with
    ``wkv_scale`` UE8M0 ``[ceil(out/br), ceil(in/bc)]``) or bf16 (``wkv_scale`` None);
    ``q_weight``, ``k_weight`` bf16 ``[hc, hidden]``.
    """

    embed_weight: torch.Tensor
    embed_scale: torch.Tensor
    wkv_weight: torch.Tensor
    wkv_scale: torch.Tensor | None
    q_weight: torch.Tensor
    k_weight: torch.Tensor

    def named(self, layer_id: int, prefix: str = "") -> dict[str, torch.Tensor]:
        """Checkpoint name -> tensor as stored (UE8M0 bytes as ``float8_e8m0fnu`` where torch has it)."""
        tensors = {"embed.weight": self.embed_weight, "embed.scale": _as_ue8m0(self.embed_scale),
                   "wkv.weight": self.wkv_weight, "q_weight": self.q_weight, "k_weight": self.k_weight}
        if self.wkv_scale is not None:
            tensors["wkv.scale"] = _as_ue8m0(self.wkv_scale)
        return {engram_tensor_name(layer_id, kind, prefix): tensor.contiguous().cpu() for kind, tensor in tensors.items()}


def _as_ue8m0(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.uint8 and E8M0_DTYPE is not None:
        return tensor.view(E8M0_DTYPE)
    return tensor


def _split_by_bytes(named: Mapping[str, torch.Tensor], num_shards: int) -> list[dict[str, torch.Tensor]]:
    """``num_shards`` groups of about equal bytes: largest tensor first, each into the lightest
    group so far (ties: the first group); every group gets a tensor when there are enough."""
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in named.items()}
    totals = [0] * num_shards
    owner: dict[str, int] = {}
    for name in sorted(named, key=lambda n: -sizes[n]):
        lightest = min(range(num_shards), key=lambda k: (totals[k], k))
        owner[name] = lightest
        totals[lightest] += sizes[name]
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name, tensor in named.items():  # each file keeps the tensors in their given order
        groups[owner[name]][name] = tensor
    return groups


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_engram_checkpoint(
    directory: str | os.PathLike,
    layers: Mapping[int, EngramLayerTensors],
    *,
    num_shards: int = 1,
    with_index: bool = True,
    prefix: str = "",
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, str]:
    """Write the layers' tensors as safetensors shards; returns the weight map (name -> file name).

    Tensors are split by bytes into ``num_shards`` files ``model-0000k-of-0000n.safetensors``
    (``model.safetensors`` for one shard without index): largest first, each into the
    file holding the fewest bytes so far (so the tables land in different files, and
    one layer's tensors spread over several). With ``with_index`` also
    ``model.safetensors.index.json``. Files get the permissions of the process umask,
    as any file the process creates. Meant for tests, demos and converted tables of
    moderate size (each file is built in memory).
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards: expected a positive integer, found {num_shards!r}")
    named: dict[str, torch.Tensor] = {}
    for layer_id, tensors in layers.items():
        named.update(tensors.named(layer_id, prefix))
    for name, tensor in (extra_tensors or {}).items():
        if name in named:
            raise ValueError(f"extra_tensors: {name!r} clashes with an Engram tensor name")
        named[name] = tensor.contiguous().cpu()
    if num_shards > len(named):
        raise ValueError(f"num_shards: expected at most {len(named)} (one tensor per file at least), found {num_shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if num_shards == 1 and not with_index:
        file_names = ["model.safetensors"]
    else:
        file_names = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    groups = _split_by_bytes(named, num_shards)
    mode = 0o666 & ~_current_umask()
    weight_map: dict[str, str] = {}
    for file_name, group in zip(file_names, groups):
        temporary = directory / (file_name + ".tmp")
        try:
            save_file(group, str(temporary), metadata={"format": "pt"})
            os.chmod(temporary, mode)  # safetensors creates its files 0600
            os.replace(temporary, directory / file_name)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        weight_map.update({name: file_name for name in group})
    if with_index:
        total = sum(t.numel() * t.element_size() for t in named.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return weight_map
