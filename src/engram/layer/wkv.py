"""The ``wkv`` projection of an Engram layer: gathered rows -> one key per
hyper-connection copy and one shared value (DESIGN §1 step 4, §2 "Checkpoint tensors").

``kv = rows.flatten(-2) @ weight.T`` with ``weight [(hc_mult + 1) * hidden, C * head_dim]``.

Checkpoint weights come as bf16, or as FP8 E4M3 with block scales: one scale per
``[block_rows, block_cols]`` block (``quantization_config.weight_block_size``,
e.g. ``[128, 128]``), scale tensor ``[ceil(out / block_rows), ceil(in / block_cols)]``,
UE8M0 (``2 ** (byte - 127)``) or plain fp32. The last block row/column may be partial.

Choices of this path (torch's ``linear``: cuBLAS on CUDA, oneDNN/BLAS on the CPU):

* The FP8 weight is dequantized **once, at construction**, to bf16
  (``e4m3 * scale`` in fp32, one rounding to bf16; exact for UE8M0 scales). The
  CPU has no FP8 GEMM, and a per-call dequantization would cost a full pass over
  the weight for every batch. There is no FP8 GEMM here yet; one would keep the
  FP8 weight and its scales and replace the ``linear`` in :meth:`WkvProjection.forward`.
* The output ``kv`` is **bf16** (fp32 accumulation inside the GEMM, one rounding
  to bf16), like every other bf16 linear layer of the model: the gate then reads
  bf16 keys and values and does its own math in fp32. bf16 halves the bytes
  between the GEMM and the gate (8192 tokens x 25600 outputs: 419 MB vs 839 MB).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..common import ceil_div
from ..table.fp8 import E8M0_DTYPE, scale_bytes_to_float

__all__ = ["WkvProjection", "dequantize_wkv_weight", "split_kv"]

_FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn,)
_PLAIN_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_block_size(block_size) -> tuple[int, int]:
    if (not isinstance(block_size, (list, tuple)) or len(block_size) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)):
        raise ValueError(f"block_size: expected two positive integers [block_rows, block_cols], found {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 multipliers of a scale tensor: UE8M0 (``float8_e8m0fnu`` or raw ``uint8``
    bytes, value ``2 ** (byte - 127)``) or floating values taken as they are."""
    if E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        if bool((scale == 255).any()):
            raise ValueError("scale: found UE8M0 byte 255 (NaN); expected bytes 0..254")
        return scale_bytes_to_float(scale)  # exact 2**(byte-127), the table codec's decode
    if scale.dtype in _FLOAT_SCALE_DTYPES:
        values = scale.to(torch.float32)
        if not bool(torch.isfinite(values).all()):
            raise ValueError("scale: found a non-finite value; expected finite block scales")
        return values
    raise ValueError(
        f"scale: expected dtype float8_e8m0fnu or uint8 (UE8M0 bytes) or float32/bfloat16/float16, found {scale.dtype}"
    )


def dequantize_wkv_weight(
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """bf16 ``[out, in]`` copy of a ``wkv`` weight: ``W[i, j] = weight[i, j] * scale[i // br, j // bc]``.

    Args:
        weight: ``[out, in]``; ``float8_e4m3fn`` (needs ``scale`` and ``block_size``)
            or bf16/fp16/fp32 (no scale; rounded once to bf16).
        scale: ``[ceil(out / br), ceil(in / bc)]``, UE8M0 (``float8_e8m0fnu`` or
            ``uint8`` bytes) or float32/bf16/fp16 multipliers.
        block_size: ``(br, bc)``, rows and columns of the weight per scale.

    The product is computed in fp32 and rounded once to bf16.
    """
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight: expected a torch.Tensor, found {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [out_features, in_features], found {list(weight.shape)}")
    if weight.dtype in _PLAIN_WEIGHT_DTYPES:
        if scale is not None:
            raise ValueError(f"scale: expected None for a {weight.dtype} weight (scales go with FP8 weights), "
                             f"found a tensor of shape {list(scale.shape)}")
        return weight.to(torch.bfloat16).contiguous()
    if weight.dtype not in _FP8_WEIGHT_DTYPES:
        raise ValueError(f"weight: expected dtype float8_e4m3fn, bfloat16, float16 or float32, found {weight.dtype}")
    if scale is None:
        raise ValueError("scale: expected the block scales of the float8_e4m3fn weight, found None")
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"scale: expected a torch.Tensor, found {type(scale).__name__}")
    if block_size is None:
        raise ValueError("block_size: expected [block_rows, block_cols] (quantization_config.weight_block_size) "
                         "for a float8_e4m3fn weight, found None")
    block_rows, block_cols = _check_block_size(block_size)
    out_features, in_features = weight.shape
    expected = [ceil_div(out_features, block_rows), ceil_div(in_features, block_cols)]
    if list(scale.shape) != expected:
        raise ValueError(
            f"scale: expected shape {expected} (ceil([{out_features}, {in_features}] / [{block_rows}, {block_cols}])), "
            f"found {list(scale.shape)}"
        )
    if scale.device != weight.device:
        raise ValueError(f"scale: expected device {weight.device} (the weight's), found {scale.device}")
    multipliers = _scale_values(scale)
    result = torch.empty(out_features, in_features, dtype=torch.bfloat16, device=weight.device)
    # One block row at a time keeps the fp32 temporaries at block_rows x in_features.
    for block_row in range(expected[0]):
        rows = slice(block_row * block_rows, min(out_features, (block_row + 1) * block_rows))
        row_scale = multipliers[block_row].repeat_interleave(block_cols)[:in_features]
        result[rows] = (weight[rows].to(torch.float32) * row_scale).to(torch.bfloat16)
    return result


def split_kv(kv: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``key [T, hc_mult, D]`` and ``value [T, D]`` of ``kv [T, (hc_mult + 1) * D]``.

    Layout assumption (the order of ``wkv``'s output rows): outputs
    ``[c * D, (c + 1) * D)`` are the key of hyper-connection copy ``c`` for
    ``c = 0 .. hc_mult - 1``; the last ``D`` outputs are the value.
    """
    if kv.dim() != 2 or kv.shape[1] % (hc_mult + 1):
        raise ValueError(f"kv: expected shape [T, (hc_mult + 1) * D] with hc_mult = {hc_mult}, found {list(kv.shape)}")
    hidden = kv.shape[1] // (hc_mult + 1)
    key = kv[:, : hc_mult * hidden].unflatten(1, (hc_mult, hidden))
    value = kv[:, hc_mult * hidden:]
    return key, value


class WkvProjection(torch.nn.Module):
    """``kv [T, out] = rows.flatten(-2) [T, C * head_dim] @ weight.T``, bf16 in and out.

    Built from the checkpoint tensors ``(weight, scale=None, block_size=None)``
    (see :func:`dequantize_wkv_weight`); holds the bf16 weight ``[out, in]`` as the
    buffer ``weight``. ``out = (hc_mult + 1) * hidden``, ``in = C * head_dim``.

    Output layout assumption: the first ``hc_mult * hidden`` outputs are the keys
    of copies ``0 .. hc_mult - 1`` in order (``hidden`` each), the last ``hidden``
    outputs the value shared by all copies (:func:`split_kv`).
    """

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 block_size: Sequence[int] | None = None):
        super().__init__()
        self.source_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
        self.block_size = None if block_size is None else _check_block_size(block_size)
        self.register_buffer("weight", dequantize_wkv_weight(weight, scale, block_size))

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` bf16 ``[T, C, head_dim]`` or ``[T, C * head_dim]`` -> ``kv`` bf16 ``[T, out_features]``."""
        if not isinstance(rows, torch.Tensor):
            raise ValueError(f"rows: expected a torch.Tensor, found {type(rows).__name__}")
        if rows.dim() == 3:
            flat = rows.flatten(1)
        elif rows.dim() == 2:
            flat = rows
        else:
            raise ValueError(f"rows: expected shape [T, C, head_dim] or [T, C * head_dim], found {list(rows.shape)}")
        if flat.shape[1] != self.in_features:
            raise ValueError(f"rows: expected C * head_dim = {self.in_features} values per token, "
                             f"found {flat.shape[1]} (shape {list(rows.shape)})")
        if rows.dtype != torch.bfloat16:
            raise ValueError(f"rows: expected dtype torch.bfloat16, found {rows.dtype}")
        if rows.device != self.weight.device:
            raise ValueError(f"rows: expected device {self.weight.device} (the weight's), found {rows.device}")
        # The one GEMM of the layer (see the module docstring): an FP8 GEMM would replace this call.
        return torch.nn.functional.linear(flat, self.weight)

    def key_value(self, rows: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows [T, C, head_dim]`` -> ``key`` bf16 ``[T, hc_mult, D]``, ``value`` bf16 ``[T, D]`` (views of kv)."""
        if self.out_features % (hc_mult + 1):
            raise ValueError(f"hc_mult: expected out_features {self.out_features} to be a multiple of hc_mult + 1, "
                             f"found hc_mult = {hc_mult}")
        return split_kv(self.forward(rows), hc_mult)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"source_dtype={self.source_dtype}, block_size={self.block_size}")
