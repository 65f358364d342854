"""Float64 references of the Engram layer math (docs/design.md §2 "Gate"), written for
clarity rather than speed. Tests compare every fast path against these.

Per token ``t`` and hyper-connection copy ``c`` (``D = hidden``)::

    w   = q_weight[c] * k_weight[c]
    dot = sum(h * w * key) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D)
    g   = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))      (g = 0 where the token is masked)
    out = h + g * value
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from engram.table.fp8 import E8M0_DTYPE

__all__ = ["reference_gate", "reference_dequantize_wkv", "reference_wkv", "reference_engram",
           "reference_quantize_activations", "reference_dequantize_activations", "reference_exact_rows"]

_F64 = torch.float64


def reference_gate(
    hidden_states: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``[T, hc, D]``: ``out = h + g * value`` of docs/design.md §2, every input taken to float64.

    Args:
        hidden_states: ``[T, hc, D]`` the residual stream copies ``h``.
        key: ``[T, hc, D]``; value: ``[T, D]``.
        q_weight, k_weight: ``[hc, D]``.
        eps: the RMS epsilon (``rms_norm_eps``).
        token_mask: bool ``[T]`` (True = the token takes part) or None; ``g = 0`` where False.
    """
    h = hidden_states.to(_F64)
    key = key.to(_F64)
    value = value.to(_F64)
    hidden = h.shape[-1]
    w = q_weight.to(_F64) * k_weight.to(_F64)                                   # [hc, D]
    raw_dot = (h * w * key).sum(dim=-1)                                          # [T, hc]
    h_scale = torch.rsqrt(h.pow(2).mean(dim=-1) + eps)                           # [T, hc]
    key_scale = torch.rsqrt(key.pow(2).mean(dim=-1) + eps)                       # [T, hc]
    dot = raw_dot * h_scale * key_scale / math.sqrt(hidden)                      # [T, hc]
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))  # [T, hc]
    if token_mask is not None:
        gate = torch.where(token_mask.to(torch.bool)[:, None], gate, torch.zeros_like(gate))
    return h + gate[:, :, None] * value[:, None, :]


def _reference_scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float64 multipliers: UE8M0 bytes b -> 2 ** (b - 127); floating scales as they are."""
    if E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return torch.pow(torch.tensor(2.0, dtype=_F64), scale.to(_F64) - 127.0)
    return scale.to(_F64)


def reference_dequantize_wkv(
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """float64 ``[out, in]``: ``W[i, j] = weight[i, j] * scale[i // block_rows, j // block_cols]``.

    No rounding to bf16 (the library's bf16 copy is exact for UE8M0 scales).
    """
    if scale is None:
        return weight.to(_F64)
    block_rows, block_cols = block_size
    out_features, in_features = weight.shape
    row_block = torch.arange(out_features) // block_rows                # [out]
    col_block = torch.arange(in_features) // block_cols                 # [in]
    multipliers = _reference_scale_values(scale).cpu()
    per_element = multipliers[row_block[:, None], col_block[None, :]]   # [out, in]
    return weight.to(_F64) * per_element.to(weight.device)


def reference_wkv(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """float64 ``kv [T, out] = rows.flatten(-2) [T, C * head_dim] @ W.T`` with W from :func:`reference_dequantize_wkv`."""
    flat = rows.to(_F64).flatten(1)
    return flat @ reference_dequantize_wkv(weight, scale, block_size).T


def reference_engram(
    hidden_states: torch.Tensor,
    rows: torch.Tensor,
    wkv_weight: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    wkv_scale: torch.Tensor | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """float64 ``[T, hc, D]`` of the whole layer: ``rows [T, C, head_dim]`` -> wkv -> gate.

    ``kv = rows.flatten(-2) @ W.T``; ``key[c] = kv[c * D : (c + 1) * D]`` for
    ``c < hc``, ``value = kv[hc * D :]``; then :func:`reference_gate`.
    """
    tokens, hc_mult, hidden = hidden_states.shape
    kv = reference_wkv(rows, wkv_weight, wkv_scale, block_size)           # [T, (hc + 1) * D]
    key = kv[:, : hc_mult * hidden].reshape(tokens, hc_mult, hidden)
    value = kv[:, hc_mult * hidden:]
    return reference_gate(hidden_states, key, value, q_weight, k_weight, eps, token_mask)


ACTIVATION_GROUP = 128


def reference_quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations of path (a): ``rows [T, K]`` (any float dtype, finite) ->
    ``(values float8_e4m3fn [T, K], scales float32 [T, ceil(K / 128)])``.

    Per token and group of 128 consecutive values (the last group may be shorter):
    ``s = 2 ** clamp(ceil(log2(amax / 448)), -127, 127)`` (amax 0 -> 1) and
    ``values = round_nearest_even_e4m3(x / s)`` -- the table codec's rule with groups of 128.
    ``ceil(log2(.))`` is taken exactly (float64 ``frexp``: ``amax = m * 2**e``, ``448 = 0.875 * 2**9``).
    """
    x = rows.to(_F64)
    tokens, in_features = x.shape
    groups = -(-in_features // ACTIVATION_GROUP)
    padded = torch.zeros(tokens, groups * ACTIVATION_GROUP, dtype=_F64, device=x.device)
    padded[:, :in_features] = x
    blocks = padded.reshape(tokens, groups, ACTIVATION_GROUP)
    amax = blocks.abs().amax(dim=-1)                                          # [T, G]
    mantissa, exponent = torch.frexp(amax)
    exponent = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    exponent = torch.where(amax == 0, torch.zeros_like(exponent), exponent).clamp(-127, 127)
    scales = torch.pow(torch.tensor(2.0, dtype=_F64, device=x.device), exponent.to(_F64))   # [T, G]
    scaled = (blocks / scales[..., None]).reshape(tokens, -1)[:, :in_features]
    # float64 -> float32 is exact here (a power-of-two rescaling of values with <= 53 bits that fit fp32
    # whenever the input was fp32/bf16), then torch's fp32 -> E4M3 cast rounds to nearest even.
    values = scaled.to(torch.float32).to(torch.float8_e4m3fn)
    return values, scales.to(torch.float32)


def reference_dequantize_activations(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``[T, K]``: ``values[t, k] * scales[t, k // 128]`` (the inverse of
    :func:`reference_quantize_activations` up to its rounding)."""
    in_features = values.shape[1]
    per_value = scales.to(_F64).repeat_interleave(ACTIVATION_GROUP, dim=1)[:, :in_features]
    return values.to(_F64) * per_value


def reference_exact_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``[..., D]``: the exact table values ``e4m3 * 2 ** (b - 127)`` of FP8 rows
    (``values`` E4M3 or its bytes ``[..., D]``, ``scales`` UE8M0 bytes ``[..., D / 32]``)."""
    from engram.table.fp8 import as_scale_bytes, as_value_bytes

    value_bytes = as_value_bytes(values, "values")
    scale_bytes = as_scale_bytes(scales, "scales")
    decoded = value_bytes.view(torch.float8_e4m3fn).to(_F64)
    factors = torch.pow(torch.tensor(2.0, dtype=_F64), scale_bytes.cpu().to(_F64) - 127.0).to(decoded.device)
    return decoded * factors.repeat_interleave(32, dim=-1)
