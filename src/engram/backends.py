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
when built) and costs no environment lookup per call. Whether Triton is there and
whether it interprets comes from :mod:`engram.triton_launch`.
"""

from __future__ import annotations

import warnings

import torch

from engram.checks import BACKEND_CHOICES as BACKENDS, check_choice
from engram.triton_launch import interpreting, triton_available

__all__ = ["BACKENDS", "resolve_backend"]
_warned_missing_triton = False


def _warn_missing_triton(purpose: str) -> None:
    global _warned_missing_triton
    if not _warned_missing_triton:
        _warned_missing_triton = True
        warnings.warn(f"{purpose} run the torch path on CUDA tensors because the 'triton' package is not "
                      f"installed; the Triton kernels are many times faster: pip install 'engram[triton]', "
                      f"or pass backend='torch' to choose the torch path",
                      RuntimeWarning, stacklevel=3)


def resolve_backend(backend: str | None, device: torch.device, purpose: str) -> str:
    """``"triton"`` or ``"torch"`` for work on ``device``; ``None`` means ``"auto"``.

    ``purpose`` names the work in messages (``"EngramTable lookups"``).
    """
    if backend is None:
        backend = "auto"
    check_choice("backend", backend, BACKENDS)
    if backend == "torch":
        return "torch"
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        if not on_cuda:
            return "torch"
        if not triton_available():
            _warn_missing_triton(purpose)
            return "torch"
        return "triton"
    if not triton_available():
        raise ValueError(f"backend: 'triton' for {purpose} needs the 'triton' package (pip install "
                         f"'engram[triton]'), which is not installed; or pass backend='torch'")
    if not on_cuda and not interpreting():
        raise ValueError(f"backend: 'triton' for {purpose} on {device} tensors needs CUDA tensors, or "
                         f"TRITON_INTERPRET=1 set before triton is imported (Triton's CPU interpreter)")
    return "triton"
