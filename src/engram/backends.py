"""Which code runs a stage: the Triton kernel or plain torch, chosen by an argument.

Every stage with a kernel (table lookups, the gate; the hasher takes the same values)
takes ``backend``, one of :data:`BACKENDS`, default ``"auto"``:

* ``"auto"``: the Triton kernel for CUDA tensors, torch for CPU tensors. Where Triton
  is not installed, CUDA tensors run the torch path, and the first time that happens a
  :class:`RuntimeWarning` says so (once per process), never silently.
* ``"triton"``: the kernel, or a ValueError saying what is missing (the triton package;
  for CPU tensors, ``TRITON_INTERPRET=1`` set before triton is imported).
* ``"torch"``: plain torch on any device.

The choice is made once per object where there is one (an ``EngramTable`` resolves it
when built) and costs no environment lookup per call.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

__all__ = ["BACKENDS", "triton_import_error", "triton_interpreter", "resolve_backend"]

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_import_error() -> str | None:
    """None when ``triton`` imports, else why not (checked once per process)."""
    try:
        importlib.import_module("triton")
    except ImportError as error:
        return str(error) or type(error).__name__
    return None


@functools.cache
def triton_interpreter() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read once: Triton
    itself reads it when it is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_warned_missing_triton = False


def _warn_missing_triton(purpose: str) -> None:
    global _warned_missing_triton
    if not _warned_missing_triton:
        _warned_missing_triton = True
        warnings.warn(f"{purpose} run the torch path on CUDA tensors because triton cannot be imported "
                      f"({triton_import_error()}); the Triton kernels are many times faster: "
                      f"pip install 'engram[triton]', or pass backend='torch' to choose the torch path",
                      RuntimeWarning, stacklevel=3)


def resolve_backend(backend: str | None, device: torch.device, purpose: str) -> str:
    """``"triton"`` or ``"torch"`` for work on ``device``; ``None`` means ``"auto"``.

    ``purpose`` names the work in messages (``"EngramTable lookups"``).
    """
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(repr(b) for b in BACKENDS)}, found {backend!r}")
    if backend == "torch":
        return "torch"
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        if not on_cuda:
            return "torch"
        if triton_import_error() is not None:
            _warn_missing_triton(purpose)
            return "torch"
        return "triton"
    if triton_import_error() is not None:
        raise ValueError(f"backend: 'triton' for {purpose} needs the triton package (pip install 'engram[triton]'), "
                         f"which could not be imported ({triton_import_error()})")
    if not on_cuda and not triton_interpreter():
        raise ValueError(f"backend: 'triton' for {purpose} on {device} tensors needs CUDA tensors, or "
                         f"TRITON_INTERPRET=1 set before triton is imported (Triton's CPU interpreter)")
    return "triton"
