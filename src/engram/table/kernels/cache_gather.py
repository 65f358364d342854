"""Launchers of the cached-lookup kernels (:mod:`engram.table.kernels.cache_kernels`).

``cached_gather_rows`` (bf16) and ``cached_gather_rows_packed`` (raw FP8 bytes) read each
row from the :class:`~engram.table.placements.row_cache.RowCache` on a hit and from the backing rows on
a miss; the results equal :func:`engram.table.kernels.gather.gather_rows` /
:func:`~engram.table.kernels.gather.gather_rows_packed` on the backing rows bit for bit, whatever
the cache holds. They run wherever the tensors are (CUDA, or the CPU under
``TRITON_INTERPRET=1``), never sync with the host, only read the index, allocate only
their outputs, and can be captured in a CUDA graph (the index is updated in place).

Large lookups of placement ``"cached"`` split that work around the host placement's host
gather (:mod:`engram.table.placements.cached`): ``cached_probe`` writes each row's slot (-1 unless a hit)
and the ids of its misses; ``checked_merge_rows`` (bf16) and ``checked_merge_rows_packed`` then
read each hit from its slot and everything else from the gathered rows through the dedup's
``inverse``, each copy only where the id it was read for is the lookup's (else the backing row,
in the same launch); the host placement's staged lookups use the same merge without a cache. With a ``direct_share`` the probe leaves a hash class of the misses out of the miss
ids (slot ``-2 - row``) and ``cached_direct_reads`` reads them from the backing rows (host memory)
while the host gathers the others. Same bytes as the one-kernel lookup; same rules (no sync,
outputs only).
"""

from __future__ import annotations

import torch

from engram.checks import check_int, check_launch_ids
from engram.triton_launch import CompiledLaunch, interpreting
from engram.table.kernels.cache_kernels import (cached_direct_kernel, cached_gather_bf16_kernel, cached_gather_packed_kernel,
                            checked_merge_bf16_kernel, checked_merge_packed_kernel, cached_probe_kernel)
from engram.table.fp8 import BLOCK_SIZE
from engram.table.host_memory.rows import packed_row_bytes, row_tags
from engram.table.placements.row_cache import RowCache

__all__ = ["cached_gather_rows", "cached_gather_rows_packed", "block_rows", "cached_probe", "cached_direct_reads",
           "checked_merge_rows", "checked_merge_rows_packed", "direct_threshold"]

_LAUNCHERS = {kernel: CompiledLaunch(kernel) for kernel in (
    cached_gather_bf16_kernel, cached_gather_packed_kernel, cached_probe_kernel, cached_direct_kernel,
    checked_merge_bf16_kernel, checked_merge_packed_kernel)}
_PROBE_BLOCK_ROWS = 128  # the probe reads 8 B of id and WAYS * 8 B of tags per row: a larger tile
_DECODE_INTEGER = 0  # the gather kernels' integer E4M3 decode: exact on the GPU and the interpreter


def block_rows() -> int:
    """Rows per program: 16 on the GPU, 64 under the interpreter (about 1 ms per program)."""
    return 64 if interpreting() else 16


def _check(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor, hash_ids: torch.Tensor,
           row_start: int) -> tuple:
    """Every argument checked; returns the launch's integers that depend on the cache and the backing rows
    alone (their checks and values are kept per backing layout: a decode lookup's host time is mostly this)."""
    if not isinstance(cache, RowCache):
        raise ValueError(f"cache: expected a RowCache, found {type(cache).__name__}")
    check_launch_ids(hash_ids)
    check_int("row_start", row_start, 0)
    if not isinstance(back_values, torch.Tensor) or not isinstance(back_scales, torch.Tensor):
        found = type(back_values if not isinstance(back_values, torch.Tensor) else back_scales).__name__
        raise ValueError(f"back_values, back_scales: expected uint8 tensors, found {found}")
    key = (back_values.data_ptr(), back_values.shape, back_values.stride(), back_values.device,
           back_scales.data_ptr(), back_scales.shape, back_scales.stride(), back_scales.device)
    constants = cache.launch_constants.get(key)
    if constants is None:
        constants = _backing_constants(cache, back_values, back_scales)
        if len(cache.launch_constants) >= 8:  # a few backings per cache at most; never grows without bound
            cache.launch_constants.clear()
        cache.launch_constants[key] = constants
    if hash_ids.device != cache.device:
        raise ValueError(f"hash_ids, cache, back_values, back_scales: expected one device, found "
                         f"{sorted({str(hash_ids.device), str(cache.device)})}")
    return constants


# One-kernel lookups of at most this many rows (decode sizes, as placement "host"'s DECODE_MAX_ROWS) issue every
# row's host read before the tags' (READ_AHEAD in cache_kernels): a miss then waits one PCIe round trip, not an
# HBM tag read and then that round trip; a hit moves its 272 host bytes too (at most 0.8 MB a lookup).
READ_AHEAD_MAX_ROWS = 128 * 24


def _backing_constants(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor) -> tuple:
    for name, tensor, width in (("back_values", back_values, cache.head_dim),
                                ("back_scales", back_scales, cache.head_dim // BLOCK_SIZE)):
        if tensor.dtype != torch.uint8 or tensor.dim() != 2 or tensor.shape[1] != width or tensor.stride(1) != 1:
            raise ValueError(f"{name}: expected uint8 [rows, {width}] with contiguous rows, found "
                             f"{tensor.dtype} {list(tensor.shape)}")
    if back_values.shape[0] != back_scales.shape[0]:
        raise ValueError(f"back_scales: expected {back_values.shape[0]} rows (those of back_values), "
                         f"found {back_scales.shape[0]}")
    if back_values.shape[0] >= 2**31:
        raise ValueError(f"back_values: expected fewer than 2**31 rows (the set index is int32), "
                         f"found {back_values.shape[0]}")
    devices = {str(t.device) for t in (cache.tags, back_values, back_scales)}
    if len(devices) != 1:
        raise ValueError(f"hash_ids, cache, back_values, back_scales: expected one device, found {sorted(devices)}")
    return (back_values.shape[0], cache.num_sets, cache.slot_values.stride(0), cache.slot_scales.stride(0),
            back_values.stride(0), back_scales.stride(0))


def _launch(kernel, outputs, cache: RowCache, back_values, back_scales, hash_ids, row_start, extra: tuple,
            constants: tuple, staged: torch.Tensor | None = None):
    tokens, local_columns = hash_ids.shape
    total_rows = tokens * local_columns
    if total_rows == 0:
        return
    rows_per_program = block_rows()
    if total_rows >= 2**31 - rows_per_program:
        raise ValueError(f"hash_ids: T * C = {total_rows} rows per launch; expected fewer than 2**31")
    if hash_ids.is_cuda and hash_ids.device.index != torch.cuda.current_device():
        with torch.cuda.device(hash_ids.device):  # Triton launches on the current device
            return _launch(kernel, outputs, cache, back_values, back_scales, hash_ids, row_start, extra, constants,
                           staged)
    head_dim = cache.head_dim
    groups = head_dim // BLOCK_SIZE
    staged_row_bytes = 0 if staged is None else staged.shape[1]
    ints = (total_rows, local_columns, hash_ids.stride(0), hash_ids.stride(1), row_start, *constants,
            0 if staged is None else staged.stride(0))
    read_ahead = total_rows <= READ_AHEAD_MAX_ROWS
    constexprs = (head_dim, 1 << (groups - 1).bit_length(), rows_per_program, cache.ways, read_ahead,
                  staged_row_bytes, *extra)
    tensors = (hash_ids, cache.tags, cache.slot_values, cache.slot_scales, back_values, back_scales, *outputs,
               outputs[0] if staged is None else staged)
    grid = -(-total_rows // rows_per_program)
    _LAUNCHERS[kernel](grid, (*tensors, *ints, *constexprs), num_warps=4, num_stages=1,
                       device_index=hash_ids.device.index if hash_ids.is_cuda else 0)


def _check_staged(staged: torch.Tensor | None, cache: RowCache, hash_ids: torch.Tensor) -> torch.Tensor | None:
    """``staged``: None, or ``uint8 [>= T * C, packed_row_bytes(D)]`` with contiguous rows (4-byte aligned) on the
    ids' device."""
    if staged is None:
        return None
    row_bytes = packed_row_bytes(cache.head_dim)
    rows = hash_ids.shape[0] * hash_ids.shape[1]
    if (not isinstance(staged, torch.Tensor) or staged.dtype != torch.uint8 or staged.dim() != 2
            or staged.shape[1] != row_bytes or staged.shape[0] < rows or staged.stride(1) != 1
            or staged.stride(0) % 4 or staged.data_ptr() % 4 or staged.device != hash_ids.device):
        raise ValueError(f"staged: expected uint8 [>= {rows}, {row_bytes}] with contiguous, 4-byte aligned rows on "
                         f"{hash_ids.device}, found {getattr(staged, 'dtype', type(staged).__name__)} "
                         f"{list(getattr(staged, 'shape', []))}")
    return staged


def cached_gather_rows(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor,
                       hash_ids: torch.Tensor, row_start: int = 0, *, out: torch.Tensor | None = None,
                       staged: torch.Tensor | None = None) -> torch.Tensor:
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
        staged: optional ``uint8 [>= T * C, packed_row_bytes(D)]``: row ``t * C + j`` also gets the bytes read
            for ``hash_ids[t, j]`` as a tagged packed row (tag: the local row, -1 outside the rows), for the
            cache's update to admit from (:meth:`RowCache.update` with ``staged`` and no ``inverse``).

    Returns: ``bfloat16 [T, C, D]``.
    """
    constants = _check(cache, back_values, back_scales, hash_ids, row_start)
    staged = _check_staged(staged, cache, hash_ids)
    shape = (hash_ids.shape[0], hash_ids.shape[1], cache.head_dim)
    out = _check_out(out, shape, torch.bfloat16, hash_ids.device)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=hash_ids.device)
    _launch(cached_gather_bf16_kernel, (out,), cache, back_values, back_scales, hash_ids, row_start,
            (_DECODE_INTEGER,), constants, staged)
    return out


def cached_gather_rows_packed(cache: RowCache, back_values: torch.Tensor, back_scales: torch.Tensor,
                              hash_ids: torch.Tensor, row_start: int = 0, *,
                              out: tuple[torch.Tensor, torch.Tensor] | None = None,
                              staged: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw FP8 rows through the cache (arguments as :func:`cached_gather_rows`; ``out``: optional contiguous
    ``(uint8 [T, C, D], uint8 [T, C, D // 32])`` to write) -> ``(values uint8 [T, C, D], scales uint8
    [T, C, D // 32])``, all-zero bytes outside the rows."""
    constants = _check(cache, back_values, back_scales, hash_ids, row_start)
    staged = _check_staged(staged, cache, hash_ids)
    tokens, columns = hash_ids.shape
    head_dim = cache.head_dim
    shapes = ((tokens, columns, head_dim), (tokens, columns, head_dim // BLOCK_SIZE))
    out_values, out_scales = _out_pair(out, shapes, torch.uint8, hash_ids.device, "(values, scales)")
    _launch(cached_gather_packed_kernel, (out_values, out_scales), cache, back_values, back_scales, hash_ids,
            row_start, (), constants, staged)
    return out_values, out_scales


# ---- large lookups: probe, then merge hits with the host gather's rows ----------------------------
def _check_out(out, shape, dtype, device, name="out", required: bool = False) -> torch.Tensor | None:
    if out is None and not required:
        return None
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != dtype
            or not out.is_contiguous() or out.device != device):
        raise ValueError(f"{name}: expected a contiguous {str(dtype).replace('torch.', '')} tensor {list(shape)} "
                         f"on {device}")
    return out


def _out_pair(out, shapes, dtype, device, names: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` checked as a pair of contiguous ``dtype`` tensors of ``shapes`` on ``device``, or a new pair
    when it is None (``names`` says what the pair holds, for the error)."""
    if out is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"out: expected a pair {names} or None, found {type(out).__name__}")
    return tuple(_check_out(given, shape, dtype, device, f"out[{index}]", True)
                 for index, (given, shape) in enumerate(zip(out, shapes)))


def direct_threshold(direct_share: float) -> int:
    """The probe's class bound for ``direct_share`` in ``[0, 1]``: ``round(256 * direct_share)`` (0: none)."""
    if isinstance(direct_share, bool) or not isinstance(direct_share, (int, float)) or not 0 <= direct_share <= 1:
        raise ValueError(f"direct_share: expected a number in [0, 1], found {direct_share!r}")
    return round(256 * direct_share)


def cached_probe(cache: RowCache, num_rows: int, hash_ids: torch.Tensor, row_start: int = 0, *,
                 direct_share: float = 0.0,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row of a lookup is. With ``r = hash_ids[t, j] - row_start``: ``slot[t, j] = s`` when cache
    slot ``s`` holds ``r``; for a miss (``0 <= r < num_rows``, not held) of the direct class (about
    ``direct_share`` of the rows, by a hash of ``r``) ``-2 - r``; else -1. ``miss[t, j] = r`` for the other
    misses, else -1 (hits, direct misses, ids outside the table: the host gather reads -1 as its zero row).

    Args:
        cache: the index (on the device of ``hash_ids``).
        num_rows: rows of the table (below 2**31).
        hash_ids: int32/int64 ``[T, C]`` global ids, any strides.
        row_start: global row id of local row 0.
        direct_share: share of the missed rows to leave to :func:`cached_direct_reads` (0: none).
        out: optional contiguous ``(int32 [T, C], int32 [T, C])`` to write.

    Returns: ``(slot int32 [T, C], miss int32 [T, C])``. Reads only the ids and the tags; no sync.
    """
    if not isinstance(cache, RowCache):
        raise ValueError(f"cache: expected a RowCache, found {type(cache).__name__}")
    check_int("num_rows", num_rows, 1, below=2**31, shown="[1, 2**31)")
    check_launch_ids(hash_ids)
    if hash_ids.device != cache.device:
        raise ValueError(f"hash_ids, cache: expected one device, found {hash_ids.device} and {cache.device}")
    check_int("row_start", row_start, 0)
    threshold = direct_threshold(direct_share)
    shape = tuple(hash_ids.shape)
    slot, miss = _out_pair(out, (shape, shape), torch.int32, hash_ids.device, "(slot, miss)")
    total_rows = hash_ids.numel()
    if total_rows == 0:
        return slot, miss
    if total_rows >= 2**31 - _PROBE_BLOCK_ROWS:
        raise ValueError(f"hash_ids: T * C = {total_rows} rows per launch; expected fewer than 2**31")
    if hash_ids.is_cuda and hash_ids.device.index != torch.cuda.current_device():
        with torch.cuda.device(hash_ids.device):
            return cached_probe(cache, num_rows, hash_ids, row_start, direct_share=direct_share, out=(slot, miss))
    ints = (total_rows, shape[1], hash_ids.stride(0), hash_ids.stride(1), row_start, num_rows, cache.num_sets,
            threshold)
    constexprs = (_PROBE_BLOCK_ROWS, cache.ways)
    tensors = (hash_ids, cache.tags, slot, miss)
    _LAUNCHERS[cached_probe_kernel](-(-total_rows // _PROBE_BLOCK_ROWS), (*tensors, *ints, *constexprs),
                                    num_warps=4, num_stages=1,
                                    device_index=hash_ids.device.index if hash_ids.is_cuda else 0)
    return slot, miss


def cached_direct_reads(slot: torch.Tensor, back_values: torch.Tensor, back_scales: torch.Tensor, *,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The direct misses of a probe: ``out[t, j, :D] = back_values[r]``, ``out[t, j, D:D + D // 32] =
    back_scales[r]`` where ``slot[t, j] = -2 - r <= -2`` (zeros when ``r`` is outside the rows); other rows of
    ``out`` are not written.

    Args:
        slot: contiguous int32 ``[T, C]`` from :func:`cached_probe`.
        back_values, back_scales: ``uint8 [rows, D]`` / ``[rows, D // 32]`` (rows contiguous): every row
            of the table; on the GPU the host placement's CUDA alias of pinned host memory.
        out: optional ``uint8 [T, C, W]``, ``W >= D + D // 32``, rows contiguous, to write.

    Returns: ``out``, or a new ``uint8 [T, C, packed_row_bytes(D)]``. No sync.
    """
    from engram.table.host_memory.rows import packed_row_bytes

    if (not isinstance(slot, torch.Tensor) or slot.dtype != torch.int32 or slot.dim() != 2
            or not slot.is_contiguous()):
        found = f"{slot.dtype} {list(slot.shape)}" if isinstance(slot, torch.Tensor) else type(slot).__name__
        raise ValueError(f"slot: expected a contiguous int32 tensor [T, C], found {found}")
    head_dim = back_values.shape[1] if isinstance(back_values, torch.Tensor) and back_values.dim() == 2 else 0
    for name, tensor, width in (("back_values", back_values, head_dim), ("back_scales", back_scales,
                                                                         head_dim // BLOCK_SIZE)):
        if (not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 2
                or width == 0 or head_dim % BLOCK_SIZE or tensor.shape[1] != width or tensor.stride(1) != 1
                or tensor.shape[0] != back_values.shape[0]):
            found = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name}: expected uint8 [rows, D] / [rows, D // 32] (D a multiple of 32, rows "
                             f"contiguous), found {found}")
    groups = head_dim // BLOCK_SIZE
    tokens, columns = slot.shape
    if out is None:
        out = torch.empty(tokens, columns, packed_row_bytes(head_dim), dtype=torch.uint8, device=slot.device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 3
          or tuple(out.shape[:2]) != (tokens, columns) or out.shape[2] < head_dim + groups
          or out.stride(2) != 1 or out.stride(0) != out.shape[1] * out.stride(1)):
        raise ValueError(f"out: expected uint8 [{tokens}, {columns}, >= {head_dim + groups}] with rows at one "
                         f"stride, on {slot.device}")
    devices = {str(t.device) for t in (slot, back_values, back_scales, out)}
    if len(devices) != 1:
        raise ValueError(f"slot, back_values, back_scales, out: expected one device, found {sorted(devices)}")
    total_rows = slot.numel()
    if total_rows == 0:
        return out
    if slot.is_cuda and slot.device.index != torch.cuda.current_device():
        with torch.cuda.device(slot.device):
            return cached_direct_reads(slot, back_values, back_scales, out=out)
    rows_per_program = block_rows()
    ints = (total_rows, back_values.shape[0], back_values.stride(0), back_scales.stride(0), out.stride(1))
    constexprs = (head_dim, 1 << (groups - 1).bit_length(), rows_per_program)
    tensors = (slot, back_values, back_scales, out)
    _LAUNCHERS[cached_direct_kernel](-(-total_rows // rows_per_program), (*tensors, *ints, *constexprs),
                                     num_warps=4, num_stages=1, device_index=slot.device.index if slot.is_cuda else 0)
    return out


def _check_merge(hash_ids, row_start, back_values, back_scales, staged, inverse, cache, slot, direct) -> int:
    """The merge's arguments (no device sync); returns ``D``."""
    if cache is not None and not isinstance(cache, RowCache):
        raise ValueError(f"cache: expected a RowCache or None, found {type(cache).__name__}")
    for name, tensor in (("back_values", back_values), ("back_scales", back_scales)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 2 or tensor.stride(1) != 1:
            found = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name}: expected uint8 [rows, D] / [rows, D // 32] with contiguous rows, found {found}")
    num_rows, head_dim = back_values.shape
    if head_dim == 0 or head_dim % BLOCK_SIZE or tuple(back_scales.shape) != (num_rows, head_dim // BLOCK_SIZE):
        raise ValueError(f"back_scales: expected shape {[num_rows, head_dim // BLOCK_SIZE]} (those of back_values "
                         f"{list(back_values.shape)}), found {list(back_scales.shape)}")
    if cache is not None and cache.head_dim != head_dim:
        raise ValueError(f"cache: expected rows of head_dim {head_dim} (back_values'), found {cache.head_dim}")
    check_launch_ids(hash_ids)
    check_int("row_start", row_start, 0)
    shape = tuple(hash_ids.shape)
    named = [("inverse", inverse)] + ([("slot", slot)] if cache is not None else [])
    if cache is None and (slot is not None or direct is not None):
        raise ValueError("slot, direct: given without a cache (they are a cached probe's)")
    if cache is not None and slot is None:
        raise ValueError("slot: expected the probe's contiguous int32 tensor [T, C] with a cache, found None")
    for name, tensor in named:
        if (not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.dim() != 2
                or not tensor.is_contiguous()):
            found = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name}: expected a contiguous int32 tensor [T, C], found {found}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected the shape of hash_ids {list(shape)}, found {list(tensor.shape)}")
    width = packed_row_bytes(head_dim)
    if (not isinstance(staged, torch.Tensor) or staged.dtype != torch.uint8 or staged.dim() != 2
            or staged.shape[0] < 1 or staged.shape[1] != width or staged.stride(1) != 1 or staged.stride(0) % 4):
        found = f"{staged.dtype} {list(staged.shape)}" if isinstance(staged, torch.Tensor) else type(staged).__name__
        raise ValueError(f"staged: expected uint8 packed rows [>= 1, {width}] (values, scales, padding, tag; rows "
                         f"contiguous), found {found}")
    if direct is not None and (
            not isinstance(direct, torch.Tensor) or direct.dtype != torch.uint8 or direct.dim() != 3
            or tuple(direct.shape[:2]) != shape or direct.shape[2] < head_dim + head_dim // BLOCK_SIZE
            or direct.stride(2) != 1 or direct.stride(0) != direct.shape[1] * direct.stride(1)):
        found = f"{direct.dtype} {list(direct.shape)}" if isinstance(direct, torch.Tensor) else type(direct).__name__
        raise ValueError(f"direct: expected uint8 [{shape[0]}, {shape[1]}, >= {head_dim + head_dim // BLOCK_SIZE}] "
                         f"with rows at one stride (cached_direct_reads' output), found {found}")
    tensors = (hash_ids, back_values, staged, inverse, *(() if cache is None else (cache.tags, slot)),
               *(() if direct is None else (direct,)))
    devices = {str(t.device) for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"hash_ids, back_values, staged, inverse, cache, slot, direct: expected one device, "
                         f"found {sorted(devices)}")
    return head_dim


def _launch_merge(kernel, outputs, hash_ids, row_start, back_values, back_scales, staged, inverse, cache, slot,
                  direct, extra: tuple) -> None:
    tokens, local_columns = hash_ids.shape
    total_rows = tokens * local_columns
    if total_rows == 0:
        return
    rows_per_program = block_rows()
    if total_rows >= 2**31 - rows_per_program:
        raise ValueError(f"hash_ids: T * C = {total_rows} rows per launch; expected fewer than 2**31")
    if hash_ids.is_cuda and hash_ids.device.index != torch.cuda.current_device():
        with torch.cuda.device(hash_ids.device):
            return _launch_merge(kernel, outputs, hash_ids, row_start, back_values, back_scales, staged, inverse,
                                 cache, slot, direct, extra)
    head_dim = back_values.shape[1]
    groups = head_dim // BLOCK_SIZE
    staged_values, staged_scales, staged_tags = staged[:, :head_dim], staged[:, head_dim: head_dim + groups], row_tags(staged)
    has_cache, has_direct = cache is not None, direct is not None
    if has_cache:
        cache_tags, slot_values, slot_scales, num_slots = cache.tags, cache.slot_values, cache.slot_scales, cache.num_slots
    else:  # not read without HAS_CACHE
        cache_tags, slot_values, slot_scales, num_slots, slot = staged_tags, staged_values, staged_scales, 0, inverse
    direct_rows = direct if has_direct else staged  # not read without HAS_DIRECT
    ints = (total_rows, local_columns, hash_ids.stride(0), hash_ids.stride(1), row_start, back_values.shape[0],
            staged.shape[0], staged_values.stride(0), staged_scales.stride(0), staged_tags.stride(0),
            back_values.stride(0), back_scales.stride(0), num_slots, slot_values.stride(0), slot_scales.stride(0),
            direct.stride(1) if has_direct else 0)
    constexprs = (head_dim, 1 << (groups - 1).bit_length(), rows_per_program, has_cache, has_direct, *extra)
    tensors = (hash_ids, inverse, staged_values, staged_scales, staged_tags, back_values, back_scales, slot,
               cache_tags, slot_values, slot_scales, direct_rows, *outputs)
    _LAUNCHERS[kernel](-(-total_rows // rows_per_program), (*tensors, *ints, *constexprs), num_warps=4,
                       num_stages=1, device_index=hash_ids.device.index if hash_ids.is_cuda else 0)


def checked_merge_rows(hash_ids: torch.Tensor, row_start: int, back_values: torch.Tensor, back_scales: torch.Tensor,
                       staged: torch.Tensor, inverse: torch.Tensor, *, cache: RowCache | None = None,
                       slot: torch.Tensor | None = None, direct: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantized rows of ``hash_ids`` from copies checked row by row, else from the backing rows.

    ``out[t, j] = bf16(e4m3(row[:D]) * 2**(row[D:D + D // 32] - 127))`` where ``row`` is local row
    ``r = hash_ids[t, j] - row_start`` of the backing rows, taken from the first copy that was read for ``r``:
    cache slot ``slot[t, j]`` whose tag is ``r``; ``direct[t, j]`` where ``slot[t, j] == -2 - r``;
    ``staged[inverse[t, j]]`` whose tag (its last 4 bytes) is ``r``; else read from ``back_values`` /
    ``back_scales`` in the same launch. +0 where ``r`` is outside ``[0, rows)``. Bit-equal to
    :func:`engram.table.kernels.gather.gather_rows` on the backing rows, whatever the copies hold.

    Args:
        hash_ids: int32/int64 ``[T, C]`` global row ids (any strides), the lookup's own.
        row_start: global row id of ``back_values[0]``.
        back_values, back_scales: ``uint8 [rows, D]`` / ``[rows, D // 32]`` (rows contiguous): the table
            (host rows through their CUDA alias on the GPU).
        staged: ``uint8 [S, packed_row_bytes(D)]`` packed tagged rows, e.g. the host gather's device staging.
        inverse: contiguous int32 ``[T, C]``: each position's staged row (the host gather's ``inverse``).
        cache, slot: optional :class:`RowCache` and its probe's contiguous int32 ``[T, C]`` slots.
        direct: optional ``uint8 [T, C, >= D + D // 32]``: :func:`cached_direct_reads` of ``slot``.
        out: optional contiguous ``bfloat16 [T, C, D]`` to write.

    Returns: ``bfloat16 [T, C, D]``. No sync.
    """
    head_dim = _check_merge(hash_ids, row_start, back_values, back_scales, staged, inverse, cache, slot, direct)
    shape = (hash_ids.shape[0], hash_ids.shape[1], head_dim)
    out = _check_out(out, shape, torch.bfloat16, hash_ids.device)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=hash_ids.device)
    _launch_merge(checked_merge_bf16_kernel, (out,), hash_ids, row_start, back_values, back_scales, staged, inverse,
                  cache, slot, direct, (_DECODE_INTEGER,))
    return out


def checked_merge_rows_packed(hash_ids: torch.Tensor, row_start: int, back_values: torch.Tensor,
                              back_scales: torch.Tensor, staged: torch.Tensor, inverse: torch.Tensor, *,
                              cache: RowCache | None = None, slot: torch.Tensor | None = None,
                              direct: torch.Tensor | None = None,
                              out: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw FP8 bytes of :func:`checked_merge_rows`'s rows (same arguments; ``out``: optional contiguous
    ``(uint8 [T, C, D], uint8 [T, C, D // 32])``) -> ``(values uint8 [T, C, D], scales uint8 [T, C, D // 32])``,
    all-zero bytes outside the table."""
    head_dim = _check_merge(hash_ids, row_start, back_values, back_scales, staged, inverse, cache, slot, direct)
    tokens, columns = hash_ids.shape
    shapes = ((tokens, columns, head_dim), (tokens, columns, head_dim // BLOCK_SIZE))
    out_values, out_scales = _out_pair(out, shapes, torch.uint8, hash_ids.device, "(values, scales)")
    _launch_merge(checked_merge_packed_kernel, (out_values, out_scales), hash_ids, row_start, back_values, back_scales,
                  staged, inverse, cache, slot, direct, ())
    return out_values, out_scales
