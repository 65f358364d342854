"""Launchers of the cached-lookup kernels (:mod:`engram.table.cache_kernels`).

``cached_gather_rows`` (bf16) and ``cached_gather_rows_packed`` (raw FP8 bytes) read each
row from the :class:`~engram.table.row_cache.RowCache` on a hit and from the backing rows on
a miss; the results equal :func:`engram.table.gather.gather_rows` /
:func:`~engram.table.gather.gather_rows_packed` on the backing rows bit for bit, whatever
the cache holds. They run wherever the tensors are (CUDA, or the CPU under
``TRITON_INTERPRET=1``), never sync with the host, only read the index, allocate only
their outputs, and can be captured in a CUDA graph (the index is updated in place).
"""

from __future__ import annotations

import torch

from ..common import HASH_ID_DTYPES
from ..triton_launch import CompiledLaunch, int_variant, interpreting, tensor_variant
from .cache_kernels import cached_gather_bf16_kernel, cached_gather_packed_kernel
from .fp8 import BLOCK_SIZE
from .row_cache import RowCache

__all__ = ["cached_gather_rows", "cached_gather_rows_packed", "block_rows"]

_LAUNCHERS = {cached_gather_bf16_kernel: CompiledLaunch(cached_gather_bf16_kernel),
              cached_gather_packed_kernel: CompiledLaunch(cached_gather_packed_kernel)}
_DECODE_INTEGER = 0  # the gather kernels' integer E4M3 decode: exact on the GPU and the interpreter


def block_rows() -> int:
    """Rows per program: 16 on the GPU, 64 under the interpreter (about 1 ms per program)."""
    return 64 if interpreting() else 16


def _check(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor, hash_ids: torch.Tensor,
           row_start: int) -> None:
    if not isinstance(cache, RowCache):
        raise ValueError(f"cache: expected a RowCache, found {type(cache).__name__}")
    for name, tensor, width in (("back_values", back_values, cache.head_dim),
                                ("back_scales", back_scales, cache.head_dim // BLOCK_SIZE)):
        if (not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 2
                or tensor.shape[1] != width or tensor.stride(1) != 1):
            found = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name}: expected uint8 [rows, {width}] with contiguous rows, found {found}")
    if back_values.shape[0] != back_scales.shape[0]:
        raise ValueError(f"back_scales: expected {back_values.shape[0]} rows (those of back_values), "
                         f"found {back_scales.shape[0]}")
    if back_values.shape[0] >= 2**31:
        raise ValueError(f"back_values: expected fewer than 2**31 rows (the set index is int32), "
                         f"found {back_values.shape[0]}")
    if not isinstance(hash_ids, torch.Tensor) or hash_ids.dtype not in HASH_ID_DTYPES or hash_ids.dim() != 2:
        found = (f"{hash_ids.dtype} {list(hash_ids.shape)}" if isinstance(hash_ids, torch.Tensor)
                 else type(hash_ids).__name__)
        raise ValueError(f"hash_ids: expected an int32 or int64 tensor [T, C], found {found}")
    devices = {str(t.device) for t in (hash_ids, cache.tags, back_values, back_scales)}
    if len(devices) != 1:
        raise ValueError(f"hash_ids, cache, back_values, back_scales: expected one device, found {sorted(devices)}")
    if isinstance(row_start, bool) or not isinstance(row_start, int) or row_start < 0:
        raise ValueError(f"row_start: expected an integer >= 0, found {row_start!r}")


def _launch(kernel, outputs, cache: RowCache, back_values, back_scales, hash_ids, row_start, extra: tuple):
    tokens, local_columns = hash_ids.shape
    total_rows = tokens * local_columns
    if total_rows == 0:
        return
    rows_per_program = block_rows()
    if total_rows >= 2**31 - rows_per_program:
        raise ValueError(f"hash_ids: T * C = {total_rows} rows per launch; expected fewer than 2**31")
    if hash_ids.is_cuda and hash_ids.device.index != torch.cuda.current_device():
        with torch.cuda.device(hash_ids.device):  # Triton launches on the current device
            return _launch(kernel, outputs, cache, back_values, back_scales, hash_ids, row_start, extra)
    head_dim = cache.head_dim
    groups = head_dim // BLOCK_SIZE
    slot_values, slot_scales = cache.slot_values, cache.slot_scales
    ints = (total_rows, local_columns, hash_ids.stride(0), hash_ids.stride(1), row_start, back_values.shape[0],
            cache.num_sets, slot_values.stride(0), slot_scales.stride(0), back_values.stride(0),
            back_scales.stride(0))
    constexprs = (head_dim, 1 << (groups - 1).bit_length(), rows_per_program, cache.ways, *extra)
    tensors = (hash_ids, cache.tags, slot_values, slot_scales, back_values, back_scales, *outputs)
    variant = (tuple(tensor_variant(t) for t in tensors), tuple(int_variant(i) for i in ints), constexprs)
    grid = -(-total_rows // rows_per_program)
    _LAUNCHERS[kernel](grid, variant, (*tensors, *ints, *constexprs), num_warps=4, num_stages=1,
                       device_index=hash_ids.device.index if hash_ids.is_cuda else 0)


def cached_gather_rows(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor,
                       hash_ids: torch.Tensor, row_start: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantized rows through the cache.

    ``out[t, j] = bf16(e4m3(row[:D]) * 2**(row[D:] - 127))`` of local row ``r = hash_ids[t, j] - row_start``,
    read from the cache slot holding ``r`` or else from ``back_values[r]`` / ``back_scales[r]``;
    +0 when ``r`` is outside ``[0, rows)``.

    Args:
        cache: the index and slots (on the device of ``hash_ids``).
        back_values, back_scales: ``uint8 [rows, D]`` / ``[rows, D // 32]`` (rows contiguous): every
            row of the table; on the GPU the host placement's CUDA alias of pinned host memory.
        hash_ids: int32/int64 ``[T, C]`` global ids, any strides.
        row_start: global row id of ``back_values[0]``.
        out: optional contiguous ``bfloat16 [T, C, D]`` to write.

    Returns: ``bfloat16 [T, C, D]``.
    """
    _check(cache, back_values, back_scales, hash_ids, row_start)
    shape = (hash_ids.shape[0], hash_ids.shape[1], cache.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=hash_ids.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != torch.bfloat16
          or not out.is_contiguous() or out.device != hash_ids.device):
        raise ValueError(f"out: expected a contiguous bfloat16 tensor {list(shape)} on {hash_ids.device}")
    _launch(cached_gather_bf16_kernel, (out,), cache, back_values, back_scales, hash_ids, row_start,
            (_DECODE_INTEGER,))
    return out


def cached_gather_rows_packed(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor,
                              hash_ids: torch.Tensor, row_start: int = 0, *,
                              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw FP8 rows through the cache (arguments as :func:`cached_gather_rows`; ``out``: optional contiguous
    ``(uint8 [T, C, D], uint8 [T, C, D // 32])`` to write) -> ``(values uint8 [T, C, D], scales uint8
    [T, C, D // 32])``, all-zero bytes outside the rows."""
    _check(cache, back_values, back_scales, hash_ids, row_start)
    tokens, columns = hash_ids.shape
    head_dim = cache.head_dim
    shapes = ((tokens, columns, head_dim), (tokens, columns, head_dim // BLOCK_SIZE))
    if out is None:
        out_values, out_scales = (torch.empty(shape, dtype=torch.uint8, device=hash_ids.device) for shape in shapes)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"out: expected a pair (values, scales) or None, found {type(out).__name__}")
        for index, (given, shape) in enumerate(zip(out, shapes)):
            if (not isinstance(given, torch.Tensor) or tuple(given.shape) != shape or given.dtype != torch.uint8
                    or not given.is_contiguous() or given.device != hash_ids.device):
                raise ValueError(f"out[{index}]: expected a contiguous uint8 tensor {list(shape)} on {hash_ids.device}")
        out_values, out_scales = out
    _launch(cached_gather_packed_kernel, (out_values, out_scales), cache, back_values, back_scales, hash_ids,
            row_start, ())
    return out_values, out_scales
