"""engram: serve Engram conditional-memory layers (DeepSeek-V4.1) exactly and fast.

The public names load on first use (``engram.EngramMemory`` imports torch and the serving core
then), so ``import engram.spec`` or the ``engram`` command's ``--help`` and ``info`` import no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names engram.__getattr__ serves, for type checkers and readers
    from engram.spec import EngramSpec
    from engram.layout import ColumnShard, EngramLayout
    from engram.vocab import TokenCompressor
    from engram.hashing import NgramHasher, hash_ngrams
    from engram.table import EngramTable
    from engram.layer import Engram
    from engram.memory import EngramMemory
    from engram.options import ServingOptions
    from engram import integrations

_EXPORTS = {
    "EngramSpec": "engram.spec", "EngramLayout": "engram.layout", "ColumnShard": "engram.layout",
    "TokenCompressor": "engram.vocab", "NgramHasher": "engram.hashing", "hash_ngrams": "engram.hashing",
    "EngramTable": "engram.table", "Engram": "engram.layer", "EngramMemory": "engram.memory",
    "ServingOptions": "engram.options",
}

__all__ = [
    "EngramSpec", "EngramLayout", "ColumnShard", "TokenCompressor", "NgramHasher", "hash_ngrams",
    "EngramTable", "Engram", "EngramMemory", "ServingOptions", "integrations",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name (its module imported now), or a submodule (``engram.table``, ...)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
