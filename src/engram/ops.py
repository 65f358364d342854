"""The calls an engine makes inside a model forward, as torch custom ops, so a compiled model
(``torch.compile(fullgraph=True)``, CUDA graphs of a compiled graph) traces through them.

Each op is opaque to the compiler: its real implementation is the eager call, checks, planning
and Triton launches included, and its fake implementation only gives the output's shape and
dtype. ``NgramHasher.__call__``, ``EngramMemory.prefetch`` / ``forward_layer`` and
``Engram.forward`` route here while ``torch.compiler.is_compiling()``; eagerly they run as always.

* ``engram::hash_batch``: the hasher's step, ``int [T, L, C]``; mutates the bound history stores
  (the slot cache's ``values``, the request history's ``values`` and ``tags``), declared as such.
* ``engram::prefetch``: a step's prefetch of every layer's rows; returns the ticket as an int64
  scalar tensor on the ids' device (the ticket's number; the handle itself stays on the host side, found
  again by the tensor's storage).
* ``engram::layer``: one Engram layer, ``out [n, hc, D]``, given a ticket tensor or none.

Objects (hashers, memories, layers) are named in the ops by the number :func:`register` gave them
when they were built (their ``op_key``: a plain attribute the compiler reads); the registry holds
them weakly.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any

import torch

__all__ = ["register", "registered", "compiling"]

_OBJECTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_KEYS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_NEXT = itertools.count(1)
_TICKETS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_TICKET_NUMBERS = itertools.count(1)


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def compiling() -> bool:
    """Whether torch.compile is tracing this call (False on torch without ``torch.compiler``)."""
    return _IS_COMPILING is not None and bool(_IS_COMPILING())


def register(obj: Any) -> int:
    """The number naming ``obj`` in the ops (the same number for the same object)."""
    key = _KEYS.get(obj)
    if key is None:
        key = next(_NEXT)
        _KEYS[obj] = key
        _OBJECTS[key] = obj
    return key


def registered(key: int) -> Any:
    obj = _OBJECTS.get(key)
    if obj is None:
        raise ValueError(f"engram op: object {key} is gone (the hasher, memory or layer a compiled graph "
                         "was traced with must outlive the graph)")
    return obj


def ticket_tensor(ticket: Any, like: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``like``'s device naming ``ticket`` (a step's prefetch handle), for graphs that pass
    it along: the handle is found again by the tensor's storage (no read of its value, so no host sync),
    and the tensor holds the ticket's number. A CUDA tensor, so CUDA-graph trees (``mode="reduce-overhead"``)
    take it as any output of a captured region (a CPU scalar there is refused: it is not in the graph's
    memory pool). A storage reused by a later tensor can only name a handle whose own checks refuse ids it
    was not made for (``StepPrefetch.take``): a row is never served from it."""
    number = next(_TICKET_NUMBERS)
    tensor = torch.empty((), dtype=torch.int64, device=like.device)
    tensor.fill_(number)
    _TICKETS[tensor.untyped_storage().data_ptr()] = ticket
    return tensor


def ticket_of(tensor: torch.Tensor | None) -> Any:
    """The handle a ticket tensor names, or None (no ticket, or one whose handle is gone: the layer
    then reads its own rows, as with an unusable handle)."""
    if tensor is None:
        return None
    return _TICKETS.get(tensor.untyped_storage().data_ptr())


def _fresh(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out``, or a copy where it shares storage with an input (a custom op's output may not alias
    its inputs; the eager calls return fresh tensors, so this copies nothing in practice)."""
    pointer = out.untyped_storage().data_ptr()
    if out.numel() and any(x is not None and x.numel() and x.untyped_storage().data_ptr() == pointer for x in inputs):
        return out.clone()
    return out


def _stores(hasher) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bound stores' tensors; an empty tensor of the hasher's for a store not bound (inductor
    handles mutated arguments that are tensors, not None)."""
    none_int, none_tags = hasher.empty_stores
    slots = hasher.slot_cache.values if hasher.slot_cache is not None else none_int
    history = hasher.request_history
    return slots, (history.values if history is not None else none_int), (history.tags if history is not None
                                                                           else none_tags)


# ---- the hasher's step --------------------------------------------------------------------
@torch.library.custom_op("engram::hash_batch", mutates_args=("slot_values", "history_values", "history_tags"))
def _hash_batch(input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                dead_mask: torch.Tensor | None, lookback_token_ids: torch.Tensor | None,
                lookback_dead_mask: torch.Tensor | None, slot_mapping: torch.Tensor | None,
                block_table: torch.Tensor | None, request_rows: torch.Tensor | None,
                slot_values: torch.Tensor, history_values: torch.Tensor,
                history_tags: torch.Tensor, hasher_key: int) -> torch.Tensor:
    hasher = registered(hasher_key)
    with _stores_written_to(hasher, slot_values, history_values, history_tags):
        out = hasher.hash_eagerly(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids,
                                   lookback_dead_mask, slot_mapping, block_table, request_rows)
    return _fresh(out, input_ids, slot_values, history_values, history_tags)


@contextlib.contextmanager
def _stores_written_to(hasher, slot_values, history_values, history_tags):
    """The op mutates the tensors it is given (a functionalized graph gives copies of the stores and
    copies them back): the hasher's stores read and write those for the call."""
    slot_cache, history = hasher.slot_cache, hasher.request_history
    saved = (slot_cache.values if slot_cache is not None else None,
             (history.values, history.tags) if history is not None else None)
    try:
        if slot_cache is not None:
            slot_cache.values = slot_values
        if history is not None:
            history.values, history.tags = history_values, history_tags
        yield
    finally:
        if slot_cache is not None:
            slot_cache.values = saved[0]
        if history is not None:
            history.values, history.tags = saved[1]


@_hash_batch.register_fake
def _(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead_mask, slot_mapping,
      block_table, request_rows, slot_values, history_values, history_tags, hasher_key):
    hasher = registered(hasher_key)
    spec = hasher.layout.spec
    return input_ids.new_empty((input_ids.shape[0], spec.num_layers, spec.num_columns), dtype=hasher.out_dtype,
                               device=hasher.device)


def hash_batch(hasher, *args) -> torch.Tensor:
    """``hasher(*args)`` through ``engram::hash_batch`` (args in ``NgramHasher.__call__``'s order)."""
    return torch.ops.engram.hash_batch(*args, *_stores(hasher), hasher.op_key)


# ---- prefetch -------------------------------------------------------------------------------
@torch.library.custom_op("engram::prefetch", mutates_args=())
def _prefetch(hash_ids: torch.Tensor, memory_key: int) -> torch.Tensor:
    return ticket_tensor(registered(memory_key).prefetch_eagerly(hash_ids), hash_ids)


@_prefetch.register_fake
def _(hash_ids, memory_key):
    return hash_ids.new_empty((), dtype=torch.int64)


def prefetch(memory, hash_ids: torch.Tensor) -> torch.Tensor:
    return torch.ops.engram.prefetch(hash_ids, memory.op_key)


# ---- one layer ------------------------------------------------------------------------------
@torch.library.custom_op("engram::layer", mutates_args=())
def _layer(hidden_states: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None,
           ticket: torch.Tensor | None, owner_key: int, layer_id: int) -> torch.Tensor:
    owner = registered(owner_key)
    out = owner.layer_eagerly(layer_id, hidden_states, hash_ids, token_mask, ticket_of(ticket))
    return _fresh(out, hidden_states, hash_ids)


@_layer.register_fake
def _(hidden_states, hash_ids, token_mask, ticket, owner_key, layer_id):
    return torch.empty_like(hidden_states)


def layer(owner, layer_id: int, hidden_states, hash_ids, token_mask, ticket) -> torch.Tensor:
    """``owner.layer_eagerly(layer_id, ...)`` through ``engram::layer``: an EngramMemory's layer
    ``layer_id``, or an Engram module (``layer_id`` -1). ``ticket``: an int64 ticket tensor or None."""
    return torch.ops.engram.layer(hidden_states, hash_ids, token_mask, ticket, owner.op_key, layer_id)
