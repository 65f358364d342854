"""``Engram``: one Engram layer as a ``torch.nn.Module`` — rows -> wkv -> gate,
on one process or over tensor / sequence parallel groups (docs/design.md §1 steps 3-5, §3).

Data movement (``T`` tokens, ``C`` hash columns, ``hd = head_dim``, ``tp`` / ``sp``
group sizes, ``P = ceil(C / tp)`` columns per rank, bf16 rows of ``2 * hd`` bytes):

* **single** (no group): ``table.lookup`` of all ``T x C`` rows; no communication.
* **tensor parallel** (``tp_group``): rank ``r`` owns columns
  ``[r * P, min(C, (r + 1) * P))`` of the table. It looks up those columns for all
  ``T`` tokens, pads them to ``P`` columns, and one ``all_gather`` of
  ``[T, P, hd]`` per rank gives every rank all ``[T, C, hd]`` rows. Every rank then
  runs the same wkv GEMM and gate on the same inputs: the outputs are identical on
  all ranks and to the single-process result. Gathering rows (``C * hd`` values per
  token) instead of all-reducing partial GEMM outputs (``(hc + 1) * D`` values per
  token, 4x more for V4.1) is also what keeps the result bit-exact.
* **sequence parallel** (``sequence_parallel=True``, ``sp_group``, no tensor
  parallel): ``hidden_states`` holds this rank's contiguous token shard, ``hash_ids``
  all tokens. The rank holds the whole table and looks up only its own tokens;
  wkv and gate run on its own tokens; no communication.
* **sequence + tensor parallel over one group** (``tp_group`` and ``sp_group`` are
  the same ranks in the same order): rank ``r`` owns columns ``r * P ...`` and tokens
  ``[start_r, start_r + n_r)``. It looks up its columns for all ``T`` tokens (every
  row of the layer is read exactly once across the group), then one
  ``all_to_all`` (chunks padded to ``[max n, P, hd]``) sends each rank the rows of
  its own tokens: rank ``r`` receives ``[n_r, C, hd]``, ``tp`` times less than the
  tensor-parallel all-gather. wkv and gate run on the rank's own tokens only.
* **sequence x tensor parallel mesh** (the two groups meet only in this rank; the
  tensor-parallel peers hold the same token shard): look up own columns for own
  tokens, ``all_gather`` them over ``tp_group``, wkv and gate on own tokens.

FP8 wkv (``wkv.fp8``): the same movement with FP8 rows (``uint8 [.., hd + hd / 32]``:
E4M3 bytes and UE8M0 scale bytes, 264 B per V4.1 row instead of 512 B of bf16), which the wkv
kernels read as packed rows; without tensor parallelism they read a device table in place, by
hash id. Tensor parallelism stays **gather-first** rather than partial kv sums (each rank
multiplying its own columns by its K-slice of ``wkv`` and all-reducing kv): at T = 8192 the
all-gather moves 8192 x 24 x 264 B x (tp - 1) / tp = 26-45 MB, the all-reduce 2 (tp - 1) / tp x
8192 x 25,600 x 2 B = 419-734 MB (bf16 kv; fp32 partials double it). With the buses measured on
two H200 (227 GB/s for the row all-gather, benchmarks/NOTES.md) the all-reduce alone costs
1.8-3.2 ms, more than the (tp - 1) / tp of a 2.3 ms FP8 GEMM that splitting K would save
(1.15-2.0 ms); and gather-first keeps every rank's result bit-identical to one process.

Bit-exactness: the tensor-parallel mode is bit-identical to one process by
construction (every rank runs the single-process GEMM on the same rows). The
sequence-parallel modes run the wkv GEMM on fewer rows, so they are bit-identical
only where the GEMM's per-row result does not depend on the row count: true of
torch's CPU bf16 GEMM single-threaded (what the tests pin), not promised with
several threads (a probe at K=256, N=192, 2 threads differed for some row counts)
nor by cuBLAS (split-K heuristics). Lookups, the all-gather / all-to-all and the
gate are exact.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from engram.backends import resolve_backend
from engram.call_cache import CallCache
from engram import ops
from engram.checks import check_bool, check_hash_ids, check_positive_int
from engram.common import ceil_div
from engram.ops import compiling
from engram.layer.plan import KvAhead, LayerPlan, plan_key
from engram.table.prefetch import IdsIdentity
from engram.layer.gate import engram_gate_kv
from engram.layer.wkv import WkvProjection

__all__ = ["Engram", "tensor_parallel_columns", "sequence_parallel_sizes"]

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def tensor_parallel_columns(num_columns: int, rank: int, world_size: int) -> tuple[int, int]:
    """Columns ``[rank * P, min(C, (rank + 1) * P))`` with ``P = ceil(C / world_size)``
    (the rule of :meth:`EngramLayout.shard`); ValueError when the rank gets none."""
    per_rank = ceil_div(num_columns, world_size)
    start, end = rank * per_rank, min(num_columns, (rank + 1) * per_rank)
    if start >= end:
        raise ValueError(f"tp_group: rank {rank} of {world_size} gets no hash column ({num_columns} columns, "
                         f"{per_rank} per rank); expected a group size whose ceil(C/tp) split covers every rank")
    return start, end


def sequence_parallel_sizes(num_tokens: int, world_size: int) -> list[int]:
    """Contiguous token shards of the ceil split: rank ``r`` gets
    ``[r * ceil(T / sp), min(T, (r + 1) * ceil(T / sp)))`` (possibly empty)."""
    per_rank = ceil_div(num_tokens, world_size) if num_tokens else 0
    return [max(0, min(num_tokens, (r + 1) * per_rank) - r * per_rank) for r in range(world_size)]


def _token_range(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` of ``tensor``: the tensor itself when that is all of it."""
    return tensor if start == 0 and count == tensor.shape[0] else tensor[start:start + count]


def _all_gather_stacked(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """``output [world, *tensor.shape]`` <- every rank's ``tensor`` (passed in the
    concatenated form ``[world * n, ...]``, which every backend accepts)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output.view(-1, *tensor.shape[1:]), tensor, group=group)


def _group_info(name: str, group) -> tuple[int, int, list[int]]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: expected a process group of an initialized torch.distributed, found "
                         f"torch.distributed not initialized")
    try:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{name}: expected a torch.distributed ProcessGroup, found {group!r} ({error})") from None
    if rank < 0:
        raise ValueError(f"{name}: expected a group this process belongs to, found one of ranks {ranks}")
    return size, rank, list(ranks)


class Engram(torch.nn.Module):
    """One Engram layer: ``out [T, hc, D] = h + g * value`` with ``key, value = wkv(table rows)``.

    Args:
        table: anything with ``lookup(hash_ids [T, C] int) -> bf16 [T, C_local, head_dim]``
            (rows of its columns ``[column_start, column_end)``) and those two attributes;
            ``column_end = None`` means ``C``. Without tensor parallelism it must hold
            all ``C`` columns; with it, exactly the columns of :func:`tensor_parallel_columns`.
            A table whose ``collective`` is True (placement ``"node"``, its rows spread over a
            group: per column shard under tensor parallelism) is looked up on every forward, with
            no tokens too, so every rank of its group calls its lookups in the same order; it is
            never prefetched (:meth:`prefetch` returns None) and has no :meth:`kv_ahead`.
        wkv: the :class:`WkvProjection`, ``[(hc + 1) * D, C * head_dim]``.
        q_weight, k_weight: bf16 ``[hc, D]``.
        eps: ``rms_norm_eps``.
        num_columns: ``C``, hash columns of the layer.
        tp_group: tensor-parallel ``ProcessGroup`` or None.
        sequence_parallel: True when ``hidden_states`` holds only this rank's tokens.
        sp_group: the sequence-parallel ``ProcessGroup`` (required with ``sequence_parallel``).
        gate_backend: ``"auto"`` (default), ``"triton"`` or ``"torch"`` for the gate
            (:mod:`engram.backends`), resolved once here for the device of ``q_weight``.

    The module-level docstring describes the data movement of each mode.
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor

    def __init__(
        self,
        table: Any,
        wkv: WkvProjection,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        *,
        eps: float,
        num_columns: int,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        sp_group: Any = None,
        gate_backend: str = "auto",
    ):
        super().__init__()
        if not isinstance(wkv, WkvProjection):
            raise ValueError(f"wkv: expected a WkvProjection, found {type(wkv).__name__}")
        for name, tensor in (("q_weight", q_weight), ("k_weight", k_weight)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.dtype != torch.bfloat16:
                found = (f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                         else type(tensor).__name__)
                raise ValueError(f"{name}: expected a bfloat16 tensor [hc, D], found {found}")
        if q_weight.shape != k_weight.shape:
            raise ValueError(f"k_weight: expected shape {list(q_weight.shape)} (q_weight's), found {list(k_weight.shape)}")
        hc_mult, hidden = q_weight.shape
        if wkv.out_features != (hc_mult + 1) * hidden:
            raise ValueError(f"wkv: expected (hc + 1) * D = {(hc_mult + 1) * hidden} output features "
                             f"(q_weight is [{hc_mult}, {hidden}]), found {wkv.out_features}")
        check_positive_int("num_columns", num_columns)
        if wkv.in_features % num_columns:
            raise ValueError(f"num_columns: expected a divisor of wkv's {wkv.in_features} input features "
                             f"(C * head_dim), found {num_columns}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps: expected a positive number, found {eps!r}")
        check_bool("sequence_parallel", sequence_parallel)

        self.hc_mult, self.hidden_size = hc_mult, hidden
        self.num_columns = num_columns
        self.head_dim = wkv.in_features // num_columns
        self.eps = float(eps)
        self.gate_backend = resolve_backend(gate_backend, q_weight.device, "the Engram gate")
        self.wkv = wkv
        self.register_buffer("q_weight", q_weight.contiguous())
        self.register_buffer("k_weight", k_weight.contiguous())

        # ---- parallel layout ---------------------------------------------------
        self.tp_group, self.sp_group = tp_group, sp_group
        self.sequence_parallel = sequence_parallel
        self.tp_size, self.tp_rank, tp_ranks = 1, 0, None
        if tp_group is not None:
            self.tp_size, self.tp_rank, tp_ranks = _group_info("tp_group", tp_group)
        self.sp_size, self.sp_rank, sp_ranks = 1, 0, None
        if sequence_parallel:
            if sp_group is None:
                raise ValueError("sp_group: expected the sequence-parallel ProcessGroup with sequence_parallel=True, found None")
            self.sp_size, self.sp_rank, sp_ranks = _group_info("sp_group", sp_group)
        elif sp_group is not None:
            raise ValueError("sp_group: expected None unless sequence_parallel=True, found a group")

        tensor_parallel = self.tp_size > 1
        if not tensor_parallel:
            self.mode = "sequence" if sequence_parallel else "single"
        elif not sequence_parallel or self.sp_size == 1:
            self.mode = "tensor"
        elif tp_ranks == sp_ranks:
            self.mode = "sequence+tensor"      # one group: all_to_all of rows
        elif set(tp_ranks) & set(sp_ranks) == {dist.get_rank()}:
            self.mode = "sequence x tensor"    # 2-D mesh: all_gather over tp of own tokens
        else:
            raise ValueError(f"sp_group: expected the same ranks as tp_group in the same order {tp_ranks}, or a group "
                             f"meeting tp_group only in this rank (a 2-D mesh), found ranks {sp_ranks}")

        self.column_start, self.column_end = tensor_parallel_columns(num_columns, self.tp_rank, self.tp_size)
        self.columns_per_rank = ceil_div(num_columns, self.tp_size)
        self.table = table
        self._check_table(table)
        self._checked_calls = CallCache(64)  # argument structures forward has checked (single mode)
        self._lookups_started = 0  # lookups reached by the current forward (collective tables: see forward)
        self.op_key = ops.register(self)  # names this layer in engram::layer
        self._kv_stream = None  # kv_ahead's side stream (CUDA), made on first use

    @classmethod
    def from_weights(
        cls,
        spec,
        table: Any,
        *,
        wkv_weight: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        wkv_scale: torch.Tensor | None = None,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        sp_group: Any = None,
        gate_backend: str = "auto",
        wkv_backend: str | None = None,
        wkv_small_m: bool | None = None,
    ) -> "Engram":
        """Build from an :class:`EngramSpec` and one layer's checkpoint tensors
        (``engram.wkv.weight`` [+ ``.scale``], ``engram.q_weight``, ``engram.k_weight``), on the
        device of ``wkv_weight``; ``wkv_backend`` and ``wkv_small_m`` as :class:`WkvProjection`'s
        ``backend`` and ``small_m``."""
        expected = [spec.kv_dim, spec.num_columns * spec.head_dim]
        if not isinstance(wkv_weight, torch.Tensor) or list(wkv_weight.shape) != expected:
            found = list(wkv_weight.shape) if isinstance(wkv_weight, torch.Tensor) else type(wkv_weight).__name__
            raise ValueError(f"wkv_weight: expected shape {expected} ((hc_mult + 1) * hidden_size, C * head_dim), found {found}")
        for name, tensor in (("q_weight", q_weight), ("k_weight", k_weight)):
            if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != [spec.hc_mult, spec.hidden_size]:
                found = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name}: expected shape [{spec.hc_mult}, {spec.hidden_size}] (hc_mult, hidden_size), found {found}")
        wkv = WkvProjection(wkv_weight, wkv_scale, spec.weight_block_size if wkv_scale is not None else None,
                            backend=wkv_backend, small_m=wkv_small_m)
        return cls(table, wkv, q_weight, k_weight, eps=spec.rms_norm_eps, num_columns=spec.num_columns,
                   tp_group=tp_group, sequence_parallel=sequence_parallel, sp_group=sp_group,
                   gate_backend=gate_backend)

    # ---- checks --------------------------------------------------------------
    def _check_table(self, table: Any) -> None:
        for attribute in ("lookup", "column_start", "column_end"):
            if not hasattr(table, attribute):
                raise ValueError(f"table: expected an object with lookup(), column_start and column_end, "
                                 f"found {type(table).__name__} without {attribute!r}")
        start = table.column_start
        end = self.num_columns if table.column_end is None else table.column_end
        if (start, end) != (self.column_start, self.column_end):
            raise ValueError(f"table: expected hash columns [{self.column_start}, {self.column_end}) "
                             f"(tensor-parallel rank {self.tp_rank} of {self.tp_size}, C = {self.num_columns}), "
                             f"found [{start}, {end})")

    def _token_layout(self, num_tokens: int, sp_token_counts) -> tuple[list[int], list[int]]:
        """Per sequence-parallel rank: token counts and first token."""
        if not self.sequence_parallel:
            if sp_token_counts is not None:
                raise ValueError("sp_token_counts: expected None without sequence_parallel, found "
                                 f"{list(sp_token_counts)!r}")
            return [num_tokens], [0]
        if sp_token_counts is None:
            counts = sequence_parallel_sizes(num_tokens, self.sp_size)
        else:
            counts = list(sp_token_counts)
            if (len(counts) != self.sp_size
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
                    or sum(counts) != num_tokens):
                raise ValueError(f"sp_token_counts: expected {self.sp_size} non-negative integers summing to the "
                                 f"{num_tokens} tokens of hash_ids, found {counts!r}")
        starts = [sum(counts[:r]) for r in range(len(counts))]
        return counts, starts

    # ---- rows ------------------------------------------------------------------
    @property
    def collective(self) -> bool:
        """Whether the table's lookups are collectives (placement ``"node"``): every rank of its group
        then calls every lookup, with no tokens too, and nothing is prefetched."""
        return bool(getattr(self.table, "collective", False))

    def _lookup(self, hash_ids: torch.Tensor, device: torch.device, prefetch=None) -> torch.Tensor:
        """This rank's columns for the tokens of ``hash_ids [n, C]``: bf16 ``[n, C_local, hd]``."""
        local_columns = self.column_end - self.column_start
        if hash_ids.shape[0] == 0 and not self.collective:
            return torch.empty(0, local_columns, self.head_dim, dtype=torch.bfloat16, device=device)
        self._lookups_started += 1
        rows = self.table.lookup(hash_ids) if prefetch is None else self.table.lookup(hash_ids, prefetch=prefetch)
        expected = [hash_ids.shape[0], local_columns, self.head_dim]
        if not isinstance(rows, torch.Tensor) or list(rows.shape) != expected or rows.dtype != torch.bfloat16:
            found = f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"table.lookup: expected a bfloat16 tensor {expected} [T, C_local, head_dim], found {found}")
        return rows

    def _lookup_packed(self, hash_ids: torch.Tensor, device: torch.device, prefetch=None) -> torch.Tensor:
        """This rank's columns for the tokens of ``hash_ids [n, C]`` as FP8 rows:
        ``uint8 [n, C_local, hd + hd / 32]`` (E4M3 bytes, then the UE8M0 scale bytes of each row)."""
        local_columns = self.column_end - self.column_start
        width = self.head_dim + self.head_dim // 32
        if hash_ids.shape[0] == 0 and not self.collective:
            return torch.empty(0, local_columns, width, dtype=torch.uint8, device=device)
        self._lookups_started += 1
        values, scales = (self.table.lookup_packed(hash_ids) if prefetch is None
                          else self.table.lookup_packed(hash_ids, prefetch=prefetch))
        return torch.cat([values.view(torch.uint8), scales], dim=-1)

    def _pad_columns(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, C_local, w]`` -> ``[n, P, w]`` (zeros right of the rank's columns), contiguous."""
        if rows.shape[1] == self.columns_per_rank:
            return rows.contiguous()
        padded = rows.new_zeros(rows.shape[0], self.columns_per_rank, rows.shape[2])
        padded[:, : rows.shape[1]] = rows
        return padded

    def _unshard_columns(self, received: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[tp, >= n, P, w]`` (chunk ``s`` = rank ``s``'s columns) -> ``[n, C, w]``."""
        width = received.shape[-1]
        rows = received[:, :num_tokens].permute(1, 0, 2, 3).reshape(num_tokens, self.tp_size * self.columns_per_rank,
                                                                     width)
        return rows[:, : self.num_columns].contiguous()

    def gather_rows(self, hash_ids: torch.Tensor, counts: Sequence[int], starts: Sequence[int],
                    device: torch.device, prefetch=None) -> torch.Tensor:
        """bf16 ``[n, C, head_dim]``: all columns' rows of this rank's ``n`` tokens (see the module docstring)."""
        return self._gather(hash_ids, counts, starts, device, self._lookup, self.head_dim, torch.bfloat16,
                            prefetch)

    def gather_packed_rows(self, hash_ids: torch.Tensor, counts: Sequence[int], starts: Sequence[int],
                           device: torch.device, prefetch=None) -> torch.Tensor:
        """FP8 rows ``uint8 [n, C, hd + hd / 32]`` (E4M3 bytes, then scale bytes) of this rank's
        ``n`` tokens: the same data movement as :meth:`gather_rows` with 264 bytes per V4.1 row
        instead of 512."""
        return self._gather(hash_ids, counts, starts, device, self._lookup_packed,
                            self.head_dim + self.head_dim // 32, torch.uint8, prefetch)

    def lookup_ids(self, hash_ids: torch.Tensor, counts: Sequence[int], starts: Sequence[int]) -> torch.Tensor | None:
        """The view of ``hash_ids [T, C]`` this rank's table lookup reads (None: it reads none): its own
        tokens, or all tokens in mode ``"sequence+tensor"`` (own columns of every token). A collective
        table is read on every call, with no tokens too (an empty view)."""
        start, count = starts[self.sp_rank], counts[self.sp_rank]
        if self.mode == "sequence+tensor":
            return hash_ids if max(counts) > 0 or self.collective else None
        return _token_range(hash_ids, start, count) if count > 0 or self.collective else None

    def prefetch(self, hash_ids: torch.Tensor, *, sp_token_counts: Sequence[int] | None = None):
        """Start reading the rows that :meth:`forward` of ``hash_ids int [T, C]`` (with the same
        ``sp_token_counts``) will look up on this rank, exactly those; returns the table's handle for
        ``forward(..., prefetch=handle)``, or None when this rank looks up nothing. None for a
        collective table: its rows are exchanged by the lookup itself, on every rank, and a read
        started here on some ranks only would not be matched by the others."""
        check_hash_ids(hash_ids, columns=self.num_columns)
        counts, starts = self._token_layout(hash_ids.shape[0], sp_token_counts)
        if self.collective:
            return None
        ids = self.lookup_ids(hash_ids, counts, starts)
        if ids is None or not hasattr(self.table, "prefetch"):
            return None
        return self.table.prefetch(ids)

    def _gather(self, hash_ids, counts, starts, device, lookup, width: int, dtype: torch.dtype,
                prefetch=None) -> torch.Tensor:
        """``[n, C, width]`` rows of this rank's tokens, ``lookup(ids, device) -> [m, C_local, width]``."""
        rank = self.sp_rank
        start, count = starts[rank], counts[rank]
        if prefetch is not None:
            lookup = functools.partial(lookup, prefetch=prefetch)
        if self.mode in ("single", "sequence"):
            return lookup(_token_range(hash_ids, start, count), device)
        if self.mode in ("tensor", "sequence x tensor"):
            # The tensor-parallel peers hold the same tokens: gather their columns.
            if count == 0:  # every peer has no token either: no all_gather
                if self.collective:  # but the table's group (per column shard) may have tokens elsewhere
                    lookup(hash_ids[start:start], device)
                return torch.empty(0, self.num_columns, width, dtype=dtype, device=device)
            local = self._pad_columns(lookup(hash_ids[start:start + count], device))
            received = local.new_empty(self.tp_size, *local.shape)
            _all_gather_stacked(received, local, self.tp_group)
            return self._unshard_columns(received, count)
        # "sequence+tensor": own columns of all tokens, all_to_all so each rank gets its tokens.
        chunk = max(counts)
        if chunk == 0:  # no token in the group (T = 0): no all_to_all
            if self.collective:
                lookup(hash_ids, device)
            return torch.empty(0, self.num_columns, width, dtype=dtype, device=device)
        local = lookup(hash_ids, device)
        send = local.new_zeros(self.tp_size, chunk, self.columns_per_rank, width)
        for destination in range(self.tp_size):
            first, n = starts[destination], counts[destination]
            send[destination, :n, : local.shape[1]] = local[first:first + n]
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.tp_group)
        return self._unshard_columns(received, count)

    def project(self, hash_ids: torch.Tensor, counts: Sequence[int], starts: Sequence[int],
                device: torch.device, prefetch=None) -> torch.Tensor:
        """``kv`` bf16 ``[n, (hc + 1) * D]`` of this rank's tokens: rows -> wkv.

        bf16 wkv: :meth:`gather_rows`, then the bf16 GEMM. FP8 wkv: without tensor parallelism,
        a table whose bytes live on the compute device is read in place by the wkv kernels
        (:meth:`EngramTable.rows_in_place`); otherwise FP8 rows are gathered first
        (:meth:`gather_packed_rows`, all-gathered across tensor-parallel ranks) and the kernels
        read them as packed rows.
        """
        if not self.wkv.fp8:
            return self.wkv(self.gather_rows(hash_ids, counts, starts, device, prefetch))
        if self.mode in ("single", "sequence") and hasattr(self.table, "rows_in_place"):
            start, count = starts[self.sp_rank], counts[self.sp_rank]
            source = self.table.rows_in_place(_token_range(hash_ids, start, count))
            if source is not None:
                values, scales, local_ids, row_start = source
                return self.wkv.forward_fp8_rows(values, scales, local_ids, row_start)
        packed = self.gather_packed_rows(hash_ids, counts, starts, device, prefetch)
        return self.wkv.forward_fp8_rows(packed[..., : self.head_dim], packed[..., self.head_dim:])

    # ---- forward ---------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        hash_ids: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        sp_token_counts: Sequence[int] | None = None,
        prefetch=None,
        kv_ahead: KvAhead | None = None,
    ) -> torch.Tensor:
        """``out [n, hc, D] = h + g * value`` (docs/design.md §2 "Gate"), dtype of ``hidden_states``.

        Args:
            hidden_states: bf16 ``[n, hc, D]``; ``n = T``, or with sequence parallelism
                this rank's ``n`` tokens (a contiguous shard).
            hash_ids: int32/int64 ``[T, C]``, all tokens (global row ids).
            token_mask: bool ``[T]`` or ``[n]`` (False = dead token: output = input bit
                for bit), or None.
            sp_token_counts: tokens per sequence-parallel rank (same list on every rank);
                default the ceil split of :func:`sequence_parallel_sizes`.
            prefetch: the handle :meth:`prefetch` returned for this ``hash_ids`` (or None); served only
                while valid (:mod:`engram.table.prefetch`).
            kv_ahead: what :meth:`kv_ahead` returned for this very ``hash_ids`` (or None): only the gate
                runs; for other ids (or a second use) kv is computed here.

        Every rank of a group must call forward with the same ``hash_ids`` (and counts). Under
        ``torch.compile`` the call is the custom op ``engram::layer`` (:mod:`engram.ops`).
        """
        if compiling():
            if sp_token_counts is not None:
                raise ValueError("sp_token_counts: not supported under torch.compile")
            return ops.layer(self, -1, hidden_states, hash_ids, token_mask, None)
        if sp_token_counts is None and kv_ahead is None and self.mode == "single":
            # The common eager call, straight to its plan (this call's host time is most of a decode
            # layer's: 60-110 us on the H200's hosts); collective tables take the guarded path below.
            plan = self._checked_calls.get(plan_key(self, hidden_states, hash_ids, token_mask))
            if plan is not None and plan.table is self.table and not plan.collective:
                return plan.launch(hidden_states, hash_ids, token_mask, prefetch)
        return self._forward_eagerly(hidden_states, hash_ids, token_mask, sp_token_counts, prefetch, kv_ahead)

    def layer_eagerly(self, layer_id, hidden_states, hash_ids, token_mask, prefetch) -> torch.Tensor:
        """The eager forward (the body of the custom op ``engram::layer`` for a lone layer)."""
        return self._forward_eagerly(hidden_states, hash_ids, token_mask, None, prefetch)

    def _forward_eagerly(self, hidden_states, hash_ids, token_mask, sp_token_counts, prefetch,
                         kv_ahead=None) -> torch.Tensor:
        if not self.collective:
            return self._forward_unguarded(hidden_states, hash_ids, token_mask, sp_token_counts, prefetch, kv_ahead)
        # A collective table: a rank that refuses its arguments before reaching the lookup still tells
        # the table's group (which then raises too), instead of leaving the other ranks waiting in it.
        self._lookups_started = 0
        try:
            return self._forward_unguarded(hidden_states, hash_ids, token_mask, sp_token_counts, prefetch, kv_ahead)
        except ValueError:
            refuse = getattr(self.table, "refuse_lookup", None)
            if self._lookups_started == 0 and refuse is not None:
                refuse()
            raise

    def _forward_unguarded(self, hidden_states, hash_ids, token_mask, sp_token_counts, prefetch,
                           kv_ahead=None) -> torch.Tensor:
        if sp_token_counts is None and self.mode == "single":
            key = plan_key(self, hidden_states, hash_ids, token_mask)
            plan = self._checked_calls.get(key)
            if plan is None:
                plan = self._checked_calls.put(key, LayerPlan(self, hidden_states, hash_ids, token_mask, key=key))
            kv = kv_ahead.consume(hash_ids) if kv_ahead is not None else None
            return plan.launch(hidden_states, hash_ids, token_mask, prefetch, kv)
        if kv_ahead is not None:
            raise ValueError(f"kv_ahead: layers of mode {self.mode!r} compute kv in forward; expected None")
        return self.forward_checked(hidden_states, hash_ids, token_mask, sp_token_counts, prefetch=prefetch)

    def kv_ahead(self, hash_ids: torch.Tensor, prefetch=None) -> KvAhead:
        """``kv`` of ``hash_ids int [T, C]`` (lookup, then wkv) started now, for ``forward(...,
        kv_ahead=...)`` of the same tensor, which then runs only the gate. On CUDA it runs on a side stream
        that first waits for the current one (capturable: the fork and the join are events), so a later
        layer's kv overlaps the decoder; on the CPU now. Single-process layers, not with a collective
        table: a forward whose kv ahead no longer holds would look up again on one rank alone."""
        if self.mode != "single":
            raise ValueError(f"kv_ahead: layers of mode {self.mode!r} compute kv in forward")
        if self.collective:
            raise ValueError(f"kv_ahead: the table {self.table!r} serves lookups as collectives; a forward that "
                             "could not use the kv ahead would look it up again on this rank alone")
        check_hash_ids(hash_ids, columns=self.num_columns)
        device = self.q_weight.device
        identity = IdsIdentity.of(hash_ids)
        if device.type != "cuda":
            return KvAhead(self.project(hash_ids, [hash_ids.shape[0]], [0], device, prefetch), None, identity)
        main = torch.cuda.current_stream(device)
        if self._kv_stream is None:
            self._kv_stream = torch.cuda.Stream(device)
        side = self._kv_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            kv = self.project(hash_ids, [hash_ids.shape[0]], [0], device, prefetch)
        hash_ids.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        return KvAhead(kv, done, identity)

    def plan(self, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
             token_mask: torch.Tensor | None = None) -> LayerPlan:
        """The :class:`~engram.layer.plan.LayerPlan` of calls with these arguments' structure: every check
        and choice made now; ``plan.run(...)`` then only launches (single-process layers)."""
        return LayerPlan(self, hidden_states, hash_ids, token_mask)

    def _apply(self, fn, *args, **kwargs):
        self._checked_calls.clear()  # steps hold views and launch plans of the tensors being replaced
        return super()._apply(fn, *args, **kwargs)

    def forward_checked(self, hidden_states, hash_ids, token_mask, sp_token_counts, check_only: bool = False,
                        prefetch=None):
        """:meth:`forward` with every check on this call (``check_only``: the checks alone)."""
        check_hash_ids(hash_ids, columns=self.num_columns)
        num_tokens = hash_ids.shape[0]
        counts, starts = self._token_layout(num_tokens, sp_token_counts)
        start, count = starts[self.sp_rank], counts[self.sp_rank]

        if not isinstance(hidden_states, torch.Tensor):
            raise ValueError(f"hidden_states: expected a torch.Tensor, found {type(hidden_states).__name__}")
        expected = [count, self.hc_mult, self.hidden_size]
        if list(hidden_states.shape) != expected:
            what = (f"this rank's {count} of {num_tokens} tokens" if self.sequence_parallel else "T from hash_ids")
            raise ValueError(f"hidden_states: expected shape {expected} ({what}, hc, D), found {list(hidden_states.shape)}")
        if hidden_states.dtype not in _HIDDEN_DTYPES:
            raise ValueError(f"hidden_states: expected dtype torch.bfloat16 (or float16/float32), found {hidden_states.dtype}")
        if hidden_states.device != self.q_weight.device:
            raise ValueError(f"hidden_states: expected device {self.q_weight.device} (the layer's), found {hidden_states.device}")

        if token_mask is not None:
            if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
                found = token_mask.dtype if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
                raise ValueError(f"token_mask: expected a torch.bool tensor or None, found {found}")
            if list(token_mask.shape) == [num_tokens]:
                token_mask = token_mask[start:start + count]
            elif list(token_mask.shape) != [count]:
                expected = (f"[{num_tokens}] (all tokens) or [{count}] (this rank's)" if count != num_tokens
                            else f"[{num_tokens}] (T from hash_ids)")
                raise ValueError(f"token_mask: expected shape {expected}, found {list(token_mask.shape)}")
            token_mask = token_mask.to(hidden_states.device)
        if check_only:
            return None

        kv = self.project(hash_ids, counts, starts, hidden_states.device, prefetch)
        # The fused Triton gate on CUDA (keys and value read in place from kv), torch on the CPU.
        return engram_gate_kv(hidden_states, kv, self.q_weight, self.k_weight, self.eps, token_mask,
                              backend=self.gate_backend)

    def extra_repr(self) -> str:
        return (f"hc_mult={self.hc_mult}, hidden_size={self.hidden_size}, num_columns={self.num_columns}, "
                f"head_dim={self.head_dim}, eps={self.eps}, mode={self.mode!r}, "
                f"columns=[{self.column_start}, {self.column_end}), tp={self.tp_size}, sp={self.sp_size}")
