"""Helpers of the disk-tier tests: a small checkpoint, its layer sources and the rows placement "host"
packs from it (the reference every row file and read is compared with, byte for byte)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engram.checkpoint import SafetensorsCheckpoint
from engram.layout import EngramLayout
from engram.table.disk.writing import layer_table_source
from engram.table.host_memory.rows import pack_rows
from engram.tools.testing import write_synthetic_checkpoint


@dataclass
class DiskCheckpoint:
    directory: Path
    checkpoint: SafetensorsCheckpoint
    layout: EngramLayout
    weight_map: dict

    def source(self, layer_index: int = 0, **options):
        return layer_table_source(self.checkpoint, self.layout, layer_index, **options)

    def host_rows(self, layer_index: int = 0) -> torch.Tensor:
        """``uint8 [rows + 1, row_bytes]``: the layer's rows as placement "host" packs them (zero row last)."""
        source = self.source(layer_index)
        tensors = []
        for info in (source.values_info, source.scales_info):
            tensors.append(load_file(self.directory / self.weight_map[info.name])[info.name].view(torch.uint8))
        return pack_rows(*tensors).packed


def disk_checkpoint(directory: Path, seed: int, scale: str = "wide") -> DiskCheckpoint:
    """A synthetic checkpoint at ``scale`` ("wide": V4.1's head_dim 256, 272-byte rows, 15 a page)."""
    synthetic = write_synthetic_checkpoint(directory, seed=seed % 2**31, scale=scale, tokenizer="word")
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    return DiskCheckpoint(synthetic.directory, checkpoint, EngramLayout(synthetic.spec), synthetic.weight_map)
