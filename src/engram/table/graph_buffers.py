"""Buffers that a captured lookup keeps for its CUDA graph's replays, from the device's ordinary memory pool.

Under capture torch's caching allocator serves a capturing stream's allocations from the graph's private pool.
What a captured lookup keeps for every replay (a captured host gather's row list, inverse and device staging;
a cached lookup's staging) lives as long as the graph, not as one of its temporaries: inductor's CUDA graphs
(``torch.compile(mode="reduce-overhead")``) refuse a recording that leaves blocks of their pool alive that are
no outputs ("tensor(s) in the cudagraph pool not tracked as outputs"). A stream that is not capturing allocates
from the ordinary pool, so :func:`kept_for_graph` allocates on a stream of its own (never captured), with the
capture mode relaxed where the allocator needs a fresh segment (``cudaMalloc`` beside a capture).
"""

from __future__ import annotations

import contextlib

import torch

from engram.common import cuda_capturing

__all__ = ["kept_for_graph"]

_ALLOCATING_STREAMS: dict[int, torch.cuda.Stream] = {}  # per device: never captured, never given work


def kept_for_graph(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on CUDA ``device``, outside any capture's memory pool (the ordinary
    one; eagerly the same as ``torch.empty``). Uninitialized; not an inference tensor. The caller keeps it as long
    as a graph that uses it may replay: freed, its block returns to the ordinary pool."""
    if not cuda_capturing():
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, device=device)
    from engram.table.host_memory import stream_memory_ops

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _ALLOCATING_STREAMS.get(index)
    if stream is None:
        with _relaxed(stream_memory_ops):  # a stream's creation is refused beside a capture in global mode
            stream = _ALLOCATING_STREAMS.setdefault(index, torch.cuda.Stream(index))
    with _relaxed(stream_memory_ops), torch.cuda.stream(stream), torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device=device)


def _relaxed(stream_memory_ops):
    """The capture mode relaxed for this thread where the driver offers it; otherwise nothing changes."""
    return stream_memory_ops.relaxed_capture() if stream_memory_ops.driver_reachable() else contextlib.nullcontext()
