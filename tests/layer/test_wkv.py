"""wkv projection: FP8 block-scaled dequantization against an independent
per-element decode, non-divisible block shapes, the bf16 path, output layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engram.layer import WkvProjection, dequantize_wkv_weight, reference_wkv, split_kv


def _e4m3_value(byte: int) -> float:
    """OCP E4M3 (fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * (mantissa / 8.0) * 2.0 ** -6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


E4M3 = [_e4m3_value(b) for b in range(256)]


def _random_fp8_weight(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Every finite E4M3 bit pattern is possible (subnormals and +-448 included)."""
    bits = torch.randint(0, 256, (out_features, in_features), generator=generator, dtype=torch.int32)
    bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)  # no NaN patterns
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


def _expected_ue8m0(weight_bytes: np.ndarray, scale_bytes: np.ndarray, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = weight_bytes.shape
    expected = np.empty((rows, cols), dtype=np.float32)
    for i in range(rows):
        for j in range(cols):
            product = E4M3[weight_bytes[i, j]] * 2.0 ** (int(scale_bytes[i // block[0], j // block[1]]) - 127)
            with np.errstate(over="ignore"):  # 448 * 2**127 overflows to inf, as in fp32
                expected[i, j] = np.float32(product)  # exact in float64; one rounding to fp32
    return torch.from_numpy(expected).to(torch.bfloat16)


SHAPES = [
    (64, 96, (32, 32)),     # divisible
    (50, 70, (16, 32)),     # neither dimension divisible
    (130, 200, (128, 128)),  # checkpoint block shape, partial last blocks
    (7, 300, (4, 128)),
]


@pytest.mark.parametrize("out_features,in_features,block", SHAPES)
@pytest.mark.parametrize("scale_kind", ["e8m0", "uint8"])
def test_fp8_ue8m0_dequant_matches_per_element(out_features, in_features, block, scale_kind):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = _random_fp8_weight(out_features, in_features, generator)
    scale_shape = (-(-out_features // block[0]), -(-in_features // block[1]))
    scale_bytes = torch.randint(100, 150, scale_shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    scale = scale_bytes.view(torch.float8_e8m0fnu) if scale_kind == "e8m0" else scale_bytes

    projection = WkvProjection(weight, scale, block)
    expected = _expected_ue8m0(weight.view(torch.uint8).numpy(), scale_bytes.numpy(), block)
    assert projection.weight.dtype == torch.bfloat16
    assert torch.equal(projection.weight.view(torch.int16), expected.view(torch.int16))


def test_fp8_ue8m0_extreme_scale_bytes():
    """Bytes 0 (2**-127, fp32 subnormal) to 254 (2**127): still one exact product, one rounding."""
    generator = torch.Generator().manual_seed(5)
    weight = _random_fp8_weight(16, 64, generator)
    scale_bytes = torch.tensor([[0, 1, 126, 127], [128, 200, 253, 254]], dtype=torch.uint8)
    projection = WkvProjection(weight, scale_bytes, [8, 16])
    expected = _expected_ue8m0(weight.view(torch.uint8).numpy(), scale_bytes.numpy(), (8, 16))
    assert torch.equal(projection.weight.view(torch.int16), expected.view(torch.int16))


def test_fp8_fp32_scales_match_per_element():
    generator = torch.Generator().manual_seed(11)
    weight = _random_fp8_weight(50, 70, generator)
    scale = torch.rand(4, 3, generator=generator) * 0.1 + 1e-3
    projection = WkvProjection(weight, scale, (16, 32))
    weight_bytes, scale_values = weight.view(torch.uint8).numpy(), scale.numpy()
    expected = np.empty((50, 70), dtype=np.float32)
    for i in range(50):
        for j in range(70):
            expected[i, j] = np.float32(E4M3[weight_bytes[i, j]]) * scale_values[i // 16, j // 32]  # fp32 product
    expected = torch.from_numpy(expected).to(torch.bfloat16)
    assert torch.equal(projection.weight.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("hc_mult", [1, 2, 4])
def test_bf16_weight_path_and_layout(hc_mult):
    generator = torch.Generator().manual_seed(hc_mult)
    tokens, columns, head_dim, hidden = 13, 6, 32, 48
    weight = (torch.randn((hc_mult + 1) * hidden, columns * head_dim, generator=generator) / 14).to(torch.bfloat16)
    rows = torch.randn(tokens, columns, head_dim, generator=generator).to(torch.bfloat16)
    projection = WkvProjection(weight)
    assert torch.equal(projection.weight.view(torch.int16), weight.view(torch.int16))
    assert (projection.in_features, projection.out_features) == (columns * head_dim, (hc_mult + 1) * hidden)

    kv = projection(rows)
    assert kv.dtype == torch.bfloat16 and kv.shape == (tokens, (hc_mult + 1) * hidden)
    assert torch.equal(kv, projection(rows.flatten(1)))
    assert torch.equal(kv, torch.nn.functional.linear(rows.flatten(1), weight))
    reference = reference_wkv(rows, weight)
    assert torch.allclose(kv.double(), reference, rtol=2 ** -7, atol=1e-3)

    key, value = projection.key_value(rows, hc_mult)
    assert key.shape == (tokens, hc_mult, hidden) and value.shape == (tokens, hidden)
    for copy in range(hc_mult):
        assert torch.equal(key[:, copy], kv[:, copy * hidden:(copy + 1) * hidden])
    assert torch.equal(value, kv[:, hc_mult * hidden:])


def test_fp8_forward_matches_float64_reference():
    generator = torch.Generator().manual_seed(3)
    out_features, in_features = 3 * 40, 5 * 32  # hc 2, hidden 40, C 5, head_dim 32; [128, 128] blocks don't divide
    weight = (torch.randn(out_features, in_features, generator=generator) * 8).to(torch.float8_e4m3fn)
    scale = torch.full((1, 2), 127 - 6, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    rows = torch.randn(9, 5, 32, generator=generator).to(torch.bfloat16)
    kv = WkvProjection(weight, scale, [128, 128])(rows)
    reference = reference_wkv(rows, weight, scale, [128, 128])
    assert torch.allclose(kv.double(), reference, rtol=2 ** -7, atol=1e-3)
    key, value = split_kv(kv, 2)
    assert key.shape == (9, 2, 40) and value.shape == (9, 40)


def test_dequantize_is_once_at_construction():
    weight = torch.ones(4, 4, dtype=torch.float8_e4m3fn)
    projection = WkvProjection(weight, torch.tensor([[128]], dtype=torch.uint8), [4, 4])
    assert projection.weight.dtype == torch.bfloat16 and bool((projection.weight == 2).all())
    assert projection.source_dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_wkv_weight(weight, torch.tensor([[2.0]]), (4, 4)), torch.full((4, 4), 2.0).bfloat16())


def test_errors_name_the_argument():
    fp8 = torch.zeros(10, 20, dtype=torch.float8_e4m3fn)
    good_scale = torch.full((2, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale: expected the block scales"):
        WkvProjection(fp8)
    with pytest.raises(ValueError, match="block_size"):
        WkvProjection(fp8, good_scale)
    with pytest.raises(ValueError, match=r"scale: expected shape \[2, 1\].*found \[1, 1\]"):
        WkvProjection(fp8, good_scale[:1], (8, 32))
    with pytest.raises(ValueError, match="byte 255"):
        WkvProjection(fp8, torch.full((2, 1), 255, dtype=torch.uint8), (8, 32))
    with pytest.raises(ValueError, match="scale: expected None"):
        WkvProjection(torch.zeros(10, 20, dtype=torch.bfloat16), good_scale, (8, 32))
    with pytest.raises(ValueError, match="weight: expected dtype"):
        WkvProjection(torch.zeros(10, 20, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size"):
        WkvProjection(fp8, good_scale, (8, 0))
    projection = WkvProjection(torch.zeros(10, 20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows: expected C \\* head_dim = 20"):
        projection(torch.zeros(3, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows: expected dtype torch.bfloat16"):
        projection(torch.zeros(3, 20))
    with pytest.raises(ValueError, match="hc_mult"):
        projection.key_value(torch.zeros(3, 20, dtype=torch.bfloat16), 2)
