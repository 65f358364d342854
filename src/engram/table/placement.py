"""TablePlacement: where one table's FP8 bytes live and how rows are gathered from them, and the
registry of placements (:func:`register_placement`, :func:`available_placements`).

A placement owns its storage, how it is filled from a checkpoint (``storage_device``,
``allocate_storage``, ``load_storage``, ``adopt``; :mod:`engram.checkpoint.loading` calls them) and
its optional hooks (``prefetch``, ``update``, ``load_hot``, ``prepare_gather``), each declared here
with a default. The placements themselves are :mod:`engram.table.placements`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import torch

from engram.common import resolve_cuda_device
from engram.table.fp8 import BLOCK_SIZE

__all__ = ["TablePlacement", "register_placement", "placement_class", "available_placements", "make_placement",
           "check_host_table_shared"]


class TablePlacement(abc.ABC):
    """Owns a table's FP8 storage and gathers rows from it.

    Storage: ``value_bytes uint8 [rows, D]`` (E4M3 bit patterns) and
    ``scale_bytes uint8 [rows, D // 32]`` (UE8M0). ``device`` is where hash ids are
    given and gathered rows land; the storage itself may live elsewhere (host memory).

    Subclasses set ``name``, place the storage in ``__init__`` and implement
    :meth:`gather`; ``gather`` must not sync with the host. A subclass with a Triton
    lookup sets ``has_triton_lookup`` and honours :attr:`backend` in :meth:`gather_fused`.
    """

    name: ClassVar[str] = ""
    has_triton_lookup: ClassVar[bool] = False
    collective: ClassVar[bool] = False
    """True where every lookup is a collective that every rank of a group must call, in the same order."""
    starts_reads: ClassVar[bool] = False
    """True where :meth:`prefetch` may start a read (device work on the stream it is called on, then host
    work) that a lookup finishes; :class:`~engram.memory.EngramMemory` then runs its prefetches on a stream
    of its own."""
    backend: str = "torch"
    """``"triton"`` or ``"torch"``: set once by :class:`EngramTable` from its ``backend`` argument."""
    options_type: ClassVar[type | None] = None
    """The placement's options: a frozen dataclass whose fields are keyword arguments of ``__init__``
    (None: it takes none that :class:`~engram.options.ServingOptions` carries). Its class attribute
    ``serving_fields`` (``{ServingOptions field: its field}``) names the shared fields it takes;
    ``ServingOptions(placements={name: options})`` gives it the rest."""
    serves_cpu: ClassVar[bool] = False
    """True where a table may also serve lookups on the CPU (a CPU ``device``, or none without CUDA)."""
    keeps_host_table: ClassVar[bool] = False
    """True where the rows live in host memory that ``share_host_tables`` can keep once per node."""
    no_host_table_reason: ClassVar[str] = ""
    """Why ``share_host_tables`` does not apply, for its refusal (optional)."""

    def __init__(self, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device: torch.device):
        self._value_bytes = value_bytes
        self._scale_bytes = scale_bytes
        self._device = device

    @property
    def device(self) -> torch.device:
        """Device of the hash ids a lookup takes and of the rows it returns."""
        return self._device

    @property
    def value_bytes(self) -> torch.Tensor:
        """``uint8 [rows, D]``: the E4M3 values as stored."""
        return self._value_bytes

    @property
    def scale_bytes(self) -> torch.Tensor:
        """``uint8 [rows, D // 32]``: the UE8M0 scales as stored."""
        return self._scale_bytes

    @property
    def num_rows(self) -> int:
        return self._value_bytes.shape[0]

    @property
    def head_dim(self) -> int:
        return self._value_bytes.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows: ``rows * (D + D // 32)``."""
        return self._value_bytes.numel() + self._scale_bytes.numel()

    @abc.abstractmethod
    def gather(self, local_row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``int64 [N]`` local row ids in ``[0, rows)`` on :attr:`device` ->
        ``(uint8 [N, D], uint8 [N, D // 32])`` on :attr:`device`: ``storage[local_row_ids]``."""

    def gather_fused(self, global_ids: torch.Tensor, row_start: int, packed: bool, pending: Any = None):
        """Optional fused lookup: ``global_ids`` int32/int64 ``[T, C_local]`` (any strides) on
        :attr:`device` -> ``bfloat16 [T, C_local, D]``, or when ``packed`` ``(uint8 [T, C_local, D],
        uint8 [T, C_local, D // 32])``; zeros for ids outside ``[row_start, row_start + rows)``.
        ``pending``: what :meth:`prefetch` returned for exactly these ids, checked usable by the table.
        None (the default) means "no fused path": the table then uses :meth:`gather`."""
        return None

    # ---- loading from a checkpoint (engram.checkpoint.loading) -------------------------
    @classmethod
    def storage_device(cls, device) -> torch.device | None:
        """The device a table of this placement is built for, given the loader's ``device`` argument
        (None: the CPU). Default: a CUDA device (``device`` or the current one)."""
        return resolve_cuda_device(device, f"placement {cls.name!r}")

    @classmethod
    def allocate_storage(cls, num_rows: int, head_dim: int, device: torch.device | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty ``uint8 [num_rows, D]`` values and ``[num_rows, D // 32]`` scales where this placement
        keeps its bytes. Default: on ``device`` (the CPU for None)."""
        return (torch.empty(num_rows, head_dim, dtype=torch.uint8, device=device),
                torch.empty(num_rows, head_dim // BLOCK_SIZE, dtype=torch.uint8, device=device))

    @classmethod
    def load_storage(cls, source, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Fill this placement's storage from ``source`` (:class:`engram.checkpoint.loading.TableSource`:
        the rank's rows of one table and how to read them); returns ``(values, scales, keep)``, ``keep``
        being attributes for :meth:`adopt`. Default: :meth:`allocate_storage`, then the rows streamed in."""
        values, scales = cls.allocate_storage(source.num_rows, source.head_dim, device)
        source.read_into(values, scales)
        return values, scales, {}

    def adopt(self, keep: dict) -> None:
        """Keep what :meth:`load_storage` made beside the storage (a mapping, the source files)."""
        for name, value in keep.items():
            setattr(self, name, value)

    def close(self) -> None:
        """Release what the placement holds beyond memory Python frees (mappings of other processes'
        memory). Default: nothing."""

    def refuse_lookup(self) -> None:
        """Collective placements: this rank refuses its lookup (bad ids); join the lookup's first
        collective so the other ranks raise instead of waiting. Default: nothing (no collective)."""

    # ---- optional hooks (defaults: nothing to do) ------------------------------------
    def prefetch(self, global_ids: torch.Tensor, row_start: int) -> Any:
        """Start reading the rows of ``global_ids int [T, C_local]`` now; returns the pending state that
        :meth:`gather_fused` finishes, or None (the default: nothing to start, rows are at hand)."""
        return None

    def prefetch_captured(self, global_ids: torch.Tensor, row_start: int) -> Any:
        """:meth:`prefetch` while a CUDA graph is being captured: a read captured into the graph, whose pending
        state :meth:`gather_fused` finishes in the same capture, or None (the default: nothing captured)."""
        return None

    def release_captured(self, pending: Any) -> None:
        """A pending state from :meth:`prefetch_captured` that no lookup finishes: join its captured work to the
        current stream (a capture ends only with every forked stream joined). Default: nothing."""

    def prefetch_starts(self, num_ids: int) -> bool:
        """Whether :meth:`prefetch` of ``num_ids`` ids (outside graph capture) may start a read (True where
        unsure). Default: :attr:`starts_reads`."""
        return self.starts_reads

    def prefetch_usable(self, pending: Any) -> bool:
        """Whether ``pending`` (from :meth:`prefetch`) still holds the rows it was started for."""
        return True

    def finish_waits(self, pending: Any) -> bool:
        """Whether finishing ``pending`` (from :meth:`prefetch`) blocks the calling thread. Default: no."""
        return False

    def update(self, global_ids: torch.Tensor, row_start: int) -> None:
        """Between steps: learn from the reads ``global_ids int [T, C_local]`` (row caches). Default: nothing."""

    def load_hot(self, local_row_ids: torch.Tensor) -> int:
        """Make the rows ``local_row_ids int [K]`` the content of a row cache; the rows held. Default: refused."""
        raise ValueError(f"load_hot_rows: placement {self.name!r} has no row cache; use placement 'cached'")

    def prepare_gather(self, global_ids: torch.Tensor, row_start: int, column_start: int, column_end: int,
                       flat: bool):
        """Optional: a planned lookup for every call of ``global_ids``' structure, or None (default)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rows={self.num_rows}, head_dim={self.head_dim}, device={self.device})"


_PLACEMENTS: dict[str, type[TablePlacement]] = {}


def register_placement(placement_class: type[TablePlacement]) -> type[TablePlacement]:
    """Make a :class:`TablePlacement` subclass available under its ``name`` (usable as a decorator).

    The class is constructed as ``placement_class(value_bytes, scale_bytes, device, **options)``
    with the storage as given (any device), the ``device`` argument of the table and the
    table's ``placement_options`` (keyword arguments; none for most placements).
    """
    if not (isinstance(placement_class, type) and issubclass(placement_class, TablePlacement)):
        raise ValueError(f"placement_class: expected a TablePlacement subclass, found {placement_class!r}")
    if not placement_class.name:
        raise ValueError(f"placement_class {placement_class.__name__}: expected a non-empty class attribute 'name'")
    _check_options_type(placement_class)
    _PLACEMENTS[placement_class.name] = placement_class
    return placement_class


def _check_options_type(placement_class: type[TablePlacement]) -> None:
    """``options_type``: None, or a frozen dataclass whose ``serving_fields`` map ServingOptions fields
    that have a default onto its own fields."""
    options_type = placement_class.options_type
    if options_type is None:
        return
    where = f"placement_class {placement_class.__name__}: options_type"
    parameters = getattr(options_type, "__dataclass_params__", None)
    if not isinstance(options_type, type) or parameters is None or not parameters.frozen:
        raise ValueError(f"{where}: expected a frozen dataclass, found {options_type!r}")
    from engram.options import ServingOptions

    own = {f.name for f in dataclasses.fields(options_type)}
    shared = {f.name for f in dataclasses.fields(ServingOptions) if f.default is not dataclasses.MISSING}
    for serving, field in dict(getattr(options_type, "serving_fields", {})).items():
        if serving not in shared or field not in own:
            raise ValueError(f"{where}: serving_fields maps {serving!r} onto {field!r}; expected a ServingOptions "
                             f"field ({', '.join(sorted(shared))}) onto a field of {options_type.__name__}")


def placement_class(name: str) -> type[TablePlacement]:
    """The registered :class:`TablePlacement` subclass called ``name``; ValueError naming the choices."""
    found = _PLACEMENTS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"placement: unknown placement {name!r}; available placements: "
                         f"{', '.join(repr(n) for n in _PLACEMENTS)}")
    return found


def available_placements() -> tuple[str, ...]:
    """Names accepted by ``EngramTable(placement=...)``."""
    return tuple(_PLACEMENTS)


def check_host_table_shared(field: str, placement: str) -> None:
    """``field`` (``share_host_tables``) True with ``placement``: refused, naming the placements that keep
    a host table to share, unless ``placement`` is one of them."""
    found = placement_class(placement)
    if found.keeps_host_table:
        return
    keepers = [repr(name) for name, cls in _PLACEMENTS.items() if cls.keeps_host_table]
    named = " and ".join(filter(None, [", ".join(keepers[:-1]), keepers[-1] if keepers else ""]))
    reason = found.no_host_table_reason
    raise ValueError(f"{field}: True keeps one copy of each host table per node, which placements {named} have; "
                     f"placement {placement!r} keeps none" + (f" ({reason})" if reason else ""))


def make_placement(
    name: str, value_bytes: torch.Tensor, scale_bytes: torch.Tensor, device: torch.device | str | int | None = None,
    options: dict | None = None,
) -> TablePlacement:
    """Build the placement called ``name`` around ``uint8`` storage ``[rows, D]`` and ``[rows, D // 32]``;
    ``options``: keyword arguments of that placement (e.g. ``{"cache_fraction": 0.02}`` for ``"cached"``)."""
    placement_class = _PLACEMENTS.get(name) if isinstance(name, str) else None
    if placement_class is None:
        available = ", ".join(repr(n) for n in _PLACEMENTS)
        raise ValueError(f"placement: unknown placement {name!r}; available placements: {available}")
    if not options:
        return placement_class(value_bytes, scale_bytes, device)
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise ValueError(f"placement_options: expected a dict of keyword arguments, found {options!r}")
    import inspect

    accepted = inspect.signature(placement_class.__init__).parameters
    unknown = sorted(key for key in options if key not in accepted or key in ("self", "value_bytes", "scale_bytes",
                                                                                "device"))
    if unknown:
        raise ValueError(f"placement_options: placement {name!r} takes no option {unknown[0]!r}")
    return placement_class(value_bytes, scale_bytes, device, **options)


