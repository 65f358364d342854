"""Launchers of the peer gather kernels (:mod:`engram.table.kernels.peer_gather_kernels`): one table
whose rows are split over ``W`` packed shards, read through a pointer table.

:class:`PeerShards` is checked once (shard shapes, alignment, the pointer table); each call then
checks its ids' structure (kept per structure in a :class:`~engram.call_cache.CallCache` of the
shards) and launches one kernel. No host sync, outputs allocated unless given, capturable in a
CUDA graph. Bit-identical to :func:`engram.table.kernels.gather.gather_rows` /
:func:`~engram.table.kernels.gather.gather_rows_packed` over the concatenated shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engram.call_cache import CallCache, structure
from engram.checks import check_positive_int
from engram.table.fp8 import BLOCK_SIZE
from engram.table.host_memory.rows import packed_row_bytes
from engram.table.kernels.gather import check_lookup_ids
from engram.table.peer_memory import shard_rows
from engram.table.kernels.peer_gather_kernels import peer_gather_rows_bf16_kernel, peer_gather_rows_packed_kernel
from engram.triton_launch import BoundLaunch, CompiledLaunch, interpreting
from engram.tuning import tuning

__all__ = ["PeerShards", "shard_rows", "peer_gather_rows", "peer_gather_rows_packed"]

# Launch shapes: the device gather's (engram.tuning, keys gather.*; benchmarks/NOTES.md "Gather launch
# shapes"); under the interpreter 64 rows a program (about 1 ms per program).
_TUNED = tuning().gather
_BF16_SHAPE = (_TUNED.bf16_block_rows, _TUNED.bf16_num_warps, _TUNED.bf16_vector)  # block rows, warps, bytes per thread
_PACKED_SHAPE = (_TUNED.packed_block_rows, _TUNED.packed_num_warps, 0)
_INTERPRETED_BLOCK_ROWS = 64
_LAUNCHERS = {peer_gather_rows_bf16_kernel: CompiledLaunch(peer_gather_rows_bf16_kernel),
              peer_gather_rows_packed_kernel: CompiledLaunch(peer_gather_rows_packed_kernel)}


class _PeerPlan(NamedTuple):
    out_shapes: tuple[tuple[int, ...], ...]
    grid: int                   # 0: nothing to launch
    ints: tuple
    constexprs: tuple
    column_start: int
    column_end: int
    full_width: bool
    launch: BoundLaunch


@dataclass(eq=False)
class PeerShards:
    """One table's local rows ``[0, num_rows)`` split over ``W`` shards, as the peer kernels read them.

    Args:
        shards: ``W`` tensors ``uint8 [owned_s, packed_row_bytes(D)]``, contiguous, 16-byte aligned:
            shard ``s`` holds rows :func:`shard_rows` ``(num_rows, W, s)`` packed (values ``[:D]``,
            scales ``[D:D + D // 32]``). They may live on other devices (mapped peer memory) or,
            under the interpreter, on the CPU.
        num_rows: rows of the whole table (``< 2**31``).
        head_dim: ``D``, a positive multiple of 32.
        device: where ids are given, the pointer table lives and rows land.

    Holds the shards (they stay alive while it does) and ``bases int64 [W]`` on ``device``.
    """

    shards: tuple[torch.Tensor, ...]
    num_rows: int
    head_dim: int
    device: torch.device
    bases: torch.Tensor = field(init=False)
    rows_per_shard: int = field(init=False)
    row_bytes: int = field(init=False)
    _plans: CallCache = field(init=False, repr=False)

    def __post_init__(self):
        self.shards = tuple(self.shards)
        self.device = torch.device(self.device)
        num_shards = len(self.shards)
        if num_shards < 1:
            raise ValueError("shards: expected at least one shard, found none")
        check_positive_int("num_rows", self.num_rows)
        check_positive_int("head_dim", self.head_dim)
        if self.num_rows >= 2**31:
            raise ValueError(f"num_rows: expected fewer than 2**31 rows (the kernel's int32 row index), "
                             f"found {self.num_rows}")
        if self.head_dim % BLOCK_SIZE:
            raise ValueError(f"head_dim: expected a multiple of {BLOCK_SIZE}, found {self.head_dim}")
        self.row_bytes = packed_row_bytes(self.head_dim)
        for index, shard in enumerate(self.shards):
            start, end = shard_rows(self.num_rows, num_shards, index)
            expected = [end - start, self.row_bytes]
            if not isinstance(shard, torch.Tensor) or shard.dtype != torch.uint8 or list(shard.shape) != expected:
                found = (f"{shard.dtype} {list(shard.shape)}" if isinstance(shard, torch.Tensor)
                         else type(shard).__name__)
                raise ValueError(f"shards[{index}]: expected uint8 {expected} (rows [{start}, {end}) of "
                                 f"{self.num_rows} over {num_shards} shards, packed), found {found}")
            if not shard.is_contiguous() or shard.data_ptr() % 16:
                raise ValueError(f"shards[{index}]: expected a contiguous, 16-byte aligned tensor "
                                 f"(address {shard.data_ptr():#x}, strides {shard.stride()})")
            if (shard.device.type == "cuda") != (self.device.type == "cuda"):
                raise ValueError(f"shards[{index}]: on {shard.device}, the lookups run on {self.device}: "
                                 "a kernel reads CUDA memory from CUDA, host memory under the interpreter")
        self.rows_per_shard = max(1, -(-self.num_rows // num_shards))
        self.bases = torch.tensor([shard.data_ptr() for shard in self.shards], dtype=torch.int64,
                                  device=self.device)
        self.device = self.bases.device  # "cuda" resolved to "cuda:N": ids and outputs compare to it
        self._plans = CallCache(64)

    @property
    def num_shards(self) -> int:
        return len(self.shards)


def _check_ids(peer: PeerShards, hash_ids, row_start, column_start, column_end) -> int:
    column_end = check_lookup_ids(hash_ids, row_start, column_start, column_end)
    if hash_ids.device != peer.device:
        raise ValueError(f"hash_ids: expected a tensor on {peer.device} (the pointer table's device), "
                         f"found {hash_ids.device}")
    return column_end


def _plan(kernel, peer: PeerShards, hash_ids, row_start, column_start, column_end, packed: bool) -> _PeerPlan:
    key = (kernel, structure(hash_ids), type(row_start), row_start, column_start, column_end)
    plan = peer._plans.get(key)
    if plan is not None:
        return plan
    column_end = _check_ids(peer, hash_ids, row_start, column_start, column_end)
    block_rows, num_warps, vector = _PACKED_SHAPE if packed else _BF16_SHAPE
    if interpreting():
        block_rows = _INTERPRETED_BLOCK_ROWS
    tokens, width = hash_ids.shape
    head_dim = peer.head_dim
    groups = head_dim // BLOCK_SIZE
    local_columns = column_end - column_start
    total_rows = tokens * local_columns
    if total_rows >= 2**31 - block_rows:  # the kernels' flattened row index is int32
        raise ValueError(f"hash_ids: T * C_local = {total_rows} rows per launch; expected fewer than 2**31")
    if packed:
        out_shapes = ((tokens, local_columns, head_dim), (tokens, local_columns, groups))
        extra = ()
    else:
        out_shapes = ((tokens, local_columns, head_dim),)
        extra = (vector, 0)  # VECTOR, DECODE (integer: exact under the interpreter too)
    ints = (total_rows, local_columns, hash_ids.stride(0), hash_ids.stride(1), row_start, peer.num_rows,
            peer.rows_per_shard)
    constexprs = (head_dim, 1 << (groups - 1).bit_length(), peer.row_bytes, block_rows, *extra)
    device_index = hash_ids.device.index if hash_ids.is_cuda else 0
    plan = _PeerPlan(out_shapes, -(-total_rows // block_rows), ints, constexprs, column_start, column_end,
                     column_start == 0 and column_end == width,
                     _LAUNCHERS[kernel].bind(num_warps, device_index, num_stages=1))
    return peer._plans.put(key, plan)


def _output(name: str, given, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (not isinstance(given, torch.Tensor) or tuple(given.shape) != shape or given.dtype != dtype
            or given.device != device or not given.is_contiguous()):
        found = (f"{given.dtype} {list(given.shape)} on {given.device}" if isinstance(given, torch.Tensor)
                 else type(given).__name__)
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor {list(shape)} on {device}, found {found}")
    return given


def _launch(kernel, plan: _PeerPlan, peer: PeerShards, hash_ids: torch.Tensor, outputs: tuple) -> None:
    if not plan.grid:
        return
    local_ids = hash_ids if plan.full_width else hash_ids[:, plan.column_start:plan.column_end]
    if local_ids.is_cuda and local_ids.device.index != torch.cuda.current_device():
        with torch.cuda.device(local_ids.device):  # Triton launches on the current device
            plan.launch(plan.grid, (local_ids, peer.bases, *outputs, *plan.ints, *plan.constexprs))
        return
    plan.launch(plan.grid, (local_ids, peer.bases, *outputs, *plan.ints, *plan.constexprs))


def peer_gather_rows(peer: PeerShards, hash_ids: torch.Tensor, row_start: int = 0, column_start: int = 0,
                     column_end: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t, j] = bf16(e4m3(row[:D]) * 2**(row[D:] - 127))`` for the packed row of local row
    ``hash_ids[t, column_start + j] - row_start`` in its shard; +0 for ids outside ``[row_start,
    row_start + num_rows)``. ``hash_ids`` int32/int64 ``[T, C]`` (any strides) on ``peer.device``;
    ``out``: optional contiguous ``bfloat16 [T, C_local, D]``. Returns ``bfloat16 [T, C_local, D]``."""
    plan = _plan(peer_gather_rows_bf16_kernel, peer, hash_ids, row_start, column_start, column_end, False)
    out = _output("out", out, plan.out_shapes[0], torch.bfloat16, peer.device)
    _launch(peer_gather_rows_bf16_kernel, plan, peer, hash_ids, (out,))
    return out


def peer_gather_rows_packed(peer: PeerShards, hash_ids: torch.Tensor, row_start: int = 0, column_start: int = 0,
                            column_end: int | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw FP8 bytes of :func:`peer_gather_rows`' rows: ``(uint8 [T, C_local, D], uint8 [T, C_local,
    D // 32])``, all zeros for ids outside the table; ``out``: optional pair of contiguous tensors."""
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise ValueError(f"out: expected a pair (values, scales) or None, found {type(out).__name__}")
    plan = _plan(peer_gather_rows_packed_kernel, peer, hash_ids, row_start, column_start, column_end, True)
    values = _output("out[0]", None if out is None else out[0], plan.out_shapes[0], torch.uint8, peer.device)
    scales = _output("out[1]", None if out is None else out[1], plan.out_shapes[1], torch.uint8, peer.device)
    _launch(peer_gather_rows_packed_kernel, plan, peer, hash_ids, (values, scales))
    return values, scales
