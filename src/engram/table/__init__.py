"""Engram tables: the FP8 row codec, placements and lookups (docs/design.md §2 "FP8 table rows", §3)."""

from engram.table.fp8 import (
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
from engram.table.kernels.reference import lookup_reference
from engram.table.table import (
    EngramTable,
    TablePlacement,
    available_placements,
    make_placement,
    register_placement,
)
from engram.table.placements.cpu import CpuPlacement  # each placement registers itself on import
from engram.table.placements.device import DevicePlacement
from engram.table.placements.host import HostPlacement
from engram.table.placements.cached import CachedPlacement
from engram.table.placements.node import NodePlacement
from engram.table.placements.disk import DiskPlacement

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
    "NodePlacement",
    "DiskPlacement",
    "available_placements",
    "make_placement",
    "register_placement",
]
