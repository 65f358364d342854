"""Engram tensors in the checkpoint's safetensors layout: :mod:`.reading` (files, tensor checks,
weights), :mod:`.loading` (a table into its placement) and :mod:`.writing`."""

from engram.checkpoint.loading import (LoadedStorage, TableSource, allocate_table_storage, host_share_key, load_engram_table,
                      register_storage_allocator)
from engram.checkpoint.reading import (DEFAULT_CHUNK_BYTES, INDEX_FILE, TENSOR_KINDS, ByteProgress, EngramLayerWeights,
                      SafetensorsCheckpoint, ScaleOverflowCheck, TensorInfo, check_weight_values, copy_checked_rows,
                      engram_tensor_name, expected_layer_tensors, file_problem, layer_weight_problems,
                      load_engram_layer_weights, map_table_rows, table_progress, unexpected_engram_tensors)
from engram.checkpoint.reading import _open, _wkv_scale_info  # noqa: F401 (engram.tools.checkpoint_report)
from engram.checkpoint.writing import EngramLayerTensors, write_engram_checkpoint

__all__ = [
    "INDEX_FILE", "TENSOR_KINDS", "DEFAULT_CHUNK_BYTES", "engram_tensor_name", "TensorInfo", "SafetensorsCheckpoint",
    "EngramLayerWeights", "EngramLayerTensors", "expected_layer_tensors", "load_engram_layer_weights",
    "layer_weight_problems", "check_weight_values", "load_engram_table", "allocate_table_storage",
    "register_storage_allocator", "write_engram_checkpoint", "table_progress", "ByteProgress", "TableSource",
    "LoadedStorage", "host_share_key", "copy_checked_rows", "map_table_rows", "ScaleOverflowCheck",
    "unexpected_engram_tensors", "file_problem",
]
