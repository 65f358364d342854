"""The table's Triton kernels, per operation, each beside its launcher and its plain-PyTorch reference:
the row gather (:mod:`.gather_kernels`, :mod:`.gather`, :mod:`.reference`), the cached lookup's probe
and merges (:mod:`.cache_kernels`, :mod:`.cache_gather`; reference in
:mod:`engram.table.placements.row_cache`) and the distinct rows of a lookup (:mod:`.dedup_kernels`,
:mod:`.dedup`)."""
