"""Prefetch handles: a started read, and the one rule that decides whether a lookup tries it.

:meth:`EngramTable.prefetch <engram.table.table.EngramTable.prefetch>` returns a
:class:`TablePrefetch`. Its :class:`PrefetchState` moves one way:

* ``EMPTY`` (nothing was started: the rows live on the device, a decode-sized batch is read
  directly) or ``STARTED`` (a host gather is under way, or captured into the graph being captured);
* then exactly one of ``SERVED`` (a lookup finished it), ``STALE`` (a later prefetch of the table
  superseded it before any lookup) or ``DROPPED`` (a lookup found it not worth trying, or its
  step's handle was taken by other ids).

**Correctness does not rest on this rule.** The lookup's consuming kernel serves a prefetched row
only where the id it was read for equals the lookup's own id at that position and reads every
other row itself (docs/design.md, "Rows exact by construction"; the states: "Step lifecycle"). :func:`claim` only decides
whether finishing the prefetch is worth it, i.e. likely to hold the lookup's rows, and that it
is safe to finish (the staging was not reused by a later gather: a reused staging's rows could
be overwritten while the lookup reads them). A lookup tries a ``STARTED`` handle when every one
of these holds:

* it is the table's latest prefetch;
* the lookup's ids are the tensor the prefetch read, by :class:`~engram.common.IdsIdentity`
  (same base tensor, geometry and, outside inference mode, version);
* it was made in a CUDA-graph capture exactly when the lookup runs in one (a graph must not bake in
  the table's shared staging, and a captured read runs only as part of its graph);
* the placement says its pending state still holds (:meth:`TablePlacement.prefetch_usable`).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any

from engram.common import IdsIdentity, cuda_capturing

__all__ = ["TablePrefetch", "PrefetchState", "claim", "IdsIdentity", "capturing"]


capturing = cuda_capturing


class PrefetchState(enum.Enum):
    """Where a :class:`TablePrefetch` stands (the module docstring gives the transitions)."""

    EMPTY = "empty"
    STARTED = "started"
    SERVED = "served"
    STALE = "stale"
    DROPPED = "dropped"


_OPEN = (PrefetchState.EMPTY, PrefetchState.STARTED)


@dataclass(eq=False)
class TablePrefetch:
    """One table's prefetch: its table (weakly: the table keeps its latest handle, and a cycle would
    leave freeing both to the garbage collector, at any moment, a graph capture included), the
    table's ``serial`` of it, the ids it read, the placement's pending state (None: nothing was
    started; the lookup reads the rows as without a prefetch) and its :class:`PrefetchState`."""

    table: weakref.ref
    serial: int
    ids: IdsIdentity
    pending: Any
    state: PrefetchState = field(default=PrefetchState.EMPTY)
    captured: bool = False  # made during a CUDA-graph capture: its read is part of that graph

    def __post_init__(self):
        if self.pending is not None and self.state is PrefetchState.EMPTY:
            self.state = PrefetchState.STARTED

    @property
    def spent(self) -> bool:
        """Whether the handle is closed (served, stale or dropped): no lookup will try it."""
        return self.state not in _OPEN

    def drop(self, state: PrefetchState = PrefetchState.DROPPED) -> None:
        """Close the handle unserved, as ``state`` (``DROPPED`` or ``STALE``); a started one is counted in the
        owner's ``prefetches["dropped"]``. A no-op once closed."""
        if self.spent:
            return
        table = self.table()
        if self.state is PrefetchState.STARTED and table is not None:
            table.prefetches["dropped"] += 1
            if self.captured and capturing():  # its captured copies must join the capture all the same
                table.storage.release_captured(self.pending)
        self.state = state

    @property
    def started(self) -> bool:
        """Whether the prefetch started a read (a host gather) that a lookup can finish."""
        return self.pending is not None

    @property
    def finish_waits(self) -> bool:
        """Whether the lookup finishing this prefetch blocks its thread (a host gather's Python worker)."""
        table = self.table()
        return self.pending is not None and table is not None and table.storage.finish_waits(self.pending)


def claim(prefetch: "TablePrefetch | None", table, latest_serial: int, hash_ids) -> Any:
    """The placement's pending state of ``prefetch`` when the lookup of ``hash_ids`` on ``table`` should try it
    (the module docstring's rule), else None. The handle is closed either way: ``SERVED`` or ``DROPPED``."""
    if prefetch is None:
        return None
    if not isinstance(prefetch, TablePrefetch):
        raise ValueError(f"prefetch: expected the TablePrefetch that EngramTable.prefetch returned, or None, "
                         f"found {type(prefetch).__name__}")
    if prefetch.table() is not table:
        raise ValueError(f"prefetch: a handle of another table ({prefetch.table()!r}), given to {table!r}")
    worth_trying = (prefetch.state is PrefetchState.STARTED and prefetch.serial == latest_serial
                    and prefetch.ids.matches(hash_ids) and capturing() == prefetch.captured
                    and table.storage.prefetch_usable(prefetch.pending))
    if not worth_trying:
        prefetch.drop()
        return None
    prefetch.state = PrefetchState.SERVED
    table.prefetches["served"] += 1
    return prefetch.pending
