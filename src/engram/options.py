"""ServingOptions: every serving knob of the library in one frozen object.

Pass one to :meth:`EngramMemory.from_pretrained <engram.memory.EngramMemory.from_pretrained>`
(``options=``), :class:`~engram.table.table.EngramTable` or
:meth:`Engram.from_weights <engram.layer.module.Engram.from_weights>`. Every field is checked
when the object is made, so a bad value fails before any byte is read. Environment variables
(:mod:`engram.environment`) are only the defaults of :meth:`ServingOptions.from_environment`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from engram import environment

__all__ = ["ServingOptions", "BACKEND_CHOICES", "WKV_BACKEND_CHOICES", "CACHE_POLICIES"]

BACKEND_CHOICES = ("auto", "triton", "torch")
WKV_BACKEND_CHOICES = ("auto", "bf16", "scaled_mm", "triton", "fused")
CACHE_POLICIES = ("set-lru", "dynamic", "static")
HOST_GATHER_WORKERS = ("auto", "native", "python")  # engram.table.host_memory.gather.WORKERS
HOST_GATHER_DEDUP = ("auto", "always", "never")  # engram.table.host_memory.gather.DEDUP_CHOICES
SHARED_HOST_PLACEMENTS = ("host", "cached")  # placements whose host tables share_host_tables keeps once per node
UNSHARED_PLACEMENTS = ("cpu", "device", "node")  # built-in placements that keep no host table to share

# Lookups of at most this many rows read host memory directly (the decode path, capturable); larger
# ones take the host gather. H200, 34 GiB table on 2 MiB pages (benchmarks/NOTES.md "Host tables"):
# direct reads 19 us at T = 64, 0.87 ms at T = 1024, ~7.5 GB/s beyond; the host gather 0.6-0.9 ms at
# small T, 1.16 ms at T = 1024, 3.5 ms at T = 8192 (direct 6.9).
DEFAULT_DIRECT_MAX_ROWS = 4096 * 24
# 2% of rows: the HBM cache size evaluated on held-out English (benchmarks/NOTES.md, cache policies).
DEFAULT_CACHE_FRACTION = 0.02
# Prefetched lookups of more rows than this start the host gather at the prefetch, hidden behind the
# layers before theirs, even below direct_max_rows. H200, step of 40 layers at T = 4096 (98,304 rows,
# direct): the direct reads held the main stream 9.8 ms a step against 2.7 ms with HBM tables (+1.8%
# of the step); the host gather of 196,608 rows takes 3.8 ms end to end (benchmarks/NOTES.md "The
# served decoder step").
DEFAULT_PREFETCH_DIRECT_MAX_ROWS = 1024 * 24


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, found {value!r}")


def _optional_bool(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: expected True, False or None, found {value!r}")


def _integer(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}{' or None' if optional else ''}, found {value!r}")


class ReadOnlyDict(dict):
    """A dict that refuses every change (``TypeError``): a frozen :class:`ServingOptions`' own copy of
    ``extra_placement_options``. It pickles and copies as a dict does."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("ServingOptions.extra_placement_options is read-only (the options are frozen); make new "
                        "options with ServingOptions.replace(extra_placement_options={...})")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return (ReadOnlyDict, (dict(self),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(frozen=True)
class ServingOptions:
    """How the Engram layers are served (all fields optional; defaults in brackets).

    Stages:
        backend: hash kernel, table lookups and gate: ``"auto"`` (Triton on CUDA, torch on the CPU),
            ``"triton"`` or ``"torch"`` [``"auto"``].
        wkv_backend: the wkv projection: ``"auto"`` (FP8 block-scaled ``_scaled_mm`` for an FP8
            weight on CUDA, else bf16), ``"bf16"``, ``"scaled_mm"``, ``"triton"``, ``"fused"``
            [``$ENGRAM_WKV_BACKEND`` or ``"auto"``].
        wkv_small_m: the split-K GEMM for few tokens on the ``_scaled_mm`` path [``$ENGRAM_WKV_SMALL_M``
            or off].
        validate: check hash ids and batches on every call (a host sync) [on for the CPU, off for CUDA].
        check_values: refuse table rows and weights holding NaN bytes while loading [True].
    Host placements (``"host"``, ``"cached"``):
        direct_max_rows: lookups of at most this many rows read host memory directly over PCIe,
            larger ones take the host gather; 0 sends every lookup outside graph capture through
            the host gather [4096 * 24].
        prefetch_direct_max_rows: placement ``"host"``: prefetched lookups of at most this many rows
            (and at most ``direct_max_rows``) read host memory directly; larger ones start the host
            gather at the prefetch, off the main stream [1024 * 24].
        gather_threads: host threads copying rows for the host gather [usable cores divided by
            ``$LOCAL_WORLD_SIZE``, at least 1].
        host_gather_worker: who copies the host gather's rows: ``"native"`` (threads in C, built at
            first use with the system's C compiler; the caller's thread never waits for a gather),
            ``"python"`` (torch's ``index_select`` on a Python thread; the caller waits until the
            copies are enqueued) or ``"auto"`` (native where a C compiler and the driver's stream
            memory operations are found) [``"auto"``].
        host_gather_dedup: whether the native worker's gathers copy each distinct row once (a sort on
            the device first, ~0.25 ms of GPU and ~0.3 ms of host time at T = 8192 on the H200) or every
            lookup's row in lookup order: ``"always"``, ``"never"`` or ``"auto"`` (sorts while the table's
            recent lookups repeat rows often enough to pay for it, measured on every 16th gather) [``"auto"``].
        share_host_tables: one copy of each table per node in ``/dev/shm`` [False].
    Placement ``"cached"``:
        cache_fraction: fraction of a table's rows held in HBM, in (0, 1] [0.02].
        cache_policy: ``"set-lru"``, ``"dynamic"`` or ``"static"`` [``"set-lru"``].
        cache_ways: slots per set, a power of two up to 64 [8].
    Loading:
        chunk_bytes: bytes read per memory-mapped slice while tables stream in [64 MiB].
        progress: a progress bar while tables stream in [True].
    """

    backend: str = "auto"
    wkv_backend: str | None = None
    wkv_small_m: bool | None = None
    validate: bool | None = None
    check_values: bool = True
    direct_max_rows: int = DEFAULT_DIRECT_MAX_ROWS
    prefetch_direct_max_rows: int = DEFAULT_PREFETCH_DIRECT_MAX_ROWS
    gather_threads: int | None = None
    host_gather_worker: str = "auto"
    host_gather_dedup: str = "auto"
    share_host_tables: bool = False
    cache_fraction: float = DEFAULT_CACHE_FRACTION
    cache_policy: str = "set-lru"
    cache_ways: int = 8
    chunk_bytes: int = 64 << 20
    progress: bool = True
    extra_placement_options: dict = field(default_factory=dict, compare=False)
    """Keyword arguments of a placement beyond the fields above (a registered placement's own)."""

    def __post_init__(self):
        _choice("backend", self.backend, BACKEND_CHOICES)
        if self.wkv_backend is not None:
            _choice("wkv_backend", self.wkv_backend, WKV_BACKEND_CHOICES)
        _optional_bool("wkv_small_m", self.wkv_small_m)
        _optional_bool("validate", self.validate)
        for name in ("check_values", "share_host_tables", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, found {getattr(self, name)!r}")
        _integer("direct_max_rows", self.direct_max_rows, 0)
        _integer("prefetch_direct_max_rows", self.prefetch_direct_max_rows, 0)
        _integer("gather_threads", self.gather_threads, 1, optional=True)
        _choice("host_gather_worker", self.host_gather_worker, HOST_GATHER_WORKERS)
        _choice("host_gather_dedup", self.host_gather_dedup, HOST_GATHER_DEDUP)
        fraction = self.cache_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"cache_fraction: expected a number in (0, 1], found {fraction!r}")
        _choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        _integer("cache_ways", self.cache_ways, 1)
        if self.cache_ways & (self.cache_ways - 1) or self.cache_ways > 64:
            raise ValueError(f"cache_ways: expected a power of two up to 64, found {self.cache_ways!r}")
        _integer("chunk_bytes", self.chunk_bytes, 1)
        if not isinstance(self.extra_placement_options, Mapping) or not all(
                isinstance(key, str) for key in self.extra_placement_options):
            raise ValueError(f"extra_placement_options: expected a dict of keyword arguments, found "
                             f"{self.extra_placement_options!r}")
        # Frozen means frozen: a copy the caller's dict cannot change, and that cannot be changed itself.
        object.__setattr__(self, "extra_placement_options", ReadOnlyDict(self.extra_placement_options))

    @classmethod
    def from_environment(cls, **fields: Any) -> "ServingOptions":
        """The options with ``fields`` as given and the environment's defaults (:mod:`engram.environment`)
        for ``wkv_backend`` and ``wkv_small_m`` where not given."""
        if fields.get("wkv_backend") is None:
            given, name = environment.wkv_backend_default()
            if given is not None:
                try:
                    _choice(name, given, WKV_BACKEND_CHOICES)
                except ValueError as error:
                    raise ValueError(str(error)) from None
                fields["wkv_backend"] = given
        if fields.get("wkv_small_m") is None:
            fields["wkv_small_m"] = environment.wkv_small_m_default()
        if fields.get("gather_threads") is None:
            environment.local_world_size()   # a malformed LOCAL_WORLD_SIZE is refused now, before any byte is read
        return cls(**fields)

    def replace(self, **fields: Any) -> "ServingOptions":
        """A copy with ``fields`` changed (checked again); fields given as None are left as they are."""
        changes = {name: value for name, value in fields.items() if value is not None}
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"options: ServingOptions has no field {unknown[0]!r}")
        return dataclasses.replace(self, **changes) if changes else self

    def placement_options(self, placement: str) -> dict:
        """Keyword arguments for placement ``placement`` (``"host"``, ``"cached"``; none for the others),
        then :attr:`extra_placement_options`. ``share_host_tables`` with a placement that keeps no host
        table (``"cpu"``, ``"device"``, ``"node"``) is refused, as a placement option it does not take is."""
        if self.share_host_tables and placement in UNSHARED_PLACEMENTS:
            raise ValueError(f"share_host_tables: True keeps one copy of each host table per node, which placements "
                             f"{' and '.join(map(repr, SHARED_HOST_PLACEMENTS))} have; placement {placement!r} keeps "
                             f"none" + (" (its rows are memory maps of the checkpoint files, shared by the page "
                                        "cache already)" if placement == "cpu" else ""))
        options: dict = {}
        if placement in ("host", "cached"):
            options.update(direct_max_rows=self.direct_max_rows, gather_threads=self.gather_threads,
                           host_gather_worker=self.host_gather_worker, host_gather_dedup=self.host_gather_dedup)
        if placement == "host":
            options.update(prefetch_direct_max_rows=self.prefetch_direct_max_rows)
        if placement == "cached":
            options.update(cache_fraction=self.cache_fraction, policy=self.cache_policy, ways=self.cache_ways)
        options.update(dict(self.extra_placement_options))
        return options
