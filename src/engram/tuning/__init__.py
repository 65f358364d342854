"""Tuned constants as data: the launch shapes, switch points, wave sizes and thresholds that were chosen
by measurement, one TOML file per device kind in this package's directory.

``default.toml`` holds every key (the CPU and every device without a file of its own read it); a device
file (``h200.toml``) names the devices it is for in its ``[device]`` table (``names``, as
``torch.cuda.get_device_name`` and NVML report them, and optionally ``capability``) and holds the keys
measured there, the others coming from ``default.toml``. Every key is a table::

    [gather.bf16_block_rows]
    value = 8
    source = "benchmarks/NOTES.md: Gather launch shapes"   # a heading of NOTES.md, or "unmeasured"
    note = "49.4 us at T = 8192, 3.09 TB/s (H200)"          # optional: the figure and the hardware

Names and types are those of the frozen dataclasses below (:class:`Tuning`, one field per area); a
file is checked once, when first read: an unknown key, a missing one (``default.toml``), a value of
the wrong type or outside its range is a :class:`TuningError` naming the file, the key and the value.

The modules read their values once, at import (module-level names) or when a plan is made, never per
call: :func:`tuning` with no device is the process's device kind, found without starting CUDA (NVML,
or torch's current device where CUDA is already initialized; a node of mixed GPU kinds, or none,
reads ``default.toml``). Imports nothing of engram, and no torch unless a torch device is given.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Tuning", "TuningError", "tuning", "tuned", "load", "device_kind", "kind_for_name", "device_files",
           "DIRECTORY", "DEFAULT_KIND", "UNMEASURED", "NOTES_SOURCE"]

DIRECTORY = Path(__file__).resolve().parent
DEFAULT_KIND = "default"
UNMEASURED = "unmeasured"
NOTES_SOURCE = "benchmarks/NOTES.md: "


class TuningError(ValueError):
    """A tuning file that cannot be used: names the file, the key and the value."""


def _number(minimum=None, maximum=None, power_of_two=False, multiple_of=None):
    return field(metadata={"minimum": minimum, "maximum": maximum, "power_of_two": power_of_two,
                           "multiple_of": multiple_of})


def _count():
    return _number(minimum=1)


def _power_of_two(minimum=1, maximum=None):
    return _number(minimum=minimum, maximum=maximum, power_of_two=True)


def _ascending_bands(area, name: str) -> None:
    limits = [band.max_tokens for band in getattr(area, name)]
    if any(b <= a for a, b in zip(limits, limits[1:])):
        raise ValueError(f"{name}: expected bands of ascending max_tokens, found {limits}")


@dataclass(frozen=True)
class TokenBand:
    """Batches of at most ``max_tokens`` tokens: ``block_tokens`` tokens per hash program."""

    max_tokens: int = _count()
    block_tokens: int = _power_of_two()


@dataclass(frozen=True)
class HashTuning:
    """:mod:`engram.hashing.launch`: tokens per hash program by batch size, its warps, request ends per
    compare chunk (the largest), tokens per slot-writer program, requests per history-writer program."""

    block_tokens_by_batch: tuple[TokenBand, ...]
    block_tokens_largest: int = _power_of_two()
    num_warps: int = _power_of_two()
    request_chunk_largest: int = _power_of_two(2)
    write_block: int = _power_of_two()
    history_block: int = _power_of_two()

    def __post_init__(self):
        _ascending_bands(self, "block_tokens_by_batch")


@dataclass(frozen=True)
class GatherTuning:
    """:mod:`engram.table.kernels.gather` and :mod:`~engram.table.kernels.peer_gather`: rows and warps per
    program of the bf16 and packed gathers, bytes per thread of the bf16 one."""

    bf16_block_rows: int = _power_of_two()
    bf16_num_warps: int = _power_of_two()
    bf16_vector: int = _power_of_two(maximum=32)
    packed_block_rows: int = _power_of_two()
    packed_num_warps: int = _power_of_two()


@dataclass(frozen=True)
class GateTuning:
    """:mod:`engram.layer.gate`: copies of a token per program, head elements per thread (which sets the
    warps), the most warps, the value row loaded before the sums, L2 eviction hints."""

    copies_per_program: int = _count()
    elements_per_thread: int = _power_of_two()
    max_num_warps: int = _power_of_two()
    early_value: bool
    cache_hints: bool


@dataclass(frozen=True)
class GemmShape:
    """A tile shape of the wkv GEMM kernels (:class:`engram.layer.wkv_gemm.WkvGemmConfig`)."""

    block_m: int = _power_of_two(16)
    block_n: int = _power_of_two(16)
    group_m: int = _power_of_two()
    num_warps: int = _power_of_two()
    num_stages: int = _count()


@dataclass(frozen=True)
class GemmBand(GemmShape):
    """:class:`GemmShape` for batches of at most ``max_tokens`` tokens."""

    max_tokens: int = _count()


@dataclass(frozen=True)
class SmallMShape:
    """A launch shape of the split-K small-T GEMM (:class:`engram.layer.wkv_gemm.SmallMGemmConfig`)."""

    block_n: int = _power_of_two(16)
    split_k: int = _power_of_two()
    num_warps: int = _power_of_two()
    num_stages: int = _count()


@dataclass(frozen=True)
class SmallMBand(SmallMShape):
    """:class:`SmallMShape` for batches of at most ``max_tokens`` tokens."""

    max_tokens: int = _count()


@dataclass(frozen=True)
class QuantizeShape:
    """Tokens per program and warps of the activation quantize (``gather_quantize_kernel``)."""

    block_t: int = _power_of_two()
    num_warps: int = _power_of_two()


@dataclass(frozen=True)
class WkvTuning:
    """:mod:`engram.layer.wkv_gemm` and :mod:`~engram.layer.scaled_mm`: GEMM tiles by batch size (the
    fused kernel takes ``fused_extra_stages`` more stages), the small-T GEMM's shapes, the quantize's
    shapes and switch point, and the fewest rows of the quantized activations."""

    gemm_by_tokens: tuple[GemmBand, ...]
    gemm_largest: GemmShape
    fused_extra_stages: int = _number(minimum=0)
    small_m_by_tokens: tuple[SmallMBand, ...]
    small_m_largest: SmallMShape
    quantize_small_max_tokens: int = _number(minimum=0)
    quantize_small: QuantizeShape
    quantize_large: QuantizeShape
    min_activation_rows: int = _number(minimum=4, multiple_of=4)  # rows padded to 4 (cuBLASLt's alignment)

    def __post_init__(self):
        _ascending_bands(self, "gemm_by_tokens")
        _ascending_bands(self, "small_m_by_tokens")


@dataclass(frozen=True)
class HostGatherTuning:
    """:mod:`engram.table.host_memory.gather`: rows per wave (the fewest), waves of the Python and the
    native worker (the most), how much each native wave shrinks, and ``host_gather_dedup="auto"``'s
    rule (sort while the repeat share is at least ``dedup_min_repeats``, measured every
    ``dedup_remeasure``-th gather)."""

    min_wave_rows: int = _count()
    max_waves: int = _count()
    max_waves_native: int = _count()
    wave_shrink: float = _number(minimum=0.01, maximum=1.0)
    dedup_min_repeats: float = _number(minimum=0.0, maximum=1.0)
    dedup_remeasure: int = _count()


@dataclass(frozen=True)
class RowCopyTuning:
    """:mod:`engram.table.host_memory.row_copy`: the fewest rows of one thread's part."""

    min_rows_per_thread: int = _count()


@dataclass(frozen=True)
class ServingTuning:
    """Defaults of :class:`engram.options.ServingOptions` (and the placements' options): the host path's
    switch points (rows read directly, at most; prefetched) and the HBM cache's fraction of rows."""

    direct_max_rows: int = _number(minimum=0)
    prefetch_direct_max_rows: int = _number(minimum=0)
    graph_direct_max_rows: int = _number(minimum=0)
    cache_fraction: float = _number(minimum=1e-9, maximum=1.0)


@dataclass(frozen=True)
class Tuning:
    """Every tuned value of one device kind, by area (a file's top-level tables)."""

    hash: HashTuning
    gather: GatherTuning
    gate: GateTuning
    wkv: WkvTuning
    host_gather: HostGatherTuning
    row_copy: RowCopyTuning
    serving: ServingTuning


_ENTRY_KEYS = {"value", "source", "note"}


def _type_name(hint) -> str:
    if dataclasses.is_dataclass(hint):
        return "a table {" + ", ".join(f.name for f in dataclasses.fields(hint)) + "}"
    if typing.get_origin(hint) is tuple:
        return f"an array of {_type_name(typing.get_args(hint)[0])}"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _convert(value: Any, hint, metadata, where: str) -> Any:
    """``value`` as ``hint`` (bool, int, float, str, tuple[X, ...], a dataclass from a table), checked against
    ``metadata``'s range; ValueError naming ``where`` otherwise."""
    def wrong(reason: str | None = None):
        return ValueError(f"{where}: expected {reason or _type_name(hint)}, found {value!r}")

    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise wrong()
        return _build(hint, value, where)
    if typing.get_origin(hint) is tuple:
        (item,) = {argument for argument in typing.get_args(hint) if argument is not Ellipsis}
        if not isinstance(value, list):
            raise wrong()
        return tuple(_convert(entry, item, {}, f"{where}[{index}]") for index, entry in enumerate(value))
    if hint is bool or hint is str:
        if type(value) is not hint:
            raise wrong()
        return value
    if hint is int and (type(value) is not int):
        raise wrong()
    if hint is float:
        if type(value) not in (int, float):
            raise wrong()
        value = float(value)
    minimum, maximum = metadata.get("minimum"), metadata.get("maximum")
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise wrong(f"{_type_name(hint)} {bounds}")
    if metadata.get("power_of_two") and value & (value - 1):
        raise wrong("a power of two")
    if metadata.get("multiple_of") and value % metadata["multiple_of"]:
        raise wrong(f"a multiple of {metadata['multiple_of']}")
    return value


def _hints(cls) -> dict:
    return typing.get_type_hints(cls, globalns=globals())


def _build(cls, table: dict, where: str):
    """An instance of dataclass ``cls`` from ``table`` (every field given, no other key)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key, value {table[unknown[0]]!r} (the keys of {where}: "
                         f"{', '.join(fields)})")
    missing = [name for name in fields if name not in table]
    if missing:
        raise ValueError(f"{where}.{missing[0]}: missing key ({_type_name(_hints(cls)[missing[0]])})")
    hints = _hints(cls)
    values = {name: _convert(table[name], hints[name], fields[name].metadata, f"{where}.{name}") for name in fields}
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"{where}.{error}") from None  # __post_init__ messages start with the field's name


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise TuningError(f"tuning file {path}: cannot be read: {error}") from None


def _entries(path: Path, document: dict) -> dict[str, dict[str, Any]]:
    """``{area: {key: value}}`` of ``document`` (``[device]`` aside), each entry's form checked."""
    areas = {f.name: f.type for f in dataclasses.fields(Tuning)}
    found: dict[str, dict[str, Any]] = {}
    for area, keys in document.items():
        if area == "device":
            continue
        if area not in areas:
            raise TuningError(f"tuning file {path}: {area}: unknown key, value {keys!r} (the areas: "
                              f"{', '.join(['device', *areas])})")
        if not isinstance(keys, dict):
            raise TuningError(f"tuning file {path}: {area}: expected a table of keys, found {keys!r}")
        for key, entry in keys.items():
            name = f"{area}.{key}"
            if not isinstance(entry, dict) or "value" not in entry or not set(entry) <= _ENTRY_KEYS:
                raise TuningError(f"tuning file {path}: {name}: expected a table with value, source and "
                                  f"optionally note, found {entry!r}")
            source = entry.get("source")
            if not isinstance(source, str) or not (source == UNMEASURED or source.startswith(NOTES_SOURCE)
                                                   and len(source) > len(NOTES_SOURCE)):
                raise TuningError(f"tuning file {path}: {name}: expected source = \"{NOTES_SOURCE}<section>\" "
                                  f"or \"{UNMEASURED}\", found {source!r}")
            if not isinstance(entry.get("note", ""), str):
                raise TuningError(f"tuning file {path}: {name}: expected a string note, found {entry['note']!r}")
            found.setdefault(area, {})[key] = entry["value"]
    return found


def _device_table(path: Path, document: dict) -> tuple[tuple[str, ...], tuple[int, int] | None]:
    """``(names, capability or None)`` of a device file's ``[device]`` table."""
    table = document.get("device")
    if not isinstance(table, dict) or not set(table) <= {"names", "capability", "description"}:
        raise TuningError(f"tuning file {path}: device: expected a table of names, optionally capability "
                          f"and description, found {table!r}")
    names, capability = table.get("names"), table.get("capability")
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise TuningError(f"tuning file {path}: device.names: expected an array of device names, found {names!r}")
    if capability is not None and not (isinstance(capability, list) and len(capability) == 2
                                       and all(type(part) is int for part in capability)):
        raise TuningError(f"tuning file {path}: device.capability: expected [major, minor], found {capability!r}")
    return tuple(names), None if capability is None else tuple(capability)


def _assemble(path: Path, entries: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]] | None) -> Tuning:
    """The :class:`Tuning` of ``entries`` over ``base`` (a device file over ``default.toml``)."""
    merged = {area: dict(keys) for area, keys in (base or {}).items()}
    for area, keys in entries.items():
        merged.setdefault(area, {}).update(keys)
    areas = {}
    for area in dataclasses.fields(Tuning):
        try:
            areas[area.name] = _build(_hints(Tuning)[area.name], merged.get(area.name, {}), area.name)
        except ValueError as error:
            raise TuningError(f"tuning file {path}: {error}") from None
    return Tuning(**areas)


def load(path: str | Path, base: str | Path | None = None) -> Tuning:
    """The checked :class:`Tuning` of the file ``path``: a complete one (``default.toml``'s form), or a device
    file whose missing keys come from ``base``. Raises :class:`TuningError` naming the file and the key."""
    path = Path(path)
    document = _read(path)
    base_entries = None
    if base is not None:  # checked on its own first, so that an error names the file holding the value
        _device_table(path, document)
        base = Path(base)
        base_entries = _entries(base, _read(base))
        _assemble(base, base_entries, None)
    return _assemble(path, _entries(path, document), base_entries)


@functools.cache
def device_files(directory: Path = DIRECTORY) -> dict[str, tuple[Path, tuple[str, ...], tuple[int, int] | None]]:
    """``{kind: (path, names, capability)}`` of the device files in ``directory`` (every ``*.toml`` but
    ``default.toml``); a device name claimed by two files is refused."""
    found, claimed = {}, {}
    for path in sorted(directory.glob("*.toml")):
        if path.stem == DEFAULT_KIND:
            continue
        names, capability = _device_table(path, _read(path))
        for name in names:
            key = " ".join(name.lower().split())
            if key in claimed:
                raise TuningError(f"tuning file {path}: device.names: {name!r} is claimed by {claimed[key]} too")
            claimed[key] = path
        found[path.stem] = (path, names, capability)
    return found


def kind_for_name(name: str | None, capability: tuple[int, int] | None = None,
                  directory: Path = DIRECTORY) -> str:
    """The kind (a file's stem) of the device named ``name``: the device file listing the name (case and runs
    of spaces aside) whose capability, where it gives one, is ``capability``; else ``"default"``."""
    if name is None:
        return DEFAULT_KIND
    key = " ".join(name.lower().split())
    for kind, (_, names, wanted) in device_files(directory).items():
        if key in {" ".join(n.lower().split()) for n in names} and (wanted is None or capability is None
                                                                   or tuple(capability) == wanted):
            return kind
    return DEFAULT_KIND


def _nvml_device() -> tuple[str, tuple[int, int] | None] | None:
    """``(name, capability)`` of the node's GPUs as NVML reports them (no CUDA context is made), where they
    are all of one name; None without NVML, without GPUs or with GPUs of several names."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            return None
        seen = set()
        for index in range(count.value):
            handle, buffer = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            major, minor = ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetName(handle, buffer, ctypes.c_uint(96)) != 0):
                return None
            known = nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
            seen.add((buffer.value.decode(errors="replace"), (major.value, minor.value) if known else None))
        return next(iter(seen)) if len(seen) == 1 else None
    finally:
        nvml.nvmlShutdown()


def _torch_device(device) -> tuple[str, tuple[int, int]] | None:
    """``(name, capability)`` of a torch device (``torch.device``, ``"cuda:1"``, an index); None for the CPU."""
    import torch

    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


@functools.cache
def _process_device() -> tuple[str, tuple[int, int] | None] | None:
    """The device this process serves on, found without starting CUDA: torch's current device where CUDA is
    initialized already, else NVML's GPUs where they are of one kind; None for none (the CPU)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return _torch_device(cuda.current_device())
    return _nvml_device()


def device_kind(device=None) -> str:
    """The kind (the tuning file's stem) of ``device``: None (the process's, see :func:`tuning`), a torch device,
    ``"cuda:1"``, ``"cpu"`` or a CUDA index."""
    found = _process_device() if device is None else _torch_device(device)
    return DEFAULT_KIND if found is None else kind_for_name(*found)


@functools.cache
def _tuning_of_kind(kind: str) -> Tuning:
    default = DIRECTORY / f"{DEFAULT_KIND}.toml"
    if kind == DEFAULT_KIND:
        return load(default)
    return load(device_files()[kind][0], base=default)


def tuning(device=None) -> Tuning:
    """The :class:`Tuning` of ``device``'s kind (None: the process's device), read and checked once per kind."""
    return _tuning_of_kind(device_kind(device))


def tuned(name: str, device=None) -> Any:
    """One value by its key, ``"area.key"`` (``tuned("gather.bf16_block_rows")``), for ``device``'s kind."""
    area, _, key = name.partition(".")
    values = tuning(device)
    if area not in {f.name for f in dataclasses.fields(Tuning)} or key not in {
            f.name for f in dataclasses.fields(getattr(values, area))}:
        raise KeyError(f"tuned: no key {name!r}")
    return getattr(getattr(values, area), key)
