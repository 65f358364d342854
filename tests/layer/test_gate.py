"""The torch gate against the float64 reference (docs/design.md §2 "Gate")."""

from __future__ import annotations

import math

import pytest
import torch

from engram.layer import engram_gate, reference_gate

EPS = 1e-6


def _inputs(tokens: int, hc_mult: int, hidden: int, seed: int, value_scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    hidden_states = randn(tokens, hc_mult, hidden, scale=3.0)
    key = randn(tokens, hc_mult, hidden)
    value = randn(tokens, hidden, scale=3.0 * value_scale)
    q_weight, k_weight = randn(hc_mult, hidden), randn(hc_mult, hidden)
    mask = torch.rand(tokens, generator=generator) < 0.75
    return hidden_states, key, value, q_weight, k_weight, mask


CASES = [(1, 1, 64), (1, 4, 64), (63, 2, 64), (63, 4, 80), (200, 4, 96), (33, 3, 48)]


@pytest.mark.parametrize("tokens,hc_mult,hidden", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_matches_float64_reference(tokens, hc_mult, hidden, masked):
    seed = tokens * 100 + hc_mult * 10 + hidden + masked
    hidden_states, key, value, q_weight, k_weight, mask = _inputs(tokens, hc_mult, hidden, seed)
    mask = mask if masked else None
    reference = reference_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask)
    reference_update = reference - hidden_states.double()

    # Unrounded (fp32) output: the update agrees to fp32 accuracy, copy by copy.
    out32 = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask, out_dtype=torch.float32)
    update32 = out32.double() - hidden_states.double()
    error = (update32 - reference_update).norm(dim=-1)
    assert bool((error <= 1e-5 * reference_update.norm(dim=-1) + 1e-6).all())

    # bf16 output: one rounding of the fp32 result.
    out = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask)
    assert out.dtype == torch.bfloat16 and out.shape == hidden_states.shape
    assert bool(((out.double() - reference).abs() <= 2 ** -8 * reference.abs() + 1e-5).all())
    update = out.double() - hidden_states.double()
    relative = (update - reference_update).norm() / reference_update.norm().clamp(min=1e-30)
    assert relative < 1e-2


def test_masked_tokens_are_bit_identical():
    hidden_states, key, value, q_weight, k_weight, mask = _inputs(63, 4, 80, seed=7)
    mask[::5] = False
    key[~mask] = float("nan")          # garbage in masked tokens must not leak
    value[~mask] = float("inf")
    for out_dtype in (None, torch.float32):
        out = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask, out_dtype=out_dtype)
        assert torch.equal(out[~mask], hidden_states[~mask].to(out.dtype))
        assert bool(torch.isfinite(out).all())
    out = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask)
    assert torch.equal(out[~mask].view(torch.int16), hidden_states[~mask].view(torch.int16))
    # Negative zeros survive too (a g = 0 product would not be needed to keep them).
    hidden_states[~mask] = -0.0
    out = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask)
    assert torch.equal(out[~mask].view(torch.int16), hidden_states[~mask].view(torch.int16))


def test_reference_gate_by_hand():
    """The float64 reference against plain Python math for two tokens, one copy."""
    hidden_states = torch.tensor([[[1.0, -2.0, 0.5, 3.0]], [[0.25, 0.25, -1.0, 2.0]]])
    key = torch.tensor([[[0.5, 1.0, -1.5, 2.0]], [[0.0, 0.0, 0.0, 0.0]]])
    value = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 2.0]])
    q_weight, k_weight = torch.tensor([[1.0, 0.5, 2.0, -1.0]]), torch.tensor([[2.0, 1.0, 0.5, 1.0]])
    eps = 1e-6
    out = reference_gate(hidden_states, key, value, q_weight, k_weight, eps)
    for t in range(2):
        h, k, v = hidden_states[t, 0].tolist(), key[t, 0].tolist(), value[t].tolist()
        w = [a * b for a, b in zip(q_weight[0].tolist(), k_weight[0].tolist())]
        dot = sum(a * b * c for a, b, c in zip(h, w, k))
        dot /= math.sqrt(sum(a * a for a in h) / 4 + eps) * math.sqrt(sum(a * a for a in k) / 4 + eps) * 2.0
        sign = (dot > 0) - (dot < 0)
        gate = 1.0 / (1.0 + math.exp(-sign * math.sqrt(max(abs(dot), 1e-6))))
        expected = [a + gate * b for a, b in zip(h, v)]
        assert out[t, 0].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # Token 1 has a zero key: dot = 0, sign 0, g = sigmoid(0) = 0.5.
    assert out[1, 0].tolist() == pytest.approx([0.25 - 0.5, 0.5, -1.0, 3.0])
    masked = reference_gate(hidden_states, key, value, q_weight, k_weight, eps, torch.tensor([True, False]))
    assert torch.equal(masked[1], hidden_states[1].double())


def test_gate_small_and_zero_dot():
    """Near-zero dots hit the 1e-6 clamp; zero keys give sign 0 -> g = 0.5."""
    hidden_states, key, value, q_weight, k_weight, _ = _inputs(8, 2, 64, seed=3)
    key[0] = 0
    key[1] = hidden_states[1] * 1e-4
    reference = reference_gate(hidden_states, key, value, q_weight, k_weight, EPS)
    out32 = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, out_dtype=torch.float32)
    assert torch.allclose(out32.double(), reference, rtol=1e-5, atol=1e-4)
    assert torch.allclose(out32[0], hidden_states[0].float() + 0.5 * value[0].float())


def test_gate_empty_batch():
    hidden_states, key, value, q_weight, k_weight, mask = _inputs(0, 2, 64, seed=1)
    out = engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask)
    assert out.shape == (0, 2, 64) and out.dtype == torch.bfloat16


def test_gate_errors_name_the_argument():
    hidden_states, key, value, q_weight, k_weight, mask = _inputs(5, 2, 64, seed=2)
    with pytest.raises(ValueError, match=r"key: expected shape \[5, 2, 64\], found \[5, 64\]"):
        engram_gate(hidden_states, value, value, q_weight, k_weight, EPS)
    with pytest.raises(ValueError, match=r"value: expected shape \[5, 64\]"):
        engram_gate(hidden_states, key, key, q_weight, k_weight, EPS)
    with pytest.raises(ValueError, match=r"q_weight: expected shape \[2, 64\]"):
        engram_gate(hidden_states, key, value, q_weight[:1], k_weight, EPS)
    with pytest.raises(ValueError, match="token_mask: expected a torch.bool"):
        engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask.int())
    with pytest.raises(ValueError, match=r"token_mask: expected shape \[5\]"):
        engram_gate(hidden_states, key, value, q_weight, k_weight, EPS, mask[:3])
    with pytest.raises(ValueError, match="hidden_states: expected shape"):
        engram_gate(hidden_states[0], key, value, q_weight, k_weight, EPS)
