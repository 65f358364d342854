"""The Engram layer's eager step for one call structure, with every check and decision made once.

An engine calls the layer with tensors whose structure (shapes, dtypes, strides, devices)
repeats step after step. :meth:`engram.layer.Engram.forward` checks the first call of each
structure; where the table, the wkv projection and the gate all have prepared calls (a
``device`` table read by the Triton gather, validation off, the Triton gate), it keeps an
:class:`EagerStep` that runs later calls of that structure as allocations and launches only:

* bf16 wkv: rows gathered flat ``[T, C * D]`` -> ``F.linear`` -> gate;
* FP8 wkv: the table's rows read in place by the prepared quantize -> the FP8 GEMM -> gate.

The step holds the table, its storage and the wkv module it was made for; the layer uses it only
while those are still the layer's (else it falls back to its checked path). It runs the wkv as a
module (``wkv(rows)``) whenever forward hooks are registered on it, so hooks keep firing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.modules import module as nn_module

from engram.layer.gate import prepare_gate_kv

__all__ = ["EagerStep", "prepare_eager_step"]


def _has_forward_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks
                or getattr(nn_module, "_global_forward_hooks", None)
                or getattr(nn_module, "_global_forward_pre_hooks", None))


class EagerStep:
    """One call structure's step: ``step(layer, hidden_states, hash_ids, token_mask) -> out``."""

    __slots__ = ("table", "storage", "wkv", "lookup", "fp8_rows", "gate")

    def __init__(self, table: Any, wkv: torch.nn.Module, lookup: Callable | None, gate: Callable,
                 fp8_rows: Callable | None = None):
        self.table, self.storage, self.wkv = table, getattr(table, "_storage", None), wkv
        self.lookup = lookup  # bf16 wkv: hash_ids -> rows [T, C * D]
        self.fp8_rows = fp8_rows  # FP8 wkv: hash_ids -> kv, the table's rows read in place
        self.gate = gate

    def current(self, layer) -> bool:
        """Whether the layer still has the table, storage and wkv this step was made for (and
        the table still skips per-call id checks)."""
        table = layer.table
        return (table is self.table and getattr(table, "_storage", None) is self.storage and layer.wkv is self.wkv
                and not table.validate)

    def __call__(self, layer, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                 token_mask: torch.Tensor | None) -> torch.Tensor:
        wkv = self.wkv
        if self.lookup is not None:
            rows = self.lookup(hash_ids)
            kv = wkv(rows) if _has_forward_hooks(wkv) else torch.nn.functional.linear(rows, wkv.weight)
        else:
            kv = self.fp8_rows(hash_ids)
        return self.gate(hidden_states, kv, layer.q_weight, layer.k_weight, layer.eps, token_mask)


def prepare_eager_step(layer, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                       token_mask: torch.Tensor | None) -> EagerStep | None:
    """The :class:`EagerStep` of a checked single-mode call's structure, or None where a part has
    no prepared call (the layer then runs its checked path for this structure)."""
    table, wkv = layer.table, layer.wkv
    tokens = hash_ids.shape[0]
    if tokens == 0 or getattr(table, "validate", True) or not hasattr(table, "prepare_lookup"):
        return None
    if wkv.fp8:
        rows = table.rows_in_place(hash_ids)
        if rows is None:  # rows not on the compute device (host placements)
            return None
        values, scales, served_ids, row_start = rows
        if served_ids is not hash_ids:  # a column slice per call (tensor-parallel shards): the checked path
            return None
        fp8_rows = wkv.prepare_fp8_rows(values, scales, hash_ids, row_start)
        if fp8_rows is None:
            return None
        lookup = None
    else:
        if wkv.backend != "bf16":
            return None
        lookup = table.prepare_lookup(hash_ids, flat=True)
        if lookup is None:
            return None
    kv_like = torch.empty(tokens, wkv.out_features, dtype=torch.bfloat16, device=hidden_states.device)
    gate = prepare_gate_kv(hidden_states, kv_like, layer.q_weight, layer.k_weight, token_mask,
                           backend=layer.gate_backend)
    if gate is None:
        return None
    return EagerStep(table, wkv, lookup, gate, None if lookup is not None else fp8_rows)
