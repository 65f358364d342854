"""Where a table's bytes live, one module per placement: ``cpu`` (memory-mapped files, CPU lookups),
``device`` (HBM), ``host`` (pinned host memory read by the GPU) and ``cached`` (host rows plus an
HBM row cache, :mod:`.row_cache`) and ``node`` (rows spread over a node's process group,
served by collectives). Each registers itself with :func:`engram.table.table.register_placement`."""
