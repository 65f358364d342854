"""Launch shapes of the layer's small kernels at decode sizes (issue 13: the layer at T = 64).

At T = 64 the FP8 layer is ``torch._scaled_mm`` (~58 us on the H200) plus the activation
quantize and the gate (~11 us together, graph-replayed). This sweeps the quantize kernel's
``(BLOCK_T, num_warps)`` and the gate's launch shape, timing the whole default layer (CUDA graph
replay, input sets spanning 4x the L2, as ``bench_layer.py``) and each kernel alone, at V4.1-Flash
shapes over a 20M-row table in HBM. Prints a table; ``--json PATH`` writes the results.

    PYTHONPATH=src python benchmarks/small_t_sweep.py [--tokens 1,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_layer  # noqa: E402
from bench_layer import COLUMNS, EPS, HC, HIDDEN, fp8_weight, input_sets, time_us  # noqa: E402

QUANTIZE_SHAPES = ((32, 4), (16, 4), (16, 2), (8, 2), (8, 1), (4, 1), (2, 1), (1, 1))
GATE_SHAPES = ((1, 8, False), (1, 4, False), (1, 16, False), (1, 8, True), (2, 8, False), (4, 16, False))


def main() -> None:
    from engram.layer import Engram, WkvProjection, gate
    from engram.layer import wkv_gemm
    from engram.table import EngramTable
    from gather_bench import big_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(29)
    weight, weight_scale = fp8_weight(generator)
    q_weight, k_weight = (torch.randn(2, HC, HIDDEN, device="cuda", generator=generator)).to(torch.bfloat16)
    table_rows = 20_000_000
    values, scales = big_table(table_rows, bench_layer.HEAD_DIM)
    table = EngramTable(values, scales, placement="device", validate=False)
    wkv = WkvProjection(weight, weight_scale.view(torch.float8_e8m0fnu), [128, 128])
    layer = Engram(table, wkv, q_weight, k_weight, eps=EPS, num_columns=COLUMNS)
    print(f"{torch.cuda.get_device_name()}: wkv backend {wkv.backend}", flush=True)
    original_quantize, original_gate = wkv_gemm.quantize_launch_shape, gate.gate_launch_config

    def use(quantize_shape, gate_shape):
        wkv_gemm.quantize_launch_shape = lambda tokens: quantize_shape
        copies, warps, early = gate_shape
        gate.gate_launch_config = lambda tokens, hc, hidden: gate.GateLaunchConfig(copies, warps, early)
        wkv_gemm._QUANTIZE_PLANS.clear()
        gate._KV_PLANS.clear()
        layer._checked_calls.clear()

    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        sets = input_sets(tokens, table_rows, values, scales, generator)
        calls = [lambda s=s: layer(s["hidden"], s["ids"], s["mask"]) for s in sets]
        use(QUANTIZE_SHAPES[0], GATE_SHAPES[0])
        reference = [call() for call in calls]
        first = sets[0]
        kv = wkv.forward_fp8_rows(values, scales, first["ids"])
        for quantize_shape in QUANTIZE_SHAPES:
            use(quantize_shape, GATE_SHAPES[0])
            assert all(torch.equal(call(), expected) for call, expected in zip(calls, reference)), quantize_shape
            row = {"T": tokens, "quantize": list(quantize_shape), "gate": list(GATE_SHAPES[0]),
                   "layer_us": time_us(calls, graph=True),
                   "quantize_us": time_us([lambda: wkv_gemm.quantize_gathered_rows(values, scales, first["ids"])],
                                          graph=True)}
            rows.append(row)
            print(row, flush=True)
        for gate_shape in GATE_SHAPES[1:]:
            use(QUANTIZE_SHAPES[0], gate_shape)
            # Other warp counts sum the gate's dot products in another order: equal within rounding.
            for call, expected in zip(calls, reference):
                torch.testing.assert_close(call(), expected, rtol=2 ** -7, atol=2 ** -7, msg=str(gate_shape))
            gate_call = lambda: gate.engram_gate_kv(first["hidden"], kv, q_weight, k_weight, EPS,  # noqa: E731
                                                    first["mask"])
            row = {"T": tokens, "quantize": list(QUANTIZE_SHAPES[0]), "gate": list(gate_shape),
                   "layer_us": time_us(calls, graph=True), "gate_us": time_us([gate_call], graph=True)}
            rows.append(row)
            print(row, flush=True)
    wkv_gemm.quantize_launch_shape, gate.gate_launch_config = original_quantize, original_gate
    print(f"{'T':>5} {'quantize':>10} {'gate':>14} {'layer us':>9} {'kernel us':>9}")
    for row in rows:
        kernel = row.get("quantize_us", row.get("gate_us"))
        print(f"{row['T']:>5} {str(tuple(row['quantize'])):>10} {str(tuple(row['gate'])):>14} "
              f"{row['layer_us']:>9.1f} {kernel:>9.1f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
