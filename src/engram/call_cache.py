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

from typing import Any, Hashable

import torch

__all__ = ["CallCache", "structure"]


def structure(tensor: torch.Tensor | None) -> tuple | None:
    """What checks and launch decisions may depend on: shape, dtype, device, strides
    (for anything but a tensor, its type: such a call fails its checks and is never kept)."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return (type(tensor),)
    return tensor.shape, tensor.dtype, tensor.device, tensor.stride()


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
