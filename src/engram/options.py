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
from engram.checks import (BACKEND_CHOICES, CACHE_POLICIES, HOST_GATHER_DEDUP, HOST_GATHER_WORKERS,
                           WKV_BACKEND_CHOICES, check_bool, check_choice, check_fraction, check_int,
                           check_power_of_two)
from engram.tuning import tuning

__all__ = ["ServingOptions", "BACKEND_CHOICES", "WKV_BACKEND_CHOICES", "CACHE_POLICIES"]

# Defaults read once from the device kind's tuning file (engram.tuning, keys serving.*; each cites its
# measurement). DEFAULT_DIRECT_MAX_ROWS: lookups of at most this many rows read host memory directly
# (the decode path, capturable); larger ones take the host gather (the H200's switch: 4096 x 24 rows).
# DEFAULT_CACHE_FRACTION: the HBM cache size evaluated on held-out text (2% of rows).
# DEFAULT_PREFETCH_DIRECT_MAX_ROWS: prefetched lookups of more rows than this start the host gather at
# the prefetch, hidden behind the layers before theirs, even below direct_max_rows (1024 x 24 rows).
_TUNED = tuning().serving
DEFAULT_DIRECT_MAX_ROWS = _TUNED.direct_max_rows
DEFAULT_CACHE_FRACTION = _TUNED.cache_fraction
DEFAULT_PREFETCH_DIRECT_MAX_ROWS = _TUNED.prefetch_direct_max_rows
# DEFAULT_GRAPH_DIRECT_MAX_ROWS: under CUDA-graph capture, prefetched lookups of more rows take the captured host
# gather (replayed with the graph), fewer read host memory directly (64 x 24 rows).
DEFAULT_GRAPH_DIRECT_MAX_ROWS = _TUNED.graph_direct_max_rows


class ReadOnlyDict(dict):
    """A dict that refuses every change (``TypeError``): a frozen :class:`ServingOptions`' own copy of
    ``placements`` and ``extra_placement_options``. It pickles and copies as a dict does."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("ServingOptions.placements and .extra_placement_options are read-only (the options are "
                        "frozen); make new options with ServingOptions.replace(placements={...}) or "
                        "replace(extra_placement_options={...})")

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
    Shared placement fields (each placement takes those its options type names in its
    ``serving_fields``; the built-in ones: ``"host"`` and ``"cached"``,
    :class:`~engram.table.placements.host.HostOptions`, :class:`~engram.table.placements.cached.CachedOptions`):
        direct_max_rows: lookups of at most this many rows read host memory directly over PCIe,
            larger ones take the host gather; 0 sends every lookup outside graph capture through
            the host gather [4096 * 24].
        prefetch_direct_max_rows: placement ``"host"``: prefetched lookups of at most this many rows
            (and at most ``direct_max_rows``) read host memory directly; larger ones start the host
            gather at the prefetch, off the main stream [1024 * 24].
        graph_direct_max_rows: placement ``"host"`` under CUDA-graph capture: prefetched lookups of more
            rows than this take a host gather captured with the graph (the native worker answers every
            replay); the others read host memory directly [64 * 24].
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
    Per placement:
        placements: for a placement's registered name, its options: an instance of its ``options_type``
            (a frozen dataclass; every field counts as given) or a dict of some of its fields (the rest
            from the shared fields above, else its defaults), e.g. ``{"cached": CachedOptions(ways=4)}``
            or ``{"cached": {"aging_interval": 32}}``; an object's fields left at their defaults take
            the shared fields' values too. A field set here and, to another value, as a shared field
            above is refused [{}].
        extra_placement_options: keyword arguments given to whichever placement is built, last
            (over both of the above) [{}].
    """

    backend: str = "auto"
    wkv_backend: str | None = None
    wkv_small_m: bool | None = None
    validate: bool | None = None
    check_values: bool = True
    direct_max_rows: int = DEFAULT_DIRECT_MAX_ROWS
    prefetch_direct_max_rows: int = DEFAULT_PREFETCH_DIRECT_MAX_ROWS
    graph_direct_max_rows: int = DEFAULT_GRAPH_DIRECT_MAX_ROWS
    gather_threads: int | None = None
    host_gather_worker: str = "auto"
    host_gather_dedup: str = "auto"
    share_host_tables: bool = False
    cache_fraction: float = DEFAULT_CACHE_FRACTION
    cache_policy: str = "set-lru"
    cache_ways: int = 8
    chunk_bytes: int = 64 << 20
    progress: bool = True
    placements: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Options of each placement by its registered name: its ``options_type`` or a dict of its fields."""
    extra_placement_options: dict = field(default_factory=dict, compare=False)
    """Keyword arguments given to whichever placement is built, over everything else."""

    def __post_init__(self):
        check_choice("backend", self.backend, BACKEND_CHOICES)
        if self.wkv_backend is not None:
            check_choice("wkv_backend", self.wkv_backend, WKV_BACKEND_CHOICES)
        check_bool("wkv_small_m", self.wkv_small_m, optional=True)
        check_bool("validate", self.validate, optional=True)
        for name in ("check_values", "share_host_tables", "progress"):
            check_bool(name, getattr(self, name))
        check_int("direct_max_rows", self.direct_max_rows, 0)
        check_int("prefetch_direct_max_rows", self.prefetch_direct_max_rows, 0)
        check_int("graph_direct_max_rows", self.graph_direct_max_rows, 0)
        check_int("gather_threads", self.gather_threads, 1, optional=True)
        check_choice("host_gather_worker", self.host_gather_worker, HOST_GATHER_WORKERS)
        check_choice("host_gather_dedup", self.host_gather_dedup, HOST_GATHER_DEDUP)
        check_fraction("cache_fraction", self.cache_fraction)
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        check_power_of_two("cache_ways", self.cache_ways, 64)
        check_int("chunk_bytes", self.chunk_bytes, 1)
        for name in ("placements", "extra_placement_options"):
            given = getattr(self, name)
            if not isinstance(given, Mapping) or not all(isinstance(key, str) for key in given):
                what = "placement names" if name == "placements" else "keyword arguments"
                raise ValueError(f"{name}: expected a dict of {what}, found {given!r}")
            # Frozen means frozen: a copy the caller's dict cannot change, and that cannot be changed itself.
            object.__setattr__(self, name, ReadOnlyDict(given))
        if self.placements:
            object.__setattr__(self, "placements", ReadOnlyDict(
                {name: _placement_entry(name, entry) for name, entry in self.placements.items()}))
            for name in self.placements:
                self.options_for(name)  # conflicts with the shared fields, and bad values, refused now

    @classmethod
    def from_environment(cls, **fields: Any) -> "ServingOptions":
        """The options with ``fields`` as given and the environment's defaults (:mod:`engram.environment`)
        for ``wkv_backend`` and ``wkv_small_m`` where not given."""
        if fields.get("wkv_backend") is None:
            given, name = environment.wkv_backend_default()
            if given is not None:
                fields["wkv_backend"] = check_choice(name, given, WKV_BACKEND_CHOICES)
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

    def options_for(self, placement: str):
        """The options object (its ``options_type``) of the registered placement ``placement`` as these
        options give it: the shared fields it names in ``serving_fields``, then what
        ``placements[placement]`` sets (a dict's keys, an object's fields not at their defaults); None
        for a placement without options."""
        options_type = _placement_class(placement).options_type
        if options_type is None:
            return None
        entry = self.placements.get(placement)
        given = {} if entry is None else dict(entry) if isinstance(entry, Mapping) else _changed_fields(entry)
        values = {}
        for shared, own in getattr(options_type, "serving_fields", {}).items():
            value = getattr(self, shared)
            if own in given and given[own] != value and value != _DEFAULTS[shared]:
                raise ValueError(f"{shared}: {value!r} as a ServingOptions field and {own}={given[own]!r} in "
                                 f"placements[{placement!r}] ({options_type.__name__}); give it once")
            values[own] = value
        try:
            return options_type(**{**values, **given})
        except ValueError as error:
            raise ValueError(f"placements[{placement!r}]: {error}") from None

    def placement_options(self, placement: str) -> dict:
        """Keyword arguments for the registered placement ``placement``: the fields of :meth:`options_for`
        (none for a placement without options), then :attr:`extra_placement_options`.
        ``share_host_tables`` with a placement that keeps no host table is refused, as a placement
        option it does not take is."""
        if self.share_host_tables:
            _placement_class(placement)  # the built-in placements registered
            from engram.table.placement import check_host_table_shared

            check_host_table_shared("share_host_tables", placement)
        resolved = self.options_for(placement)
        options = {} if resolved is None else _fields_of(resolved)
        options.update(dict(self.extra_placement_options))
        return options


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServingOptions) if f.default is not dataclasses.MISSING}


def _placement_class(name: str):
    import engram.table  # noqa: F401  (the built-in placements register themselves on import)
    from engram.table.placement import placement_class

    return placement_class(name)


def _fields_of(options) -> dict:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _changed_fields(options) -> dict:
    """The fields of an options object that differ from their defaults: those its maker gave."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if f.default is dataclasses.MISSING or getattr(options, f.name) != f.default}


def _placement_entry(name: str, entry: Any):
    """``placements[name]`` checked: an instance of the placement's options type, or a dict of its fields
    (kept as given, read-only)."""
    try:
        options_type = _placement_class(name).options_type
    except ValueError as error:  # an unknown name: the registry's message, for this field
        raise ValueError(str(error).replace("placement: ", "placements: ", 1)) from None
    if options_type is None:
        raise ValueError(f"placements[{name!r}]: placement {name!r} takes no options")
    if isinstance(entry, options_type):
        return entry
    if not isinstance(entry, Mapping):
        raise ValueError(f"placements[{name!r}]: expected a {options_type.__name__} or a dict of its fields, "
                         f"found {entry!r}")
    known = [f.name for f in dataclasses.fields(options_type)]
    unknown = sorted(key for key in entry if key not in known)
    if unknown:
        raise ValueError(f"placements[{name!r}]: placement {name!r} has no option {unknown[0]!r} (its options, "
                         f"{options_type.__name__}: {', '.join(known)})")
    return ReadOnlyDict(entry)
