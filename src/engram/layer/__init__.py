"""The Engram layer: ``wkv`` projection, gate (Triton kernel, torch path and float64
reference) and the :class:`Engram` module with tensor / sequence parallelism."""

from engram.layer.gate import engram_gate, engram_gate_kv, engram_gate_torch
from engram.layer.module import Engram, sequence_parallel_sizes, tensor_parallel_columns
from engram.layer.reference import reference_dequantize_wkv, reference_engram, reference_gate, reference_wkv
from engram.layer.wkv import WkvProjection, dequantize_wkv_weight, split_kv

__all__ = [
    "Engram",
    "WkvProjection",
    "dequantize_wkv_weight",
    "split_kv",
    "engram_gate",
    "engram_gate_kv",
    "engram_gate_torch",
    "tensor_parallel_columns",
    "sequence_parallel_sizes",
    "reference_gate",
    "reference_dequantize_wkv",
    "reference_wkv",
    "reference_engram",
]
