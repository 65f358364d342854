"""LayerPlan: one Engram layer's calls of one batch structure, checked and decided once.

An engine calls a layer with tensors whose structure (shapes, dtypes, strides, devices) repeats step
after step. :meth:`Engram.plan <engram.layer.module.Engram.plan>` makes the plan for a structure:
every argument check runs there, and the path is chosen there (an
:class:`~engram.layer.eager_step.EagerStep` of prepared launches where the table, wkv and gate all
have one, else the unchecked lookup -> wkv -> gate). :meth:`LayerPlan.run` then only compares the
call's structure with the plan's (a tuple compare: a call of another structure is refused, never
launched with the plan's sizes) and launches. ``Engram.forward`` keeps one plan per structure and
runs it, so eager calls and planned calls are the same code.
"""

from __future__ import annotations

import torch

from engram.call_cache import structure, structure_mismatch
from engram.layer.gate import engram_gate_kv

__all__ = ["LayerPlan", "KvAhead", "plan_key"]


class KvAhead:
    """A layer's ``kv [T, (hc + 1) * D]`` computed ahead of its gate (:meth:`Engram.kv_ahead
    <engram.layer.module.Engram.kv_ahead>`): on CUDA on a side stream, with the event after it."""

    __slots__ = ("kv", "done", "ids", "spent")

    def __init__(self, kv: torch.Tensor, done, ids):
        self.kv, self.done, self.ids, self.spent = kv, done, ids, False

    def consume(self, hash_ids: torch.Tensor) -> torch.Tensor | None:
        """The kv for the gate of ``hash_ids`` (the tensor it was computed from, unrefilled), ordered after
        its computation on the current stream; None (spent, or made for other ids) otherwise."""
        if self.spent or not self.ids.matches(hash_ids):
            self.spent = True  # DROPPED in the step lifecycle (docs/design.md "Step lifecycle")
            return None
        self.spent = True  # SERVED
        if self.done is not None:
            stream = torch.cuda.current_stream(self.kv.device)
            stream.wait_event(self.done)
            self.kv.record_stream(stream)
        return self.kv


def plan_key(layer, hidden_states, hash_ids, token_mask) -> tuple:
    """What a plan is made for: the structure of the three arguments and the layer's device."""
    return structure(hidden_states), structure(hash_ids), structure(token_mask), layer.q_weight.device


class LayerPlan:
    """``plan.run(hidden_states [T, hc, D], hash_ids [T, C], token_mask [T] | None, prefetch=None)
    -> out [T, hc, D]`` for calls of the structure the plan was made for (see the module docstring).

    ``path``: ``"prepared"`` (an EagerStep of prepared launches), ``"unchecked"`` (lookup, wkv and gate
    without per-call checks) or ``"checked"`` (every check on every call: a token mask on another
    device than the hidden states, moved per call)."""

    __slots__ = ("layer", "key", "step", "path", "table", "collective")

    def __init__(self, layer, hidden_states, hash_ids, token_mask=None, *, key: tuple | None = None):
        if layer.mode != "single":
            raise ValueError(f"plan: layers of mode {layer.mode!r} (tensor or sequence parallel) run through "
                             "Engram.forward; plans are made for single-process layers")
        self.layer = layer
        self.table, self.collective = layer.table, layer.collective  # Engram.forward's fast path checks both
        self.key = plan_key(layer, hidden_states, hash_ids, token_mask) if key is None else key
        layer.forward_checked(hidden_states, hash_ids, token_mask, None, check_only=True)  # every check, once
        self.step = None
        if token_mask is not None and token_mask.device != hidden_states.device:
            self.path = "checked"
        else:
            from engram.layer.eager_step import prepare_eager_step

            self.step = prepare_eager_step(layer, hidden_states, hash_ids, token_mask)
            self.path = "prepared" if self.step is not None else "unchecked"

    def run(self, hidden_states: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None = None,
            prefetch=None, kv_ahead: "KvAhead | None" = None) -> torch.Tensor:
        """The layer's output for a call of the plan's structure; ValueError for another structure.
        ``kv_ahead``: from :meth:`Engram.kv_ahead` for this ``hash_ids`` (then only the gate runs)."""
        key = plan_key(self.layer, hidden_states, hash_ids, token_mask)
        if key != self.key:
            raise ValueError(f"plan: {structure_mismatch(('hidden_states', 'hash_ids', 'token_mask'), self.key[:3], key[:3])}; "
                             "make a plan for this structure (Engram.plan) or call the layer")
        kv = kv_ahead.consume(hash_ids) if kv_ahead is not None else None
        return self.launch(hidden_states, hash_ids, token_mask, prefetch, kv)

    def launch(self, hidden_states, hash_ids, token_mask, prefetch=None, kv: torch.Tensor | None = None
               ) -> torch.Tensor:
        """:meth:`run` without the structure compare (for a caller that looked the plan up by it);
        ``kv``: the layer's kv computed ahead (then only the gate runs)."""
        layer = self.layer
        if kv is not None:
            if self.path == "checked":
                token_mask = token_mask.to(hidden_states.device)
            return engram_gate_kv(hidden_states, kv, layer.q_weight, layer.k_weight, layer.eps, token_mask,
                                  backend=layer.gate_backend)
        if self.path == "checked":
            return layer.forward_checked(hidden_states, hash_ids, token_mask, None, prefetch=prefetch)
        started = getattr(prefetch, "started", False) is True  # a read under way: the lookup path finishes it
        if self.step is not None and self.step.current(layer) and not started:  # prepared launches, rows in place
            return self.step(layer, hidden_states, hash_ids, token_mask)
        kv = layer.project(hash_ids, [hash_ids.shape[0]], [0], hidden_states.device, prefetch)
        return engram_gate_kv(hidden_states, kv, layer.q_weight, layer.k_weight, layer.eps, token_mask,
                              backend=layer.gate_backend)
