"""Prefetch handles: a started read that only the lookup it was made for may consume.

:meth:`EngramTable.prefetch <engram.table.table.EngramTable.prefetch>` returns a
:class:`TablePrefetch`; :meth:`~engram.table.table.EngramTable.lookup` given it serves the
prefetched rows only when every one of these holds, and otherwise reads the rows itself
(right, only slower):

* the handle is the table's latest prefetch (a later prefetch drops it) and not consumed yet;
* the lookup's ids are the tensor the prefetch read: the same storage (the same base tensor
  object, alive; a fresh tensor that the caching allocator put at the same address is another
  object), the same view geometry, and the same version counter (an in-place refill bumps it;
  inference tensors have none, and then :class:`~engram.memory.EngramMemory`'s step counter
  is what tells a refill by the hasher);
* no CUDA graph is being captured (a graph must not bake in a staging buffer);
* the placement says its pending state still holds (no later gather reused its staging, the
  row cache's content is the one it probed).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from engram.common import IdsIdentity, cuda_capturing

__all__ = ["TablePrefetch", "IdsIdentity", "capturing"]


capturing = cuda_capturing


@dataclass(eq=False)
class TablePrefetch:
    """One table's prefetch: its table (weakly: the table keeps its latest handle, and a cycle would
    leave freeing both to the garbage collector, at any moment, a graph capture included), the
    table's ``serial`` of it, the ids it read, the placement's pending state (None: nothing was
    started; the lookup reads the rows as without a prefetch), and whether a lookup has claimed it
    (or it was dropped)."""

    table: weakref.ref
    serial: int
    ids: IdsIdentity
    pending: Any
    spent: bool = field(default=False)

    def drop(self) -> None:
        """Spend the handle unserved (counted in the owner's ``prefetches["dropped"]`` if it started a read)."""
        table = self.table()
        if not self.spent and self.pending is not None and table is not None:
            table.prefetches["dropped"] += 1
        self.spent = True

    @property
    def started(self) -> bool:
        """Whether the prefetch started a read (a host gather) that a lookup can finish."""
        return self.pending is not None

    @property
    def finish_waits(self) -> bool:
        """Whether the lookup finishing this prefetch blocks its thread (a host gather's Python worker)."""
        table = self.table()
        return self.pending is not None and table is not None and table.storage.finish_waits(self.pending)
