"""Float64 references of the Engram layer math (DESIGN §2 "Gate"), written for
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

from ..table.fp8 import E8M0_DTYPE

__all__ = ["reference_gate", "reference_dequantize_wkv", "reference_wkv", "reference_engram"]

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
    """float64 ``[T, hc, D]``: ``out = h + g * value`` of DESIGN §2, every input taken to float64.

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
