"""Engram tables: the FP8 row codec, placements and lookups (docs/design.md §2 "FP8 table rows", §3)."""

from .fp8 import (
    BLOCK_SIZE,
    E4M3_MAX,
    E8M0_DTYPE,
    SCALE_BYTE_MAX,
    SCALE_BYTE_ONE,
    as_scale_bytes,
    as_value_bytes,
    dequantize_rows,
    quantize_rows,
    scale_bytes_to_float,
)
from .reference import lookup_reference
from .table import (
    EngramTable,
    TablePlacement,
    available_placements,
    make_placement,
    register_placement,
)
from .cpu import CpuPlacement  # each placement registers itself on import
from .device import DevicePlacement
from .host import HostPlacement
from .cached import CachedPlacement

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "E8M0_DTYPE",
    "SCALE_BYTE_MAX",
    "SCALE_BYTE_ONE",
    "as_scale_bytes",
    "as_value_bytes",
    "dequantize_rows",
    "quantize_rows",
    "scale_bytes_to_float",
    "lookup_reference",
    "EngramTable",
    "TablePlacement",
    "CpuPlacement",
    "DevicePlacement",
    "HostPlacement",
    "CachedPlacement",
    "available_placements",
    "make_placement",
    "register_placement",
]
