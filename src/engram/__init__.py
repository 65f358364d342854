"""engram: serve Engram conditional-memory layers (DeepSeek-V4.1) exactly and fast."""

from .spec import EngramSpec
from .layout import ColumnShard, EngramLayout
from .vocab import TokenCompressor
from .hashing import NgramHasher, hash_ngrams
from .table import EngramTable
from .layer import Engram
from .memory import EngramMemory
from .options import ServingOptions
from . import integrations

__all__ = [
    "EngramSpec", "EngramLayout", "ColumnShard", "TokenCompressor", "NgramHasher", "hash_ngrams",
    "EngramTable", "Engram", "EngramMemory", "ServingOptions", "integrations",
]
__version__ = "0.1.0"
