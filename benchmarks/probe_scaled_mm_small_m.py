"""Forms of the block-scaled FP8 wkv GEMM at decode sizes (issue 13: the layer at T = 64 needs ~2 us).

``torch._scaled_mm`` with 1 x 128 activation / 128 x 128 weight scales streams the 157 MB FP8 weight
at ~2.7 TB/s at M = 64 on the H200 (57.5 us; floor 37 us at 4.3 TB/s). This times, at V4.1-Flash
shapes (K = 6144, N = 25600), CUDA-graph replayed, forms that might make cuBLAS pick another kernel:

* ``as_is``: the library's call (``scaled_mm_gemm``);
* ``fast_accum``: the same with ``use_fast_accum=True`` (where the build takes it with block scales);
* ``swapped``: ``kv^T = W @ a^T`` (weight as the first operand, 128 x 128 scales as ``scale_a``, the
  activations' 1 x 128 scales as ``scale_b``), several scale layouts tried, then with the transpose
  back to ``[T, N]`` that the gate needs;
* ``rows_128``: the activations padded to 128 rows.

Each form that runs is checked against ``as_is`` (within bf16 rounding) before it is timed.

    PYTHONPATH=src python benchmarks/probe_scaled_mm_small_m.py [--tokens 1,64,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layer import IN_FEATURES, scaled_mm_weight, time_us  # noqa: E402


def main() -> None:
    from engram.layer import wkv_gemm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,128")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(31)
    weight, weight_scale, layout, note = scaled_mm_weight(generator)  # weight_scale fp32 [N / 128, K / 128]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {note}", flush=True)
    if layout is None:
        return
    weight_scale_t = wkv_gemm.scaled_mm_weight_scale(weight_scale, layout)
    weight_t = weight.t()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        padded = wkv_gemm.padded_tokens(tokens)
        a = (torch.randn(padded, IN_FEATURES, device=device, generator=generator) * 8).to(torch.float8_e4m3fn)
        a_scale = torch.exp2(torch.randint(-6, 2, (IN_FEATURES // 128, padded), device=device,
                                           generator=generator).float()).t()  # [padded, K / 128], column-major
        expected = wkv_gemm.scaled_mm_gemm(a, a_scale, tokens, weight, weight_scale_t)
        forms = {"as_is": lambda: wkv_gemm.scaled_mm_gemm(a, a_scale, tokens, weight, weight_scale_t)}
        forms["fast_accum"] = lambda: torch._scaled_mm(a, weight_t, scale_a=a_scale, scale_b=weight_scale_t,
                                                        out_dtype=torch.bfloat16, use_fast_accum=True)[:tokens]
        a128 = torch.zeros(max(128, padded), IN_FEATURES, dtype=torch.float8_e4m3fn, device=device)
        a128[:padded] = a
        scale128 = torch.ones(IN_FEATURES // 128, a128.shape[0], device=device)
        scale128[:, :padded] = a_scale.t()
        scale128 = scale128.t()
        forms["rows_128"] = lambda: torch._scaled_mm(a128, weight_t, scale_a=scale128, scale_b=weight_scale_t,
                                                      out_dtype=torch.bfloat16)[:tokens]
        weight_scale_forms = {"w_rowmajor": weight_scale.contiguous(),
                              "w_colmajor": weight_scale.t().contiguous().t(),
                              "w_padded_view": weight_scale_t.t()}
        act_scale_forms = {"a_rowmajor": a_scale.t().contiguous(),  # [K / 128, padded]
                           "a_colmajor": a_scale.t().contiguous().t().contiguous().t()}
        for weight_name, scale_w in weight_scale_forms.items():
            for act_name, scale_act in act_scale_forms.items():
                name = f"swapped_{weight_name}_{act_name}"
                forms[name] = (lambda scale_w=scale_w, scale_act=scale_act:
                               torch._scaled_mm(weight, a.t(), scale_a=scale_w, scale_b=scale_act,
                                                out_dtype=torch.bfloat16)[:, :tokens].t())
                forms[name + "_transposed_back"] = (lambda scale_w=scale_w, scale_act=scale_act:
                                                    torch._scaled_mm(weight, a.t(), scale_a=scale_w, scale_b=scale_act,
                                                                     out_dtype=torch.bfloat16)[:, :tokens].t().contiguous())
        for name, form in forms.items():
            row = {"T": tokens, "form": name}
            try:
                found = form()
                torch.cuda.synchronize()
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                print(row, flush=True)
                rows.append(row)
                continue
            difference = (found.float() - expected.float()).abs().max().item()
            largest = expected.float().abs().max().item()
            row["max_rel_difference"] = difference / max(largest, 1e-30)
            if row["max_rel_difference"] > 2 ** -6:
                row["error"] = "differs from as_is"
            else:
                row["us"] = time_us([form], graph=True)
                row["weight_TBps"] = weight.numel() / row["us"] / 1e6
            print(row, flush=True)
            rows.append(row)
    print(f"\n{'T':>5} {'form':50} {'us':>8} {'TB/s':>6}")
    for row in rows:
        if "us" in row:
            print(f"{row['T']:>5} {row['form']:50} {row['us']:8.1f} {row['weight_TBps']:6.2f}")
        else:
            print(f"{row['T']:>5} {row['form']:50} {row.get('error', '')[:60]}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
