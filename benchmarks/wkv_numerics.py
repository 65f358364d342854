"""Numerics of the wkv paths (issue 13) on the CPU: each path's roundings emulated exactly in
torch at V4.1-Flash shapes (K = 24 x 256, N = 5 x 5120), against the float64 reference
(``engram.layer.reference``), on hash ids of real English text.

* bf16 path: bf16 rows (exact) x the bf16 copy of the FP8 weight (exact), fp32 accumulation,
  kv rounded to bf16 (torch's CPU bf16 linear: the library's CPU path);
* path (a): rows re-quantized to E4M3 per 1 x 128 group with a power-of-two scale
  (``reference_quantize_activations``: bit-identical to the Triton kernel, tested), then the
  exact product of those values and the weight accumulated in fp32, kv rounded to bf16;
* path (b): the table's exact values and the weight, fp32 accumulation, kv rounded to bf16.

Each kv then goes through the torch gate (fp32 math, one rounding of ``out`` to bf16). Reported:
relative error of kv and of the update ``out - h`` (Frobenius norms over live tokens), per path
and ratio to the bf16 path. The GPU's own accumulation order (cuBLAS, the tensor core's 32- or
128-deep partial sums) differs from the CPU's; ``bench_layer.py`` measures the same errors on
the H200.

Tables: rows are i.i.d. random (a real table is 101 GB; the real-text ids decide which rows
repeat), quantized with the table codec, in two models: ``normal`` (N(0, 1) values: the 32-value
blocks of a row differ by about one binade) and ``spread`` (each 32-value block scaled by
2**-4 .. 2**2, the synthetic checkpoint's model: up to 6 binades within a 128-group, the hard
case for re-quantization). Weight: N(0, 1 / K) quantized to E4M3 with 128 x 128 UE8M0 blocks.

    PYTHONPATH=src python benchmarks/wkv_numerics.py [--tokens 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engram.layer import engram_gate_torch, reference_gate, split_kv  # noqa: E402
from engram.layer.reference import (  # noqa: E402
    reference_dequantize_activations,
    reference_dequantize_wkv,
    reference_exact_rows,
    reference_quantize_activations,
)
from engram.table import quantize_rows  # noqa: E402

HIDDEN, HC, COLUMNS, HEAD_DIM = 5120, 4, 24, 256
EPS = 1e-6


def real_text_ids(tokens: int, layer_index: int = 0) -> torch.Tensor:
    """int64 ``[T, C]`` hash ids of the first Engram layer for ``tokens`` tokens of real English
    text (the packaged V4.1-Flash config, the DeepSeek-V4 tokenizer)."""
    import numpy as np
    from tokenizers import Tokenizer

    import engram
    from engram.tools.corpus import english_texts
    from engram.tools.demo import default_tokenizer_path, packaged_config

    spec = engram.EngramSpec.from_hf_config(packaged_config())
    layout = engram.EngramLayout(spec)
    tokenizer_file = default_tokenizer_path()
    vocab = engram.TokenCompressor.from_tokenizer(str(tokenizer_file), spec=spec)
    raw = Tokenizer.from_file(str(tokenizer_file))
    ids = []
    for _, text in english_texts(max_texts=8):
        token_ids = np.array(raw.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        ids.append(torch.from_numpy(np.asarray(engram.hash_ngrams(token_ids, layout, vocab)))[:, layer_index])
        if sum(len(i) for i in ids) >= tokens:
            break
    return torch.cat(ids)[:tokens]


def table_rows(ids: torch.Tensor, model: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows ``(values e4m3 [T, C, D], scales uint8 [T, C, D / 32])`` of the ids: one random row
    per distinct id (repeated ids read the same row)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    dense = torch.randn(unique.numel(), HEAD_DIM // 32, 32, generator=generator)
    if model == "spread":
        dense = dense * torch.exp2(torch.randint(-4, 3, (unique.numel(), HEAD_DIM // 32, 1), generator=generator).float())
    values, scales = quantize_rows(dense.reshape(unique.numel(), HEAD_DIM))
    return values[inverse], scales[inverse]


def fp8_weight(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight e4m3 [N, K], scale uint8 [N / 128, K / 128])``: N(0, 1 / K) per 128 x 128 block rule."""
    out_features, in_features = (HC + 1) * HIDDEN, COLUMNS * HEAD_DIM
    dense = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    amax = dense.reshape(out_features // 128, 128, in_features // 128, 128).abs().amax(dim=(1, 3))
    mantissa, exponent = torch.frexp(amax)
    scale = (exponent - 9 + (mantissa > 0.875).to(exponent.dtype) + 127).to(torch.uint8)
    factors = torch.exp2(scale.float() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
    weight = (dense / factors).to(torch.float8_e4m3fn)
    return weight, scale


def fp32_scale_requantize(exact: torch.Tensor) -> torch.Tensor:
    """float64 ``[T, K]``: the common engine recipe, for comparison (not a path of this library):
    per 1 x 128 group ``s = fp32(amax / 448)`` (not a power of two), ``e4m3(x / s) * s``."""
    tokens, in_features = exact.shape
    groups = exact.reshape(tokens, in_features // 128, 128).float()
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).double().reshape(tokens, in_features)


def run(tokens: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    started = time.time()
    ids = real_text_ids(tokens)
    weight, weight_scale = fp8_weight(generator)
    weight64 = reference_dequantize_wkv(weight, weight_scale, (128, 128))        # exact
    weight32 = weight64.float()                                                  # exact
    weight_bf16 = weight64.to(torch.bfloat16)                                    # exact (E4M3 x 2**k)
    q_weight = torch.randn(HC, HIDDEN, generator=generator).to(torch.bfloat16)
    k_weight = torch.randn(HC, HIDDEN, generator=generator).to(torch.bfloat16)
    hidden = torch.randn(tokens, HC, HIDDEN, generator=generator).to(torch.bfloat16)
    mask = torch.ones(tokens, dtype=torch.bool)
    report = {"tokens": tokens, "distinct_rows": int(torch.unique(ids).numel()), "seed": seed, "models": {}}
    for model in ("normal", "spread"):
        values, scales = table_rows(ids, model, generator)
        exact = reference_exact_rows(values, scales).reshape(tokens, -1)          # float64 [T, K]
        kv64 = exact @ weight64.T
        key64, value64 = split_kv(kv64, HC)
        out64 = reference_gate(hidden, key64, value64, q_weight, k_weight, EPS, mask)
        update64 = out64 - hidden.double()
        requantized = reference_dequantize_activations(*reference_quantize_activations(exact))
        engine_recipe = fp32_scale_requantize(exact)
        kvs = {
            "bf16": torch.nn.functional.linear(exact.to(torch.bfloat16), weight_bf16),
            "a (re-quantized 1x128)": (requantized.float() @ weight32.T).to(torch.bfloat16),
            "b (fused, exact rows)": (exact.float() @ weight32.T).to(torch.bfloat16),
            "a' (fp32 scale amax/448)": (engine_recipe.float() @ weight32.T).to(torch.bfloat16),
        }
        rows = {"requantization_error": float((requantized - exact).norm() / exact.norm()),
                "requantized_values_changed": float((requantized != exact).double().mean())}
        for name, kv in kvs.items():
            key, value = split_kv(kv, HC)
            out = engram_gate_torch(hidden, key, value, q_weight, k_weight, EPS, mask)
            rows[name] = {
                "kv_rel_error": float((kv.double() - kv64).norm() / kv64.norm()),
                "update_rel_error": float(((out.double() - hidden.double()) - update64).norm() / update64.norm()),
            }
        for name in kvs:
            rows[name]["update_error_vs_bf16"] = rows[name]["update_rel_error"] / rows["bf16"]["update_rel_error"]
            rows[name]["kv_error_vs_bf16"] = rows[name]["kv_rel_error"] / rows["bf16"]["kv_rel_error"]
        report["models"][model] = rows
        print(f"{model}: done in {time.time() - started:.0f} s", flush=True)
    return report


def print_table(report: dict) -> None:
    print(f"\nT = {report['tokens']} real-text tokens ({report['distinct_rows']} distinct rows of layer 1), "
          f"V4.1 shapes; relative errors against float64")
    print(f"{'table':8} {'path':26} {'kv error':>10} {'x bf16':>7} {'update error':>13} {'x bf16':>7}")
    for model, rows in report["models"].items():
        for name in ("bf16", "a (re-quantized 1x128)", "b (fused, exact rows)", "a' (fp32 scale amax/448)"):
            row = rows[name]
            print(f"{model:8} {name:26} {row['kv_rel_error']:10.3e} {row['kv_error_vs_bf16']:7.2f} "
                  f"{row['update_rel_error']:13.3e} {row['update_error_vs_bf16']:7.2f}")
        print(f"{model:8} re-quantization alone: rows relative error {rows['requantization_error']:.3e}, "
              f"{100 * rows['requantized_values_changed']:.2f}% of values changed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "wkv-numerics-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = run(args.tokens, args.seed)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print_table(report)


if __name__ == "__main__":
    main()
