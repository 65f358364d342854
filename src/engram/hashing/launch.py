"""Launcher of the Triton hash kernels (:mod:`engram.hashing.kernels`).

One batch is up to three launches on the caller's stream, in this order: slot
writes, the hash, history writes. The stream orders them; no program waits on
another, so any number of hashers and streams may run at once. Where the order
needs no second launch (a one-program grid orders its own writes and reads; one
request, or a ``fused_write`` slot cache, reads no slot the batch writes), the
hash kernel makes the writes itself and the extra launches are skipped: a decode
step of one token is one launch.

Safe under CUDA-graph capture: no host sync, no host-to-device copies. Sizes are
not specialization keys: the compiled variants are bounded (tokens per program: 3
batch-size bands; request ends per compare chunk: powers of two up to 128).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engram.common import ceil_div, next_power_of_2
from engram.triton_launch import BoundLaunch, CompiledLaunch
from engram.tuning import tuning

__all__ = ["HashConstants", "HashLaunchPlan", "PreparedHash", "launch_hash_kernels", "plan_hash_launch",
           "prepare_hash_launch", "run_hash_launch", "block_tokens_for"]

# Launch shapes, read once from the device kind's tuning file (engram.tuning, keys hash.*; each cites its
# measurement): tokens per program by batch size ((largest T, tokens)), one warp per program; request ends
# compared per loop step (the most); tokens (and requests, for lookback seeds) per slot-writer program;
# requests per history-writer program (each a row of up to 16 ring cells).
_TUNED = tuning().hash
_BLOCK_TOKENS_BY_BATCH = tuple((band.max_tokens, band.block_tokens) for band in _TUNED.block_tokens_by_batch)
_BLOCK_TOKENS_LARGEST, _NUM_WARPS = _TUNED.block_tokens_largest, _TUNED.num_warps
_REQUEST_CHUNK_LARGEST = _TUNED.request_chunk_largest
_WRITE_BLOCK = _TUNED.write_block
_HISTORY_BLOCK = _TUNED.history_block

# Launch-shape overrides for benchmark sweeps ({"block_tokens": 32, "num_warps": 2}).
LAUNCH_OVERRIDE: dict[str, int] = {}


def block_tokens_for(num_tokens: int) -> int:
    """Tokens per hash program for a batch of ``num_tokens``."""
    for limit, block_tokens in _BLOCK_TOKENS_BY_BATCH:
        if num_tokens <= limit:
            return block_tokens
    return _BLOCK_TOKENS_LARGEST


class HashConstants(NamedTuple):
    """What the kernels need of a hasher, built once (:class:`~engram.hashing.batch.NgramHasher`)."""

    token_map: torch.Tensor           # int32 [V]: raw id -> compressed id
    multipliers: torch.Tensor         # int64 [L, N]
    column_primes: torch.Tensor       # int64 [L, C]
    barrett_multipliers: torch.Tensor # int64 [L, C], floor((2**64 - 1) / prime) as uint64 bits
    column_offsets: torch.Tensor      # int64 [L, C]
    vocab_size: int                   # raw token ids
    pad_id: int                       # compressed id of the pad token
    num_layers: int
    max_ngram_size: int
    n_heads: int
    device_index: int

    @property
    def padded_sizes(self) -> tuple[int, int, int]:
        """Powers of two >= layers, columns and history length (the kernels' tile sizes)."""
        history = self.max_ngram_size - 1
        return (next_power_of_2(self.num_layers), next_power_of_2(history * self.n_heads),
                next_power_of_2(history))


_hash_launch: CompiledLaunch | None = None
_slot_launch: CompiledLaunch | None = None
_history_launch: CompiledLaunch | None = None


def _launchers() -> tuple[CompiledLaunch, CompiledLaunch, CompiledLaunch]:
    global _hash_launch, _slot_launch, _history_launch
    if _hash_launch is None:
        from engram.hashing.kernels import history_write_kernel, ngram_hash_kernel, slot_write_kernel

        _hash_launch = CompiledLaunch(ngram_hash_kernel)
        _slot_launch = CompiledLaunch(slot_write_kernel)
        _history_launch = CompiledLaunch(history_write_kernel)
    return _hash_launch, _slot_launch, _history_launch


_PADDED_SIZES: dict[tuple, tuple[int, int, int]] = {}


def _padded_sizes(constants: HashConstants) -> tuple[int, int, int]:
    key = (constants.num_layers, constants.max_ngram_size, constants.n_heads)
    sizes = _PADDED_SIZES.get(key)
    if sizes is None:
        sizes = _PADDED_SIZES[key] = constants.padded_sizes
    return sizes


class _KernelLaunch(NamedTuple):
    """One launch of a plan: grid, the bound launch of its call structure (variant from the
    kernel's rules, prepared from the first call's arguments), and the arguments after the tensors."""

    grid: int
    launch: BoundLaunch
    scalars: tuple  # ints, then constexprs, in the kernel's parameter order


class HashLaunchPlan(NamedTuple):
    """Every decision of a batch's launches that depends only on its shapes, dtypes and the
    bound stores (:func:`plan_hash_launch`); :func:`run_hash_launch` applies it to the tensors."""

    num_tokens: int
    copy_lookback: bool       # a non-contiguous lookback is copied first
    copy_lookback_dead: bool
    copy_block_table: bool    # a block table with non-unit column stride is copied first
    uses_history: bool
    slot_launch: _KernelLaunch | None
    hash_launch: _KernelLaunch
    history_launch: _KernelLaunch | None
    num_warps: int


def plan_hash_launch(constants: HashConstants, batch, slot_cache=None, history=None, fused_slot_write=False,
                     with_missing_shift: bool = False) -> HashLaunchPlan:
    """The launches of :func:`launch_hash_kernels` for ``batch`` (shape-checked), decided from
    its shapes, dtypes and strides and the stores' geometry alone: the same for every batch
    with the same structure, so a caller may keep it (see :class:`NgramHasher`)."""
    hash_launcher, slot_launcher, history_launcher = _launchers()
    device_index = constants.device_index
    num_tokens, num_requests = batch.num_tokens, batch.num_requests
    history_length = constants.max_ngram_size - 1
    lookback, lookback_dead, block_table = batch.lookback_token_ids, batch.lookback_dead_mask, batch.block_table
    copy_lookback = lookback is not None and not lookback.is_contiguous()
    copy_lookback_dead = lookback_dead is not None and not lookback_dead.is_contiguous()
    copy_block_table = block_table is not None and block_table.stride(1) != 1
    write_slots = slot_cache is not None and batch.slot_mapping is not None
    write_seeds = slot_cache is not None and lookback is not None and block_table is not None
    read_slots = slot_cache is not None and block_table is not None
    uses_history = history is not None and batch.request_rows is not None

    block_tokens = LAUNCH_OVERRIDE.get("block_tokens", block_tokens_for(num_tokens))
    num_warps = LAUNCH_OVERRIDE.get("num_warps", _NUM_WARPS)
    write_items = max(num_tokens, num_requests) if write_seeds else num_tokens
    lone_program = ceil_div(write_items, block_tokens) == 1
    slots_in_hash = (write_slots or write_seeds) and (not read_slots or lone_program or num_requests <= 1
                                                       or fused_slot_write)
    # A one-program grid that another request of the batch may read from writes first.
    slots_before_reads = (slots_in_hash and read_slots and lone_program and num_requests > 1
                          and not fused_slot_write)
    num_hash_programs = ceil_div(write_items if slots_in_hash else num_tokens, block_tokens)
    history_in_hash = uses_history and num_hash_programs == 1

    slot_geometry = (slot_cache.block_size if slot_cache is not None else 1,
                     slot_cache.num_slots if slot_cache is not None else 1,
                     block_table.shape[1] if block_table is not None else 1,
                     (block_table.shape[1] if copy_block_table else block_table.stride(0))
                     if block_table is not None else 0)
    history_geometry = (history.width if uses_history else 1, history.max_requests if uses_history else 0)
    has_dead, has_lookback = batch.dead_mask is not None, lookback is not None
    has_lookback_dead = lookback_dead is not None
    layers_pad, columns_pad, history_pad = _padded_sizes(constants)
    width_pad = next_power_of_2(history.width) if uses_history else 1

    slot_launch = None
    if (write_slots or write_seeds) and not slots_in_hash:
        constexprs = (history_length, history_pad, has_dead, has_lookback_dead, write_slots, write_seeds,
                      _WRITE_BLOCK)
        slot_launch = _KernelLaunch(ceil_div(write_items, _WRITE_BLOCK), slot_launcher.bind(1, device_index),
                                    (num_tokens, num_requests, constants.vocab_size, *slot_geometry, *constexprs))

    constexprs = (constants.num_layers, layers_pad, constants.max_ngram_size,
                  history_pad, constants.n_heads, columns_pad,
                  has_dead, has_lookback, has_lookback_dead, read_slots, uses_history,
                  write_slots and slots_in_hash, write_seeds and slots_in_hash,
                  slots_before_reads, history_in_hash,
                  width_pad, with_missing_shift, block_tokens, _HISTORY_BLOCK,
                  min(_REQUEST_CHUNK_LARGEST, next_power_of_2(max(num_requests, 2))))
    hash_launch = _KernelLaunch(num_hash_programs, hash_launcher.bind(num_warps, device_index),
                                (num_tokens, num_requests, constants.vocab_size, constants.pad_id, *slot_geometry,
                                 *history_geometry, *constexprs))

    history_launch = None
    if uses_history and not history_in_hash and num_requests > 0:
        constexprs = (history_length, history_pad, has_dead, has_lookback, has_lookback_dead, _HISTORY_BLOCK,
                      width_pad)
        history_launch = _KernelLaunch(ceil_div(num_requests, _HISTORY_BLOCK), history_launcher.bind(1, device_index),
                                       (num_tokens, num_requests, constants.vocab_size, *history_geometry,
                                        *constexprs))
    return HashLaunchPlan(num_tokens, copy_lookback, copy_lookback_dead, copy_block_table, uses_history,
                          slot_launch, hash_launch, history_launch, num_warps)


def run_hash_launch(plan: HashLaunchPlan, constants: HashConstants, batch, slot_cache=None, history=None,
                    missing_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Launch ``plan`` (made by :func:`plan_hash_launch` for a batch of the same structure) on
    ``batch``'s tensors: hash ids int32 ``[T, L, C]``."""
    out = torch.empty((plan.num_tokens, constants.num_layers, (constants.max_ngram_size - 1) * constants.n_heads),
                      dtype=torch.int32, device=constants.token_map.device)
    if plan.num_tokens == 0:
        return out
    placeholder = constants.token_map  # any device tensor stands in for an absent input (never read)
    lookback, lookback_dead, block_table = batch.lookback_token_ids, batch.lookback_dead_mask, batch.block_table
    if plan.copy_lookback:
        lookback = lookback.contiguous()
    if plan.copy_lookback_dead:
        lookback_dead = lookback_dead.contiguous()
    if plan.copy_block_table:
        block_table = block_table.contiguous()
    dead_mask = batch.dead_mask
    # Arguments shared by the three kernels, in their parameter order.
    inputs = (batch.input_ids, batch.positions, batch.query_start_loc,
              dead_mask if dead_mask is not None else placeholder, constants.token_map,
              lookback if lookback is not None else placeholder,
              lookback_dead if lookback_dead is not None else placeholder)
    slot_mapping = batch.slot_mapping if batch.slot_mapping is not None else placeholder
    table = block_table if block_table is not None else placeholder
    slot_values = slot_cache.values if slot_cache is not None else placeholder
    if plan.uses_history:
        history_tensors = (batch.request_rows, history.values, history.tags)
    else:
        history_tensors = (placeholder, placeholder, placeholder)
    launch = plan.slot_launch
    if launch is not None:
        launch.launch(launch.grid, (*inputs, slot_mapping, table, slot_values, *launch.scalars))
    launch = plan.hash_launch
    launch.launch(launch.grid, (*inputs, slot_mapping, table, slot_values, *history_tensors,
                                constants.multipliers, constants.column_primes, constants.barrett_multipliers,
                                constants.column_offsets, out,
                                missing_shift if missing_shift is not None else placeholder, *launch.scalars))
    launch = plan.history_launch
    if launch is not None:
        launch.launch(launch.grid, (*inputs, *history_tensors, *launch.scalars))
    return out


class PreparedHash:
    """:func:`run_hash_launch` of one plan with everything but the caller's tensors made once:
    the bound launches (:class:`~engram.triton_launch.BoundLaunch`), the hasher's constant
    arguments and the output's shape. ``prepared(input_ids, positions, query_start_loc,
    dead_mask, lookback_token_ids, lookback_dead_mask, slot_mapping, block_table,
    request_rows) -> int32 [T, L, C]``, for batches of the plan's structure only
    (the caller keys it by :func:`~engram.call_cache.structure`). Made by
    :func:`prepare_hash_launch` for plans that need no per-call copy.
    """

    __slots__ = ("_slot", "_hash", "_history", "_slot_grid", "_hash_grid", "_history_grid", "_slot_scalars",
                 "_hash_scalars", "_history_scalars", "_constants", "_token_map", "_out_shape", "_device",
                 "_slot_cache", "_request_history")

    def __init__(self, plan: HashLaunchPlan, constants: HashConstants, slot_cache=None, history=None):
        self._slot = self._hash = self._history = None
        self._slot_grid = self._hash_grid = self._history_grid = 0
        self._slot_scalars = self._hash_scalars = self._history_scalars = ()
        if plan.slot_launch is not None:
            self._slot = plan.slot_launch.launch
            self._slot_grid, self._slot_scalars = plan.slot_launch.grid, plan.slot_launch.scalars
        self._hash = plan.hash_launch.launch
        self._hash_grid, self._hash_scalars = plan.hash_launch.grid, plan.hash_launch.scalars
        if plan.history_launch is not None:
            self._history = plan.history_launch.launch
            self._history_grid, self._history_scalars = plan.history_launch.grid, plan.history_launch.scalars
        self._constants = (constants.multipliers, constants.column_primes, constants.barrett_multipliers,
                           constants.column_offsets)
        self._token_map = constants.token_map
        self._out_shape = (plan.num_tokens, constants.num_layers,
                           (constants.max_ngram_size - 1) * constants.n_heads)
        self._device = constants.token_map.device
        self._slot_cache = slot_cache
        self._request_history = history if plan.uses_history else None

    def __call__(self, input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead_mask,
                 slot_mapping, block_table, request_rows) -> torch.Tensor:
        out = torch.empty(self._out_shape, dtype=torch.int32, device=self._device)
        token_map = placeholder = self._token_map  # the placeholder stands in for an absent input (never read)
        inputs = (input_ids, positions, query_start_loc, placeholder if dead_mask is None else dead_mask,
                  token_map, placeholder if lookback_token_ids is None else lookback_token_ids,
                  placeholder if lookback_dead_mask is None else lookback_dead_mask,
                  placeholder if slot_mapping is None else slot_mapping,
                  placeholder if block_table is None else block_table)
        slot_values = placeholder if self._slot_cache is None else self._slot_cache.values
        history = self._request_history
        history_tensors = ((placeholder, placeholder, placeholder) if history is None
                           else (request_rows, history.values, history.tags))
        if self._slot is not None:
            self._slot(self._slot_grid, (*inputs, slot_values, *self._slot_scalars))
        self._hash(self._hash_grid, (*inputs, slot_values, *history_tensors, *self._constants, out, placeholder,
                                     *self._hash_scalars))
        if self._history is not None:
            self._history(self._history_grid, (*inputs[:7], *history_tensors, *self._history_scalars))
        return out


def prepare_hash_launch(plan: HashLaunchPlan, constants: HashConstants, slot_cache=None,
                        history=None) -> PreparedHash | None:
    """A :class:`PreparedHash` of ``plan`` (sharing its bound launches), or None where its calls
    need per-call work beyond launching (copies of non-contiguous inputs, an empty batch)."""
    if plan.num_tokens == 0 or plan.copy_lookback or plan.copy_lookback_dead or plan.copy_block_table:
        return None
    return PreparedHash(plan, constants, slot_cache, history)


def launch_hash_kernels(constants: HashConstants, batch, slot_cache=None, history=None, fused_slot_write=False,
                        missing_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Hash ids int32 ``[T, L, C]`` of ``batch`` (a shape-checked
    :class:`~engram.hashing.validation.BatchMetadata`); writes the bound ``slot_cache``
    (:class:`~engram.hashing.stores.SlotCache`) before any read of it and the
    ``history`` (:class:`~engram.hashing.stores.RequestHistory`) after every read of
    it. ``missing_shift`` (int8 ``[T]``), if given, receives per token the first
    shift whose history no source knew (0 = none)."""
    plan = plan_hash_launch(constants, batch, slot_cache, history, fused_slot_write, missing_shift is not None)
    return run_hash_launch(plan, constants, batch, slot_cache, history, missing_shift)
