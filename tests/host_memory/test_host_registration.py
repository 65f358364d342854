"""engram.table.host_memory.rows.register_with_cuda: host memory is unregistered only after every device
it was registered for is synchronized (CPU test: torch.cuda's functions record their calls)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engram.table.host_memory import rows as host_rows

REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _Cudart:
    """Stands in for ``torch.cuda.cudart()``: records registrations; ``unregister_error`` is returned."""

    def __init__(self, calls: list):
        self.calls, self.unregister_error = calls, 0

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes, flags))
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return self.unregister_error


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda as seen by the registration code, with device 0 current; ``cuda.calls`` in order."""
    calls: list = []
    cudart = _Cudart(calls)

    def synchronize(device=None):
        if cudart.synchronize_error is not None:
            raise cudart.synchronize_error
        calls.append(("synchronize", device))

    cudart.synchronize_error = None
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(host_rows, "_REGISTERED", {})
    return cudart


def _rows() -> torch.Tensor:
    return torch.zeros(4096, dtype=torch.uint8)


def test_unregistering_synchronizes_the_device_it_was_registered_for(cuda):
    rows = _rows()
    address, nbytes = rows.untyped_storage().data_ptr(), rows.untyped_storage().nbytes()
    registration = host_rows.register_with_cuda(rows, torch.device("cuda", 1))  # device 0 is current
    assert cuda.calls == [("register", address, nbytes, REGISTER_FLAGS)]
    registration.close()
    assert cuda.calls[1:] == [("synchronize", 1), ("unregister", address)]
    registration.close()  # closing again does nothing
    registration()
    assert len(cuda.calls) == 3 and registration.closed


def test_a_shared_range_is_unregistered_by_its_last_close_after_syncing_every_device(cuda):
    rows = _rows()
    address = rows.untyped_storage().data_ptr()
    first = host_rows.register_with_cuda(rows, 2)
    second = host_rows.register_with_cuda(rows[8:], None)  # the current device, 0; the same storage
    assert [call[0] for call in cuda.calls] == ["register"]
    first.close()
    assert len(cuda.calls) == 1  # still registered for the second reader
    second.close()
    assert cuda.calls[1:] == [("synchronize", 0), ("synchronize", 2), ("unregister", address)]
    again = host_rows.register_with_cuda(rows, 0)  # registered afresh after the last close
    assert cuda.calls[-1][0] == "register"
    with again:
        pass
    assert cuda.calls[-2:] == [("synchronize", 0), ("unregister", address)]


def test_the_finalizer_of_an_owner_closes_it(cuda):
    """As placement "host" uses it: a finalizer of the owning object closes the registration."""

    class Owner:
        pass

    rows = _rows()
    owner = Owner()
    registration = host_rows.register_with_cuda(rows, 3)
    weakref.finalize(owner, registration.close)
    del owner
    gc.collect()
    assert cuda.calls[1:] == [("synchronize", 3), ("unregister", rows.untyped_storage().data_ptr())]
    assert registration.closed


def test_a_failed_sync_leaves_the_range_registered_and_close_can_be_retried(cuda):
    rows = _rows()
    registration = host_rows.register_with_cuda(rows, 0)
    cuda.synchronize_error = RuntimeError("device busy")
    with pytest.raises(RuntimeError, match="device busy"):
        registration.close()
    assert not registration.closed and [call[0] for call in cuda.calls] == ["register"]
    cuda.synchronize_error = None
    registration.close()
    assert [call[0] for call in cuda.calls] == ["register", "synchronize", "unregister"]


def test_an_unregister_error_is_reported(cuda):
    registration = host_rows.register_with_cuda(_rows(), 0)
    cuda.unregister_error = 1
    with pytest.raises(RuntimeError, match="cudaHostUnregister .* CUDA error 1"):
        registration.close()
    assert registration.closed and not host_rows._REGISTERED


def test_device_must_be_a_cuda_device(cuda):
    with pytest.raises(ValueError, match="device: expected a CUDA device, found cpu"):
        host_rows.register_with_cuda(_rows(), "cpu")
    assert not cuda.calls


def test_a_close_during_graph_capture_is_deferred_until_after_it(cuda, monkeypatch):
    """The garbage collector may run a placement's finalizer while a graph is being captured, where a
    device sync breaks the capture: the unregister waits, the bytes stay allocated meanwhile, and the
    next registration outside the capture performs it."""
    capturing = [True]
    monkeypatch.setattr(host_rows, "cuda_capturing", lambda: capturing[0])
    monkeypatch.setattr(host_rows, "_DEFERRED", [])
    rows = _rows()
    address = rows.untyped_storage().data_ptr()
    registration = host_rows.register_with_cuda(rows, 0)
    storage_ref = weakref.ref(rows.untyped_storage())
    del rows
    registration.close()
    gc.collect()
    assert [call[0] for call in cuda.calls] == ["register"] and not registration.closed
    assert storage_ref() is not None, "the bytes were freed while still registered"
    capturing[0] = False
    host_rows.register_with_cuda(_rows(), 0)  # outside the capture: the deferred close runs first
    assert cuda.calls[1:3] == [("synchronize", 0), ("unregister", address)] and registration.closed
