"""Stream memory operations on pinned host words: a CUDA stream writes a ``uint32`` or waits for one.

``write_value(stream, address, value)`` enqueues ``cuStreamWriteValue32`` (the word is set once the
stream's earlier work has run, its writes visible first); ``wait_value(stream, address, value)``
enqueues ``cuStreamWaitValue32`` with the wrap-aware greater-or-equal test (later work on the stream
waits until ``(int32)(*word - value) >= 0``). Both only enqueue: no host sync. ``address`` is the
device address of a word of pinned host memory (:func:`device_address`). ``copy_to_device(stream,
target, source, nbytes)`` enqueues ``cuMemcpyHtoDAsync`` between raw addresses: on the H200's host
about 5 us of host time against 15-20 us for a slice and ``Tensor.copy_``; ``copy_to_host`` the other way
(``cuMemcpyDtoHAsync``). All of them may be captured in a CUDA graph. :func:`relaxed_capture` lets this
thread allocate (pinned memory, streams) while a capture is under way, as torch's allocator does for
``cudaMalloc``.

The host gather uses them with its native worker (:mod:`engram.table.host_memory.native_worker`):
the stream waits for a word the worker stores, and the worker polls words the stream writes, so
the caller's thread waits for nothing. :func:`available` says whether this driver runs them (one
write and one wait on a scratch stream, once per device).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

__all__ = ["available", "device_address", "write_value", "wait_value", "copy_to_device", "copy_to_host",
           "relaxed_capture", "driver_reachable"]

_WAIT_GEQ = 0x0        # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-aware
_WRITE_DEFAULT = 0x0   # CU_STREAM_WRITE_VALUE_DEFAULT: after the stream's earlier writes are visible


@functools.lru_cache(maxsize=1)
def _driver():
    """``(wait, write, device_pointer, copy, copy_back, exchange_capture_mode)`` of the CUDA driver, or None
    where it is not reachable."""
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
    copy = function("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync")
    copy_back = function("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync")
    exchange = function("cuThreadExchangeStreamCaptureMode")
    if None in (wait, write, pointer, copy, copy_back, exchange):
        return None
    for operation in (wait, write):
        operation.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        operation.restype = ctypes.c_int
    pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    pointer.restype = ctypes.c_int
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    copy_back.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    copy_back.restype = ctypes.c_int
    exchange.argtypes = [ctypes.POINTER(ctypes.c_int)]
    exchange.restype = ctypes.c_int
    return wait, write, pointer, copy, copy_back, exchange


def _checked(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUresult {status}")


def device_address(pinned: torch.Tensor, device: torch.device) -> int:
    """The device address of the first byte of ``pinned`` (a CPU tensor in pinned memory) on ``device``."""
    driver = _driver()
    if driver is None:
        raise RuntimeError("CUDA driver stream memory operations are unavailable (libcuda.so.1 or its "
                           "cuStreamWaitValue32 / cuStreamWriteValue32 not found)")
    if not pinned.is_pinned():
        raise ValueError("pinned: expected a tensor in pinned host memory")
    address = ctypes.c_uint64()
    with torch.cuda.device(device):
        _checked(driver[2](ctypes.byref(address), ctypes.c_void_p(pinned.data_ptr()), 0), "cuMemHostGetDevicePointer")
    return address.value


def write_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Enqueue on ``stream``: store ``value`` (uint32) at ``address`` once the stream's earlier work has run."""
    _checked(_driver()[1](ctypes.c_void_p(stream.cuda_stream), address, value & 0xFFFFFFFF, _WRITE_DEFAULT),
             "cuStreamWriteValue32")


def wait_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Enqueue on ``stream``: later work waits until the word at ``address`` has reached ``value`` (wrap-aware)."""
    _checked(_driver()[0](ctypes.c_void_p(stream.cuda_stream), address, value & 0xFFFFFFFF, _WAIT_GEQ),
             "cuStreamWaitValue32")


def copy_to_device(stream: torch.cuda.Stream, target: int, source: int, nbytes: int) -> None:
    """Enqueue on ``stream`` (its device current): copy ``nbytes`` from host address ``source`` (pinned
    memory) to device address ``target``. The caller keeps both buffers alive until the copy has run."""
    _checked(_driver()[3](target, ctypes.c_void_p(source), nbytes, ctypes.c_void_p(stream.cuda_stream)),
             "cuMemcpyHtoDAsync")


def copy_to_host(stream: torch.cuda.Stream, target: int, source: int, nbytes: int) -> None:
    """Enqueue on ``stream`` (its device current): copy ``nbytes`` from device address ``source`` to host
    address ``target`` (pinned memory). The caller keeps both buffers alive until the copy has run."""
    _checked(_driver()[4](ctypes.c_void_p(target), source, nbytes, ctypes.c_void_p(stream.cuda_stream)),
             "cuMemcpyDtoHAsync")


def driver_reachable() -> bool:
    """Whether the CUDA driver's functions used here were found (``libcuda.so.1``)."""
    return _driver() is not None


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


@contextlib.contextmanager
def relaxed_capture():
    """This thread's stream-capture mode relaxed inside the block (``cuThreadExchangeStreamCaptureMode``): calls
    that a capture would refuse as unsafe (``cudaHostAlloc``) are allowed; the mode before is restored after."""
    exchange = _driver()[5]
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    _checked(exchange(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        _checked(exchange(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")


_AVAILABLE: dict[int, bool] = {}


def available(device: torch.device) -> bool:
    """Whether stream memory operations work on CUDA ``device`` (False without CUDA or a driver that refuses them)."""
    if not torch.cuda.is_available() or device.type != "cuda" or _driver() is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _AVAILABLE:
        try:
            word = torch.zeros(16, dtype=torch.int32, pin_memory=True)
            address = device_address(word, torch.device("cuda", index))
            stream = torch.cuda.Stream(index)
            write_value(stream, address, 7)
            wait_value(stream, address, 7)
            stream.synchronize()
            _AVAILABLE[index] = int(word[0]) == 7
        except RuntimeError:
            _AVAILABLE[index] = False
    return _AVAILABLE[index]
