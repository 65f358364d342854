"""Host-memory row storage: one packed, pinned byte array per table, readable by the GPU.

Each row is stored as ``[D E4M3 bytes | D / 32 UE8M0 bytes | zero padding | int32 tag]``,
padded to 16 bytes (272 B for D = 256) so that every row starts 16-byte aligned: the GPU's
direct reads and the host's ``index_select`` each move one contiguous row. The tag, in the
row's last 4 bytes, is the row's own index: a copy of the row (host staging, device staging,
a cache slot) carries the id it was read for, and a consumer serves the copy only where
that tag equals the lookup's id (docs/design.md, "Rows exact by construction"). One extra
row at the end (value +0, scale byte 0, tag ``rows``) stands in for ids outside the table,
so both read paths return +0 there without a branch.

The bytes are registered with CUDA (``cudaHostRegister``: pinned, mapped), and a CUDA
tensor aliasing them (unified addressing) lets Triton kernels read them directly.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

from engram.common import ceil_div, cuda_capturing
from engram.table.fp8 import BLOCK_SIZE

__all__ = ["packed_row_bytes", "TAG_BYTES", "row_tags", "row_tags_written", "write_row_tags", "PackedRows", "pack_rows", "pack_rows_in_own_pages", "owns_its_pages",
           "register_with_cuda", "HostRegistration", "mapped_read_only", "release_deferred", "cuda_alias"]

ROW_ALIGNMENT = 16
_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_CUDA_HOST_REGISTER_READ_ONLY = 8   # cudaHostRegisterReadOnly (CUDA 11.1+): the device only reads the range


TAG_BYTES = 4  # the int32 tag at the end of each packed row
_TAG_CHUNK_ROWS = 1 << 20  # tags written a million rows at a time (no arange of a 384M-row table)


def packed_row_bytes(head_dim: int) -> int:
    """Bytes per packed row: ``D + D / 32`` plus the 4-byte tag, rounded up to 16 (272 for D = 256)."""
    return ceil_div(head_dim + head_dim // BLOCK_SIZE + TAG_BYTES, ROW_ALIGNMENT) * ROW_ALIGNMENT


def row_tags(packed: torch.Tensor) -> torch.Tensor:
    """The tags of packed rows ``uint8 [N, row_bytes]`` (rows contiguous, ``row_bytes % 4 == 0``): an
    ``int32 [N]`` view of each row's last 4 bytes (stride ``row_bytes / 4``), on the rows' device."""
    row_bytes = packed.shape[1]
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.stride(1) != 1 or row_bytes % TAG_BYTES:
        raise ValueError(f"packed: expected uint8 rows [N, row_bytes] with contiguous rows and row_bytes a multiple "
                         f"of {TAG_BYTES}, found {packed.dtype} {list(packed.shape)} strides {packed.stride()}")
    if packed.stride(0) % TAG_BYTES or (packed.data_ptr() + row_bytes - TAG_BYTES) % TAG_BYTES:
        raise ValueError(f"packed: rows must start 4-byte aligned, found stride {packed.stride(0)} at address "
                         f"{packed.data_ptr():#x}")
    return packed[:, row_bytes - TAG_BYTES:].view(torch.int32)[:, 0]


def row_tags_written(packed: torch.Tensor, samples: int = 64) -> bool:
    """Whether ``packed uint8 [N, row_bytes]`` rows carry their tags, on a sample: the first and last rows and
    ``samples`` spread between (a few reads, not a pass over a 100 GB table)."""
    tags = row_tags(packed)
    count = tags.shape[0]
    picks = torch.unique(torch.linspace(0, count - 1, min(count, samples + 2), dtype=torch.float64).round().to(torch.int64))
    return bool((tags[picks].to(torch.int64) == picks).all())


def write_row_tags(packed: torch.Tensor, first: int = 0) -> None:
    """Tag every row of ``packed uint8 [N, row_bytes]`` with its index, ``first + i`` (int32)."""
    tags = row_tags(packed)
    for begin in range(0, tags.shape[0], _TAG_CHUNK_ROWS):
        end = min(begin + _TAG_CHUNK_ROWS, tags.shape[0])
        tags[begin:end] = torch.arange(first + begin, first + end, dtype=torch.int32, device=tags.device)


@dataclass
class PackedRows:
    """``packed uint8 [rows + 1, row_bytes]`` (CPU) and its value / scale column views.

    ``values uint8 [rows, D]`` and ``scales uint8 [rows, D / 32]`` are strided views of
    the first ``rows`` rows; row ``rows`` is all zeros but its tag; :attr:`tags` ``int32 [rows + 1]``
    holds each row's index."""

    packed: torch.Tensor
    head_dim: int

    @property
    def num_rows(self) -> int:
        return self.packed.shape[0] - 1

    @property
    def values(self) -> torch.Tensor:
        return self.packed[:-1, : self.head_dim]

    @property
    def scales(self) -> torch.Tensor:
        return self.packed[:-1, self.head_dim: self.head_dim + self.head_dim // BLOCK_SIZE]

    @property
    def tags(self) -> torch.Tensor:
        return row_tags(self.packed)

    @staticmethod
    def view_of(buffer: torch.Tensor, num_rows: int, head_dim: int) -> "PackedRows":
        """Packed rows over the first bytes of ``buffer`` (uint8 ``[>= (rows + 1) * row_bytes]``);
        the zero row, the padding and the tags are written here."""
        row_bytes = packed_row_bytes(head_dim)
        needed = (num_rows + 1) * row_bytes
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < needed:
            raise ValueError(f"buffer: expected uint8 [>= {needed}] bytes for {num_rows} rows of {row_bytes} B, "
                             f"found {buffer.dtype} {list(buffer.shape)}")
        packed = buffer[:needed].view(num_rows + 1, row_bytes)
        packed[-1].zero_()
        packed[:-1, head_dim + head_dim // BLOCK_SIZE:].zero_()
        write_row_tags(packed)
        return PackedRows(packed, head_dim)

    @staticmethod
    def matching(value_bytes: torch.Tensor, scale_bytes: torch.Tensor) -> "PackedRows | None":
        """The packed rows that ``value_bytes`` / ``scale_bytes`` are views of (as the loader
        writes them), or None when they are separate tensors."""
        head_dim = value_bytes.shape[1]
        row_bytes = packed_row_bytes(head_dim)
        if (value_bytes.device.type != "cpu" or value_bytes.stride() != (row_bytes, 1)
                or scale_bytes.stride() != (row_bytes, 1)
                or scale_bytes.data_ptr() != value_bytes.data_ptr() + head_dim
                or value_bytes.untyped_storage().data_ptr() != scale_bytes.untyped_storage().data_ptr()):
            return None
        storage = value_bytes.untyped_storage()
        offset = value_bytes.data_ptr() - storage.data_ptr()
        needed = (value_bytes.shape[0] + 1) * row_bytes
        if offset + needed > storage.nbytes():
            return None  # no room for the zero row after the table
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (needed,), (1,))
        return PackedRows(whole.view(value_bytes.shape[0] + 1, row_bytes), head_dim)


def pack_rows(value_bytes: torch.Tensor, scale_bytes: torch.Tensor, buffer: torch.Tensor | None = None) -> PackedRows:
    """Copy separate ``uint8 [rows, D]`` / ``[rows, D / 32]`` into packed rows (in ``buffer``,
    or a new CPU tensor)."""
    num_rows, head_dim = value_bytes.shape
    if buffer is None:
        buffer = torch.empty((num_rows + 1) * packed_row_bytes(head_dim), dtype=torch.uint8)
    rows = PackedRows.view_of(buffer, num_rows, head_dim)
    rows.values.copy_(value_bytes)
    rows.scales.copy_(scale_bytes)
    return rows


def pack_rows_in_own_pages(value_bytes: torch.Tensor, scale_bytes: torch.Tensor) -> PackedRows:
    """:func:`pack_rows` into a private anonymous mapping of whole pages
    (:func:`engram.table.host_memory.buffers.allocate_host_buffer`; 2 MiB pages from 2 MiB on), so the
    rows share no page with any other allocation. CUDA pins and maps whole pages: rows packed
    into heap memory next to another table's registered rows would share a page with them, so
    they could look pinned before being registered (:func:`register_with_cuda` then leaves them
    alone, and only that page is mapped for the GPU), lose that page's pinning when the other
    table is unregistered, or be refused (CUDA error 712 on drivers that check overlaps)."""
    from engram.table.host_memory.buffers import HUGE_PAGE_BYTES, allocate_host_buffer

    num_rows, head_dim = value_bytes.shape
    nbytes = (num_rows + 1) * packed_row_bytes(head_dim)
    packed: list[PackedRows] = []
    allocate_host_buffer(nbytes, fill=lambda buffer: packed.append(pack_rows(value_bytes, scale_bytes, buffer)),
                         huge_pages=nbytes >= HUGE_PAGE_BYTES, read_only=False)
    return packed[0]  # its tensors keep the mapping alive


def owns_its_pages(rows: PackedRows) -> bool:
    """Whether the storage of ``rows`` starts on a page boundary: a mapping of its own (as the
    checkpoint loader's), not heap memory that may share its first or last page."""
    return rows.packed.untyped_storage().data_ptr() % mmap.PAGESIZE == 0


class _RegisteredRange:
    """One host range this process registered with CUDA: its bytes, its open registrations, and
    every device a registration was made for (any of them may still read it)."""

    __slots__ = ("nbytes", "users", "devices")

    def __init__(self, nbytes: int):
        self.nbytes, self.users, self.devices = nbytes, 0, set()


def mapped_read_only(address: int, nbytes: int) -> bool:
    """Whether some page of ``[address, address + nbytes)`` is mapped without write permission
    (``/proc/self/maps``): a shared table attached read-only, a buffer made read-only after its fill."""
    end = address + nbytes
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                bounds, permissions = line.split(maxsplit=2)[:2]
                start, stop = (int(bound, 16) for bound in bounds.split("-"))
                if start < end and stop > address and "w" not in permissions:
                    return True
    except OSError:
        pass
    return False


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused ``cudaHostRegister``: torch reads it
    after its own kernel launches and would report this one there. Only a runtime already
    loaded in this process is used (``RTLD_NOLOAD``)."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _host_register(address: int, nbytes: int, flags: int) -> int:
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, flags)
    return int(getattr(error, "value", error))


# Host ranges this process registered with CUDA, by storage address.
_REGISTERED: dict[int, _RegisteredRange] = {}


def _device_index(device) -> int:
    """The CUDA device index of ``device`` (a ``torch.device``, an index, or None: the current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, found {device}")
    return torch.cuda.current_device() if device.index is None else device.index


class HostRegistration:
    """A host range pinned and mapped for the GPU (made by :func:`register_with_cuda`).

    ``close()`` (also ``registration()``, or leaving a ``with`` block) ends this registration,
    once; the last open registration of a range unregisters it (``cudaHostUnregister``), after
    synchronizing every device any registration of the range was made for, since a kernel or
    copy queued on any of them may still read it. Freed memory must not stay registered: a later
    allocation at the same address would look pinned and only partly be. Call it once no GPU work
    that reads the memory is still to be enqueued; the owner's finalizer calls it otherwise.
    """

    __slots__ = ("address", "nbytes", "device_index", "_range", "_storage", "_closed", "__weakref__")

    def __init__(self, address: int, nbytes: int, device_index: int, registered: _RegisteredRange | None,
                 storage=None):
        self.address, self.nbytes, self.device_index = address, nbytes, device_index
        self._range = registered  # None: torch's own pinned memory, left alone
        self._storage = storage   # the bytes stay allocated until they are unregistered
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        registered = self._range
        last = registered is not None and registered.users == 1 and _REGISTERED.get(self.address) is registered
        if last and cuda_capturing():
            # The garbage collector ran this during a graph capture, where a sync would break the capture:
            # keep the bytes (held by this registration) and unregister them after the capture.
            _DEFERRED.append(self)
            return
        code = 0
        if last:
            for index in sorted(registered.devices):
                torch.cuda.synchronize(index)  # no kernel or copy on that device may still read it
            error = torch.cuda.cudart().cudaHostUnregister(self.address)
            code = int(getattr(error, "value", error) or 0)
            del _REGISTERED[self.address]
        if registered is not None:
            registered.users -= 1
        self._closed = True
        self._storage = None
        if code != 0:
            raise RuntimeError(f"cudaHostUnregister of {self.nbytes:,} bytes of host table rows failed with CUDA "
                               f"error {code}")

    __call__ = close

    def __enter__(self) -> "HostRegistration":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def register_with_cuda(tensor: torch.Tensor, device=None) -> HostRegistration:
    """Pin ``tensor``'s storage in place and map it for the GPU (``cudaHostRegister``,
    portable + mapped; read-only, ``cudaHostRegisterReadOnly``, when the host mapping is
    read-only, falling back to the plain flags where CUDA refuses that flag), for CUDA ``device``
    to read (default: the current device). Returns its
    :class:`HostRegistration`: ``close()`` it once the GPU no longer reads it (see there).
    Registering a range again (another reader, another device) shares the registration; torch's
    own pinned allocations are left alone. Raises naming the CUDA error."""
    device_index = _device_index(device)
    release_deferred()
    storage = tensor.untyped_storage()
    address, nbytes = storage.data_ptr(), storage.nbytes()
    registered = _REGISTERED.get(address)
    if registered is None:
        if tensor.is_pinned():
            return HostRegistration(address, nbytes, device_index, None)
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        read_only = mapped_read_only(address, nbytes)
        code = _host_register(address, nbytes, flags | _CUDA_HOST_REGISTER_READ_ONLY) if read_only else -1
        if code != 0:
            if read_only:
                _clear_cuda_error()   # the read-only flag refused (CUDA < 11.1, or the device lacks it)
            code = _host_register(address, nbytes, flags)
        if code != 0:
            _clear_cuda_error()
            why = ("a page of the range is already registered (ranges may not share a page)" if code == 712
                   else "the rows are mapped read-only and this CUDA refused cudaHostRegisterReadOnly" if read_only
                   else "pinned memory limit? see `ulimit -l`")
            raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes of host table rows failed with CUDA error "
                               f"{code} ({why})")
        registered = _REGISTERED[address] = _RegisteredRange(nbytes)
    registered.users += 1
    registered.devices.add(device_index)
    return HostRegistration(address, nbytes, device_index, registered, storage)


_DEFERRED: list[HostRegistration] = []  # closed during a graph capture: unregistered after it


def release_deferred() -> None:
    """Close the registrations whose close came during a graph capture (then their bytes may go)."""
    while _DEFERRED and not cuda_capturing():
        _DEFERRED.pop().close()


class _CudaArrayInterface:
    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3, "strides": None}


def cuda_alias(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` over the same (pinned, mapped) host bytes as the
    contiguous CPU ``tensor``: with unified addressing the host pointer is valid on the
    GPU, so kernels read host memory through it over PCIe."""
    flat = tensor.reshape(-1)
    if flat.data_ptr() != tensor.data_ptr():
        raise ValueError("tensor: expected a contiguous host tensor to alias")
    with torch.cuda.device(device):
        alias = torch.as_tensor(_CudaArrayInterface(tensor.data_ptr(), tensor.numel() * tensor.element_size()),
                                device=device)
    return alias.view(tensor.shape)
