"""Placement ``"device"``: the whole table in one CUDA device's memory (HBM)."""

from __future__ import annotations

import torch

from engram.common import resolve_cuda_device
from engram.table.table import TablePlacement, register_placement

__all__ = ["DevicePlacement"]


def _triton_gather():
    """The Triton launchers (:mod:`engram.table.kernels.gather`); only called once Triton is known to import."""
    from engram.table.kernels import gather

    return gather


@register_placement
class DevicePlacement(TablePlacement):
    """The whole table in one CUDA device's memory (HBM); lookups run there.

    ``device`` defaults to the current CUDA device. Lookups run the Triton gather kernel
    (:mod:`engram.table.kernels.gather`) with backend ``"triton"``, else index_select + dequantize.
    """

    name = "device"
    has_triton_lookup = True

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None):
        target = resolve_cuda_device(device, "placement 'device'")
        super().__init__(value_bytes.to(target), scale_bytes.to(target), target)

    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self._value_bytes.index_select(0, local_row_ids),
                self._scale_bytes.index_select(0, local_row_ids))

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool, pending=None):
        """The Triton gather kernel (one launch, no host sync) with backend ``"triton"``."""
        if self.backend != "triton":
            return None
        gather = _triton_gather()
        if packed:
            return gather.gather_rows_packed(self._value_bytes, self._scale_bytes, global_ids, row_start)
        return gather.gather_rows(self._value_bytes, self._scale_bytes, global_ids, row_start)

    def prepare_gather(self, global_ids: torch.Tensor, row_start: int, column_start: int, column_end: int,
                       flat: bool = False):
        """A :class:`~engram.table.kernels.gather.PreparedGather` of the columns ``[column_start, column_end)``
        of ``global_ids``' structure (backend ``"triton"``), else None."""
        if self.backend != "triton":
            return None
        return _triton_gather().PreparedGather(self._value_bytes, self._scale_bytes, global_ids, row_start,
                                               column_start, column_end, flat=flat)
