"""A row cache's updates on a CUDA stream of their own, beside the rest of the step.

An eager update (``RowCache.update`` outside graph capture) is enqueued on :attr:`UpdatesBeside.stream`,
after the caller's stream's work so far (the step's lookups), and the caller's stream goes on at once:
at prefill the admission's reads of host rows (about 8 ms a table at T = 8192 over 25 GiB tables on the
H200, ``benchmarks/NOTES.md`` "An HBM cache beside the step") overlap the decoder layers after the last
Engram layer instead of following them.

Every later access of the cache waits for it, without the caller's help:

* eager accesses (the cache's views, the placement's lookups, probes and merges, the next update) make
  their stream wait on :attr:`UpdatesBeside.done` (:meth:`UpdatesBeside.order`);
* accesses captured in a CUDA graph enqueue a wait on the pinned word :attr:`UpdatesBeside.idle`, which
  the caller's stream sets to 0 before the update and the update's stream back to 1 after it
  (``stream_memory_ops``: ``cuStreamWriteValue32`` / ``cuStreamWaitValue32``). A graph replayed after an
  eager update therefore reads the cache only once that update is done, whichever thread replays it.

One update runs beside at a time: the caller's stream waits for the previous one before it clears the
word (the word is a flag, not a count); that previous update overlapped a whole step, so the wait is
empty in practice. The update's stream depends only on work enqueued before it, so no wait can close a
cycle; an update that fails to enqueue still sets the word back (no graph waits forever): from its
stream, or, where that write fails too, from the host once the update's work has run.
"""

from __future__ import annotations

from typing import Callable

import torch

from engram.common import cuda_capturing

__all__ = ["UpdatesBeside", "updates_beside_available"]

_IDLE = 1
_BUSY = 0


def updates_beside_available(device: torch.device) -> bool:
    """Whether updates may run beside on ``device``: CUDA with the driver's stream memory operations."""
    from engram.table.host_memory import stream_memory_ops

    return device.type == "cuda" and stream_memory_ops.available(device)


class UpdatesBeside:
    """The stream, the idle word (pinned ``int32 [1]``: 1 idle, 0 while an update runs beside) and the
    event after the last update beside, for one cache on CUDA ``device``."""

    def __init__(self, device: torch.device):
        from engram.table.host_memory import stream_memory_ops

        self._ops = stream_memory_ops
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.idle = torch.full((1,), _IDLE, dtype=torch.int32).pin_memory()
        self._address = stream_memory_ops.device_address(self.idle, device)
        self.done: torch.cuda.Event | None = None
        """Recorded on :attr:`stream` after the last update beside (None before the first)."""
        self.count = 0
        """Updates run beside since construction (host-side count, for tests and benchmarks)."""

    def run(self, update: Callable[[], None], used: tuple[torch.Tensor, ...] = ()) -> None:
        """Enqueue ``update()`` on :attr:`stream` after the current stream's work; ``used``: tensors made on the
        current stream that the update reads (kept from reuse until it has run)."""
        caller = torch.cuda.current_stream(self.device)
        if self.done is not None:
            caller.wait_event(self.done)  # the word is one flag: one update beside at a time
        self._ops.write_value(caller, self._address, _BUSY)  # a failure here has enqueued nothing
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                update()
        finally:
            done = torch.cuda.Event()
            done.record(self.stream)
            self.done = done  # eager accesses wait for whatever of the update was enqueued
            for tensor in used:
                tensor.record_stream(self.stream)
            try:
                self._ops.write_value(self.stream, self._address, _IDLE)
            except BaseException:
                # The word must not stay busy (a captured access would wait forever): once the update's work
                # has run, the host sets it.
                done.synchronize()
                self.idle[0] = _IDLE
                raise
        self.count += 1

    def order(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream``'s later work (default: the current stream) after every update run beside: an
        event wait, or under graph capture a wait on the idle word (the graph may replay after a later one)."""
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        if cuda_capturing():
            self._ops.wait_value(stream, self._address, _IDLE)
        elif self.done is not None:
            stream.wait_event(self.done)
