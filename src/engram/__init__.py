"""engram: serve Engram conditional-memory layers (DeepSeek-V4.1) exactly and fast."""

from .spec import EngramSpec
from .layout import ColumnShard, EngramLayout

__all__ = ["EngramSpec", "EngramLayout", "ColumnShard"]
__version__ = "0.1.0"
