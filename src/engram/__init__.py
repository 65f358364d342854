"""engram: serve Engram conditional-memory layers (DeepSeek-V4.1) exactly and fast."""

from engram.spec import EngramSpec
from engram.layout import ColumnShard, EngramLayout
from engram.vocab import TokenCompressor
from engram.hashing import NgramHasher, hash_ngrams
from engram.table import EngramTable
from engram.layer import Engram
from engram.memory import EngramMemory
from engram.options import ServingOptions
from engram import integrations

__all__ = [
    "EngramSpec", "EngramLayout", "ColumnShard", "TokenCompressor", "NgramHasher", "hash_ngrams",
    "EngramTable", "Engram", "EngramMemory", "ServingOptions", "integrations",
]
__version__ = "0.1.0"
