"""Is cuBLAS's block-scaled FP8 GEMM at decode size held back by how its tiles fill the 132 SMs?
(issue 13: the layer at T = 64 is ~1 us over its 65 us target, and ``torch._scaled_mm`` streams the
157 MB weight at ~2.8 TB/s where HBM gives ~4.3)

If each output tile is one program and N / tile width is not a multiple of the SM count, the last
wave runs part-empty. This times, CUDA-graph replayed, activations 128 rows (T = 64 padded):

* ``N=...``: the GEMM over the first N weight rows, for N from one wave of 128-wide tiles upward
  (time against N shows the steps if tiles quantize);
* ``split_n_2streams``: two half-N GEMMs on two streams at once (tiles of both fill the SMs together);
* ``split_k_2streams_fp32``: two half-K GEMMs with fp32 outputs on two streams, added and rounded to
  bf16 (split-K by hand; the sum is one extra launch), where the build takes fp32 output.

    PYTHONPATH=src python benchmarks/probe_scaled_mm_split.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layer import IN_FEATURES, OUT_FEATURES, scaled_mm_weight, time_us  # noqa: E402


def two_streams(first, second):
    """``first`` on the current stream and ``second`` on a side stream at once, joined after."""
    side = torch.cuda.Stream()

    def call():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            second_result = second()
        first_result = first()
        main.wait_stream(side)
        return first_result, second_result
    return call


def main() -> None:
    from engram.layer import wkv_gemm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(43)
    weight, weight_scale, layout, note = scaled_mm_weight(generator)  # weight_scale fp32 [N / 128, K / 128]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}: {note}",
          flush=True)
    if layout is None:
        return
    tokens, padded = args.tokens, wkv_gemm.padded_tokens(args.tokens)
    a = (torch.randn(padded, IN_FEATURES, device=device, generator=generator) * 8).to(torch.float8_e4m3fn)
    a_scale = torch.exp2(torch.randint(-6, 2, (IN_FEATURES // 128, padded), device=device,
                                       generator=generator).float()).t()  # [padded, K / 128] column-major
    rows = {}

    def record(name, call, weight_bytes):
        try:
            call()
            torch.cuda.synchronize()
        except (RuntimeError, TypeError, ValueError) as error:
            rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            print(f"{name:40s} {rows[name]['error']}", flush=True)
            return
        us = time_us([call], graph=True)
        rows[name] = {"us": us, "weight_TBps": weight_bytes / us / 1e6}
        print(f"{name:40s} {us:8.2f} us {rows[name]['weight_TBps']:6.2f} TB/s", flush=True)

    def gemm_over(n_rows, k_begin=0, k_end=IN_FEATURES, out_dtype=torch.bfloat16, n_begin=0):
        w = weight[n_begin:n_begin + n_rows, k_begin:k_end]
        w_scale = weight_scale[n_begin // 128:(n_begin + n_rows) // 128, k_begin // 128:k_end // 128]
        w_scale_t = wkv_gemm.scaled_mm_weight_scale(w_scale.contiguous(), layout)
        a_part = a[:, k_begin:k_end]
        if k_begin or k_end != IN_FEATURES:
            a_part = a_part.contiguous()
        a_scale_part = a_scale[:, k_begin // 128:k_end // 128].t().contiguous().t()
        w_t = w.t() if not (k_begin or k_end != IN_FEATURES) else w.contiguous().t()
        return lambda: torch._scaled_mm(a_part, w_t, scale_a=a_scale_part, scale_b=w_scale_t,
                                        out_dtype=out_dtype)[:tokens]

    for n in sorted({sms * 64, sms * 128, 12800, 19200, sms * 128 + 128, OUT_FEATURES, 2 * sms * 128}):
        n = min(n, OUT_FEATURES) // 128 * 128
        if f"N={n}" not in rows:
            record(f"N={n}", gemm_over(n), n * IN_FEATURES)
    half_n = OUT_FEATURES // 2 // 128 * 128
    record("split_n_2streams", two_streams(gemm_over(half_n), gemm_over(OUT_FEATURES - half_n, n_begin=half_n)),
           OUT_FEATURES * IN_FEATURES)
    half_k = IN_FEATURES // 2 // 128 * 128
    first = gemm_over(OUT_FEATURES, 0, half_k, torch.float32)
    second = gemm_over(OUT_FEATURES, half_k, IN_FEATURES, torch.float32)
    pair = two_streams(first, second)
    record("split_k_2streams_fp32_no_sum", pair, OUT_FEATURES * IN_FEATURES)
    record("split_k_2streams_fp32", lambda: (lambda p: (p[0] + p[1]).to(torch.bfloat16))(pair()),
           OUT_FEATURES * IN_FEATURES)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "triton": triton.__version__, "tokens": tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
