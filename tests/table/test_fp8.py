"""FP8 table-row codec (docs/design.md §2 "FP8 table rows") against independent numpy/float64 models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram.table import (
    E8M0_DTYPE,
    dequantize_rows,
    quantize_rows,
    scale_bytes_to_float,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------
# independent float64 models
# ---------------------------------------------------------------------------
def decode_e4m3(value_bytes: np.ndarray) -> np.ndarray:
    """E4M3 (fn) bit patterns -> float64: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    value_bytes = value_bytes.astype(np.int64)
    sign = np.where(value_bytes & 0x80, -1.0, 1.0)
    exponent = (value_bytes >> 3) & 0xF
    mantissa = value_bytes & 0x7
    magnitude = np.where(exponent == 0, np.ldexp(mantissa.astype(np.float64), -9),
                         np.ldexp((8 + mantissa).astype(np.float64), exponent - 10))
    return np.where((value_bytes & 0x7F) == 0x7F, np.nan, sign * magnitude)


def round_to_grid(x: np.ndarray, mantissa_bits: int, min_normal_exponent: int) -> np.ndarray:
    """Round float64 ``x`` to nearest, ties to even, on the grid of a binary format with
    ``mantissa_bits`` stored bits and smallest normal ``2**min_normal_exponent`` (no overflow handling)."""
    x = np.asarray(x, dtype=np.float64)
    _, frexp_exponent = np.frexp(np.abs(x))  # |x| = m * 2**e, m in [0.5, 1)
    binade = np.maximum(frexp_exponent - 1, min_normal_exponent)
    quantum = np.ldexp(1.0, binade - mantissa_bits)
    with np.errstate(invalid="ignore"):
        return np.round(x / quantum) * quantum  # x / quantum is exact; np.round is half-to-even


def round_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bit patterns (int64), round to nearest even, overflow to inf, NaN kept."""
    rounded = round_to_grid(x, 7, -126)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = np.where(np.abs(rounded) >= 2.0**128, np.copysign(np.inf, rounded), rounded)
        as_float32 = rounded.astype(np.float32)  # exact: on the bf16 grid
    return (as_float32.view(np.uint32) >> 16).astype(np.int64)


def dequantize_model(value_bytes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """float64 ``e4m3 * 2**(b - 127)``, value bytes [..., D], scale bytes [..., D/32]."""
    factors = np.ldexp(1.0, scale_bytes.astype(np.int64) - 127)
    factors = np.where(scale_bytes == 255, np.nan, factors)
    return decode_e4m3(value_bytes) * np.repeat(factors, 32, axis=-1)


def quantize_model(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 model of the quantizer: (E4M3 values as float64 [..., D], scale bytes [..., D/32])."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    # least integer k with amax <= 448 * 2**k, by exact comparisons (448 * 2**k is exact in float64)
    exponent = np.zeros(amax.shape, dtype=np.int64)
    for index in np.ndindex(amax.shape):
        value = float(amax[index])
        if value == 0.0:
            continue
        k = math.frexp(value)[1] - 9
        while value > math.ldexp(448.0, k):
            k += 1
        while value <= math.ldexp(448.0, k - 1):
            k -= 1
        exponent[index] = k
    scale_bytes = np.clip(exponent + 127, 0, 254)
    scaled = blocks * np.ldexp(1.0, 127 - scale_bytes)[..., None]
    values = round_to_grid(scaled, 3, -6)
    assert np.all(np.abs(values) <= 448.0)
    return values.reshape(x.shape), scale_bytes


def float32_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)


def bf16_bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF


# ---------------------------------------------------------------------------
# input generation
# ---------------------------------------------------------------------------
def random_rows(rng: np.random.Generator, leading: tuple[int, ...], head_dim: int) -> np.ndarray:
    """float32 rows with per-block magnitudes from subnormal to near float32 max, zero blocks,
    exact powers of two at the scale boundaries, and E4M3 rounding ties."""
    num_blocks = head_dim // 32
    shape = (*leading, num_blocks, 32)
    block_exponent = rng.integers(-150, 126, size=(*leading, num_blocks, 1))
    x = rng.standard_normal(shape) * np.ldexp(1.0, block_exponent)
    kind = rng.integers(0, 8, size=(*leading, num_blocks))
    # zero blocks
    x[kind == 1] = 0.0
    # one element exactly 448 * 2**k (the boundary of a scale), the others E4M3 ties at that scale
    k = rng.integers(-135, 100, size=x.shape[:-1])
    boundary = np.ldexp(448.0, k)
    positive = decode_e4m3(np.arange(0x7F, dtype=np.uint8))  # 0 .. 448
    midpoints = (positive[:-1] + positive[1:]) / 2  # ties between neighbours, below 448
    ties = rng.choice(midpoints, size=shape) * np.ldexp(1.0, k)[..., None]
    ties *= rng.choice([-1.0, 1.0], size=shape)
    x = np.where((kind == 2)[..., None], ties, x)
    x[..., 0] = np.where(kind == 2, boundary, x[..., 0])
    # amax just above / below a boundary
    x[..., 1] = np.where(kind == 3, np.nextafter(np.float32(boundary), np.float32(np.inf)), x[..., 1])
    x[..., 1] = np.where(kind == 4, np.nextafter(np.float32(boundary), np.float32(0)), x[..., 1])
    with np.errstate(over="ignore"):
        x32 = np.clip(x, -3.0e38, 3.0e38).astype(np.float32)
    return x32.reshape(*leading, head_dim)


leading_shapes = st.sampled_from([(1,), (3,), (7,), (2, 5), (63,), (1, 1, 3)])
head_dims = st.sampled_from([32, 64, 96, 160, 256])
seeds = st.integers(0, 2**63 - 1)


# ---------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------
def test_scale_factors_exact_for_every_byte():
    scale_bytes = torch.arange(256, dtype=torch.uint8)
    factors = scale_bytes_to_float(scale_bytes).numpy()
    for byte in range(255):
        assert float(factors[byte]) == math.ldexp(1.0, byte - 127), byte
    assert factors[0] > 0 and float(factors[0]) == 2.0**-127  # float32 subnormal, not flushed
    assert np.isnan(factors[255])


def test_dequantize_exhaustive_bit_exact():
    """Every E4M3 byte times every UE8M0 byte, against float64 rounded once to bf16."""
    value_bytes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # [256 scale bytes, 256 values]
    scale_bytes = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)  # [256, 8]
    out = dequantize_rows(torch.from_numpy(value_bytes).view(torch.float8_e4m3fn), torch.from_numpy(scale_bytes))
    assert out.dtype == torch.bfloat16 and out.shape == (256, 256)
    expected = dequantize_model(value_bytes, scale_bytes)
    nan = np.isnan(expected)
    assert np.array_equal(torch.isnan(out).numpy(), nan)
    assert np.array_equal(bf16_bits(out)[~nan], round_to_bfloat16_bits(expected)[~nan])

    out32 = dequantize_rows(torch.from_numpy(value_bytes), torch.from_numpy(scale_bytes), out_dtype=torch.float32)
    with np.errstate(over="ignore"):
        expected32 = expected.astype(np.float32)  # exact (the product has 4 significant bits) or overflow to inf
    assert np.array_equal(float32_bits(out32.numpy())[~nan], float32_bits(expected32)[~nan])


@pytest.mark.skipif(E8M0_DTYPE is None, reason="this torch has no float8_e8m0fnu")
def test_dequantize_accepts_e8m0_scales(seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (5, 64), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 255, (5, 2), dtype=torch.uint8, generator=generator)
    expected = dequantize_rows(values, scales)
    found = dequantize_rows(values.view(torch.float8_e4m3fn), scales.view(E8M0_DTYPE))
    assert torch.equal(expected.view(torch.int16), found.view(torch.int16))


@SETTINGS
@given(seed=seeds, leading=leading_shapes, head_dim=head_dims)
def test_dequantize_random_bytes_bit_exact(seed, leading, head_dim):
    rng = np.random.default_rng(seed)
    value_bytes = rng.integers(0, 256, size=(*leading, head_dim), dtype=np.uint8)
    value_bytes[(value_bytes & 0x7F) == 0x7F] = 0x42  # no NaN patterns
    scale_bytes = rng.integers(0, 255, size=(*leading, head_dim // 32), dtype=np.uint8)
    out = dequantize_rows(torch.from_numpy(value_bytes).view(torch.float8_e4m3fn), torch.from_numpy(scale_bytes))
    assert out.shape == (*leading, head_dim)
    assert np.array_equal(bf16_bits(out), round_to_bfloat16_bits(dequantize_model(value_bytes, scale_bytes)))


# ---------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, leading=leading_shapes, head_dim=head_dims)
def test_quantize_matches_float64_model(seed, leading, head_dim):
    x = random_rows(np.random.default_rng(seed), leading, head_dim)
    values, scales = quantize_rows(torch.from_numpy(x))
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (*leading, head_dim // 32)
    expected_values, expected_scales = quantize_model(x.astype(np.float64))
    assert np.array_equal(scales.numpy().astype(np.int64), expected_scales)
    assert np.array_equal(float32_bits(values.to(torch.float32).numpy()), float32_bits(expected_values))


@SETTINGS
@given(seed=seeds, leading=leading_shapes, head_dim=head_dims, dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_quantize_half_precision_inputs(seed, leading, head_dim, dtype):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((*leading, head_dim)) * np.ldexp(1.0, rng.integers(-20, 12))).to(dtype)
    values, scales = quantize_rows(x)
    expected_values, expected_scales = quantize_model(x.to(torch.float64).numpy())
    assert np.array_equal(scales.numpy().astype(np.int64), expected_scales)
    assert np.array_equal(float32_bits(values.to(torch.float32).numpy()), float32_bits(expected_values))


@SETTINGS
@given(seed=seeds, leading=leading_shapes, head_dim=head_dims)
def test_quantize_error_bound(seed, leading, head_dim):
    """|x - q * s| <= half an E4M3 step: 2**-4 * |x| in the normal range (3 mantissa bits),
    2**-10 * s in the subnormal range (step 2**-9 * s); and amax / s in (224, 448] unless clamped."""
    x = random_rows(np.random.default_rng(seed), leading, head_dim).astype(np.float64)
    values, scales = quantize_rows(torch.from_numpy(x.astype(np.float32)))
    scale = np.repeat(np.ldexp(1.0, scales.numpy().astype(np.int64) - 127), 32, axis=-1)
    reconstructed = values.to(torch.float64).numpy() * scale
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale)
    assert np.all(np.abs(reconstructed - x) <= bound)
    amax = np.abs(x.reshape(*leading, -1, 32)).max(axis=-1)
    block_scale = np.ldexp(1.0, scales.numpy().astype(np.int64) - 127)
    ratio = amax / block_scale
    assert np.all(ratio <= 448.0)
    regular = (amax > 0) & (scales.numpy() > 0)
    assert np.all(ratio[regular] > 224.0)
    assert np.all(scales.numpy()[amax == 0] == 127)


@SETTINGS
@given(seed=seeds, leading=leading_shapes, head_dim=head_dims,
       anchor=st.booleans(), exponent_low=st.integers(-120, 90))
def test_round_trip_exact_for_representable_values(seed, leading, head_dim, anchor, exponent_low):
    """Blocks of e4m3 * 2**k come back exactly; with an element of exponent field 15 in each
    block (|e4m3| in [256, 448]) the scale is 2**k itself and the bytes come back too."""
    rng = np.random.default_rng(seed)
    num_blocks = head_dim // 32
    value_bytes = rng.integers(0, 256, size=(*leading, num_blocks, 32), dtype=np.uint8)
    value_bytes[(value_bytes & 0x7F) == 0x7F] = 0x00
    if anchor:
        value_bytes[..., 0] = (rng.integers(0, 2, size=value_bytes.shape[:-1]) << 7 | 0x78
                               | rng.integers(0, 7, size=value_bytes.shape[:-1])).astype(np.uint8)
    k = rng.integers(exponent_low, exponent_low + 30, size=(*leading, num_blocks, 1))
    x = decode_e4m3(value_bytes) * np.ldexp(1.0, k)
    x32 = x.astype(np.float32)
    assert np.array_equal(x32.astype(np.float64), x)  # representable in float32
    values, scales = quantize_rows(torch.from_numpy(x32.reshape(*leading, head_dim)))
    back32 = dequantize_rows(values, scales, out_dtype=torch.float32).numpy()
    assert np.array_equal(float32_bits(back32), float32_bits(x32.reshape(*leading, head_dim)))
    back16 = dequantize_rows(values, scales)
    assert torch.equal(back16, torch.from_numpy(x32.reshape(*leading, head_dim)).to(torch.bfloat16))
    if anchor:
        assert np.array_equal(scales.numpy().astype(np.int64), k[..., 0] + 127)
        assert np.array_equal(values.view(torch.uint8).numpy(), value_bytes.reshape(*leading, head_dim))


def test_zero_blocks_give_byte_127_and_zeros():
    x = torch.zeros(3, 96)
    x[1, 32:64] = -0.0
    x[2, 64:] = torch.linspace(-5, 5, 32)
    values, scales = quantize_rows(x)
    assert scales.tolist() == [[127, 127, 127], [127, 127, 127], [127, 127, scales[2, 2].item()]]
    assert scales[2, 2].item() == 127 - 6  # amax 5: 5 <= 448 * 2**-6 = 7, 5 > 3.5
    assert torch.all(values[:, :64].to(torch.float32) == 0)
    assert torch.all(values[2, :64].view(torch.uint8) == 0)
    assert torch.equal(dequantize_rows(values, scales)[:, :64], torch.zeros(3, 64, dtype=torch.bfloat16))


def test_scale_exponent_exact_at_powers_of_two():
    """amax exactly 448 * 2**j keeps scale 2**j; one float32 ulp above needs 2**(j + 1)."""
    rows, expected = [], []
    for j in range(-150, 120):  # 448 * 2**j = 7 * 2**(j + 6) is exact in float32 over this range
        boundary = np.float32(math.ldexp(448.0, j))
        assert float(boundary) == math.ldexp(448.0, j)
        for amax, exponent in ((boundary, j), (np.nextafter(boundary, np.float32(np.inf)), j + 1),
                               (np.nextafter(boundary, np.float32(0)), j)):
            row = np.zeros(32, dtype=np.float32)
            row[5] = -amax
            rows.append(row)
            expected.append(min(max(127 + exponent, 0), 254))
    _, scales = quantize_rows(torch.from_numpy(np.stack(rows)))
    assert scales[:, 0].tolist() == expected


def test_quantize_extremes():
    tiny = torch.tensor([2.0**-149, -(2.0**-140), 448 * 2.0**-127, 3.0 * 2.0**-135])
    huge = torch.tensor([torch.finfo(torch.float32).max, -1.0e38])
    x = torch.zeros(2, 32)
    x[0, :4] = tiny
    x[1, :2] = huge
    values, scales = quantize_rows(x)
    assert scales[0, 0].item() == 0  # amax / 448 == 2**-127
    assert values[0, :4].to(torch.float32).tolist() == [0.0, -0.0, 448.0, 3 * 2.0**-8]
    assert values[0, 1].view(torch.uint8).item() == 0x80  # -2**-13 rounds to -0
    assert scales[1, 0].item() == 127 + 120  # float32 max < 448 * 2**120 = 1.75 * 2**128
    expected_values, expected_scales = quantize_model(x.to(torch.float64).numpy())
    assert scales.numpy().astype(np.int64).tolist() == expected_scales.tolist()
    assert np.array_equal(float32_bits(values.to(torch.float32).numpy()), float32_bits(expected_values))


def test_quantize_validation():
    with pytest.raises(ValueError, match=r"rows: last dimension \(head_dim\) must be a positive multiple of 32, found 48"):
        quantize_rows(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"rows: expected finite values, found inf at index \(1, 7\)"):
        x = torch.zeros(2, 32)
        x[1, 7] = float("inf")
        quantize_rows(x)
    with pytest.raises(ValueError, match=r"rows: expected finite values, found nan at index \(0, 3\)"):
        x = torch.zeros(2, 32)
        x[0, 3] = float("nan")
        quantize_rows(x)
    with pytest.raises(ValueError, match="rows: expected dtype"):
        quantize_rows(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="0-dimensional"):
        quantize_rows(torch.tensor(1.0))


def test_dequantize_validation():
    values = torch.zeros(2, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scales: expected shape \[2, 2\].*found \[2, 3\]"):
        dequantize_rows(values, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales: expected dtype torch.uint8"):
        dequantize_rows(values, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="values: expected dtype torch.float8_e4m3fn"):
        dequantize_rows(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="values: last dimension"):
        dequantize_rows(torch.zeros(2, 40, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_codec_on_cuda_matches_cpu(rng):
    """Same bytes and bits on the GPU (no flush of subnormals, same E4M3 rounding)."""
    x = torch.from_numpy(random_rows(rng, (257,), 256))
    values, scales = quantize_rows(x)
    cuda_values, cuda_scales = quantize_rows(x.cuda())
    assert torch.equal(cuda_values.cpu().view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(cuda_scales.cpu(), scales)
    value_bytes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scale_bytes = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    expected = dequantize_rows(value_bytes, scale_bytes)
    found = dequantize_rows(value_bytes.cuda(), scale_bytes.cuda()).cpu()
    assert torch.equal(torch.isnan(found), torch.isnan(expected))
    same = ~torch.isnan(expected)
    assert torch.equal(found.view(torch.int16)[same], expected.view(torch.int16)[same])


@pytest.mark.parametrize("size", [1, 7, 8, 9, 64, 1000, 4099])
@pytest.mark.parametrize("kind", ["e4m3", "ue8m0"])
def test_first_nan_byte_finds_the_first_anywhere(size, kind, rng):
    """The word-wise scan against a plain byte-by-byte search, NaN bytes at random places
    (the tail past the last whole word included), and none."""
    from engram.table.fp8 import first_nan_byte

    nan_bytes = [0x7F, 0xFF] if kind == "e4m3" else [0xFF]
    clean = rng.integers(0, 0x7F, size).astype(np.uint8)  # no byte is NaN for either kind
    assert first_nan_byte(torch.from_numpy(clean), kind) is None
    for _ in range(5):
        data = clean.copy()
        places = rng.choice(size, size=min(size, int(rng.integers(1, 4))), replace=False)
        data[places] = rng.choice(nan_bytes, size=len(places))
        data[rng.integers(0, size)] |= 0x80 if kind == "ue8m0" else 0  # 0x80.. bytes are not UE8M0 NaN
        expected = next(i for i, b in enumerate(data.tolist())
                        if (b in nan_bytes) and (kind == "e4m3" or b == 0xFF))
        assert first_nan_byte(torch.from_numpy(data).view(size, 1), kind) == expected


# ---------------------------------------------------------------------------
# check_table_values: a table decodes to finite values
# ---------------------------------------------------------------------------
def _every_byte_under_every_scale():
    """Value bytes ``[255 * 8, 32]`` and scales ``[255 * 8, 1]``: row ``8 * b + k`` holds value bytes
    ``32k .. 32k + 31`` under scale byte ``b`` (every finite scale), so every (value, scale) pair appears."""
    values = np.tile(np.arange(256, dtype=np.uint8).reshape(8, 32), (255, 1))
    scales = np.repeat(np.arange(255, dtype=np.uint8), 8).reshape(-1, 1)
    return values, scales


def test_overflowing_blocks_are_exactly_those_that_decode_to_infinity():
    """Exhaustive: a block is flagged exactly when the codec's fp32 product (rounded to bf16, and fp32
    itself) of a finite value is infinite; NaN value bytes are the NaN check's, never flagged here."""
    from engram.table.fp8 import OVERFLOW_SCALE_BYTE, overflowing_blocks

    values, scales = _every_byte_under_every_scale()
    decoded = {dtype: dequantize_rows(torch.from_numpy(values), torch.from_numpy(scales), dtype).float().numpy()
               for dtype in (torch.bfloat16, torch.float32)}
    finite_value = (values | 0x80) != 0xFF
    for dtype, rows in decoded.items():
        expected = np.flatnonzero((np.isinf(rows) & finite_value).any(axis=1))
        assert np.array_equal(overflowing_blocks(values, scales), expected), dtype
    assert int(scales[overflowing_blocks(values, scales)].min()) == OVERFLOW_SCALE_BYTE
    # no value overflows below byte 247, and 448 (0x7E, the largest) does at 247
    assert not overflowing_blocks(values[scales[:, 0] < OVERFLOW_SCALE_BYTE], scales[scales[:, 0] < OVERFLOW_SCALE_BYTE]).size
    one = np.zeros((1, 32), dtype=np.uint8)
    one[0, 5] = 0x7E
    assert overflowing_blocks(one, np.array([[246]], dtype=np.uint8)).size == 0
    assert overflowing_blocks(one, np.array([[247]], dtype=np.uint8)).tolist() == [0]


def test_check_table_values_accepts_every_quantized_table(seed):
    """What quantize_rows makes of finite rows (bf16 range) passes; random tables of small scales pass."""
    from engram.table.fp8 import check_table_values

    rng = np.random.default_rng(seed)
    rows = torch.from_numpy(rng.standard_normal((64, 64)).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -100, 100, size=(64, 1)).astype(np.float32))
    check_table_values(*quantize_rows(rows))
    values = torch.from_numpy(rng.integers(0, 256, (300, 64), dtype=np.uint8))
    values[(values & 0x7F) == 0x7F] = 0
    check_table_values(values, torch.from_numpy(rng.integers(0, 247, (300, 2), dtype=np.uint8)), chunk_rows=7)


@pytest.mark.parametrize("case", ["nan value 0x7f", "nan value 0xff", "scale 255", "scale 254", "scale 247"])
def test_check_table_values_names_the_tensor_row_and_byte(case, seed):
    from engram.table.fp8 import check_table_values

    rng = np.random.default_rng(seed)
    values = rng.integers(0, 0x70, (500, 64), dtype=np.uint8)        # finite, at most 2**7
    values[rng.random((500, 64)) < 0.5] |= 0x80                        # both signs
    scales = rng.integers(100, 140, (500, 2), dtype=np.uint8)
    row, column = int(rng.integers(0, 500)), int(rng.integers(0, 64))
    if case.startswith("nan value"):
        values[row, column] = int(case.split()[-1], 16)
        expected = rf"values: row {row + 1000} holds value byte {case.split()[-1]} \(E4M3 NaN\) at column {column}"
    elif case == "scale 255":
        scales[row, column // 32] = 255
        expected = rf"scales: row {row + 1000} holds scale byte 255 \(UE8M0 NaN\) at column {column // 32}"
    else:
        byte = int(case.split()[-1])
        block = column // 32
        values[row, block * 32:(block + 1) * 32] = 0
        values[row, column] = 0x78 if byte == 247 else 0x40              # 256 (overflows under 2**120) / 2.0
        scales[row, block] = byte
        expected = (rf"scales: row {row + 1000} holds scale byte {byte} \(2\*\*{byte - 127}\) at column {block}, "
                    rf"under which values byte {values[row, column]:#04x} .* at column {column} decodes to .* >= 2\*\*128")
    for chunk_rows in (1, 64, 1 << 16):
        with pytest.raises(ValueError, match=expected):
            check_table_values(torch.from_numpy(values).view(torch.float8_e4m3fn), torch.from_numpy(scales),
                               row_start=1000, chunk_rows=chunk_rows)
    # the first bad row wins, whatever its kind
    earlier = values.copy()
    earlier[0, 0] = 0xFF
    with pytest.raises(ValueError, match=r"row 1000 holds value byte 0xff" if row else r"row 1000 holds"):
        check_table_values(torch.from_numpy(earlier), torch.from_numpy(scales), row_start=1000)


def test_check_table_values_a_finite_product_at_the_largest_scale_passes():
    """Scale 254 (2**127) times 1.0 is 2**127: finite in bf16, so not refused (the rule is the codec's own)."""
    from engram.table.fp8 import check_table_values

    values = torch.zeros(1, 32, dtype=torch.uint8)
    values[0, 3] = 0x38                                  # 1.0
    scales = torch.full((1, 1), 254, dtype=torch.uint8)
    check_table_values(values, scales)
    assert torch.isfinite(dequantize_rows(values, scales)).all()


def test_check_table_values_refuses_bad_arguments():
    from engram.table.fp8 import check_table_values

    with pytest.raises(ValueError, match=r"values: expected a torch.Tensor of E4M3 values, found list"):
        check_table_values([[0] * 32], torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scales: expected shape \[2, 1\]"):
        check_table_values(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"chunk_rows: expected an integer >= 1, found 0"):
        check_table_values(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), chunk_rows=0)
