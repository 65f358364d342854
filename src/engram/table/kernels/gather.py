"""Launchers of the Triton row-gather kernels (:mod:`engram.table.kernels.gather_kernels`).

``gather_rows`` returns dequantized bf16 rows and ``gather_rows_packed`` the raw FP8
bytes, both bit-identical to :func:`engram.table.kernels.reference.lookup_reference` and to
``EngramTable.lookup_packed``. They run wherever the tensors are (CUDA, or the CPU
under ``TRITON_INTERPRET=1``), never sync with the host, allocate only their
outputs, and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engram.call_cache import CallCache, structure
from engram.checks import check_int, check_launch_ids, check_power_of_two
from engram.triton_launch import BoundLaunch, CompiledLaunch, interpreting
from engram.table.fp8 import BLOCK_SIZE, as_scale_bytes, as_value_bytes
from engram.table.kernels.gather_kernels import gather_rows_bf16_kernel, gather_rows_packed_kernel
from engram.tuning import tuning

__all__ = ["GatherConfig", "default_config", "gather_rows", "gather_rows_packed", "PreparedGather"]

_DECODE_MODES = {"integer": 0, "fp8": 1, "fp8_nan_select": 2}  # the kernels' DECODE


@dataclass(frozen=True)
class GatherConfig:
    """Launch shape of a gather kernel.

    Attributes:
        block_rows: rows per program (a power of two).
        num_warps: warps per program.
        vector: bf16 mode: consecutive value bytes per thread (8: loads of 8 B, stores of 16 B in
            one register layout; 16: loads of 16 B, re-laid out through shared memory before the stores).
        chunk_outer: bf16 mode: tile ``[32 // vector, rows, groups, vector]`` instead of
            ``[rows, groups, 32 // vector, vector]`` (fewer rows per thread, more values of each).
        decode: bf16 mode: how E4M3 is decoded: ``"integer"`` (bit manipulation), ``"fp8"``
            (the fp8 converter, ``tl.float8e4nv``) or ``"fp8_nan_select"`` (the converter, then
            NaN selected for 0x7F/0xFF: exact under the interpreter too).
        value_eviction: L2 eviction policy of the row loads (``""``, ``"evict_first"``, ``"evict_last"``).
        out_cache: cache modifier of the output stores (``""``, ``".cs"``, ``".cg"``, ...).
    """

    block_rows: int = 16
    num_warps: int = 4
    vector: int = 8
    chunk_outer: bool = False
    decode: str = "integer"
    value_eviction: str = ""
    out_cache: str = ""

    def __post_init__(self):
        for name in ("block_rows", "num_warps", "vector"):
            check_power_of_two(f"GatherConfig.{name}", getattr(self, name))
        if self.vector > BLOCK_SIZE:
            raise ValueError(f"GatherConfig.vector: expected at most {BLOCK_SIZE}, found {self.vector}")
        if self.decode not in _DECODE_MODES:
            raise ValueError(f"GatherConfig.decode: expected one of {sorted(_DECODE_MODES)}, found {self.decode!r}")


# The device kind's launch shapes (engram.tuning, keys gather.*: the H200's are the best of its sweep,
# benchmarks/NOTES.md "Gather launch shapes"). The integer decode is exact under the interpreter too, so
# CPU tests run the GPU's code path.
_TUNED = tuning().gather
_GPU_BF16_CONFIG = GatherConfig(block_rows=_TUNED.bf16_block_rows, num_warps=_TUNED.bf16_num_warps,
                                vector=_TUNED.bf16_vector)
_GPU_PACKED_CONFIG = GatherConfig(block_rows=_TUNED.packed_block_rows, num_warps=_TUNED.packed_num_warps)


@functools.lru_cache(maxsize=4)
def _default_config(packed: bool, interpreted: bool) -> GatherConfig:
    config = _GPU_PACKED_CONFIG if packed else _GPU_BF16_CONFIG
    if interpreted:
        decode = "fp8_nan_select" if config.decode == "fp8" else config.decode
        config = dataclasses.replace(config, block_rows=64, decode=decode)
    return config


def default_config(packed: bool) -> GatherConfig:
    """The launch shape used when none is given: the H200's, or under the interpreter the same
    layout in blocks of 64 rows (about 1 ms per program; an ``"fp8"`` decode becomes
    ``"fp8_nan_select"``, as the interpreter's fp8 cast knows no E4M3 NaN)."""
    return _default_config(packed, interpreting())


def _check_inputs(value_bytes, scale_bytes, hash_ids, row_start, column_start, column_end):
    """Validate the arguments (no device sync) -> ``(value_bytes, scale_bytes, column_end)``."""
    value_bytes = as_value_bytes(value_bytes, "values")
    scale_bytes = as_scale_bytes(scale_bytes, "scales")
    if value_bytes.dim() != 2:
        raise ValueError(f"values: expected shape [rows, head_dim], found {list(value_bytes.shape)}")
    num_rows, head_dim = value_bytes.shape
    if head_dim == 0 or head_dim % BLOCK_SIZE:
        raise ValueError(f"values: head_dim must be a positive multiple of {BLOCK_SIZE}, "
                         f"found shape {list(value_bytes.shape)}")
    if tuple(scale_bytes.shape) != (num_rows, head_dim // BLOCK_SIZE):
        raise ValueError(f"scales: expected shape {[num_rows, head_dim // BLOCK_SIZE]}, "
                         f"found {list(scale_bytes.shape)}")
    if value_bytes.stride(1) != 1 or scale_bytes.stride(1) != 1:
        raise ValueError(f"values/scales: rows must be contiguous (last stride 1), found strides "
                         f"{value_bytes.stride()} and {scale_bytes.stride()}")
    column_end = check_lookup_ids(hash_ids, row_start, column_start, column_end)
    if not (value_bytes.device == scale_bytes.device == hash_ids.device):
        raise ValueError(f"hash_ids, values, scales: expected one device, found {hash_ids.device}, "
                         f"{value_bytes.device}, {scale_bytes.device}")
    return value_bytes, scale_bytes, column_end


def check_lookup_ids(hash_ids, row_start, column_start: int, column_end: int | None) -> int:
    """A gather's ids and what it reads of them: ``hash_ids`` int32/int64 ``[T, C]``, ``0 <= column_start
    < column_end <= C`` (None: ``C``), ``row_start >= 0``; returns ``column_end``. One ValueError per field."""
    check_launch_ids(hash_ids)
    width = hash_ids.shape[1]
    column_end = width if column_end is None else column_end
    if not 0 <= column_start < column_end <= width:
        raise ValueError(f"column_start, column_end: expected 0 <= {column_start} < {column_end} <= {width} "
                         f"(hash_ids shape {list(hash_ids.shape)})")
    check_int("row_start", row_start, 0)
    return column_end


def _output(name: str, given: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """``given`` checked against the expected output, or a new tensor."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(given, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, found {type(given).__name__}")
    if given.dtype == torch.float8_e4m3fn and dtype == torch.uint8:
        given = given.view(torch.uint8)
    if tuple(given.shape) != shape or given.dtype != dtype or given.device != device or not given.is_contiguous():
        found = f"{given.dtype} {list(given.shape)} on {given.device}"
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor {list(shape)} on {device}, found {found}")
    return given


_LAUNCHERS = {gather_rows_bf16_kernel: CompiledLaunch(gather_rows_bf16_kernel),
              gather_rows_packed_kernel: CompiledLaunch(gather_rows_packed_kernel)}


class _GatherPlan(NamedTuple):
    """What a gather call of one structure launches (see :mod:`engram.call_cache`)."""

    out_shapes: tuple[tuple[int, ...], ...]
    out_dtype: torch.dtype
    grid: int                    # 0: nothing to launch
    ints: tuple
    constexprs: tuple
    num_warps: int
    column_start: int
    column_end: int
    full_width: bool             # the served columns are all of hash_ids: no slice needed
    launch: BoundLaunch          # the launches of this structure (variant from the kernel's rules)


_PLANS = CallCache()


def _plan(kernel, values, scales, hash_ids, row_start, column_start, column_end, config, packed: bool,
          out) -> tuple[_GatherPlan, torch.Tensor, torch.Tensor]:
    """The checked plan of a call (made on the first call of its structure), and the byte views of
    ``values`` / ``scales``."""
    key = (kernel, structure(values), structure(scales), structure(hash_ids), type(row_start), row_start,
           column_start, column_end, config)
    plan = _PLANS.get(key) if out is None else None  # a given out is checked on every call
    if plan is not None:
        value_bytes = values.view(torch.uint8) if values.dtype != torch.uint8 else values
        scale_bytes = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
        return plan, value_bytes, scale_bytes
    value_bytes, scale_bytes, column_end = _check_inputs(values, scales, hash_ids, row_start, column_start, column_end)
    config = default_config(packed=packed) if config is None else config
    tokens, width = hash_ids.shape
    num_rows, head_dim = value_bytes.shape
    local_columns = column_end - column_start
    groups = head_dim // BLOCK_SIZE
    if packed:
        out_shapes = ((tokens, local_columns, head_dim), (tokens, local_columns, groups))
        out_dtype, extra = torch.uint8, ()
    else:
        out_shapes = ((tokens, local_columns, head_dim),)
        out_dtype = torch.bfloat16
        extra = (config.vector, config.chunk_outer, _DECODE_MODES[config.decode])
    total_rows = tokens * local_columns
    if total_rows >= 2**31 - config.block_rows:  # the kernels' flattened row index is int32
        raise ValueError(f"hash_ids: T * C_local = {total_rows} rows per launch; expected fewer than 2**31")
    ints = (total_rows, local_columns, hash_ids.stride(0), hash_ids.stride(1),
            row_start, num_rows, value_bytes.stride(0), scale_bytes.stride(0))
    constexprs = (head_dim, 1 << (groups - 1).bit_length(), config.block_rows, *extra,
                  config.value_eviction, config.out_cache)
    device_index = hash_ids.device.index if hash_ids.is_cuda else 0
    plan = _GatherPlan(out_shapes, out_dtype, -(-total_rows // config.block_rows), ints, constexprs,
                       config.num_warps, column_start, column_end, column_start == 0 and column_end == width,
                       _LAUNCHERS[kernel].bind(config.num_warps, device_index, num_stages=1))
    if out is None:
        _PLANS.put(key, plan)
    return plan, value_bytes, scale_bytes


def _launch(kernel, plan: _GatherPlan, outputs, value_bytes, scale_bytes, hash_ids):
    """Launch ``kernel`` on ``plan`` (nothing when the batch has no row)."""
    if not plan.grid:
        return
    local_ids = hash_ids if plan.full_width else hash_ids[:, plan.column_start:plan.column_end]
    if local_ids.is_cuda and local_ids.device.index != torch.cuda.current_device():
        with torch.cuda.device(local_ids.device):  # Triton launches on the current device
            return _launch(kernel, plan, outputs, value_bytes, scale_bytes, hash_ids)
    # Every pointer's alignment (outputs included: a given ``out`` may be a misaligned view) is
    # read per call by the bound launch; the rest of the variant is the plan's.
    plan.launch(plan.grid, (local_ids, value_bytes, scale_bytes, *outputs, *plan.ints, *plan.constexprs))


def gather_rows(
    values: torch.Tensor,
    scales: torch.Tensor,
    hash_ids: torch.Tensor,
    row_start: int = 0,
    column_start: int = 0,
    column_end: int | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GatherConfig | None = None,
) -> torch.Tensor:
    """Gather and dequantize rows with the Triton kernel.

    ``out[t, j] = bf16(e4m3(values[id - row_start]) * 2**(scales[id - row_start] - 127))`` with
    ``id = hash_ids[t, column_start + j]``; +0 when ``id`` is outside ``[row_start, row_start + rows)``.

    Args:
        values: ``float8_e4m3fn`` or ``uint8 [rows, D]`` (rows contiguous), the table rows
            ``[row_start, row_start + rows)``.
        scales: ``uint8 [rows, D // 32]`` UE8M0 bytes (``float8_e8m0fnu`` accepted).
        hash_ids: int32/int64 ``[T, C]`` global row ids, any strides (e.g. ``ids[:, layer]``).
        row_start: global row id of ``values[0]``.
        column_start, column_end: the hash columns served (default: all).
        out: optional ``bfloat16 [T, C_local, D]`` contiguous tensor to write (else allocated).
        config: launch shape (default :func:`default_config`).

    Returns:
        ``bfloat16 [T, column_end - column_start, D]``, contiguous, on the device of the inputs.
    """
    plan, value_bytes, scale_bytes = _plan(gather_rows_bf16_kernel, values, scales, hash_ids, row_start,
                                           column_start, column_end, config, False, out)
    out = _output("out", out, plan.out_shapes[0], torch.bfloat16, hash_ids.device)
    _launch(gather_rows_bf16_kernel, plan, (out,), value_bytes, scale_bytes, hash_ids)
    return out


def gather_rows_packed(
    values: torch.Tensor,
    scales: torch.Tensor,
    hash_ids: torch.Tensor,
    row_start: int = 0,
    column_start: int = 0,
    column_end: int | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: GatherConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather raw FP8 rows with the Triton kernel, for an FP8 consumer.

    Same arguments as :func:`gather_rows` (``out``: optional ``(uint8 [T, C_local, D],
    uint8 [T, C_local, D // 32])`` contiguous tensors to write). Returns ``(values uint8 [T, C_local, D],
    scales uint8 [T, C_local, D // 32])``, contiguous: the bytes of row ``id - row_start``,
    all zeros when ``id`` is outside ``[row_start, row_start + rows)`` (as ``EngramTable.lookup_packed``).
    """
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise ValueError(f"out: expected a pair (values, scales) or None, found {type(out).__name__}")
    plan, value_bytes, scale_bytes = _plan(gather_rows_packed_kernel, values, scales, hash_ids, row_start,
                                           column_start, column_end, config, True, out)
    out_values = _output("out[0]", None if out is None else out[0], plan.out_shapes[0], torch.uint8, hash_ids.device)
    out_scales = _output("out[1]", None if out is None else out[1], plan.out_shapes[1], torch.uint8, hash_ids.device)
    _launch(gather_rows_packed_kernel, plan, (out_values, out_scales), value_bytes, scale_bytes, hash_ids)
    return out_values, out_scales


class PreparedGather:
    """:func:`gather_rows` for every call whose ``hash_ids`` have one structure (shape, dtype,
    strides, device), with the table's ``values`` / ``scales``: checked and planned once, then
    each call allocates the output and launches (an engine's eager step calls it per layer).

    ``prepared(hash_ids) -> bfloat16 [T, C_local, D]`` (``[T, C_local * D]`` with ``flat``: the
    same bytes, as the wkv GEMM takes them), equal to ``gather_rows(values, scales, hash_ids,
    row_start, column_start, column_end)``. ``hash_ids`` must have the structure it was
    prepared with (the caller keys its prepared calls by :func:`~engram.call_cache.structure`).
    """

    __slots__ = ("_plan", "_value_bytes", "_scale_bytes", "_shape", "_device", "_device_index", "_scalars")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, hash_ids: torch.Tensor, row_start: int = 0,
                 column_start: int = 0, column_end: int | None = None, *, flat: bool = False):
        plan, value_bytes, scale_bytes = _plan(gather_rows_bf16_kernel, values, scales, hash_ids, row_start,
                                               column_start, column_end, None, False, None)
        self._plan, self._value_bytes, self._scale_bytes = plan, value_bytes, scale_bytes
        tokens, columns, head_dim = plan.out_shapes[0]
        self._shape = (tokens, columns * head_dim) if flat else plan.out_shapes[0]
        self._device = hash_ids.device
        self._device_index = hash_ids.device.index if hash_ids.is_cuda else None
        self._scalars = (*plan.ints, *plan.constexprs)

    def __call__(self, hash_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self._shape, dtype=torch.bfloat16, device=self._device)
        plan = self._plan
        if not plan.grid:  # no row to read
            return out
        if self._device_index is not None and self._device_index != torch.cuda.current_device():
            _launch(gather_rows_bf16_kernel, plan, (out,), self._value_bytes, self._scale_bytes, hash_ids)
            return out
        local_ids = hash_ids if plan.full_width else hash_ids[:, plan.column_start:plan.column_end]
        plan.launch(plan.grid, (local_ids, self._value_bytes, self._scale_bytes, out, *self._scalars))
        return out
