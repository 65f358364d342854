"""The ``wkv`` projection of an Engram layer: gathered rows -> one key per
hyper-connection copy and one shared value (docs/design.md §1 step 4, §2 "Checkpoint tensors").

``kv = rows.flatten(-2) @ weight.T`` with ``weight [(hc_mult + 1) * hidden, C * head_dim]``.

Checkpoint weights come as bf16, or as FP8 E4M3 with block scales: one scale per
``[block_rows, block_cols]`` block (``quantization_config.weight_block_size``,
e.g. ``[128, 128]``), scale tensor ``[ceil(out / block_rows), ceil(in / block_cols)]``,
UE8M0 (``2 ** (byte - 127)``) or plain fp32. The last block row/column may be partial.

Paths (``backend``; default ``"auto"``, or the environment variable ``ENGRAM_WKV_BACKEND``):

* ``"bf16"`` (the CPU path, and the fallback): the FP8 weight is dequantized **once, at
  construction**, to bf16 (``e4m3 * scale`` in fp32, one rounding to bf16; exact for UE8M0
  scales); ``kv = rows @ W.T`` by torch (fp32 accumulation, one rounding to bf16).
* ``"scaled_mm"`` -- path (a): the FP8 weight stays FP8 with fp32 copies of its block scales
  (157 MB + 38 KB instead of 315 MB for V4.1); the table rows are re-quantized to E4M3 with one
  power-of-two scale per 1 x 128 group (one Triton pass straight from the table bytes, no bf16
  rows) and multiplied by ``torch._scaled_mm`` with 1 x 128 / 128 x 128 block scales. Needs a
  build where that runs (cuBLAS >= 12.9, sm90), probed once at construction.
* ``"triton"`` -- path (a) with a Triton block-scaled GEMM instead of ``torch._scaled_mm``.
* ``"fused"`` -- path (b): one Triton kernel reads each token's table rows by hash id as the
  GEMM's A operand (E4M3 bytes + the rows' own UE8M0 scales per 32 values), with no
  re-quantization and no rows tensor (numerics: ``wkv_kernels.fused_gather_gemm_kernel``).
* ``"auto"``: ``"bf16"`` for a bf16 weight or a CPU weight; on CUDA with an FP8 weight,
  ``"scaled_mm"`` where the probe passes, else ``"fused"``.

Few tokens (``small_m``, off by default until measured on the H200): path (a) (``"scaled_mm"``
and ``"triton"``) sends a batch of ``T <= wkv_gemm.SMALL_M_MAX_TOKENS`` (128) tokens to the
split-K Triton GEMM ``wkv_gemm.small_m_gemm``, which streams the FP8 weight from every SM
(cuBLAS reached ~2.7 TB/s on it at T = 64). Chosen once, at construction: the ``small_m``
argument, else ``ENGRAM_WKV_SMALL_M`` (``1``/``0``), else :data:`SMALL_M_DEFAULT`. Same numerics
as the other path (a) GEMMs up to fp32 summation order.

The FP8 paths take FP8 rows (:meth:`WkvProjection.forward_fp8_rows`: table rows by hash id or
packed rows). Given bf16 rows (:meth:`WkvProjection.forward`), every FP8 path re-quantizes them
per 1 x 128 group with torch ops (path (a)'s numerics) and runs a block-scaled GEMM
(``torch._scaled_mm`` for ``"scaled_mm"``, else the Triton one, which needs weight blocks
128-aligned along the input).

The output ``kv`` is **bf16** (fp32 accumulation inside the GEMM, one rounding to bf16), like
every other bf16 linear layer of the model: the gate then reads bf16 keys and values and does
its own math in fp32. bf16 halves the bytes between the GEMM and the gate (8192 tokens x 25600
outputs: 419 MB vs 839 MB).
"""

from __future__ import annotations

from typing import Sequence


import torch

from engram.call_cache import CallCache, structure
from engram.checks import WKV_BACKEND_CHOICES as WKV_BACKENDS, check_choice
from engram.common import ceil_div
from engram.environment import WKV_BACKEND_ENV, WKV_SMALL_M_ENV, wkv_backend_default, wkv_small_m_default
from engram.table.fp8 import E8M0_DTYPE, scale_bytes_to_float
from engram.triton_launch import interpreting

__all__ = ["WkvProjection", "dequantize_wkv_weight", "split_kv", "WKV_BACKEND_ENV", "WKV_BACKENDS",
           "WKV_SMALL_M_ENV", "SMALL_M_DEFAULT"]

"""Environment variable choosing :class:`WkvProjection`'s path when ``backend`` is not given."""
_FP8_BACKENDS = ("scaled_mm", "triton", "fused")
_SMALL_M_BACKENDS = ("scaled_mm", "triton")  # path (a): the backends whose GEMM takes quantized activations

"""Environment variable (``1`` / ``0``) turning the small-T split-K GEMM of path (a) on or off
when :class:`WkvProjection`'s ``small_m`` is not given; read once, at construction."""
SMALL_M_DEFAULT = False
"""Whether path (a) uses the split-K GEMM for few tokens when neither argument nor environment says."""

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


def _check_wkv_arguments(weight, scale, block_size) -> tuple[int, int] | None:
    """Check a ``wkv`` weight and its scales as :func:`dequantize_wkv_weight` takes them (without
    touching their values); returns the block size of an FP8 weight, None for a plain one."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight: expected a torch.Tensor, found {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [out_features, in_features], found {list(weight.shape)}")
    if weight.dtype in _PLAIN_WEIGHT_DTYPES:
        if scale is not None:
            raise ValueError(f"scale: expected None for a {weight.dtype} weight (scales go with FP8 weights), "
                             f"found a tensor of shape {list(scale.shape)}")
        return None
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
    return block_rows, block_cols


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
    blocks = _check_wkv_arguments(weight, scale, block_size)
    if blocks is None:
        return weight.to(torch.bfloat16).contiguous()
    block_rows, block_cols = blocks
    out_features, in_features = weight.shape
    expected = [ceil_div(out_features, block_rows), ceil_div(in_features, block_cols)]
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


def _resolve_small_m(small_m) -> bool:
    """The ``small_m`` choice: the argument, else ``ENGRAM_WKV_SMALL_M``, else :data:`SMALL_M_DEFAULT`."""
    if small_m is not None:
        if not isinstance(small_m, bool):
            raise ValueError(f"small_m: expected a bool or None, found {small_m!r}")
        return small_m
    given = wkv_small_m_default()
    return SMALL_M_DEFAULT if given is None else given


def _resolve_backend(backend, weight: torch.Tensor) -> str:
    """The requested backend (argument, else ``ENGRAM_WKV_BACKEND``, else ``"auto"``), checked."""
    source = "backend"
    if backend is None:
        given, source = wkv_backend_default()
        backend = given or "auto"
    check_choice(source, backend, WKV_BACKENDS)
    if backend == "auto":
        if weight.dtype not in _FP8_WEIGHT_DTYPES or weight.device.type != "cuda":
            return "bf16"
        return "auto"
    if backend in _FP8_BACKENDS:
        if weight.dtype not in _FP8_WEIGHT_DTYPES:
            raise ValueError(f"{source}: {backend!r} needs a float8_e4m3fn weight with block scales, "
                             f"found a {weight.dtype} weight")
        if weight.device.type != "cuda" and not interpreting():
            raise ValueError(f"{source}: {backend!r} runs on CUDA (or the CPU under TRITON_INTERPRET=1), "
                             f"found a weight on {weight.device}")
    return backend


class WkvProjection(torch.nn.Module):
    """``kv [T, out] = rows.flatten(-2) [T, C * head_dim] @ weight.T``, bf16 out.

    Built from the checkpoint tensors ``(weight, scale=None, block_size=None)`` on the device
    it will run on; ``backend`` and ``small_m`` as in the module docstring
    (:attr:`small_m_max_tokens`: the largest ``T`` sent to the split-K GEMM, 0 when off). ``out = (hc_mult + 1) * hidden``, ``in = C * head_dim``. Buffers:

    * ``backend == "bf16"``: ``weight`` bf16 ``[out, in]`` (see :func:`dequantize_wkv_weight`);
    * FP8 backends: ``weight`` float8_e4m3fn ``[out, in]`` as in the checkpoint, and
      ``weight_scale`` fp32 ``[ceil(out / br), >= ceil(in / bc)]`` (its multipliers, rows padded
      to the stride ``torch._scaled_mm`` wants; :attr:`weight_scale_blocks` is the unpadded view).

    See the module docstring for the paths. Output layout assumption: the first
    ``hc_mult * hidden`` outputs are the keys of copies ``0 .. hc_mult - 1`` in order (``hidden``
    each), the last ``hidden`` outputs the value shared by all copies (:func:`split_kv`).
    """

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 block_size: Sequence[int] | None = None, *, backend: str | None = None,
                 small_m: bool | None = None):
        super().__init__()
        small_m = _resolve_small_m(small_m)
        self.source_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
        self.block_size = None if block_size is None else _check_block_size(block_size)
        _check_wkv_arguments(weight, scale, block_size)
        self.backend = _resolve_backend(backend, weight)
        self.backend_note = ""
        self._scaled_mm_layout = None
        self._checked_rows = CallCache(64)  # row structures _check_flat_rows has checked
        self._checked_fp8_rows = CallCache(64)  # argument structures forward_fp8_rows has checked
        self._scaled_mm_operands = None  # (weight.t(), block scales.t()) for torch._scaled_mm
        self.small_m_max_tokens = 0
        if self.backend == "bf16":
            self.register_buffer("weight", dequantize_wkv_weight(weight, scale, block_size))
            self.weight_scale = None
            return
        # An FP8 path keeps the weight as it is: no bf16 copy is made, even for a moment.
        self._setup_fp8(weight, scale)
        if small_m and self.backend in _SMALL_M_BACKENDS:
            from engram.layer.wkv_gemm import SMALL_M_MAX_TOKENS
            self.small_m_max_tokens = SMALL_M_MAX_TOKENS

    def _setup_fp8(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        from engram.layer import wkv_gemm

        block_rows, block_cols = self.block_size
        in_features = weight.shape[1]
        wanted = self.backend
        if wanted in ("auto", "scaled_mm"):
            layout, note = (None, f"block_size {self.block_size} is not [128, 128]")
            if self.block_size == (128, 128):
                layout, note = wkv_gemm.probe_scaled_mm_blockwise(weight.device, in_features, weight.shape[0])
            if layout is None and wanted == "scaled_mm":
                raise ValueError(f"backend: 'scaled_mm' needs torch._scaled_mm with 1x128 / 128x128 block scales, "
                                 f"unavailable here: {note}")
            self.backend = "scaled_mm" if layout is not None else "fused"
            self._scaled_mm_layout, self.backend_note = layout, note
        step = wkv_gemm.ACTIVATION_GROUP if self.backend in ("scaled_mm", "triton") else 32
        if block_cols % step:
            if wanted != "auto":
                raise ValueError(f"block_size: backend {self.backend!r} needs weight blocks {step}-aligned along "
                                 f"the input, found {list(self.block_size)}")
            self.backend, self.backend_note = "bf16", f"block_size {list(self.block_size)} fits no FP8 kernel"
            self.register_buffer("weight", dequantize_wkv_weight(weight, scale, self.block_size))
            self.weight_scale = None
            return
        blocks = _scale_values(scale)                              # fp32 [ceil(out / br), ceil(in / bc)]
        row_multiple = self._scaled_mm_layout.row_multiple if self._scaled_mm_layout is not None else 4
        stride = ceil_div(blocks.shape[1], row_multiple) * row_multiple
        padded = torch.zeros(blocks.shape[0], stride, dtype=torch.float32, device=weight.device)
        padded[:, : blocks.shape[1]] = blocks
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", padded)

    def _apply(self, fn, *args, **kwargs):
        self._scaled_mm_operands = None  # views of the buffers being replaced
        return super()._apply(fn, *args, **kwargs)

    # ---- properties ----------------------------------------------------------------
    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def fp8(self) -> bool:
        """True when the weight stays FP8 and the layer should be given FP8 rows
        (:meth:`forward_fp8_rows`)."""
        return self.backend in _FP8_BACKENDS

    @property
    def weight_scale_blocks(self) -> torch.Tensor | None:
        """fp32 ``[ceil(out / br), ceil(in / bc)]`` view of the FP8 weight's block scales (None in bf16)."""
        if self.weight_scale is None:
            return None
        return self.weight_scale[:, : ceil_div(self.in_features, self.block_size[1])]

    @property
    def weight_nbytes(self) -> int:
        """Bytes the weight occupies on its device (weight plus scales)."""
        scale_bytes = 0 if self.weight_scale is None else self.weight_scale.numel() * 4
        return self.weight.numel() * self.weight.element_size() + scale_bytes

    # ---- forward ---------------------------------------------------------------
    def _check_flat_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as ``[T, C * head_dim]``, checked once per structure."""
        key = (structure(rows), self.weight.device)
        if self._checked_rows.get(key) is None:
            self._check_rows(rows)
            self._checked_rows.put(key, True)
        return rows.flatten(1) if rows.dim() == 3 else rows

    def _check_rows(self, rows: torch.Tensor) -> torch.Tensor:
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
        return flat

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` bf16 ``[T, C, head_dim]`` or ``[T, C * head_dim]`` -> ``kv`` bf16 ``[T, out_features]``.

        FP8 backends re-quantize bf16 rows per 1 x 128 group (torch ops, path (a)'s numerics);
        give them FP8 rows with :meth:`forward_fp8_rows` instead."""
        flat = self._check_flat_rows(rows)
        if not self.fp8:
            return torch.nn.functional.linear(flat, self.weight)
        from engram.layer import wkv_gemm
        from engram.layer.reference import reference_quantize_activations

        tokens = flat.shape[0]
        padded = wkv_gemm.padded_tokens(tokens)
        values, scales = reference_quantize_activations(flat)
        a = torch.zeros(padded, self.in_features, dtype=torch.float8_e4m3fn, device=flat.device)
        a[:tokens] = values
        a_scale = torch.ones(scales.shape[1], padded, dtype=torch.float32, device=flat.device)
        a_scale[:, :tokens] = scales.t()
        return self._block_scaled_gemm(a, a_scale.t(), tokens)

    def _block_scaled_gemm(self, a: torch.Tensor, a_scale: torch.Tensor, tokens: int) -> torch.Tensor:
        from engram.layer import wkv_gemm

        if 0 < tokens <= self.small_m_max_tokens:
            return wkv_gemm.small_m_gemm(a, a_scale, tokens, self.weight, self.weight_scale, self.block_size)
        if self.backend == "scaled_mm":
            if self._scaled_mm_operands is None:  # views made once (module moves clear them: _apply)
                self._scaled_mm_operands = (self.weight.t(), self.weight_scale_blocks.t())
            return wkv_gemm.scaled_mm_gemm_transposed(a, a_scale, tokens, *self._scaled_mm_operands)
        return wkv_gemm.block_scaled_gemm(a, a_scale, tokens, self.weight, self.weight_scale, self.block_size)

    def forward_fp8_rows(self, values: torch.Tensor, scales: torch.Tensor, hash_ids: torch.Tensor | None = None,
                         row_start: int = 0) -> torch.Tensor:
        """``kv`` bf16 ``[T, out_features]`` from FP8 rows, on this projection's path.

        Args:
            values, scales: packed rows E4M3 ``[T, C, D]`` and UE8M0 bytes ``[T, C, D / 32]``
                (``hash_ids`` None), or a table's rows ``[R, D]`` / ``[R, D / 32]`` holding global
                rows ``[row_start, row_start + R)``, read by ``hash_ids``.
            hash_ids: int32/int64 ``[T, C]`` global row ids of the served columns (any strides);
                ids outside the table's rows read zero rows.

        ``"bf16"`` dequantizes the rows (torch) and runs its bf16 GEMM; the FP8 paths run their
        Triton kernels (and ``torch._scaled_mm``) without a host sync.
        """
        from engram.layer import wkv_gemm

        key = (structure(values), structure(hash_ids), self.weight.device)
        if self._checked_fp8_rows.get(key) is None:
            self._check_fp8_rows(values, hash_ids)
            self._checked_fp8_rows.put(key, True)
        if not self.fp8:
            from engram.table.fp8 import dequantize_rows
            from engram.table.kernels.reference import lookup_reference

            if hash_ids is None:
                rows = dequantize_rows(values, scales, torch.bfloat16)
            else:
                rows = lookup_reference(values, scales, hash_ids, row_start)
            return self.forward(rows)
        if self.backend == "fused":
            return wkv_gemm.fused_gather_gemm(values, scales, hash_ids, self.weight, self.weight_scale,
                                              self.block_size, row_start)
        tokens = (values.shape[0] if hash_ids is None else hash_ids.shape[0])
        a, a_scale = wkv_gemm.quantize_gathered_rows(values, scales, hash_ids, row_start)
        return self._block_scaled_gemm(a, a_scale, tokens)

    def prepare_fp8_rows(self, values: torch.Tensor, scales: torch.Tensor, hash_ids: torch.Tensor,
                         row_start: int = 0):
        """``prepared(hash_ids) -> kv``, equal to ``forward_fp8_rows(values, scales, hash_ids,
        row_start)`` for every ``hash_ids`` of this one's structure, with the checks and the
        quantize launch's plan made once (an eager step calls it per layer); None where this
        projection has no such call (not FP8, or the fused kernel)."""
        from engram.layer import wkv_gemm

        if not self.fp8 or self.backend == "fused" or hash_ids is None:
            return None
        self._check_fp8_rows(values, hash_ids)
        return _PreparedFp8Rows(self, wkv_gemm.PreparedQuantize(values, scales, hash_ids, row_start),
                                hash_ids.shape[0])

    def _check_fp8_rows(self, values, hash_ids) -> None:
        """The checks of :meth:`forward_fp8_rows` that depend on the arguments' structure alone
        (the kernels' launchers check the rest)."""
        if not isinstance(values, torch.Tensor) or values.device != self.weight.device:
            found = values.device if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values: expected a tensor on {self.weight.device} (the weight's), found {found}")
        if hash_ids is None:
            width = values.shape[1] * values.shape[2] if values.dim() == 3 else None
            what = f"packed rows {list(values.shape)}"
        else:
            width = (hash_ids.shape[1] * values.shape[1] if isinstance(hash_ids, torch.Tensor)
                     and hash_ids.dim() == 2 and values.dim() == 2 else None)
            what = (f"hash_ids {list(hash_ids.shape) if isinstance(hash_ids, torch.Tensor) else hash_ids!r} "
                    f"and table rows {list(values.shape)}")
        if width is not None and width != self.in_features:
            raise ValueError(f"values: expected C * head_dim = {self.in_features} values per token, found "
                             f"{width} ({what})")

    def key_value(self, rows: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows [T, C, head_dim]`` -> ``key`` bf16 ``[T, hc_mult, D]``, ``value`` bf16 ``[T, D]`` (views of kv)."""
        if self.out_features % (hc_mult + 1):
            raise ValueError(f"hc_mult: expected out_features {self.out_features} to be a multiple of hc_mult + 1, "
                             f"found hc_mult = {hc_mult}")
        return split_kv(self.forward(rows), hc_mult)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"source_dtype={self.source_dtype}, block_size={self.block_size}, backend={self.backend!r}, "
                f"small_m_max_tokens={self.small_m_max_tokens}")


class _PreparedFp8Rows:
    """:meth:`WkvProjection.prepare_fp8_rows`: the prepared quantize, then the projection's GEMM
    (read from the projection on every call, so a later move of its weight is followed)."""

    __slots__ = ("_projection", "_quantize", "_tokens")

    def __init__(self, projection: WkvProjection, quantize, tokens: int):
        self._projection, self._quantize, self._tokens = projection, quantize, tokens

    def __call__(self, hash_ids: torch.Tensor) -> torch.Tensor:
        a, a_scale = self._quantize(hash_ids)
        return self._projection._block_scaled_gemm(a, a_scale, self._tokens)
