"""Whole-layer benchmark on one GPU, one call: lookup + wkv + gate of one Engram
layer at V4.1-Flash shapes for the bf16 wkv, path (a) (re-quantized rows, block-scaled FP8
GEMM) and path (b) (fused gather-GEMM), at T in {1, 64, 1024, 8192, 32768}, with the bf16 GEMM
and ``torch._scaled_mm`` alone as references; ``a_small_m`` is path (a) with the split-K GEMM
for T <= 128 (``WkvProjection(small_m=True)``, key ``layer_small_m_T64_us``).

Each layer is the library's :class:`engram.layer.Engram` module over a full-size device table
(384,006,168 rows, ~101 GB, ``kernels_gather.big_table``; a smaller one if that does not fit) and
one FP8 ``wkv`` ([25600, 6144], 128 x 128 UE8M0 blocks, values N(0, 1 / K)). Times are
``triton.testing.do_bench`` medians (it clears the L2 before every call) of CUDA-graph replays
(one graph per input set; eager medians beside them), cycling through input sets that together
span at least 4x the L2 (beyond the weights, which are 3-6x the L2 themselves). Stage outputs
are poisoned (NaN) and checked once before timing; each path's layer output is checked against
the float64 reference on the GPU (update ``out - h`` relative error). Any failure of a path is
recorded in the JSON (``errors``) and the run goes on.

Prints a table (median us, GEMM TFLOP/s and its share of the bf16 GEMM ceiling measured in the
same run, ratio to the bf16 layer) and writes ``layer-h200.json`` to ``$OUT`` (else
benchmarks/results/), with ``layer_T8192_us`` and ``layer_T64_us`` (the default GPU path, graph
replay), ``layer_bf16_T8192_us`` and ``wkv_bytes_per_layer``.

    PYTHONPATH=src ENGRAM_COMMIT=$(git rev-parse HEAD) python benchmarks/layer/bench_layer.py [--tokens 1,64,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]
sys.path.insert(0, str(BENCHMARKS / "kernels"))  # kernels_gather

TOKEN_COUNTS = (1, 64, 1024, 8192, 32768)
HIDDEN, HC, COLUMNS, HEAD_DIM = 5120, 4, 24, 256
IN_FEATURES, OUT_FEATURES = COLUMNS * HEAD_DIM, (HC + 1) * HIDDEN
EPS = 1e-6
PATHS = ("bf16", "a_scaled_mm", "a_triton", "b_fused", "a_small_m")
BACKENDS = {"bf16": "bf16", "a_scaled_mm": "scaled_mm", "a_triton": "triton", "b_fused": "fused"}
# "a_small_m": path (a) with the split-K GEMM for T <= 128 (wkv_gemm.small_m_gemm), torch._scaled_mm
# above where the build has it (else the Triton block-scaled GEMM): WkvProjection(small_m=True).
L2_FALLBACK = 60 * 2 ** 20
# tests/benchmarks/test_bench_layer.py runs the whole script on the CPU (interpreter) at a small geometry
DEVICE = "cuda"


def _l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


class Recorder:
    """Collects results and errors; ``attempt`` runs a step and records a failure instead of raising."""

    def __init__(self):
        self.errors: list[dict] = []

    def attempt(self, what: str, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a failed path must not stop the others
            print(f"FAILED {what}: {_error_text(error)}", flush=True)
            traceback.print_exc(limit=3)
            self.errors.append({"what": what, "error": _error_text(error)})
            try:  # a sticky CUDA error makes these fail too; the later steps then record their own
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as sticky:  # noqa: BLE001
                print(f"after {what}: {_error_text(sticky)}", flush=True)
            return None


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------
def fp8_weight(generator: torch.Generator, out_features: int | None = None, in_features: int | None = None,
               device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight float8_e4m3fn [N, K], scale uint8 [N / 128, K / 128])`` on ``device`` (default the
    benchmark's GPU; N, K default V4.1's wkv, multiples of 128): N(0, 1 / K) quantized per 128 x 128
    block with power-of-two (UE8M0) scales."""
    out_features = OUT_FEATURES if out_features is None else out_features
    in_features = IN_FEATURES if in_features is None else in_features
    dense = torch.randn(out_features, in_features, device=DEVICE if device is None else device,
                        generator=generator) / in_features ** 0.5
    amax = dense.reshape(out_features // 128, 128, in_features // 128, 128).abs().amax(dim=(1, 3))
    mantissa, exponent = torch.frexp(amax)
    scale = (exponent - 9 + (mantissa > 0.875).to(exponent.dtype) + 127).to(torch.uint8)
    factors = torch.exp2(scale.float() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
    weight = (dense / factors).to(torch.float8_e4m3fn)
    del dense, factors
    return weight, scale


def scaled_mm_weight(generator: torch.Generator):
    """``(weight float8_e4m3fn [N, K], weight_scale fp32 [N / 128, K / 128], layout, note)``: the
    :func:`fp8_weight` with its scales as fp32 factors, and what ``probe_scaled_mm_blockwise`` found
    (``layout`` None where this build has no block-scaled ``torch._scaled_mm``)."""
    from engram.layer.wkv_gemm import probe_scaled_mm_blockwise

    weight, scale_bytes = fp8_weight(generator)
    layout, note = probe_scaled_mm_blockwise(weight.device, IN_FEATURES, OUT_FEATURES)
    return weight, torch.exp2(scale_bytes.float() - 127), layout, note


def make_table(recorder: Recorder):
    """The full-size V4.1 table in HBM (rows filled where ids land), or a smaller one if it does not fit."""
    from kernels_gather import V41_TABLE_ROWS, big_table

    for rows in (V41_TABLE_ROWS, 100_000_000, 20_000_000):
        try:
            values, scales = big_table(rows, HEAD_DIM)
            return values, scales, rows
        except torch.cuda.OutOfMemoryError as error:
            recorder.errors.append({"what": f"table of {rows} rows", "error": _error_text(error)})
            torch.cuda.empty_cache()
    raise RuntimeError("no table fits")


def fill_rows(values, scales, ids: torch.Tensor, generator: torch.Generator) -> None:
    """Rows the ids name get table-like bytes: N(0, 1) blocks of 32 quantized by the table codec."""
    from engram.table import quantize_rows

    rows = torch.unique(ids.reshape(-1).long())
    for first in range(0, rows.numel(), 1 << 20):
        chunk = rows[first:first + (1 << 20)]
        q_values, q_scales = quantize_rows(torch.randn(chunk.numel(), HEAD_DIM, device=DEVICE, generator=generator))
        values[chunk] = q_values.view(torch.uint8)
        scales[chunk] = q_scales


def input_sets(tokens: int, table_rows: int, values, scales, generator) -> list[dict]:
    """Input sets (ids as the ``[:, 0]`` view of a ``[T, 2, C]`` int32 tensor, hidden states, mask),
    enough to span 4x the L2 (at most 4)."""
    per_set = tokens * (COLUMNS * (4 + HEAD_DIM + HEAD_DIM // 32) + HC * HIDDEN * 2 * 2 + OUT_FEATURES * 2)
    count = max(1, min(4, math.ceil(4 * _l2_bytes() / per_set)))
    sets = []
    for _ in range(count):
        ids = torch.randint(0, table_rows, (tokens, 2, COLUMNS), device=DEVICE, generator=generator).to(torch.int32)
        fill_rows(values, scales, ids[:, 0], generator)
        sets.append({
            "ids": ids[:, 0],
            "hidden": (torch.randn(tokens, HC, HIDDEN, device=DEVICE, generator=generator) * 2).to(torch.bfloat16),
            "mask": torch.rand(tokens, device=DEVICE, generator=generator) > 0.05,
        })
    return sets


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
def _graph_replays(calls: list):
    """Each call captured in its own CUDA graph (after one warm-up run on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)
    return graphs


def time_us(calls: list, *, graph: bool, rep_ms: int = 200) -> float:
    """Median microseconds of one call, cycling through ``calls``; ``graph``: CUDA-graph replays."""
    graphs = _graph_replays(calls) if graph else None
    functions = [g.replay for g in graphs] if graph else calls
    state = [0]

    def step():
        functions[state[0] % len(functions)]()
        state[0] += 1

    try:
        return 1e3 * triton.testing.do_bench(step, warmup=25, rep=rep_ms, return_mode="median")
    finally:
        del graphs
        torch.cuda.empty_cache()


def gemm_tflops(tokens: int, us: float) -> float:
    return 2 * tokens * IN_FEATURES * OUT_FEATURES / (us * 1e-6) / 1e12


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------
def build_layers(table, weight, weight_scale, q_weight, k_weight, recorder: Recorder) -> dict:
    from engram.layer import Engram, WkvProjection

    from engram.layer.wkv_gemm import probe_scaled_mm_blockwise

    layers = {}
    for path in ("default",) + PATHS:
        options = {"backend": None if path == "default" else BACKENDS.get(path)}
        if path == "a_small_m":
            has_scaled_mm = probe_scaled_mm_blockwise(weight.device, IN_FEATURES, OUT_FEATURES)[0] is not None
            options = {"backend": "scaled_mm" if has_scaled_mm else "triton", "small_m": True}
        wkv = recorder.attempt(f"build {path}", WkvProjection, weight, weight_scale.view(torch.float8_e8m0fnu),
                               [128, 128], **options)
        if wkv is not None:
            layers[path] = Engram(table, wkv, q_weight, k_weight, eps=EPS, num_columns=COLUMNS)
            print(f"layer {path}: backend {wkv.backend} {wkv.backend_note}, wkv {wkv.weight_nbytes / 1e6:.1f} MB",
                  flush=True)
    return layers


def check_numerics(layers: dict, values, scales, sets: list, weight64: torch.Tensor, q_weight, k_weight) -> dict:
    """Update ``out - h`` relative error of each path against float64, on the first input set."""
    from engram.layer import reference_gate, split_kv
    from engram.layer.reference import reference_exact_rows

    inputs = sets[0]
    local = inputs["ids"].long()
    exact = reference_exact_rows(values[local], scales[local]).reshape(local.shape[0], -1)
    key, value = split_kv(exact @ weight64.T, HC)
    reference = reference_gate(inputs["hidden"], key, value, q_weight, k_weight, EPS, inputs["mask"])
    update64 = reference - inputs["hidden"].double()
    errors = {}
    for path, layer in layers.items():
        out = layer(inputs["hidden"], inputs["ids"], inputs["mask"])
        if bool(torch.isnan(out).any()):
            raise RuntimeError(f"{path}: NaN in the layer output")
        update = out.double() - inputs["hidden"].double()
        errors[path] = float((update - update64).norm() / update64.norm())
    return errors


def run_numerics(layers, values, scales, table_rows, weight, weight_scale, q_weight, k_weight, generator,
                 tokens: int = 256) -> dict:
    """Update errors of every path against float64 at ``tokens`` tokens (random ids)."""
    from engram.layer.reference import reference_dequantize_wkv

    sets = input_sets(tokens, table_rows, values, scales, generator)[:1]
    weight64 = reference_dequantize_wkv(weight, weight_scale, (128, 128))
    try:
        errors = check_numerics(layers, values, scales, sets, weight64, q_weight, k_weight)
    finally:
        del weight64
        torch.cuda.empty_cache()
    bf16 = errors.get("bf16")
    return {"T": tokens, **errors, **({f"{k}_vs_bf16": v / bf16 for k, v in errors.items()} if bf16 else {})}


def stage_calls(layers: dict, values, scales, inputs: dict, weight, weight_scale_padded, weight_bf16):
    """Stand-alone stages with poisoned, checked outputs; returns ``{name: call}`` for timing."""
    from engram.layer import engram_gate_kv
    from engram.layer.wkv_gemm import (SMALL_M_MAX_TOKENS, block_scaled_gemm, fused_gather_gemm,
                                       quantize_gathered_rows, scaled_mm_gemm, small_m_gemm)
    from engram.table.kernels.gather import gather_rows

    ids, tokens = inputs["ids"], inputs["ids"].shape[0]
    rows = gather_rows(values, scales, ids, out=torch.full((tokens, COLUMNS, HEAD_DIM), float("nan"),
                                                            dtype=torch.bfloat16, device=DEVICE))
    a, a_scale = quantize_gathered_rows(values, scales, ids)
    padded_scale = weight_scale_padded
    kv = torch.full((tokens, OUT_FEATURES), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fused_gather_gemm(values, scales, ids, weight, padded_scale, (128, 128), out=kv)
    gate_out = torch.full_like(inputs["hidden"], float("nan"))
    engram_gate_kv(inputs["hidden"], kv, layers_q(layers), layers_k(layers), EPS, inputs["mask"], out=gate_out)
    for name, tensor in (("gather", rows), ("fused kv", kv), ("gate", gate_out)):
        if bool(torch.isnan(tensor).any()):
            raise RuntimeError(f"stage {name} left NaN (unwritten) outputs")
    flat_rows = rows.reshape(tokens, -1)
    calls = {
        "gather_bf16": lambda: gather_rows(values, scales, ids),
        "gather_quantize": lambda: quantize_gathered_rows(values, scales, ids),
        "gemm_bf16": lambda: torch.nn.functional.linear(flat_rows, weight_bf16),
        "gemm_fused": lambda: fused_gather_gemm(values, scales, ids, weight, padded_scale, (128, 128)),
        "gemm_triton_block_scaled": lambda: block_scaled_gemm(a, a_scale, tokens, weight, padded_scale, (128, 128)),
        "gate": lambda: engram_gate_kv(inputs["hidden"], kv, layers_q(layers), layers_k(layers), EPS, inputs["mask"]),
    }
    if tokens <= SMALL_M_MAX_TOKENS:
        calls["gemm_small_m"] = lambda: small_m_gemm(a, a_scale, tokens, weight, padded_scale, (128, 128))
    if "a_scaled_mm" in layers:
        scale_t = layers["a_scaled_mm"].wkv.weight_scale_blocks.t()
        calls["gemm_scaled_mm"] = lambda: scaled_mm_gemm(a, a_scale, tokens, weight, scale_t)
    return calls


def layers_q(layers):
    return next(iter(layers.values())).q_weight


def layers_k(layers):
    return next(iter(layers.values())).k_weight


def sweep_fused(values, scales, inputs, weight, weight_scale, recorder) -> list[dict]:
    """The fused kernel's tile shapes at this T (GEMM alone, graph replays)."""
    from engram.layer.wkv_gemm import WkvGemmConfig, fused_gather_gemm

    tokens = inputs["ids"].shape[0]
    shapes = ([(16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4)] if tokens <= 64 else
              [(128, 128, 8, 4), (128, 128, 4, 4), (128, 128, 8, 6), (128, 256, 8, 3), (64, 128, 4, 5), (128, 64, 4, 5)])
    rows = []
    for block_m, block_n, warps, stages in shapes:
        config = WkvGemmConfig(block_m=block_m, block_n=block_n, group_m=8, num_warps=warps, num_stages=stages)
        us = recorder.attempt(f"fused sweep T={tokens} {config}", time_us,
                              [lambda c=config: fused_gather_gemm(values, scales, inputs["ids"], weight, weight_scale,
                                                                  (128, 128), config=c)], graph=True, rep_ms=100)
        if us is not None:
            rows.append({"T": tokens, "config": config.__dict__, "us": us, "TFLOPs": gemm_tflops(tokens, us)})
            print(f"  fused T={tokens} {block_m}x{block_n} w{warps} s{stages}: {us:.1f} us "
                  f"({gemm_tflops(tokens, us):.0f} TFLOP/s)", flush=True)
    return rows


def token_counts(text: str) -> list[int]:
    """``--tokens``: comma-separated positive token counts."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_counts, default=list(TOKEN_COUNTS),
                        help="token counts, comma-separated (default %(default)s)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the fused kernel's tile sweep")
    args = parser.parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device "
                     "(tests/benchmarks/test_bench_layer.py runs it on the CPU under the interpreter)")
    from engram.layer.reference import reference_dequantize_wkv
    from engram.table import EngramTable

    recorder = Recorder()
    generator = torch.Generator(device=DEVICE).manual_seed(13)
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    weight, weight_scale = fp8_weight(generator)
    q_weight = torch.randn(HC, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)
    k_weight = torch.randn(HC, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)
    weight64 = reference_dequantize_wkv(weight, weight_scale, (128, 128))
    weight_bf16 = weight64.to(torch.bfloat16)
    del weight64
    torch.cuda.empty_cache()

    # The bf16 GEMM ceiling of this run: the largest shape's rate.
    ceiling_rows = torch.randn(8192, IN_FEATURES, device=DEVICE, generator=generator).to(torch.bfloat16)
    ceiling_us = time_us([lambda: torch.nn.functional.linear(ceiling_rows, weight_bf16)], graph=False)
    ceiling = gemm_tflops(8192, ceiling_us)
    del ceiling_rows
    print(f"bf16 GEMM ceiling (8192 x {IN_FEATURES} x {OUT_FEATURES}): {ceiling_us:.0f} us, {ceiling:.0f} TFLOP/s",
          flush=True)

    values, scales, table_rows = make_table(recorder)
    table = EngramTable(values, scales, placement="cpu" if DEVICE == "cpu" else "device", validate=False,
                        check_values=False)  # rows no id reads are unfilled
    layers = build_layers(table, weight, weight_scale, q_weight, k_weight, recorder)
    weight_scale_padded = torch.exp2(weight_scale.float() - 127)   # [200, 48]: rows already a multiple of 4
    results, stages, sweeps = [], [], []
    numerics = recorder.attempt("numerics", run_numerics, layers, values, scales, table_rows, weight, weight_scale,
                                q_weight, k_weight, generator) or {}
    print(f"update relative error vs float64: {numerics}", flush=True)
    # At T = 256 a_small_m runs its T > 128 GEMM; its split-K GEMM's error is measured at T = 64.
    small_layers = {path: layers[path] for path in ("bf16", "default", "a_small_m") if path in layers}
    numerics_t64 = recorder.attempt("numerics T=64", run_numerics, small_layers, values, scales, table_rows, weight,
                                    weight_scale, q_weight, k_weight, generator, tokens=64) or {}
    print(f"update relative error vs float64 at T = 64: {numerics_t64}", flush=True)
    for tokens in args.tokens:
        sets = recorder.attempt(f"inputs T={tokens}", input_sets, tokens, table_rows, values, scales, generator)
        if sets is None:
            continue
        row = {"T": tokens, "input_sets": len(sets), "gemm_flop": 2 * tokens * IN_FEATURES * OUT_FEATURES}
        for path, layer in layers.items():
            calls = [lambda layer=layer, s=s: layer(s["hidden"], s["ids"], s["mask"]) for s in sets]
            graph_us = recorder.attempt(f"layer {path} T={tokens} graph", time_us, calls, graph=True)
            eager_us = recorder.attempt(f"layer {path} T={tokens} eager", time_us, calls, graph=False)
            row[f"{path}_us"], row[f"{path}_eager_us"] = graph_us, eager_us
            if graph_us is not None:
                print(f"T={tokens} layer {path}: {graph_us:.1f} us (eager {eager_us})", flush=True)
        results.append(row)
        calls = recorder.attempt(f"stages T={tokens}", stage_calls, layers, values, scales, sets[0], weight,
                                 weight_scale_padded, weight_bf16) or {}
        stage_row = {"T": tokens}
        for name, call in calls.items():
            stage_row[f"{name}_us"] = recorder.attempt(f"stage {name} T={tokens}", time_us, [call], graph=True)
        stages.append(stage_row)
        print(f"T={tokens} stages: " + ", ".join(f"{k} {v:.1f}" for k, v in stage_row.items()
                                                  if k != "T" and v is not None), flush=True)
        if not args.no_sweep and tokens in (64, 8192) and "b_fused" in layers:
            sweeps += sweep_fused(values, scales, sets[0], weight, weight_scale_padded, recorder)
        del sets, calls
        torch.cuda.empty_cache()

    default = layers.get("default")
    report = {
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "table_rows": table_rows, "bf16_gemm_ceiling_TFLOPs": ceiling, "bf16_gemm_ceiling_us": ceiling_us,
        "default_backend": default.wkv.backend if default else None,
        "default_backend_note": default.wkv.backend_note if default else None,
        "wkv_bytes_per_layer": default.wkv.weight_nbytes if default else None,
        "wkv_bytes_per_layer_bf16": layers["bf16"].wkv.weight_nbytes if "bf16" in layers else None,
        "layer": results, "stages": stages, "fused_sweep": sweeps, "update_rel_error": numerics,
        "update_rel_error_T64": numerics_t64,
        "errors": recorder.errors,
    }

    def pick(tokens, key):
        return next((r.get(key) for r in results if r["T"] == tokens), None)

    report.update({"layer_T8192_us": pick(8192, "default_us"), "layer_T64_us": pick(64, "default_us"),
                   "layer_bf16_T8192_us": pick(8192, "bf16_us"), "layer_small_m_T64_us": pick(64, "a_small_m_us")})
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "layer-h200.json").write_text(json.dumps(report, indent=2))
    print_table(report)


def print_table(report: dict) -> None:
    ceiling = report["bf16_gemm_ceiling_TFLOPs"]
    print(f"\nEngram layer (lookup + wkv + gate) on {report['device']} (torch {report['torch']}, Triton "
          f"{report['triton']}); bf16 GEMM ceiling {ceiling:.0f} TFLOP/s; default path "
          f"{report['default_backend']}; graph-replay medians")
    print(f"{'T':>6} {'path':12} {'us':>9} {'GEMM TFLOP/s':>13} {'% ceiling':>9} {'vs bf16':>8} {'eager us':>9}")
    for row in report["layer"]:
        base = row.get("bf16_us")
        for path in ("default",) + PATHS:
            us = row.get(f"{path}_us")
            if us is None:
                continue
            tflops = gemm_tflops(row["T"], us)
            ratio = f"{base / us:.2f}x" if base else "-"
            eager = row.get(f"{path}_eager_us")
            print(f"{row['T']:>6} {path:12} {us:9.1f} {tflops:13.0f} {100 * tflops / ceiling:8.0f}% {ratio:>8} "
                  f"{eager if eager is None else round(eager, 1)!s:>9}")
    print("\nstages alone (graph replay, us):")
    for row in report["stages"]:
        print(f"  T={row['T']}: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k != "T" and v is not None))
    print(f"\nupdate relative error vs float64: {report['update_rel_error']}")
    print(f"update relative error vs float64 at T = 64: {report['update_rel_error_T64']}")
    print(f"wkv bytes per layer: {report['wkv_bytes_per_layer']} (bf16: {report['wkv_bytes_per_layer_bf16']})")
    print(f"headline: layer_T8192_us {report['layer_T8192_us']}, layer_T64_us {report['layer_T64_us']}, "
          f"layer_bf16_T8192_us {report['layer_bf16_T8192_us']}, "
          f"layer_small_m_T64_us {report['layer_small_m_T64_us']}")
    if report["errors"]:
        print(f"{len(report['errors'])} errors (see JSON): " + "; ".join(e["what"] for e in report["errors"]))


if __name__ == "__main__":
    main()
