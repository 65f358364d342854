"""Placement ``"cpu"``: plain CPU tensors (memory-mapped ones included); lookups on the CPU."""

from __future__ import annotations

import torch

from engram.table.table import TablePlacement, register_placement

__all__ = ["CpuPlacement"]


@register_placement
class CpuPlacement(TablePlacement):
    """Plain CPU tensors (memory-mapped ones included); lookups run on the CPU."""

    name = "cpu"
    no_host_table_reason = "its rows are memory maps of the checkpoint files, shared by the page cache already"

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None):
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device: placement 'cpu' runs on the CPU, found device {device!r}")
        super().__init__(value_bytes.cpu(), scale_bytes.cpu(), torch.device("cpu"))
        # The files the bytes are memory-mapped from (engram.mapped.MappedFiles), set by the loader:
        # every gather first checks that none changed, so a rewritten or truncated file is an error
        # at the next step rather than other rows or a SIGBUS.
        self.source_files = None

    @classmethod
    def storage_device(cls, device) -> None:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device: placement 'cpu' runs on the CPU, found device {device!r}")
        return None

    @classmethod
    def load_storage(cls, source, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The rows as views of private memory maps of the checkpoint's files (no copy, the page cache
        holds the bytes), checked in one pass; the files are kept to detect a change at each lookup."""
        values, scales, files = source.map_read_only()
        return values, scales, {"source_files": files}

    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.source_files is not None:
            self.source_files.check()
        return (self._value_bytes.index_select(0, local_row_ids),
                self._scale_bytes.index_select(0, local_row_ids))
