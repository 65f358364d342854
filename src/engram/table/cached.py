"""Placement ``"cached"``: a host table (placement ``"host"``) plus an HBM cache of hot rows.

The rows live in pinned host memory exactly as with ``"host"``; a
:class:`~engram.table.row_cache.RowCache` of ``cache_fraction * rows`` slots on the device
holds copies of hot rows. A lookup is one kernel (:mod:`engram.table.cache_gather`): per
row one read of its set's tags, then the row from HBM on a hit or from host memory over
the host placement's direct path (its CUDA alias of the pinned rows) on a miss. Results
equal the ``device`` placement's bit for bit whatever the cache holds.

Two policies:

* ``"dynamic"`` (default): the engine calls :meth:`EngramTable.update_cache` with each
  step's hash ids between steps; missed rows are admitted with frequency-based
  replacement and aging (:mod:`engram.table.row_cache`). A hot set, when given, is the
  starting content.
* ``"static"``: the hot set given (``hot_rows=`` or :meth:`EngramTable.load_hot_rows`)
  stays; :meth:`update` does nothing.

The index is fixed-size and updated in place, so a lookup captured in a CUDA graph keeps
serving the current content across updates. Without CUDA the placement is refused,
except under ``TRITON_INTERPRET=1`` with ``device="cpu"`` (the backing rows are then a CPU
tensor): that is how the CPU tests run the kernels.
"""

from __future__ import annotations

import torch

from ..triton_launch import interpreting, triton_available
from .host_rows import PackedRows, pack_rows
from .table import TablePlacement, register_placement

__all__ = ["CachedPlacement", "DEFAULT_CACHE_FRACTION", "POLICIES"]

DEFAULT_CACHE_FRACTION = 0.02  # issue 12: 2% of rows
POLICIES = ("dynamic", "static")


@register_placement
class CachedPlacement(TablePlacement):
    """Host rows plus an HBM row cache.

    Args (after the storage and ``device`` every placement takes; pass them through
    ``EngramTable(..., placement="cached", placement_options={...})``):
        cache_fraction: fraction of the table's rows the cache holds, in ``(0, 1]``
            (rounded down to whole sets of ``ways`` slots; at least one set).
        ways: slots per set (power of two, at most 64).
        aging_interval: counters halve every this many updates.
        policy: ``"dynamic"`` or ``"static"``.
        hot_rows: optional local row ids ``int [K]`` (hottest first) loaded as the starting content.
    """

    name = "cached"
    has_triton_lookup = True

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device=None, *,
                 cache_fraction: float = DEFAULT_CACHE_FRACTION, ways: int = 8, aging_interval: int = 8,
                 policy: str = "dynamic", hot_rows: torch.Tensor | None = None):
        if isinstance(cache_fraction, bool) or not isinstance(cache_fraction, (int, float)) or not (
                0 < cache_fraction <= 1):
            raise ValueError(f"cache_fraction: expected a number in (0, 1], found {cache_fraction!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {list(POLICIES)}, found {policy!r}")
        if torch.cuda.is_available():
            from .host import HostPlacement

            self.host = HostPlacement(value_bytes, scale_bytes, device)
            target = self.host.device
            self._back_values, self._back_scales = self.host._direct_values, self.host._direct_scales
            super().__init__(self.host.value_bytes, self.host.scale_bytes, target)
        elif interpreting() and triton_available() and (device is None or torch.device(device).type == "cpu"):
            rows = PackedRows.matching(value_bytes, scale_bytes) or pack_rows(value_bytes.cpu(), scale_bytes.cpu())
            self.host = None
            self._back_values, self._back_scales = rows.values, rows.scales
            super().__init__(rows.values, rows.scales, torch.device("cpu"))
        else:
            raise ValueError("placement 'cached' keeps the table in host memory for a CUDA device to read, and "
                             "this machine has no CUDA device; use placement='cpu' (tables served from the CPU)")
        from .row_cache import RowCache

        num_rows = self.num_rows
        self.policy = policy
        self.cache_fraction = float(cache_fraction)
        self.cache = RowCache(max(1, int(num_rows * cache_fraction)), self.head_dim, self.device, ways=ways,
                              aging_interval=aging_interval)
        if hot_rows is not None:
            self.load_hot(hot_rows)

    @property
    def backing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uint8 [rows, D], uint8 [rows, D // 32])`` on :attr:`device`: the host rows as the
        lookup kernel reads them on a miss (the CUDA alias of pinned host memory)."""
        return self._back_values, self._back_scales

    @property
    def nbytes(self) -> int:
        """Host bytes of the rows (as placement ``"host"``)."""
        return self.host.nbytes if self.host is not None else self.num_rows * (self.head_dim + self.head_dim // 32)

    @property
    def cache_nbytes(self) -> int:
        """Device bytes of the cache (slots and index)."""
        return self.cache.nbytes

    # ---- cache maintenance (between steps) -----------------------------------------
    def load_hot(self, local_row_ids: torch.Tensor) -> int:
        """Replace the cache's content by the rows ``local_row_ids int [K]`` (hottest first); returns
        the rows held (a set keeps at most ``ways`` of them)."""
        if not isinstance(local_row_ids, torch.Tensor) or local_row_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"hot_rows: expected an int32/int64 tensor of local row ids, found "
                             f"{getattr(local_row_ids, 'dtype', type(local_row_ids).__name__)}")
        return self.cache.load_hot(local_row_ids, *self.backing)

    def update(self, global_ids: torch.Tensor, row_start: int) -> None:
        """The dynamic policy's step for the reads ``global_ids int [T, C_local]`` (on :attr:`device`);
        nothing for policy ``"static"``. Call between steps, never inside a captured graph."""
        if self.policy == "dynamic":
            self.cache.update(global_ids.to(torch.int64) - row_start, *self.backing)

    # ---- lookups ------------------------------------------------------------------
    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: :func:`~engram.table.row_cache.cached_lookup_reference` (same bytes)."""
        from .row_cache import cached_lookup_reference

        values, scales = cached_lookup_reference(self.cache, *self.backing, local_row_ids.reshape(1, -1), 0)
        return values[0], scales[0]

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool):
        if self.backend != "triton":
            return None
        from .cache_gather import cached_gather_rows, cached_gather_rows_packed

        if packed:
            return cached_gather_rows_packed(self.cache, *self.backing, global_ids, row_start)
        return cached_gather_rows(self.cache, *self.backing, global_ids, row_start)

    def __repr__(self) -> str:
        return (f"CachedPlacement(rows={self.num_rows}, head_dim={self.head_dim}, device={self.device}, "
                f"slots={self.cache.num_slots}, ways={self.cache.ways}, policy={self.policy!r})")
