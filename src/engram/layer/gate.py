"""The Engram gate in plain torch: the CPU path and the GPU fallback (DESIGN §2 "Gate").

Per token ``t`` and copy ``c``, in fp32, one rounding at the end::

    dot = sum(h * q_weight[c] * k_weight[c] * key) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D)
    out = h + sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) * value

Masked tokens (``token_mask`` False) come out equal to their input bit for bit:
the output is selected with ``torch.where``, not computed with ``g = 0``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["engram_gate"]

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_gate_inputs(hidden_states, key, value, q_weight, k_weight, token_mask) -> None:
    for name, tensor in (("hidden_states", hidden_states), ("key", key), ("value", value),
                         ("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, found {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, found {tensor.dtype}")
        if tensor.device != hidden_states.device:
            raise ValueError(f"{name}: expected device {hidden_states.device} (hidden_states'), found {tensor.device}")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states: expected shape [T, hc, D], found {list(hidden_states.shape)}")
    if hidden_states.dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"hidden_states: expected dtype bfloat16, float16 or float32, found {hidden_states.dtype}")
    tokens, hc_mult, hidden = hidden_states.shape
    expected = {"key": [tokens, hc_mult, hidden], "value": [tokens, hidden],
                "q_weight": [hc_mult, hidden], "k_weight": [hc_mult, hidden]}
    for name, tensor in (("key", key), ("value", value), ("q_weight", q_weight), ("k_weight", k_weight)):
        if list(tensor.shape) != expected[name]:
            raise ValueError(f"{name}: expected shape {expected[name]}, found {list(tensor.shape)}")
    if token_mask is not None:
        if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
            found = token_mask.dtype if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
            raise ValueError(f"token_mask: expected a torch.bool tensor [T] or None, found {found}")
        if list(token_mask.shape) != [tokens]:
            raise ValueError(f"token_mask: expected shape [{tokens}], found {list(token_mask.shape)}")
        if token_mask.device != hidden_states.device:
            raise ValueError(f"token_mask: expected device {hidden_states.device} (hidden_states'), found {token_mask.device}")


def engram_gate(
    hidden_states: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out [T, hc, D] = h + g * value``, fp32 math, rounded once to ``out_dtype``.

    Args:
        hidden_states: ``h``, bf16/fp16/fp32 ``[T, hc, D]``.
        key: ``[T, hc, D]``, value: ``[T, D]`` (bf16 from ``wkv``; any float dtype).
        q_weight, k_weight: ``[hc, D]`` (bf16 in checkpoints).
        eps: ``rms_norm_eps``.
        token_mask: bool ``[T]``, False = masked (output = input, bit for bit); None = all tokens.
        out_dtype: dtype of the result; default ``hidden_states.dtype``.

    Returns:
        A new tensor ``[T, hc, D]`` of ``out_dtype``.
    """
    _check_gate_inputs(hidden_states, key, value, q_weight, k_weight, token_mask)
    out_dtype = hidden_states.dtype if out_dtype is None else out_dtype
    hidden = hidden_states.shape[-1]
    h = hidden_states.to(torch.float32)
    k = key.to(torch.float32)
    w = q_weight.to(torch.float32) * k_weight.to(torch.float32)         # [hc, D]; exact for bf16 inputs
    raw_dot = (h * w * k).sum(dim=-1)                                    # [T, hc]
    h_scale = torch.rsqrt((h * h).mean(dim=-1) + eps)                    # [T, hc]
    key_scale = torch.rsqrt((k * k).mean(dim=-1) + eps)                  # [T, hc]
    dot = raw_dot * h_scale * key_scale / math.sqrt(hidden)              # [T, hc]
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    out = (h + gate[:, :, None] * value.to(torch.float32)[:, None, :]).to(out_dtype)
    if token_mask is not None:
        out = torch.where(token_mask[:, None, None], out, hidden_states.to(out_dtype))
    return out
