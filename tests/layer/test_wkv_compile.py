"""The FP8 wkv kernels compiled for sm90 on the CPU (Triton's own ptxas, no GPU): every launch
shape the library uses builds, and the GEMMs keep their dot operands in the software pipeline
(async copies) with wgmma for the large tiles. The interpreter runs none of this: it caught
neither a constexpr early return that fails to compile nor operands that were not pipelined."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

# Imported here, in the process's own mode: triton.jit reads TRITON_INTERPRET when a kernel
# module is first imported, and the tests below clear it to compile.
from engram.layer import wkv_gemm, wkv_kernels, wkv_small_m_kernels  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - other Triton layouts
    GPUTarget = ASTSource = None

# Integer arguments a real launch passes as multiples of 16 (Triton specializes those itself).
DIVISIBLE = {"hash_ids_ptr", "value_ptr", "scale_ptr", "weight_ptr", "weight_scale_ptr", "out_ptr", "a_ptr",
             "a_scale_ptr", "out_scale_ptr", "in_features", "out_features", "value_row_stride",
             "weight_scale_stride", "padded_tokens"}


def _compile(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int):
    if ASTSource is None:
        pytest.skip("this Triton has no triton.compiler.ASTSource / GPUTarget")
    if type(kernel).__name__ == "InterpretedFunction":
        pytest.skip("the kernels were imported under TRITON_INTERPRET=1 (run these tests without it)")
    signature = dict(types)
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in DIVISIBLE}
    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    except TypeError as error:
        pytest.skip(f"ASTSource API differs in Triton {triton.__version__}: {error}")
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as error:
        if "ptxas" in str(error).lower() and "not found" in str(error).lower():
            pytest.skip(f"no ptxas: {error}")
        raise


def _ops(compiled) -> set[str]:
    return set(re.findall(r"ttg\.async_copy_global_to_local|ttng\.warp_group_dot|tt\.dot\b", compiled.asm["ttgir"]))


FUSED_TYPES = dict(hash_ids_ptr="*i32", value_ptr="*u8", scale_ptr="*u8", weight_ptr="*u8", weight_scale_ptr="*fp32",
                   out_ptr="*bf16", tokens="i32", local_columns="i32", stride_token="i32", stride_column="i32",
                   row_start="i64", num_rows="i32", value_row_stride="i32", scale_row_stride="i32",
                   in_features="i32", out_features="i32", weight_scale_stride="i32")
GEMM_TYPES = dict(a_ptr="*u8", a_scale_ptr="*fp32", weight_ptr="*u8", weight_scale_ptr="*fp32", out_ptr="*bf16",
                  tokens="i32", padded_tokens="i32", in_features="i32", out_features="i32", weight_scale_stride="i32")
QUANTIZE_TYPES = dict(hash_ids_ptr="*i32", value_ptr="*u8", scale_ptr="*u8", out_ptr="*u8", out_scale_ptr="*fp32",
                      tokens="i32", padded_tokens="i32", local_columns="i32", stride_token="i32", stride_column="i32",
                      row_start="i64", num_rows="i32", value_row_stride="i32", scale_row_stride="i32")


def _gpu_configs(fused: bool):
    return [wkv_gemm.default_gemm_config(tokens, fused=fused) for tokens in (1, 64, 8192)]


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "block_scaled"])
def test_gemm_kernels_compile_for_sm90_pipelined(fused, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    for config in _gpu_configs(fused):
        for ids_are_rows in ((False, True) if fused else (False,)):
            constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m,
                              BLOCK_N_W=128, BLOCK_K_W=128, SCALE_PER_TILE=128 % config.block_n == 0)
            if fused:
                constexprs = dict(HEAD_DIM=256, **constexprs, IDS_ARE_ROWS=ids_are_rows)
            kernel = wkv_kernels.fused_gather_gemm_kernel if fused else wkv_kernels.block_scaled_gemm_kernel
            compiled = _compile(kernel, FUSED_TYPES if fused else GEMM_TYPES, constexprs, config.num_warps,
                                config.num_stages)
            ops = _ops(compiled)
            assert "ttg.async_copy_global_to_local" in ops, (config, ops)
            if config.block_m >= 64:
                assert "ttng.warp_group_dot" in ops, (config, ops)


@pytest.mark.slow
def test_per_column_weight_scales_and_quantize_compile_for_sm90(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    constexprs = dict(HEAD_DIM=64, BLOCK_M=128, BLOCK_N=256, GROUP_M=8, BLOCK_N_W=128, BLOCK_K_W=128,
                      SCALE_PER_TILE=False, IDS_ARE_ROWS=False)
    assert "ttng.warp_group_dot" in _ops(_compile(wkv_kernels.fused_gather_gemm_kernel, FUSED_TYPES, constexprs, 8, 3))
    for ids_are_rows in (False, True):
        _compile(wkv_kernels.gather_quantize_kernel, QUANTIZE_TYPES,
                 dict(HEAD_DIM=256, BLOCK_T=32, IDS_ARE_ROWS=ids_are_rows), 4, 1)


SMALL_M_TYPES = dict(a_ptr="*u8", a_scale_ptr="*fp32", weight_ptr="*u8", weight_scale_ptr="*fp32", out_ptr="*fp32",
                     tokens="i32", padded_tokens="i32", in_features="i32", out_features="i32",
                     weight_scale_stride="i32", groups_per_split="i32")


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 64, 128])
def test_small_m_gemm_compiles_for_sm90_pipelined(tokens, monkeypatch):
    """The split-K GEMM's default shapes and a no-swap / per-column-scale / bf16-output variant
    stream both operands through the software pipeline into wgmma (its K offsets must stay
    visibly 128-aligned for that: a runtime split start of unknown alignment leaves the loads
    synchronous); the reduce kernel builds."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    default = wkv_gemm.default_small_m_config(tokens)
    block_m = wkv_gemm.small_m_block_m(tokens)
    for block_n, swap_ab, output, warps, stages in ((default.block_n, default.swap_ab, "partials", default.num_warps,
                                                     default.num_stages),
                                                    (64, False, "atomic", 4, 3), (256, True, "bf16", 8, 3)):
        types = dict(SMALL_M_TYPES, out_ptr="*bf16" if output == "bf16" else "*fp32")
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_N_W=128, BLOCK_K_W=128,
                          SCALE_PER_TILE=128 % block_n == 0, SWAP_AB=swap_ab, OUTPUT=output)
        ops = _ops(_compile(wkv_small_m_kernels.small_m_gemm_kernel, types, constexprs, warps, stages))
        assert "ttg.async_copy_global_to_local" in ops, (block_n, swap_ab, ops)
        if swap_ab or block_m >= 64:
            assert "ttng.warp_group_dot" in ops, (block_n, swap_ab, ops)
    _compile(wkv_small_m_kernels.split_k_reduce_kernel, dict(partial_ptr="*fp32", out_ptr="*bf16", splits="i32",
                                                             elements="i32"), dict(BLOCK=1024), 4, 1)
