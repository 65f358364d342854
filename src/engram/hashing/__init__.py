"""Hash ids of n-grams: whole-sequence reference, batch hasher, history stores.

The names load on first use, so the numpy reference (``engram.hashing.reference``, what
``engram hash`` runs) imports no torch."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engram.hashing.batch import NgramHasher
    from engram.hashing.reference import hash_ngrams, ngram_windows
    from engram.hashing.stores import DEAD, UNWRITTEN, RequestHistory, SlotCache

_EXPORTS = {"NgramHasher": "engram.hashing.batch", "hash_ngrams": "engram.hashing.reference",
            "ngram_windows": "engram.hashing.reference", "SlotCache": "engram.hashing.stores",
            "RequestHistory": "engram.hashing.stores", "DEAD": "engram.hashing.stores",
            "UNWRITTEN": "engram.hashing.stores"}

__all__ = ["NgramHasher", "hash_ngrams", "ngram_windows", "SlotCache", "RequestHistory", "DEAD", "UNWRITTEN"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule: engram.hashing.batch, ...
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
