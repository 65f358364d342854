"""Bounds-checked memory for Triton kernels under the interpreter.

Under ``TRITON_INTERPRET=1`` a kernel's loads and stores are numpy gathers from raw
addresses: one out of bounds reads or writes whatever lies there, or kills the
process. Inside :func:`bounds_checked`, every launch may touch only the storages
of the tensors passed to it: each active lane of each masked load and store is
checked before the access, and the first stray one raises :class:`StrayAccess`
naming the kernel's source line.
"""

from __future__ import annotations

import contextlib
import traceback

import numpy as np
import torch


class StrayAccess(AssertionError):
    pass


class _Extents:
    def __init__(self):
        self.starts = np.zeros(0, dtype=np.uint64)
        self.ends = np.zeros(0, dtype=np.uint64)
        self.accesses = 0  # lanes checked, so a test can show the checker ran

    def set(self, tensors) -> None:
        """Accesses may touch the storages of ``tensors`` (overlaps merged)."""
        spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                       for t in tensors)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = np.array([s for s, _ in merged], dtype=np.uint64)
        self.ends = np.array([e for _, e in merged], dtype=np.uint64)

    def check(self, kind: str, pointers, mask) -> None:
        addresses = np.asarray(pointers.data).astype(np.uint64)
        active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
        addresses = addresses[active]
        self.accesses += addresses.size
        if addresses.size == 0:
            return
        itemsize = np.uint64(max(1, pointers.get_element_ty().primitive_bitwidth // 8))
        index = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        safe = np.maximum(index, 0)
        inside = (index >= 0) & (addresses >= self.starts[safe]) & (addresses + itemsize <= self.ends[safe])
        if not inside.all():
            frames = [f for f in traceback.extract_stack()
                      if "triton" not in f.filename and "interpreter_bounds" not in f.filename]
            line = f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
            raise StrayAccess(f"{int((~inside).sum())} out-of-bounds lanes; first: a {int(itemsize)}-byte {kind} "
                              f"at {int(addresses[~inside][0]):#x}, from {line}")


@contextlib.contextmanager
def bounds_checked(reachable=()):
    """Check every load and store of every kernel launched inside; yields the checker
    (``.accesses`` counts the lanes checked). ``reachable``: tensors a kernel may also touch
    though they are not its arguments (shards found through a pointer table)."""
    from triton.runtime.interpreter import GridExecutor, InterpreterBuilder

    extents = _Extents()
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    launch = GridExecutor.__call__

    def checked_launch(self, *args, **kwargs):
        extents.set([a for a in (*args, *kwargs.values(), *reachable) if isinstance(a, torch.Tensor)])
        return launch(self, *args, **kwargs)

    def checked_load(self, pointers, mask, other, cache_policy, is_volatile):
        extents.check("load", pointers, mask)
        return load(self, pointers, mask, other, cache_policy, is_volatile)

    def checked_store(self, pointers, value, mask, cache_policy):
        extents.check("store", pointers, mask)
        return store(self, pointers, value, mask, cache_policy)

    GridExecutor.__call__ = checked_launch
    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = checked_load, checked_store
    try:
        yield extents
    finally:
        GridExecutor.__call__ = launch
        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = load, store
