"""Read Engram tensors in the checkpoint's safetensors layout (docs/design.md §2
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
table), a scale byte under which a finite value of its block decodes to infinity, and
value bytes 0x7F/0xFF (NaN in E4M3, never in a table) are reported with their row while
streaming (``check_values=False`` skips the value bytes' NaN scan on trusted checkpoints;
the scales are always checked).

One place reads the safetensors format by hand: a torch without
``float8_e8m0fnu`` cannot turn an ``F8_E8M0`` tensor into a torch tensor through
safetensors' torch frontend (and its numpy frontend has no FP8 dtypes at all),
so there the tensor's bytes are memory-mapped with numpy at the offsets of the
file's JSON header (:func:`_raw_tensor_bytes`).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from engram import mapped
from engram.common import ceil_div
from engram.layout import EngramLayout
from engram.spec import EngramSpec
from engram.checkpoint.checks import TENSOR_KINDS, ScaleOverflowCheck, file_problem, unexpected_engram_tensors
from engram.table.fp8 import BLOCK_SIZE, E8M0_DTYPE, first_nan_byte, nan_byte_error

__all__ = ["INDEX_FILE", "TENSOR_KINDS", "DEFAULT_CHUNK_BYTES", "engram_tensor_name", "TensorInfo",
           "SafetensorsCheckpoint", "EngramLayerWeights", "expected_layer_tensors", "load_engram_layer_weights",
           "layer_weight_problems", "check_weight_values", "table_progress", "ByteProgress", "copy_checked_rows",
           "map_table_rows", "ScaleOverflowCheck", "unexpected_engram_tensors", "file_problem"]

INDEX_FILE = "model.safetensors.index.json"
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
            problem = file_problem(path, "file")
            if problem is not None:
                self._unreadable[path] = problem.removeprefix(f"file {str(path)!r} ")
                continue
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
        problem = file_problem(path, "its file", f"(named by {str(self.index_file)!r})")
        if problem is not None:
            raise ValueError(f"tensor {name!r}: {problem}")
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
                       check_e4m3: bool = False, overflow_values: TensorInfo | None = None) -> None:
        """Copy rows ``[row_start, row_start + len(out))`` of a 2-D one-byte tensor into ``out``.

        Args:
            info: the tensor (``F8_E4M3``, ``F8_E8M0`` or ``U8``; its shape already checked).
            out: ``uint8 [rows, width]``, preallocated on any device (CPU, pinned, CUDA).
            row_start: first row of the file's tensor to read.
            chunk_rows: rows per memory-mapped slice read.
            progress: gets ``update(bytes)`` after each chunk.
            check_ue8m0: raise on byte 255 (UE8M0 NaN, never in a table), naming the row.
            check_e4m3: raise on bytes 0x7F/0xFF (E4M3 NaN, never in a table), naming the row.
            overflow_values: for a scale tensor, its values tensor: raise on a scale byte that makes a
                finite value of its block infinite (:class:`ScaleOverflowCheck`).

        The checks look at each chunk as it passes (one temporary of the chunk's size), never at
        a second copy of the table.
        """
        num_rows = out.shape[0]
        overflow = None if overflow_values is None else ScaleOverflowCheck(overflow_values, info)
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
                if overflow is not None:
                    overflow(chunk, row_start + first)
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
    """A bar in bytes on stderr (scaled units, rate), disabled when ``enabled`` is False: tqdm's on a
    terminal, whole lines elsewhere (:func:`engram.progress.progress_bar`)."""
    from engram.progress import progress_bar

    return progress_bar(total_bytes, description, unit="B", unit_divisor=1024, enabled=enabled)


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
    (:func:`check_weight_values`). An FP8 ``wkv`` comes as read: E4M3 weight and UE8M0 scales.
    A tensor named as an Engram tensor that the config has no place for is refused
    (:func:`unexpected_engram_tensors`)."""
    unexpected = unexpected_engram_tensors(checkpoint, spec)
    if unexpected:
        raise ValueError(unexpected[0])
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




_LOAD_THREADS = max(1, min(8, os.cpu_count() or 1))


def copy_checked_rows(info: TensorInfo, target: torch.Tensor, row_start: int, row_end: int, chunk_bytes: int,
                       progress, check: str | None, overflow_values: TensorInfo | None = None) -> None:
    """``target[:] = file rows [row_start, row_end)`` of ``info`` (a one-byte 2-D tensor), read
    through a memory map (no intermediate copy), each chunk scanned for NaN bytes (``check``:
    ``"e4m3"``, ``"ue8m0"`` or None) while it is in cache, then copied into ``target`` (any
    row stride: the packed host rows). ``overflow_values``: for scales, their values tensor, whose
    blocks a scale may not make infinite (:class:`ScaleOverflowCheck`)."""
    source = mapped.map_tensor_rows(mapped.tensor_location(info.file, info.name), row_start, row_end)
    overflow = None if overflow_values is None else ScaleOverflowCheck(overflow_values, info)
    width = source.shape[1]
    chunk_rows = max(1, chunk_bytes // width)

    def one_chunk(first: int) -> int:
        chunk = source[first:first + chunk_rows]
        if check is not None:
            flat = first_nan_byte(chunk, check)
            if flat is not None:
                row, column = divmod(flat, width)
                raise nan_byte_error(info.where(), row_start + first + row, column, int(chunk[row, column]), check)
        if overflow is not None:
            overflow(chunk, row_start + first)
        target[first:first + chunk.shape[0]].copy_(chunk)
        return chunk.numel()

    # Chunks in parallel (the scan is numpy, the copy torch: both release the GIL); results
    # in order, so the first bad row in file order is the one reported.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_LOAD_THREADS) as pool:
        for done in pool.map(one_chunk, range(0, source.shape[0], chunk_rows)):
            if progress is not None:
                progress.update(done)


def map_table_rows(values_info: TensorInfo, scales_info: TensorInfo, row_start: int, row_end: int,
                   chunk_bytes: int, progress: "ByteProgress | bool | None", check_values: bool,
                   description: str, total_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cpu`` placement's storage: rows ``[row_start, row_end)`` of the value and scale
    tensors as ``uint8 [rows, D]`` and ``[rows, D // 32]`` views of private memory maps of
    their files (:mod:`engram.mapped`; zero copy, the page cache holds the bytes), after one
    read-only pass that refuses NaN bytes and scales that make a value infinite as
    :meth:`SafetensorsCheckpoint.read_rows_into` does.
    Every accepted format (``F8_E4M3``, ``F8_E8M0``, ``U8``) is the bytes as stored, so no
    format needs a copy."""
    own_bar = progress is True
    bar = table_progress(total_bytes, description) if own_bar else (progress or None)
    try:
        tables = []
        for info, check in ((values_info, "e4m3"), (scales_info, "ue8m0")):
            rows = mapped.map_tensor_rows(mapped.tensor_location(info.file, info.name), row_start, row_end)
            overflow = ScaleOverflowCheck(values_info, scales_info) if check == "ue8m0" else None
            mapped.check_table_rows(rows, info.where(), row_start, chunk_bytes=chunk_bytes, progress=bar,
                                    check_ue8m0=check == "ue8m0", check_e4m3=check == "e4m3" and check_values,
                                    check_chunk=overflow)
            tables.append(rows)
    finally:
        if own_bar:
            bar.close()
    return tables[0], tables[1]


