"""Launch-shape sweep of the split-K small-T FP8 GEMM (``wkv_gemm.small_m_gemm``, issue 13) on
one GPU, beside ``torch._scaled_mm`` and the 128-row-tile Triton GEMM, at V4.1's wkv shape
(K = 6144, N = 25600, FP8 E4M3 weight with 128 x 128 UE8M0 blocks, 1 x 128 activation scales).

For each T in {1, 64, 128}: a grid of (block_n, split_k) at 4 warps / 4 stages / swap-AB /
partials reduction, then variants (8 warps, 3 and 6 stages, no swap, atomic reduction) of three
anchors. Each config's output is poisoned (NaN), checked once against ``torch._scaled_mm`` (else
the Triton GEMM: relative Frobenius difference <= 2**-8), then timed: median of
``triton.testing.do_bench`` over CUDA-graph replays of one call (do_bench clears the L2 before
each; the 157 MB weight is 3x the L2 anyway). The achieved weight-read rate is
``(N * K + scales) / time``. Kernels are compiled first by a few worker processes (Triton's disk
cache), so the run stays near a minute; ``--budget-s`` stops timing further configs (the rest
are listed as skipped).

Prints one table per T (fastest first) and writes ``wkv-small-m-sweep.json`` to ``$OUT`` (else
benchmarks/results/).

    PYTHONPATH=src python benchmarks/wkv_small_m_sweep.py [--tokens 1,64,128] [--jobs 8] [--budget-s 85]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from bench_layer import IN_FEATURES, OUT_FEATURES, fp8_weight  # noqa: E402

BLOCK = (128, 128)
DEVICE = "cuda"  # tests/test_wkv_small_m_sweep.py runs the script on the CPU (interpreter) at a small shape
LAYER_T64_TARGET_US = 65.0
LAYER_T64_REST_US = 68.9 - 57.7  # the layer at T = 64 less its torch._scaled_mm (results/layer-h200.json)


def sweep_configs() -> list[dict]:
    """The configs timed at every T (``SmallMGemmConfig`` fields), grid first, then variants."""
    grid = [(32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (64, 4), (64, 8),
            (128, 1), (128, 2), (128, 4), (128, 8), (256, 2), (256, 4), (256, 8)]
    base = dict(num_warps=4, num_stages=4, swap_ab=True, reduction="partials")
    configs = [dict(base, block_n=n, split_k=s) for n, s in grid]
    variants = (dict(num_warps=8), dict(num_stages=3), dict(num_stages=6), dict(swap_ab=False),
                dict(reduction="atomic"))
    for n, s in ((128, 2), (128, 4), (64, 4)):
        configs += [dict(base, block_n=n, split_k=s, **variant) for variant in variants]
    return configs


def _padded(tokens: int) -> int:
    from engram.layer.wkv_gemm import padded_tokens

    return padded_tokens(tokens)


def activations(tokens: int, generator: torch.Generator):
    """``(a E4M3 [padded_T, K], a_scale fp32 view [padded_T, K / 128] column-major)`` as
    ``quantize_gathered_rows`` gives them: random E4M3 values, power-of-two scales, zero padding rows."""
    padded = _padded(tokens)
    a = torch.zeros(padded, IN_FEATURES, dtype=torch.float8_e4m3fn, device=DEVICE)
    a[:tokens] = (torch.randn(tokens, IN_FEATURES, device=DEVICE, generator=generator) * 64).to(torch.float8_e4m3fn)
    a_scale = torch.ones(IN_FEATURES // 128, padded, device=DEVICE)
    a_scale[:, :tokens] = torch.exp2(torch.randint(-12, -4, (IN_FEATURES // 128, tokens), device=DEVICE,
                                                   generator=generator).float())
    return a, a_scale.t()


def _warm_worker(jobs: list[tuple[int, dict]]) -> list[str]:
    """Compile ``small_m_gemm`` for each ``(T, config)`` by one launch on real-shaped (garbage)
    tensors: the JIT's exact specialization lands in Triton's disk cache. Returns failures."""
    from engram.layer.wkv_gemm import SmallMGemmConfig, small_m_gemm

    weight = torch.zeros(OUT_FEATURES, IN_FEATURES, dtype=torch.float8_e4m3fn, device=DEVICE)
    weight_scale = torch.ones(OUT_FEATURES // 128, IN_FEATURES // 128, device=DEVICE)
    failures = []
    for tokens, config in jobs:
        padded = _padded(tokens)
        a = torch.zeros(padded, IN_FEATURES, dtype=torch.float8_e4m3fn, device=DEVICE)
        a_scale = torch.ones(IN_FEATURES // 128, padded, device=DEVICE).t()
        try:
            small_m_gemm(a, a_scale, tokens, weight, weight_scale, BLOCK, config=SmallMGemmConfig(**config))
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: recorded when timed
            failures.append(f"T={tokens} {config}: {type(error).__name__}")
    torch.cuda.synchronize()
    return failures


def prewarm(token_counts: list[int], configs: list[dict], workers: int) -> float:
    """Compile every (T, config) in ``workers`` spawned processes; seconds taken (0 if skipped)."""
    if workers <= 1:
        return 0.0
    start = time.perf_counter()
    jobs = [(tokens, config) for tokens in token_counts for config in configs]
    shares = [jobs[i::workers] for i in range(workers)]
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for failures in pool.map(_warm_worker, shares):
                for failure in failures:
                    print(f"  warm-up: {failure}", flush=True)
    except Exception as error:  # noqa: BLE001 - the timing loop compiles what is missing
        print(f"warm-up pool failed ({type(error).__name__}: {error}); compiling in the main process", flush=True)
    return time.perf_counter() - start


def graph_median_us(function, rep_ms: int) -> float:
    """Median microseconds of one CUDA-graph replay of ``function`` (warmed up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    try:
        return 1e3 * triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    finally:
        del graph


def relative_difference(found: torch.Tensor, expected: torch.Tensor) -> float:
    if bool(torch.isnan(found).any()):
        return float("nan")
    return float((found.double() - expected.double()).norm() / expected.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,128")
    parser.add_argument("--jobs", type=int, default=8, help="compile worker processes (1: compile while timing)")
    parser.add_argument("--budget-s", type=float, default=85.0, help="stop timing new configs after this")
    parser.add_argument("--rep-ms", type=int, default=40)
    args = parser.parse_args()
    start = time.perf_counter()
    from engram.layer import wkv_gemm

    token_counts = [int(t) for t in args.tokens.split(",")]
    configs = sweep_configs()
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{len(configs)} configs x T in {token_counts}", flush=True)
    warm_s = prewarm(token_counts, configs, args.jobs)
    print(f"compiled in {warm_s:.1f} s ({args.jobs} workers)", flush=True)

    generator = torch.Generator(device=DEVICE).manual_seed(13)
    weight, scale_bytes = fp8_weight(generator)
    weight_scale = torch.exp2(scale_bytes.float() - 127)                 # fp32 [200, 48], rows a multiple of 4
    weight_bytes = weight.numel() + weight_scale.numel() * 4
    layout, note = wkv_gemm.probe_scaled_mm_blockwise(weight.device, IN_FEATURES, OUT_FEATURES)
    scale_t = wkv_gemm.scaled_mm_weight_scale(weight_scale, layout) if layout is not None else None
    print(f"torch._scaled_mm: {note}", flush=True)

    rows, skipped = [], []

    def record(tokens, kernel, config, function, reference, checked_function=None):
        """Check ``checked_function`` (default ``function``) once against ``reference``, time ``function``."""
        if time.perf_counter() - start > args.budget_s:
            skipped.append({"T": tokens, "kernel": kernel, "config": config})
            return None
        row = {"T": tokens, "kernel": kernel, "config": config}
        try:
            found = (checked_function or function)()
            torch.cuda.synchronize()
            row["rel_diff"] = 0.0 if reference is None else relative_difference(found, reference)
            row["ok"] = reference is None or row["rel_diff"] <= 2 ** -8
            row["us"] = graph_median_us(function, args.rep_ms)
            row["weight_TBps"] = weight_bytes / (row["us"] * 1e-6) / 1e12
        except Exception as error:  # noqa: BLE001 - a config that does not fit must not stop the sweep
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            torch.cuda.synchronize()
        rows.append(row)
        return found if "error" not in row else None

    for tokens in token_counts:
        a, a_scale = activations(tokens, generator)
        reference = None
        if scale_t is not None:
            reference = record(tokens, "scaled_mm", None,
                               lambda: wkv_gemm.scaled_mm_gemm(a, a_scale, tokens, weight, scale_t), None)
        triton_out = record(tokens, "triton_block_scaled", dataclasses.asdict(wkv_gemm.default_gemm_config(tokens, False)),
                            lambda: wkv_gemm.block_scaled_gemm(a, a_scale, tokens, weight, weight_scale, BLOCK), reference)
        reference = triton_out if reference is None else reference
        for config in configs:
            small = wkv_gemm.SmallMGemmConfig(**config)

            def call(small=small, out=None):
                return wkv_gemm.small_m_gemm(a, a_scale, tokens, weight, weight_scale, BLOCK, out=out, config=small)

            def poisoned_call(call=call):  # the check writes into NaN; the timed call allocates (no fill kernel)
                return call(out=torch.full((tokens, OUT_FEATURES), float("nan"), dtype=torch.bfloat16, device=DEVICE))

            record(tokens, "small_m", config, call, reference, poisoned_call)
        del a, a_scale

    report = {
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"K": IN_FEATURES, "N": OUT_FEATURES, "block": list(BLOCK)}, "weight_bytes": weight_bytes,
        "compile_s": warm_s, "total_s": time.perf_counter() - start, "rows": rows, "skipped": skipped,
        "best": best_per_tokens(rows),
    }
    out_dir = Path(os.environ.get("OUT", HERE / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "wkv-small-m-sweep.json").write_text(json.dumps(report, indent=2))
    print_tables(report)


def best_per_tokens(rows: list[dict]) -> dict:
    """``{T: {"small_m": fastest correct row, "scaled_mm_us": ..., "speedup": ...}}``."""
    best = {}
    for tokens in sorted({row["T"] for row in rows}):
        timed = [r for r in rows if r["T"] == tokens and r.get("us") is not None]
        small = [r for r in timed if r["kernel"] == "small_m" and r.get("ok")]
        scaled = next((r["us"] for r in timed if r["kernel"] == "scaled_mm"), None)
        fastest = min(small, key=lambda r: r["us"]) if small else None
        best[str(tokens)] = {"small_m": fastest, "scaled_mm_us": scaled,
                             "speedup_vs_scaled_mm": scaled / fastest["us"] if fastest and scaled else None}
    return best


def _config_text(config) -> str:
    if config is None:
        return "-"
    if "block_m" in config:
        return f"{config['block_m']}x{config['block_n']} w{config['num_warps']} s{config['num_stages']}"
    return (f"n{config['block_n']} k/{config['split_k']} w{config['num_warps']} s{config['num_stages']} "
            f"{'swap' if config['swap_ab'] else 'noswap'} {config['reduction']}")


def print_tables(report: dict) -> None:
    print(f"\nsmall-T FP8 GEMM sweep on {report['device']} (torch {report['torch']}, Triton {report['triton']}), "
          f"K = {report['shape']['K']}, N = {report['shape']['N']}, weight {report['weight_bytes'] / 1e6:.1f} MB; "
          f"graph-replay medians; compile {report['compile_s']:.0f} s, total {report['total_s']:.0f} s")
    for tokens in sorted({row["T"] for row in report["rows"]}):
        rows = [r for r in report["rows"] if r["T"] == tokens]
        scaled = next((r.get("us") for r in rows if r["kernel"] == "scaled_mm"), None)
        print(f"\nT = {tokens}:")
        print(f"  {'kernel':20} {'config':42} {'us':>8} {'TB/s':>6} {'vs _scaled_mm':>13} {'rel diff':>9}")
        for row in sorted(rows, key=lambda r: r.get("us", float("inf"))):
            if "error" in row:
                print(f"  {row['kernel']:20} {_config_text(row['config']):42} error: {row['error'][:60]}")
                continue
            ratio = f"{scaled / row['us']:.2f}x" if scaled else "-"
            flag = "" if row["ok"] else "  WRONG"
            print(f"  {row['kernel']:20} {_config_text(row['config']):42} {row['us']:8.1f} {row['weight_TBps']:6.2f} "
                  f"{ratio:>13} {row['rel_diff']:9.2e}{flag}")
    print()
    for tokens, best in report["best"].items():
        fastest = best["small_m"]
        if fastest is None:
            print(f"T = {tokens}: no correct small_m config timed")
            continue
        print(f"best T = {tokens}: {_config_text(fastest['config'])}: {fastest['us']:.1f} us "
              f"({fastest['weight_TBps']:.2f} TB/s); torch._scaled_mm {best['scaled_mm_us']} us")
    if "64" in report["best"] and report["best"]["64"]["small_m"]:
        gemm = report["best"]["64"]["small_m"]["us"]
        print(f"layer at T = 64 estimated {LAYER_T64_REST_US + gemm:.1f} us (rest of the layer {LAYER_T64_REST_US:.1f} "
              f"+ this GEMM; target <= {LAYER_T64_TARGET_US}): measure with bench_layer.py path a_small_m")
    if report["skipped"]:
        print(f"{len(report['skipped'])} configs skipped by the time budget")


if __name__ == "__main__":
    main()
