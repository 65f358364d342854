"""FP8 codec of Engram table rows (docs/design.md §2 "FP8 table rows").

Storage format, used everywhere in the project:

* values: ``torch.float8_e4m3fn`` ``[rows, head_dim]`` (OCP E4M3, largest finite 448);
* scales: raw UE8M0 bytes, ``torch.uint8`` ``[rows, head_dim // 32]``; one byte
  ``b`` per block of 32 consecutive values means the factor ``2 ** (b - 127)``
  (byte 255 is NaN in OCP MX and never appears in tables).

Dequantized row: ``e4m3 * 2 ** (b - 127)``, computed exactly in fp32, rounded
once to the output dtype (bf16 by default). Quantizing: per block of 32,
``scale = 2 ** ceil(log2(amax / 448))`` (amax 0 -> byte 127), values rounded to
nearest (ties to even) E4M3.

Both directions are exact: the exponent is found with ``frexp`` (no ``log2``),
and every factor ``2 ** (b - 127)`` is built from its float32 bit pattern,
including ``b = 0`` (``2 ** -127``, a float32 subnormal).
"""

from __future__ import annotations

import numpy as np
import torch

from engram.checks import check_int

__all__ = [
    "first_nan_byte",
    "nan_byte_error",
    "OVERFLOW_SCALE_BYTE",
    "overflowing_blocks",
    "overflow_error",
    "check_table_values",
    "BLOCK_SIZE",
    "E4M3_MAX",
    "SCALE_BYTE_ONE",
    "SCALE_BYTE_MAX",
    "E8M0_DTYPE",
    "quantize_rows",
    "dequantize_rows",
    "scale_bytes_to_float",
    "as_scale_bytes",
    "as_value_bytes",
]

BLOCK_SIZE = 32
"""Values per UE8M0 scale."""
E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
SCALE_BYTE_ONE = 127
"""UE8M0 byte of the factor 1.0 (also the byte of an all-zero block)."""
SCALE_BYTE_MAX = 254
"""Largest finite UE8M0 byte (255 is NaN)."""

E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
"""``torch.float8_e8m0fnu`` (the checkpoint dtype of scales) where this torch has it, else None."""

_FLOAT32_SUBNORMAL_2_POW_MINUS_127 = 0x00400000  # bits of 2**-127: exponent field 0, mantissa 1 << 22
_FLOAT32_QUIET_NAN = 0x7FC00000
_FLOAT32_MANTISSA_BITS = 23
_QUANTIZE_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_HIGH_BITS = np.uint64(0x8080808080808080)
_LOW_BITS = np.uint64(0x0101010101010101)


_SCAN_WORDS = 1 << 15  # 256 KiB per step: the scan's two buffers stay in cache


def first_nan_byte(chunk: torch.Tensor, kind: str) -> int | None:
    """Flat index of the first NaN byte of a CPU ``uint8`` tensor, or None: ``kind``
    ``"e4m3"`` (bytes 0x7F, 0xFF) or ``"ue8m0"`` (byte 0xFF).

    The scan reads 8 bytes per step (a byte b is NaN when ``b | 0x80`` (E4M3) or ``b``
    (UE8M0) is 0xFF; a word holds such a byte when ``y = ~word'`` holds a zero byte:
    ``(y - 0x01..01) & ~y & 0x80..80 != 0``), in cache-sized blocks with two reused
    buffers; only a block that holds one is searched byte by byte."""
    if kind not in ("e4m3", "ue8m0"):
        raise ValueError(f"kind: expected 'e4m3' or 'ue8m0', found {kind!r}")
    flat = chunk.reshape(-1).numpy()
    words = flat.size // 8
    word = flat[: words * 8].view(np.uint64)
    marked = np.empty(min(words, _SCAN_WORDS), dtype=np.uint64)  # word' = word | 0x80.. (E4M3) or word
    test = np.empty_like(marked)
    for start in range(0, words, _SCAN_WORDS):
        block = word[start:start + _SCAN_WORDS]
        size = block.size
        if kind == "e4m3":
            np.bitwise_or(block, _HIGH_BITS, out=marked[:size])
        else:
            marked[:size] = block
        np.invert(marked[:size], out=test[:size])              # y: a NaN byte -> 0x00
        np.subtract(test[:size], _LOW_BITS, out=test[:size])   # y - 0x01..01 (wraps)
        np.bitwise_and(test[:size], marked[:size], out=test[:size])  # & ~y
        np.bitwise_and(test[:size], _HIGH_BITS, out=test[:size])
        if test[:size].any():
            return _first_nan_in(flat[start * 8:(start + size) * 8], kind) + start * 8
    tail = flat[words * 8:]
    found = _first_nan_in(tail, kind) if tail.size else -1
    return None if found < 0 else words * 8 + found


def nan_byte_error(where: str, row: int, column: int, byte: int, kind: str) -> ValueError:
    """The error for NaN byte ``byte`` of a table tensor (``kind`` as :func:`first_nan_byte`),
    naming the tensor and file (``where``), the file's row and the column."""
    if kind == "ue8m0":
        return ValueError(f"{where}: row {row} holds scale byte 255 (UE8M0 NaN) at column {column}; expected bytes "
                          f"0..254, the file is corrupt")
    return ValueError(f"{where}: row {row} holds value byte {byte:#04x} (E4M3 NaN) at column {column}; a table holds "
                      f"no NaN, the file is corrupt (check_values=False skips this check on trusted checkpoints)")


OVERFLOW_SCALE_BYTE = 247
"""The least scale byte at which a finite E4M3 value decodes to infinity.

A value ``v = m * 2**e`` (E4M3: 4 significant bits, ``e <= 8``, largest 448 = 1.75 * 2**8) times
``2**(b - 127)`` is computed exactly in fp32 and rounded once to bf16; with 4 significant bits it
is below ``2**128`` exactly when it is at most ``1.875 * 2**127``, which both fp32 and bf16 hold.
So it overflows exactly when ``e + b - 127 >= 128``: for a normal value with exponent field ``E``
(bits 6..3, ``e = E - 7``) when ``E + b >= 262``. Subnormals (``E = 0``, ``e <= -7``) never overflow
under a finite scale (``b <= 254``), nor does any value under ``b <= 246``."""
_OVERFLOW_EXPONENT_SUM = 262


def overflowing_blocks(value_bytes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """Flat indices (into ``scale_bytes``) of the blocks of 32 values holding a finite value that
    decodes to infinity under its scale (:data:`OVERFLOW_SCALE_BYTE`), for numpy ``uint8``
    ``value_bytes [rows, D]`` and ``scale_bytes [rows, D // 32]``. Scales below 247 cost one max:
    only blocks with a larger scale byte look at their values."""
    if scale_bytes.size == 0 or int(scale_bytes.max()) < OVERFLOW_SCALE_BYTE:
        return np.zeros(0, dtype=np.int64)
    suspects = np.flatnonzero(scale_bytes.reshape(-1) >= OVERFLOW_SCALE_BYTE)
    blocks = value_bytes.reshape(-1, BLOCK_SIZE)[suspects]            # [S, 32]
    exponent = (blocks >> 3) & 0xF
    scale = scale_bytes.reshape(-1)[suspects].astype(np.int32)[:, None]
    finite_scale = scale <= SCALE_BYTE_MAX                            # byte 255 is NaN, reported as such
    nan_value = (blocks | 0x80) == 0xFF
    bad = ((exponent.astype(np.int32) + scale >= _OVERFLOW_EXPONENT_SUM) & ~nan_value & finite_scale).any(axis=1)
    return suspects[bad]


def check_table_values(value_bytes, scale_bytes, *, values_name: str = "values", scales_name: str = "scales",
                       row_start: int = 0, chunk_rows: int = 1 << 16) -> None:
    """Refuse table bytes that do not decode to finite values (docs/design.md §2 "FP8 table rows").

    Args:
        value_bytes: E4M3 values ``[rows, D]`` (``float8_e4m3fn`` or their ``uint8`` bytes), any device.
        scale_bytes: UE8M0 scales ``[rows, D // 32]`` (``uint8`` or ``float8_e8m0fnu``), same rows.
        values_name, scales_name: how the errors name the two tensors.
        row_start: the table row of row 0 (for a slice of a table).
        chunk_rows: rows looked at per step (a CUDA table is copied to the host a chunk at a time).

    Raises ``ValueError`` naming the tensor, the row, the column and the byte, for the first row
    (in row order) that holds one of: a value byte 0x7F or 0xFF (E4M3 NaN); a scale byte 255
    (UE8M0 NaN); a finite value whose product with its scale ``2**(b - 127)`` is ``>= 2**128``, past
    fp32 and bf16 (:data:`OVERFLOW_SCALE_BYTE`). Within one row, in that order.
    """
    values = as_value_bytes(value_bytes, values_name)
    scales = as_scale_bytes(scale_bytes, scales_name)
    head_dim = _check_head_dim(values, values_name)
    if values.dim() != 2 or tuple(scales.shape) != (values.shape[0], head_dim // BLOCK_SIZE):
        raise ValueError(f"{scales_name}: expected shape [{values.shape[0] if values.dim() == 2 else 'rows'}, "
                         f"{head_dim // BLOCK_SIZE}] (one UE8M0 byte per {BLOCK_SIZE} values of {values_name} "
                         f"{list(values.shape)}, 2-D), found {list(scales.shape)}")
    check_int("chunk_rows", chunk_rows, 1)
    for first in range(0, values.shape[0], chunk_rows):
        chunk_values = values[first:first + chunk_rows].cpu().contiguous().numpy()
        chunk_scales = scales[first:first + chunk_rows].cpu().contiguous().numpy()
        found = []   # (row, order within a row, message)
        nan = first_nan_byte(torch.from_numpy(chunk_values), "e4m3")
        if nan is not None:
            row, column = divmod(nan, head_dim)
            found.append((row, 0, f"{values_name}: row {row_start + first + row} holds value byte "
                                  f"{int(chunk_values[row, column]):#04x} (E4M3 NaN) at column {column}; a table "
                                  f"holds no NaN"))
        nan = first_nan_byte(torch.from_numpy(chunk_scales), "ue8m0")
        if nan is not None:
            row, column = divmod(nan, head_dim // BLOCK_SIZE)
            found.append((row, 1, f"{scales_name}: row {row_start + first + row} holds scale byte 255 (UE8M0 NaN) "
                                  f"at column {column}; expected bytes 0..{SCALE_BYTE_MAX}"))
        blocks = overflowing_blocks(chunk_values, chunk_scales)
        if blocks.size:
            row, block = divmod(int(blocks[0]), head_dim // BLOCK_SIZE)
            found.append((row, 2, str(overflow_error(values_name, scales_name, row_start + first + row, block,
                                                     chunk_values[row], int(chunk_scales[row, block])))))
        if found:
            raise ValueError(min(found)[2])


def overflow_error(values_name: str, scales_name: str, row: int, block: int, row_values: np.ndarray,
                   scale_byte: int) -> ValueError:
    """The error for block ``block`` of table row ``row`` (its values ``row_values``, ``uint8 [D]``)
    whose scale byte makes a finite value infinite (:func:`overflowing_blocks` found it)."""
    values = row_values[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE]
    exponent = (values >> 3) & 0xF
    offset = int(np.flatnonzero((exponent.astype(np.int32) + scale_byte >= _OVERFLOW_EXPONENT_SUM)
                                & ((values | 0x80) != 0xFF))[0])
    column, byte = block * BLOCK_SIZE + offset, int(values[offset])
    value = float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
    return ValueError(f"{scales_name}: row {row} holds scale byte {scale_byte} (2**{scale_byte - 127}) at column "
                      f"{block}, under which {values_name} byte {byte:#04x} ({value:g}) at column {column} decodes to "
                      f"{value:g} * 2**{scale_byte - 127} >= 2**128, infinite in fp32 and bf16; a table decodes to "
                      f"finite values, the file is corrupt")


def _first_nan_in(data: np.ndarray, kind: str) -> int:
    bad = ((data | 0x80) == 0xFF) if kind == "e4m3" else (data == 0xFF)
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else -1


def as_scale_bytes(scales: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """View UE8M0 scales as raw bytes: ``uint8`` as is, ``float8_e8m0fnu`` viewed as ``uint8``."""
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor of UE8M0 bytes, found {type(scales).__name__}")
    if scales.dtype == torch.uint8:
        return scales
    if E8M0_DTYPE is not None and scales.dtype == E8M0_DTYPE:
        return scales.view(torch.uint8)
    accepted = "torch.uint8" + (" or torch.float8_e8m0fnu" if E8M0_DTYPE is not None else "")
    raise ValueError(f"{name}: expected dtype {accepted} (UE8M0 scale bytes), found {scales.dtype}")


def as_value_bytes(values: torch.Tensor, name: str = "values") -> torch.Tensor:
    """View E4M3 values as raw bytes: ``float8_e4m3fn`` viewed as ``uint8``, ``uint8`` as is."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor of E4M3 values, found {type(values).__name__}")
    if values.dtype == torch.float8_e4m3fn:
        return values.view(torch.uint8)
    if values.dtype == torch.uint8:
        return values
    raise ValueError(f"{name}: expected dtype torch.float8_e4m3fn (or its raw bytes as torch.uint8), found {values.dtype}")


def scale_bytes_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes ``uint8 [...]`` -> exact float32 factors ``[...]``: ``2 ** (b - 127)``.

    Built from float32 bit patterns, so every byte 0..254 is exact (byte 0 gives the
    subnormal ``2 ** -127``); byte 255 gives NaN. Accepts ``float8_e8m0fnu`` too.
    """
    exponent_field = as_scale_bytes(scale_bytes, "scale_bytes").to(torch.int32)
    bits = torch.bitwise_left_shift(exponent_field, _FLOAT32_MANTISSA_BITS)
    bits = torch.where(exponent_field == 0, torch.full_like(bits, _FLOAT32_SUBNORMAL_2_POW_MINUS_127), bits)
    bits = torch.where(exponent_field == 255, torch.full_like(bits, _FLOAT32_QUIET_NAN), bits)
    return bits.view(torch.float32)


def _check_head_dim(tensor: torch.Tensor, name: str) -> int:
    if tensor.dim() < 1:
        raise ValueError(f"{name}: expected a tensor [..., head_dim], found a 0-dimensional tensor")
    head_dim = tensor.shape[-1]
    if head_dim == 0 or head_dim % BLOCK_SIZE:
        raise ValueError(
            f"{name}: last dimension (head_dim) must be a positive multiple of {BLOCK_SIZE}, found {head_dim}"
        )
    return head_dim


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to the table format.

    Args:
        rows: float32, bfloat16 or float16 ``[..., D]``, finite, ``D % 32 == 0``.

    Returns:
        ``(values float8_e4m3fn [..., D], scales uint8 [..., D // 32])`` with, per block
        of 32, ``scale = 2 ** ceil(log2(amax / 448))`` (byte ``127 + log2(scale)``
        clamped to [0, 254]; amax 0 -> byte 127) and ``values = round_nearest_even(rows / scale)``.

    The exponent is exact: with ``amax = m * 2**e`` (``frexp``, ``m`` in [0.5, 1)) and
    ``448 = 0.875 * 2**9``, the least ``k`` with ``amax <= 448 * 2**k`` is
    ``e - 9 + (m > 0.875)``. Raises ``ValueError`` for a bad dtype, shape or a
    non-finite value (this check syncs with the device; quantizing is an offline step).
    """
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"rows: expected a torch.Tensor, found {type(rows).__name__}")
    if rows.dtype not in _QUANTIZE_INPUT_DTYPES:
        raise ValueError(
            f"rows: expected dtype torch.float32, torch.bfloat16 or torch.float16, found {rows.dtype}"
            + (" (convert to float32 first; rounding float64 through float32 would round twice)"
               if rows.dtype == torch.float64 else "")
        )
    head_dim = _check_head_dim(rows, "rows")
    rows32 = rows.to(torch.float32)  # exact for every accepted dtype
    finite = torch.isfinite(rows32)
    if not bool(finite.all()):
        index = tuple(int(i) for i in torch.nonzero(~finite)[0].tolist())
        raise ValueError(f"rows: expected finite values, found {rows32[index].item()} at index {index}")

    blocks = rows32.reshape(*rows32.shape[:-1], head_dim // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)  # [..., D/32]
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1) (0 for 0)
    scale_exponent = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    scale_exponent = torch.where(amax == 0, torch.zeros_like(scale_exponent), scale_exponent)
    scale_byte = (scale_exponent + SCALE_BYTE_ONE).clamp(0, SCALE_BYTE_MAX)
    # 1 / 2**(b - 127) == 2**((254 - b) - 127): exact, and 254 - b is again a finite byte.
    reciprocal = scale_bytes_to_float((SCALE_BYTE_MAX - scale_byte).to(torch.uint8))
    # Multiplying by a power of two is exact whenever the product is a float32 normal;
    # products below 2**-126 round to 0 in E4M3 whatever float32 did with them.
    scaled = blocks * reciprocal.unsqueeze(-1)
    values = scaled.reshape(rows32.shape).to(torch.float8_e4m3fn)
    return values, scale_byte.to(torch.uint8)


def dequantize_rows(
    values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize table rows: ``out = round_to(out_dtype, float32(e4m3) * 2 ** (b - 127))``.

    Args:
        values: ``float8_e4m3fn [..., D]`` (raw bytes as ``uint8`` accepted).
        scales: ``uint8 [..., D // 32]`` UE8M0 bytes (``float8_e8m0fnu`` accepted).
        out_dtype: a floating dtype, bfloat16 by default.

    Returns:
        ``out_dtype [..., D]``. The fp32 product is exact (E4M3 has 4 significant bits
        and every factor is an exact power of two), so the only rounding is the final
        one; products beyond the output range become inf. No host sync.
    """
    value_bytes = as_value_bytes(values, "values")
    scale_bytes = as_scale_bytes(scales, "scales")
    head_dim = _check_head_dim(value_bytes, "values")
    expected = (*value_bytes.shape[:-1], head_dim // BLOCK_SIZE)
    if tuple(scale_bytes.shape) != expected:
        raise ValueError(
            f"scales: expected shape {list(expected)} (one UE8M0 byte per {BLOCK_SIZE} values of values "
            f"{list(value_bytes.shape)}), found {list(scale_bytes.shape)}"
        )
    if value_bytes.device != scale_bytes.device:
        raise ValueError(f"scales: expected device {value_bytes.device} (the device of values), found {scale_bytes.device}")
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype: expected a floating dtype, found {out_dtype}")
    decoded = value_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    decoded = decoded.reshape(*expected, BLOCK_SIZE)
    product = decoded * scale_bytes_to_float(scale_bytes).unsqueeze(-1)
    return product.reshape(value_bytes.shape).to(out_dtype)
