"""The wkv GEMM through ``torch._scaled_mm``'s block-scaled FP8 form (path (a) of
:mod:`engram.layer.wkv`): the weight-scale layout this torch build takes, a probe of it on the
device, and the GEMM with quantized activations (``[T, K]`` E4M3 with 1 x 128 power-of-two scales)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engram.tuning import tuning

_TOKEN_PADDING = 4  # cuBLASLt wants the column-major [T, K / 128] scale's column stride 16-byte aligned
MIN_ACTIVATION_ROWS = tuning().wkv.min_activation_rows
"""Fewest rows of the quantized activations (:mod:`engram.tuning`, ``wkv.min_activation_rows``, a multiple
of 4). On the H200 cuBLAS's block-scaled FP8 GEMM picks a slower kernel below 128 rows: V4.1-Flash wkv
(K = 6144, N = 25600), graph-replayed, 59.1 us at M = 64 against 56.2 us with the same rows padded to 128
(59.4 against 55.8 at M = 1; ``benchmarks/NOTES.md``, "Findings of removed probes"). The padding rows are
zeros; the Triton GEMMs skip them."""


def padded_tokens(tokens: int) -> int:
    """Rows of the quantized activation buffer: ``T`` rounded up to a multiple of 4, at least
    :data:`MIN_ACTIVATION_ROWS`."""
    return max(MIN_ACTIVATION_ROWS, -(-tokens // _TOKEN_PADDING) * _TOKEN_PADDING)


__all__ = ["ScaledMmLayout", "scaled_mm_weight_scale", "scaled_mm_gemm", "scaled_mm_gemm_transposed",
           "probe_scaled_mm_blockwise"]


@dataclass(frozen=True)
class ScaledMmLayout:
    """How this torch build takes 128 x 128 weight scales: the row stride of the ``[N / 128, K / 128]``
    scale tensor (passed transposed) is ``K / 128`` rounded up to ``row_multiple`` (1 or 4:
    releases differ)."""

    row_multiple: int


def scaled_mm_weight_scale(weight_scale: torch.Tensor, layout: ScaledMmLayout) -> torch.Tensor:
    """fp32 ``[N / 128, K / 128]`` -> the ``[K / 128, N / 128]`` transposed view ``torch._scaled_mm``
    takes for 128 x 128 blocks, its rows padded to the layout's stride."""
    blocks_n, blocks_k = weight_scale.shape
    stride = -(-blocks_k // layout.row_multiple) * layout.row_multiple
    padded = torch.zeros(blocks_n, stride, dtype=torch.float32, device=weight_scale.device)
    padded[:, :blocks_k] = weight_scale
    return padded[:, :blocks_k].t()


def scaled_mm_gemm(a: torch.Tensor, a_scale: torch.Tensor, tokens: int, weight: torch.Tensor,
                   weight_scale_t: torch.Tensor) -> torch.Tensor:
    """``kv bf16 [T, N]`` (a view of ``[padded_T, N]``) = ``torch._scaled_mm`` of the quantized
    activations (1 x 128 scales) and ``weight`` ``[N, K]`` (128 x 128 scales,
    :func:`scaled_mm_weight_scale`); cuBLAS's block-scaled FP8 GEMM, fp32 accumulation."""
    return scaled_mm_gemm_transposed(a, a_scale, tokens, weight.t(), weight_scale_t)


def scaled_mm_gemm_transposed(a: torch.Tensor, a_scale: torch.Tensor, tokens: int, weight_t: torch.Tensor,
                              weight_scale_t: torch.Tensor) -> torch.Tensor:
    """:func:`scaled_mm_gemm` given ``weight.t()`` (``[K, N]`` column-major), for callers that keep it."""
    kv = torch._scaled_mm(a, weight_t, scale_a=a_scale, scale_b=weight_scale_t, out_dtype=torch.bfloat16)
    return kv if kv.shape[0] == tokens else kv[:tokens]


def _probe(device: torch.device, in_features: int, out_features: int, layout: ScaledMmLayout) -> str | None:
    """None when ``torch._scaled_mm`` runs 1 x 128 / 128 x 128 blocks with ``layout`` at this
    ``K x N`` (5 random tokens, random power-of-two scales, partial blocks as the real shape has
    them) and matches an fp32 reference within bf16 rounding; else why not."""
    generator = torch.Generator(device=device).manual_seed(13)
    tokens = 5
    blocks = (-(-out_features // 128), -(-in_features // 128))
    weight = (torch.randn(out_features, in_features, device=device, generator=generator) * 64).to(torch.float8_e4m3fn)
    weight_scale = torch.exp2(torch.randint(-12, -4, blocks, device=device, generator=generator).float())
    padded = padded_tokens(tokens)
    a = torch.zeros(padded, in_features, dtype=torch.float8_e4m3fn, device=device)
    a[:tokens] = (torch.randn(tokens, in_features, device=device, generator=generator) * 16).to(torch.float8_e4m3fn)
    a_scale = torch.ones(blocks[1], padded, device=device)
    a_scale[:, :tokens] = torch.exp2(torch.randint(-6, 2, (blocks[1], tokens), device=device, generator=generator).float())
    try:
        found = scaled_mm_gemm(a, a_scale.t(), tokens, weight, scaled_mm_weight_scale(weight_scale, layout)).float()
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    a_values = a[:tokens].float() * a_scale[:, :tokens].t().repeat_interleave(128, dim=1)[:, :in_features]
    worst, largest = 0.0, 0.0
    for first in range(0, out_features, 2048):  # an fp32 reference, 2048 outputs at a time
        rows = slice(first, min(out_features, first + 2048))
        factors = weight_scale[first // 128: -(-rows.stop // 128)].repeat_interleave(128, 0)[: rows.stop - first]
        w_values = weight[rows].float() * factors.repeat_interleave(128, 1)[:, :in_features]
        expected = a_values @ w_values.T
        worst = max(worst, float((found[:, rows] - expected).abs().max()))
        largest = max(largest, float(expected.abs().max()))
    error = worst / max(largest, 1e-30)
    return None if error < 2 ** -7 else f"wrong results (max error {error:.3g} of the largest output)"


@functools.cache
def probe_scaled_mm_blockwise(device: torch.device, in_features: int, out_features: int
                              ) -> tuple[ScaledMmLayout | None, str]:
    """``(layout, note)``: whether this build's ``torch._scaled_mm`` takes DeepSeek-style block
    scales on ``device`` at ``K x N`` (checked once per device and shape by running it; sm90 and
    cuBLAS >= 12.9), and with which scale row stride. ``(None, reason)`` where it does not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, "not a CUDA device"
    if not hasattr(torch, "_scaled_mm"):
        return None, "torch has no _scaled_mm"
    if in_features % 16 or out_features % 16:
        return None, f"K = {in_features} and N = {out_features} must be multiples of 16"
    reasons = []
    with torch.cuda.device(device):
        for layout in (ScaledMmLayout(4), ScaledMmLayout(1)):
            reason = _probe(device, in_features, out_features, layout)
            if reason is None:
                return layout, f"torch._scaled_mm blockwise, scale rows padded to {layout.row_multiple}"
            reasons.append(f"row stride x{layout.row_multiple}: {reason}")
    return None, "; ".join(reasons)
