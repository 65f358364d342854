"""A counter in pinned host memory that CUDA streams write and wait on (driver stream memory ops).

The host gather's consumer must not block its thread until a worker thread has enqueued the
copies: the consumer's stream waits instead, on :class:`StreamCounter`. The worker enqueues
``write(copy_stream, n)`` after the copies of gather ``n`` (the GPU writes ``n`` once they have
run); the consumer enqueues ``wait(stream, n)`` (``cuStreamWaitValue32``, greater-or-equal,
wrap-aware) and returns at once. Values only grow, and every write is enqueued on one stream in
order, so a wait for ``n`` is released exactly when gather ``n``'s copies are done.

:func:`stream_counters_available` says whether this driver runs stream memory operations
(checked once per device by a write and a wait on a scratch stream); where it does not, the host
gather falls back to waiting for the worker on the calling thread.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

__all__ = ["StreamCounter", "stream_counters_available"]

_WAIT_GEQ = 0x0          # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-aware
_WRITE_DEFAULT = 0x0     # CU_STREAM_WRITE_VALUE_DEFAULT: ordered after the stream's earlier writes


@functools.lru_cache(maxsize=1)
def _driver():
    """``(libcuda, wait, write, device_pointer)`` or None when the driver API is not reachable."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None

    def function(*names):
        for name in names:
            found = getattr(lib, name, None)
            if found is not None:
                return found
        return None

    wait = function("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    write = function("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    pointer = function("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
    if wait is None or write is None or pointer is None:
        return None
    for op in (wait, write):
        op.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        op.restype = ctypes.c_int
    pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    pointer.restype = ctypes.c_int
    return lib, wait, write, pointer


class StreamCounter:
    """One ``uint32`` in pinned host memory on ``device``; streams write it and wait for it to reach a value.

    ``write(stream, value)`` and ``wait(stream, value)`` only enqueue (no host sync);
    :attr:`value` reads the host copy (what the GPU wrote last)."""

    def __init__(self, device: torch.device):
        driver = _driver()
        if driver is None:
            raise RuntimeError("CUDA driver stream memory operations are unavailable (libcuda.so.1 or its "
                               "cuStreamWaitValue32 / cuStreamWriteValue32 not found)")
        _, self._wait, self._write, pointer = driver
        self.device = device
        self._cell = torch.zeros(4, dtype=torch.int32, pin_memory=True)  # 16 bytes: its own aligned word
        address = ctypes.c_uint64()
        with torch.cuda.device(device):
            status = pointer(ctypes.byref(address), ctypes.c_void_p(self._cell.data_ptr()), 0)
        if status != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUresult {status}")
        self._address = address.value
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return int(self._cell[0]) & 0xFFFFFFFF

    def write(self, stream: torch.cuda.Stream, value: int) -> None:
        """Enqueue on ``stream``: set the counter to ``value`` once the stream's earlier work has run."""
        with self._lock:
            status = self._write(ctypes.c_void_p(stream.cuda_stream), self._address, value & 0xFFFFFFFF,
                                 _WRITE_DEFAULT)
        if status != 0:
            raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {status}")

    def wait(self, stream: torch.cuda.Stream, value: int) -> None:
        """Enqueue on ``stream``: later work waits until the counter has reached ``value`` (wrap-aware)."""
        status = self._wait(ctypes.c_void_p(stream.cuda_stream), self._address, value & 0xFFFFFFFF, _WAIT_GEQ)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {status}")


_AVAILABLE: dict[int, bool] = {}


def stream_counters_available(device: torch.device) -> bool:
    """Whether :class:`StreamCounter` works on ``device`` (a write and a wait on a scratch stream,
    once per device; False without CUDA or where the driver refuses stream memory operations)."""
    if not torch.cuda.is_available() or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _AVAILABLE:
        try:
            counter = StreamCounter(torch.device("cuda", index))
            stream = torch.cuda.Stream(index)
            counter.write(stream, 1)
            counter.wait(stream, 1)
            stream.synchronize()
            _AVAILABLE[index] = counter.value == 1
        except RuntimeError:
            _AVAILABLE[index] = False
    return _AVAILABLE[index]
