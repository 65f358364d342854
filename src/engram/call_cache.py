"""Checks and launch decisions made once per call structure, not once per call.

An eager engine step calls each stage with tensors whose shapes, dtypes, strides and
devices repeat from step to step. Everything a stage checks or decides from those
(argument checks, launch shapes, variant keys) is the same for every call of one
structure, so a stage keys what it worked out by :func:`structure` of its arguments in a
:class:`CallCache` and, on a hit, skips straight to allocating and launching. Values
(and, where a kernel specializes on it, alignment) are never part of a structure: what
depends on them is still done on every call.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

__all__ = ["CallCache", "structure", "structure_mismatch"]


def structure(tensor: torch.Tensor | None) -> tuple | None:
    """What checks and launch decisions may depend on: shape, dtype, device, strides
    (for anything but a tensor, its type: such a call fails its checks and is never kept)."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return (type(tensor),)
    return tensor.shape, tensor.dtype, tensor.device, tensor.stride()


def _describe(what: tuple | None) -> str:
    if what is None:
        return "None"
    if len(what) == 1:
        return f"a {what[0].__name__}"
    return "a tensor"


def structure_mismatch(names: Sequence[str], expected: Sequence, found: Sequence) -> str:
    """What differs between two tuples of :func:`structure` (``expected``: what a plan was made for,
    ``found``: a call's), argument by argument as ``names`` name them: the first argument that differs
    and each of its properties that does, e.g. ``"hash_ids: shape [8, 24] (the plan's [4, 24])"``;
    ``""`` when none differs."""
    labels = ("shape", "dtype", "device", "strides")
    for name, planned, given in zip(names, expected, found):
        if planned == given:
            continue
        if planned is None or given is None or len(planned) == 1 or len(given) == 1:
            return f"{name}: {_describe(given)} (the plan's: {_describe(planned)})"
        parts = []
        for label, a, b in zip(labels, planned, given):
            if a != b:
                show = (lambda v: str(list(v))) if label in ("shape", "strides") else str
                parts.append(f"{label} {show(b)} (the plan's {show(a)})")
        return f"{name}: " + ", ".join(parts)
    return ""


class CallCache:
    """A bounded map from a call structure to what was worked out for it.

    ``max_entries`` bounds the memory an engine with ever-new batch shapes can use: when
    full, the cache starts again empty (a miss costs one call's checks, nothing more).
    """

    def __init__(self, max_entries: int = 512):
        self.max_entries = max_entries
        self._entries: dict[Hashable, Any] = {}

    def get(self, key: Hashable) -> Any:
        return self._entries.get(key)

    def put(self, key: Hashable, value: Any) -> Any:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key] = value
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
