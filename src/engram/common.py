"""Small helpers every stage uses, each written once: integer arithmetic of splits and
launch shapes, the dtypes hash ids come in, resolving the device a caller names, and what
identifies one ids tensor as read at one moment.

(The UE8M0 dtype lives with the FP8 codec: :data:`engram.table.fp8.E8M0_DTYPE`.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["HASH_ID_DTYPES", "ceil_div", "next_power_of_2", "as_device", "resolve_cuda_device", "resolve_device",
           "cuda_capturing", "IdsIdentity"]

HASH_ID_DTYPES = (torch.int32, torch.int64)
"""Dtypes a table lookup accepts for hash ids (the hasher returns int32)."""


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in integers (``denominator > 0``)."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def as_device(device: torch.device | str | int) -> torch.device:
    """``torch.device`` of a device, a device string or a CUDA index; ValueError naming the value."""
    if isinstance(device, bool):
        raise ValueError(f"device: expected a torch.device, a device string or a CUDA index, found {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: expected a torch.device, a device string or a CUDA index, found {device!r} "
                         f"({error})") from None


def _no_cuda_reason() -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "this torch is a CPU-only build"
    return "torch.cuda.is_available() is False (no GPU or driver found)"


def resolve_cuda_device(device: torch.device | str | int | None, purpose: str) -> torch.device:
    """``cuda:<index>`` for ``device`` (None or ``"cuda"``: the current CUDA device).

    ``purpose`` says what needs it (``"placement 'device'"``); every error is one
    ValueError naming it and the value: not a CUDA device, no CUDA on this machine,
    or an index past the devices there are.
    """
    resolved = torch.device("cuda") if device is None else as_device(device)
    asked = "" if device is None else f" ({device!r})"
    if resolved.type != "cuda":
        raise ValueError(f"device: {purpose} needs a CUDA device, found {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {purpose} needs a CUDA device{asked}, and this machine has none: "
                         f"{_no_cuda_reason()}; use device='cpu'")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {purpose} asks for CUDA device {index}{asked}, "
                         f"but this machine has {torch.cuda.device_count()}")
    return torch.device("cuda", index)


def resolve_device(device: torch.device | str | int | None, purpose: str) -> torch.device:
    """The CPU, or a CUDA device checked by :func:`resolve_cuda_device` (None: the CPU)."""
    if device is None:
        return torch.device("cpu")
    resolved = as_device(device)
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(f"device: {purpose} runs on the CPU or a CUDA device, found {device!r}")
    return resolve_cuda_device(device, purpose)


def cuda_capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors track no version
        return None


@dataclass(frozen=True, eq=False)
class IdsIdentity:
    """What identifies one ids tensor as read at one moment: its base tensor (weakly), its version
    and its view's geometry."""

    base: weakref.ref
    version: int | None
    geometry: tuple

    @staticmethod
    def of(ids: torch.Tensor) -> "IdsIdentity":
        return IdsIdentity(weakref.ref(_base(ids)), _version(ids), _geometry(ids))

    def matches(self, ids: torch.Tensor) -> bool:
        return self.base() is _base(ids) and _version(ids) == self.version and _geometry(ids) == self.geometry

    @property
    def sees_edits(self) -> bool:
        """Whether :meth:`matches` sees an in-place edit: False for inference tensors, which keep no version."""
        return self.version is not None


def _base(ids: torch.Tensor) -> torch.Tensor:
    return ids._base if ids._base is not None else ids


def _geometry(ids: torch.Tensor) -> tuple:
    return ids.data_ptr(), tuple(ids.shape), tuple(ids.stride()), ids.dtype, ids.device
