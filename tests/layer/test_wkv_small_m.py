"""The split-K small-T GEMM of path (a) (``wkv_gemm.small_m_gemm``) against the
float64 reference and ``torch._scaled_mm``, and its wiring into ``WkvProjection``.

* ``interpreter``: tiny shapes (T in {1, 3, 17}, K and N a few 128s / 32s), every output mode
  (bf16 direct, fp32 partials + reduce, fp32 atomics + cast), both MMA orientations, per-tile
  and per-column weight scales; the output and the split-K scratch are poisoned (NaN) first.
* ``gpu``: V4.1 shapes at T in {1, 63, 64, 128} against ``torch._scaled_mm`` and float64,
  determinism of the partials reduction, CUDA-graph capture of the projection.
* unmarked: argument checks and the ``small_m`` choice.

Inputs are fresh random every run; each failure message names the seed (``ENGRAM_TEST_SEED``).
"""

from __future__ import annotations

import pytest
import torch

from engram.layer import WkvProjection
from engram.layer.reference import reference_dequantize_activations

from test_wkv_fp8 import (  # noqa: E402 - the FP8 tests' input makers and comparison
    check_graph_replay,
    ACCUMULATION,
    RELATIVE,
    _assert_kv_close,
    _cuda_device,
    _fresh_seed,
    _kernel_device,
    _random_ids,
    _random_weight,
    _realistic_table,
    _v41_inputs,
    _weight64,
    _weight_scale_fp32,
    _wkv_gemm,
)


def _poison_split_k_buffer(monkeypatch, wkv_gemm):
    """Make the launcher's fp32 scratch start as NaN, so an unwritten partial shows up."""
    original = wkv_gemm._split_k_buffer
    monkeypatch.setattr(wkv_gemm, "_split_k_buffer", lambda shape, device: original(shape, device).fill_(float("nan")))


def _quantized_inputs(tokens, columns, head_dim, out_features, block, seed, device):
    """``(a, a_scale, weight, weight_scale fp32, weight64)``: table rows by id re-quantized per
    1 x 128 (the library's own path (a) activations) and a UE8M0 block-scaled weight."""
    wkv_gemm = _wkv_gemm()
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _realistic_table(40, head_dim, generator, device)
    ids = _random_ids(tokens, columns, 0, 40, generator, torch.int32, device)
    weight, weight_scale_bytes = _random_weight(out_features, columns * head_dim, block, generator, device)
    a, a_scale = wkv_gemm.quantize_gathered_rows(value_bytes, scale_bytes, ids)
    return a, a_scale, weight, _weight_scale_fp32(weight_scale_bytes), _weight64(weight, weight_scale_bytes, block)


# (tokens, columns, head_dim, out_features, block): K = 384 (3 groups: splits of 2 + 1 groups),
# N tiles partial, per-column weight scales (16-row blocks), 256-wide K blocks, BLOCK_M 16 / 16 / 32.
INTERPRETER_CASES = {
    1: (1, 3, 128, 96, (128, 128)),
    3: (3, 2, 128, 80, (16, 128)),
    17: (17, 4, 64, 64, (64, 256)),
}


def _interpreter_configs():
    wkv_gemm = _wkv_gemm()
    return {
        "partials-swap": wkv_gemm.SmallMGemmConfig(block_n=32, split_k=2, num_stages=1),
        "direct-noswap": wkv_gemm.SmallMGemmConfig(block_n=32, split_k=1, num_stages=1, swap_ab=False),
        "atomic-8splits": wkv_gemm.SmallMGemmConfig(block_n=64, split_k=8, num_stages=1, reduction="atomic"),
    }


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("config_name", ["partials-swap", "direct-noswap", "atomic-8splits"])
@pytest.mark.parametrize("tokens", sorted(INTERPRETER_CASES))
def test_small_m_gemm_against_reference(tokens, config_name, monkeypatch):
    device = _kernel_device()
    wkv_gemm = _wkv_gemm()
    _poison_split_k_buffer(monkeypatch, wkv_gemm)
    _, columns, head_dim, out_features, block = INTERPRETER_CASES[tokens]
    seed = _fresh_seed()
    a, a_scale, weight, weight_scale, weight64 = _quantized_inputs(tokens, columns, head_dim, out_features, block,
                                                                   seed, device)
    config = _interpreter_configs()[config_name]
    out = torch.full((tokens, out_features), float("nan"), dtype=torch.bfloat16, device=device)
    kv = wkv_gemm.small_m_gemm(a, a_scale, tokens, weight, weight_scale, block, out=out, config=config)
    assert kv is out
    activations = reference_dequantize_activations(a[:tokens].cpu(), a_scale[:tokens].cpu())
    _assert_kv_close(kv, activations, weight64, seed, f"small-M GEMM {config_name} T={tokens}",
                     relative=RELATIVE, accumulation=ACCUMULATION)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_small_m_default_config_is_deterministic(monkeypatch):
    """The default (partials) reduction adds splits in a fixed order: the same bits every call,
    allocating its own output."""
    device = _kernel_device()
    wkv_gemm = _wkv_gemm()
    _poison_split_k_buffer(monkeypatch, wkv_gemm)
    seed = _fresh_seed()
    a, a_scale, weight, weight_scale, weight64 = _quantized_inputs(5, 2, 128, 64, (128, 128), seed, device)
    first = wkv_gemm.small_m_gemm(a, a_scale, 5, weight, weight_scale, (128, 128))
    second = wkv_gemm.small_m_gemm(a, a_scale, 5, weight, weight_scale, (128, 128))
    assert torch.equal(first, second), f"seed {seed}"
    _assert_kv_close(first, reference_dequantize_activations(a[:5].cpu(), a_scale[:5].cpu()), weight64, seed,
                     "small-M default", relative=RELATIVE, accumulation=ACCUMULATION)


@pytest.mark.interpreter
def test_projection_sends_few_tokens_to_small_m(monkeypatch):
    """``small_m=True``: T <= 128 goes to ``small_m_gemm``, larger T to the backend's GEMM
    (spied, no kernel runs); off, nothing goes there."""
    _kernel_device()
    wkv_gemm = _wkv_gemm()
    generator = torch.Generator().manual_seed(4)
    weight, scale = _random_weight(32, 128, (128, 128), generator, "cpu")
    calls = []
    monkeypatch.setattr(wkv_gemm, "small_m_gemm", lambda a, s, tokens, *rest: calls.append(("small_m", tokens)))
    monkeypatch.setattr(wkv_gemm, "block_scaled_gemm", lambda a, s, tokens, *r, **k: calls.append(("triton", tokens)))
    projection = WkvProjection(weight, scale, [128, 128], backend="triton", small_m=True)
    assert projection.small_m_max_tokens == wkv_gemm.SMALL_M_MAX_TOKENS == 128
    for tokens in (1, 128, 129):
        projection(torch.zeros(tokens, 128, dtype=torch.bfloat16))
    assert calls == [("small_m", 1), ("small_m", 128), ("triton", 129)]
    calls.clear()
    WkvProjection(weight, scale, [128, 128], backend="triton", small_m=False)(torch.zeros(3, 128, dtype=torch.bfloat16))
    assert calls == [("triton", 3)]
    assert WkvProjection(weight, scale, [128, 128], backend="fused", small_m=True).small_m_max_tokens == 0


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_projection_small_m_matches_reference(monkeypatch):
    device = _kernel_device()
    _poison_split_k_buffer(monkeypatch, _wkv_gemm())
    seed = _fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _realistic_table(30, 64, generator, device)
    ids = _random_ids(3, 4, 0, 30, generator, torch.int32, device)
    weight, weight_scale_bytes = _random_weight(64, 256, (128, 128), generator, device)
    projection = WkvProjection(weight, weight_scale_bytes, [128, 128], backend="triton", small_m=True)
    plain = WkvProjection(weight, weight_scale_bytes, [128, 128], backend="triton", small_m=False)
    kv = projection.forward_fp8_rows(value_bytes, scale_bytes, ids)
    expected = plain.forward_fp8_rows(value_bytes, scale_bytes, ids)
    # Same activations, same per-group products; only the order of the fp32 adds differs.
    assert float((kv.double() - expected.double()).abs().max()) <= 2 ** -6 * float(expected.double().abs().max()), \
        f"seed {seed}"


# ---------------------------------------------------------------------------
# no kernel
# ---------------------------------------------------------------------------
def test_small_m_config_and_choice_errors(monkeypatch):
    wkv_gemm = _wkv_gemm()
    with pytest.raises(ValueError, match="SmallMGemmConfig.split_k"):
        wkv_gemm.SmallMGemmConfig(split_k=3)
    with pytest.raises(ValueError, match="SmallMGemmConfig.block_n"):
        wkv_gemm.SmallMGemmConfig(block_n=8)
    with pytest.raises(ValueError, match="SmallMGemmConfig.reduction"):
        wkv_gemm.SmallMGemmConfig(reduction="tree")
    assert [wkv_gemm.small_m_block_m(t) for t in (1, 16, 17, 64, 100, 128, 500)] == [16, 16, 32, 64, 128, 128, 128]
    generator = torch.Generator().manual_seed(5)
    weight, scale = _random_weight(32, 128, (128, 128), generator, "cpu")
    with pytest.raises(ValueError, match="small_m: expected a bool"):
        WkvProjection(weight, scale, [128, 128], small_m="yes")
    monkeypatch.setenv("ENGRAM_WKV_SMALL_M", "maybe")
    with pytest.raises(ValueError, match="ENGRAM_WKV_SMALL_M: expected '0' or '1'"):
        WkvProjection(weight, scale, [128, 128])
    monkeypatch.setenv("ENGRAM_WKV_SMALL_M", "1")
    assert WkvProjection(weight, scale, [128, 128]).small_m_max_tokens == 0  # the CPU path is bf16
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a_scale: expected the column-major fp32"):
        wkv_gemm.small_m_gemm(a, torch.ones(4, 1, dtype=torch.float64), 4, weight, torch.ones(1, 4), (128, 128))


# ---------------------------------------------------------------------------
# GPU: V4.1 shapes
# ---------------------------------------------------------------------------
def _v41_activations(tokens: int, seed: int):
    wkv_gemm = _wkv_gemm()
    value_bytes, scale_bytes, ids, weight, weight_scale_bytes = _v41_inputs(tokens, seed)
    a, a_scale = wkv_gemm.quantize_gathered_rows(value_bytes, scale_bytes, ids)
    return a, a_scale, weight, weight_scale_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 63, 64, 128])
def test_gpu_small_m_matches_scaled_mm(tokens, monkeypatch):
    device = _cuda_device()
    wkv_gemm = _wkv_gemm()
    _poison_split_k_buffer(monkeypatch, wkv_gemm)
    seed = _fresh_seed()
    a, a_scale, weight, weight_scale_bytes = _v41_activations(tokens, seed)
    weight_scale = _weight_scale_fp32(weight_scale_bytes)
    out = torch.full((tokens, weight.shape[0]), float("nan"), dtype=torch.bfloat16, device=device)
    kv = wkv_gemm.small_m_gemm(a, a_scale, tokens, weight, weight_scale, (128, 128), out=out)
    torch.cuda.synchronize()
    activations = reference_dequantize_activations(a[:tokens], a_scale[:tokens])
    _assert_kv_close(kv, activations, _weight64(weight, weight_scale_bytes, (128, 128)), seed,
                     f"small-M T={tokens}", relative=2.0 ** -8, accumulation=2.0 ** -14)
    layout, note = wkv_gemm.probe_scaled_mm_blockwise(a.device, weight.shape[1], weight.shape[0])
    if layout is None:
        pytest.skip(f"torch._scaled_mm block-scaled FP8 unavailable ({note}); checked against float64 only")
    expected = wkv_gemm.scaled_mm_gemm(a, a_scale, tokens, weight,
                                       wkv_gemm.scaled_mm_weight_scale(weight_scale[:, :-(-weight.shape[1] // 128)], layout)
                                       ).double()
    difference = float((kv.double() - expected).norm() / expected.norm())
    assert difference <= 2 ** -8, f"seed {seed}: relative difference to torch._scaled_mm {difference:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    dict(block_n=128, split_k=4), dict(block_n=64, split_k=1, swap_ab=False), dict(block_n=256, split_k=8),
    dict(block_n=32, split_k=2, reduction="atomic"), dict(block_n=128, split_k=2, swap_ab=False, num_warps=8),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gpu_small_m_configs(config, monkeypatch):
    device = _cuda_device()
    wkv_gemm = _wkv_gemm()
    _poison_split_k_buffer(monkeypatch, wkv_gemm)
    seed = _fresh_seed()
    a, a_scale, weight, weight_scale_bytes = _v41_activations(64, seed)
    out = torch.full((64, weight.shape[0]), float("nan"), dtype=torch.bfloat16, device=device)
    kv = wkv_gemm.small_m_gemm(a, a_scale, 64, weight, _weight_scale_fp32(weight_scale_bytes), (128, 128), out=out,
                               config=wkv_gemm.SmallMGemmConfig(**config))
    torch.cuda.synchronize()
    _assert_kv_close(kv, reference_dequantize_activations(a[:64], a_scale[:64]),
                     _weight64(weight, weight_scale_bytes, (128, 128)), seed, f"small-M {config}",
                     relative=2.0 ** -8, accumulation=2.0 ** -14)


@pytest.mark.gpu
def test_gpu_small_m_projection_graph_replay_and_determinism():
    device = _cuda_device()
    seed = _fresh_seed()
    value_bytes, scale_bytes, ids, weight, weight_scale = _v41_inputs(64, seed)
    projection = WkvProjection(weight, weight_scale, [128, 128], backend="triton", small_m=True)
    assert projection.small_m_max_tokens >= 64
    eager = projection.forward_fp8_rows(value_bytes, scale_bytes, ids)
    assert torch.equal(eager, projection.forward_fp8_rows(value_bytes, scale_bytes, ids)), f"seed {seed}"
    check_graph_replay(projection, value_bytes, scale_bytes, ids, seed, device, replays=2)
