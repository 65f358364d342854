"""Argument checks that several modules make, each written once, and the choice tuples they check
against, each defined once. Every refusal is one ValueError naming the field and the value.

Imports nothing from engram at import time, and torch only inside the tensor checks (with
:mod:`engram.common`, which imports nothing from engram), so any module may use it without a cycle,
:mod:`engram.spec` too, which imports no torch.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["BACKEND_CHOICES", "WKV_BACKEND_CHOICES", "CACHE_POLICIES", "HOST_GATHER_WORKERS", "HOST_GATHER_DEDUP",
           "DISK_READ_BACKENDS",
           "check_int", "check_positive_int", "check_power_of_two", "check_bool", "check_choice", "check_fraction",
           "check_hash_ids", "check_launch_ids", "same_device"]

BACKEND_CHOICES = ("auto", "triton", "torch")
"""``backend`` of the hash kernel, the table lookups and the gate (:mod:`engram.backends`)."""
WKV_BACKEND_CHOICES = ("auto", "bf16", "scaled_mm", "triton", "fused")
"""``wkv_backend``: the wkv projection's path (:mod:`engram.layer.wkv`)."""
CACHE_POLICIES = ("set-lru", "dynamic", "static")
"""Policies of placement ``"cached"``'s HBM row cache."""
HOST_GATHER_WORKERS = ("auto", "native", "python")
"""Who copies the host gather's rows (:mod:`engram.table.host_memory.gather`)."""
HOST_GATHER_DEDUP = ("auto", "always", "never")
"""Whether the host gather copies each distinct row once."""
DISK_READ_BACKENDS = ("auto", "native", "python")
"""Who reads a row file's pages (:mod:`engram.table.disk.reads`): the C thread pool or ``os.pread``."""


def _is_int(value: Any, numpy_ints: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) if numpy_ints else isinstance(value, int)


def check_int(name: str, value: Any, minimum: int = 0, *, below: int | None = None, maximum: int | None = None,
              optional: bool = False, note: str = "", numpy_ints: bool = False, shown: str | None = None
              ) -> int | None:
    """``value`` if it is an int (never a bool) ``>= minimum`` (and ``< below`` or ``<= maximum``), or None
    when ``optional``; else ``"{name}: expected an integer >= {minimum}{note}, found {value!r}"`` (``in
    [minimum, below)`` / ``in [minimum, maximum]`` with a bound; ``shown``: the bounds as written, e.g.
    ``"[0, 2**63)"``). ``numpy_ints`` accepts numpy integers too."""
    if optional and value is None:
        return None
    if (_is_int(value, numpy_ints) and value >= minimum and (below is None or value < below)
            and (maximum is None or value <= maximum)):
        return value
    if shown is not None:
        wanted = f"an integer in {shown}"
    elif below is not None:
        wanted = f"an integer in [{minimum}, {below})"
    elif maximum is not None:
        wanted = f"an integer in [{minimum}, {maximum}]"
    else:
        wanted = f"an integer >= {minimum}"
    raise ValueError(f"{name}: expected {wanted}{note}{' or None' if optional else ''}, found {value!r}")


def check_positive_int(name: str, value: Any, note: str = "") -> int:
    """``value`` if it is an int (never a bool) ``>= 1``; else ``"{name}: expected a positive integer{note},
    found {value!r}"``."""
    if _is_int(value, False) and value >= 1:
        return value
    raise ValueError(f"{name}: expected a positive integer{note}, found {value!r}")


def check_power_of_two(name: str, value: Any, maximum: int | None = None) -> int:
    """``value`` if it is an int (never a bool) that is a power of two (``<= maximum`` when given); else
    ``"{name}: expected a power of two[ up to {maximum}], found {value!r}"``."""
    if _is_int(value, False) and value >= 1 and not value & (value - 1) and (maximum is None or value <= maximum):
        return value
    raise ValueError(f"{name}: expected a power of two{'' if maximum is None else f' up to {maximum}'}, "
                     f"found {value!r}")


def check_bool(name: str, value: Any, *, optional: bool = False, note: str = "") -> bool | None:
    """``value`` if it is True or False (or None when ``optional``); else ``"{name}: expected True or False``
    (``True, False or None``) ``{note}, found {value!r}"``."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    raise ValueError(f"{name}: expected {'True, False or None' if optional else 'True or False'}{note}, "
                     f"found {value!r}")


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``; else ``"{name}: expected one of 'a', 'b', found {value!r}"``."""
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, found {value!r}")


def check_fraction(name: str, value: Any) -> float:
    """``value`` if it is a number (never a bool) in ``(0, 1]``; else ``"{name}: expected a number in (0, 1],
    found {value!r}"``."""
    if not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1:
        return value
    raise ValueError(f"{name}: expected a number in (0, 1], found {value!r}")


def same_device(given: torch.device, expected: torch.device) -> bool:
    """Whether ``given`` is ``expected`` (a CUDA device without an index is the current one)."""
    import torch

    if given.type != expected.type:
        return False
    if given.type != "cuda" or given.index == expected.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (given.index if given.index is not None else current) == (
        expected.index if expected.index is not None else current)


def check_hash_ids(hash_ids: Any, *, columns: int | None = None, layers: int | None = None,
                   device: torch.device | None = None, device_note: str = "", name: str = "hash_ids") -> torch.Tensor:
    """``hash_ids`` if it is an int32/int64 tensor ``[T, C]`` (``[T, layers, columns]`` with ``layers``;
    ``columns`` given: exactly that many) on ``device`` (when given); one ValueError naming ``name`` and
    what was found otherwise: the type, the dtype, the shape or the device, checked in that order."""
    import torch

    from engram.common import HASH_ID_DTYPES

    if not isinstance(hash_ids, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(hash_ids).__name__}")
    if hash_ids.dtype not in HASH_ID_DTYPES:
        raise ValueError(f"{name}: expected dtype torch.int32 or torch.int64, found {hash_ids.dtype}")
    shape = list(hash_ids.shape)
    if layers is not None:
        if len(shape) != 3 or shape[1:] != [layers, columns]:
            raise ValueError(f"{name}: expected shape [T, {layers}, {columns}] (tokens, Engram layers, hash columns), "
                             f"found {shape}")
    elif len(shape) != 2 or (columns is not None and shape[1] != columns):
        raise ValueError(f"{name}: expected shape [T, {'C' if columns is None else columns}], found {shape}")
    if device is not None and not same_device(hash_ids.device, device):
        raise ValueError(f"{name}: expected device {device}{device_note}, found {hash_ids.device}")
    return hash_ids


def check_launch_ids(hash_ids: Any, name: str = "hash_ids") -> torch.Tensor:
    """A kernel launcher's ids: ``hash_ids`` if it is an int32/int64 tensor ``[T, C]``; else ``"{name}:
    expected an int32 or int64 tensor [T, C], found <dtype> <shape>"`` (or the type)."""
    import torch

    from engram.common import HASH_ID_DTYPES

    if not isinstance(hash_ids, torch.Tensor) or hash_ids.dtype not in HASH_ID_DTYPES or hash_ids.dim() != 2:
        found = (f"{hash_ids.dtype} {list(hash_ids.shape)}" if isinstance(hash_ids, torch.Tensor)
                 else type(hash_ids).__name__)
        raise ValueError(f"{name}: expected an int32 or int64 tensor [T, C], found {found}")
    return hash_ids
