"""Kernel benchmark on one GPU, one call: hash, row gather, gate at V4.1-Flash shapes, and the
host time of one eager call.

Device side (``kernels_hash.py``, ``kernels_gather.py``, ``kernels_gate.py``): median time,
achieved GB/s against the HBM copy ceiling measured in the same run, speed-up over the
torch-native path measured in the same run. The peer gather (placement ``"node"``, lookup
``"peer"``) against the device gather of the same rows, on this GPU's memory split into 8 shards
(``peer_gather_T8192_vs_device``: the project's bound is 1.10).

Host side (:func:`bench_host_cost`): what an engine's Python thread pays per eager call. Each
call is timed alone with a host clock after a device sync, so the launch queue is empty and the
call never waits on the GPU; the median of many calls is reported. V4.1-Flash shapes (hidden
5120, hc 4, C = 24, head_dim 256, wkv [25600, 6144] bf16) on a small table (its size does not
change host time): the bare launch of the hash kernel through ``kernel[grid]`` (Triton's own
path: bind, specialize, look up, launch) and through
:class:`engram.triton_launch.CompiledLaunch`; an empty kernel's launch both ways; the hasher at
T = 1 and 64; gather, gate, the bf16 GEMM alone and the whole layer at T = 64, with bf16 wkv and
with FP8 wkv (``torch._scaled_mm``). ``*_bare_launches_*``: the same call's launches each
replayed alone and summed (the floor no Python around them can go below).

Prints tables and writes ``kernels-h200.json`` to ``$OUT`` (or benchmarks/results/);
``--host-cost-only`` prints the host times alone and writes nothing.

    PYTHONPATH=src ENGRAM_COMMIT=$(git rev-parse HEAD) python benchmarks/kernels/bench_kernels.py
    PYTHONPATH=src python benchmarks/kernels/bench_kernels.py --host-cost-only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import engram  # noqa: E402
from common import median_wall_us  # noqa: E402
from kernels_hash import CONFIG, _empty_kernel, _random_vocab, hash_call  # noqa: E402

TOKEN_COUNTS = (1, 64, 1024, 8192, 32768)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-cost-only", action="store_true",
                        help="only the host time of eager calls (printed, no JSON)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the kernels and their host costs are timed on it)")
    if args.host_cost_only:
        for key, value in bench_host_cost().items():
            print(f"{key:36s} {value:8.1f}")
        return 0
    from common import copy_ceiling_gbps
    from kernels_gather import bench_gather, bench_peer_gather
    from kernels_gate import bench_gate
    from kernels_hash import bench_hash, compiled_variants, empty_kernel_floor

    ceiling = copy_ceiling_gbps()
    print(f"HBM copy ceiling: {ceiling:,.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    floor = empty_kernel_floor()
    print(f"harness floor (empty kernel, graph replay): {floor}", flush=True)
    hash_rows = bench_hash(TOKEN_COUNTS)
    gate_rows = bench_gate(TOKEN_COUNTS)
    gather_rows = bench_gather(TOKEN_COUNTS)
    peer_rows = bench_peer_gather(TOKEN_COUNTS)
    host_cost = bench_host_cost()
    print("host time per eager call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in host_cost.items()), flush=True)
    report = make_report(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        ceiling, floor, hash_rows, compiled_variants(), gather_rows, gate_rows, host_cost, peer_rows)
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels-h200.json").write_text(json.dumps(report, indent=2))
    print_table(report, ceiling)
    return 0


def make_report(facts: dict, ceiling: float, floor: dict, hash_rows: list[dict], hash_compiled: list[dict],
                gather_rows: list[dict], gate_rows: list[dict], host_cost: dict, peer_rows: list[dict] = ()) -> dict:
    """The JSON report: ``facts`` (device, versions, commit, date), every row, and the headline keys."""
    report = dict(facts, copy_ceiling_GBps=ceiling, harness_floor_us=floor, hash=hash_rows, hash_compiled=hash_compiled,
                  gather=gather_rows, gate=gate_rows, host_cost=host_cost, peer_gather=list(peer_rows))
    report.update(summary_keys(hash_rows, gather_rows, gate_rows))
    if peer_rows:
        peer = _row(list(peer_rows), 8192)
        report["peer_gather_T8192_vs_device"] = peer["peer_vs_device_bf16"]  # acceptance: <= 1.10
        report["peer_gather_bit_exact"] = all(row["bit_exact"] for row in peer_rows)
    report["layer_host_T64_us"] = host_cost["layer_host_T64_us"]
    report["hash_host_T1_us"] = host_cost["hash_host_T1_us"]
    return report

def _row(rows: list[dict], num_tokens: int) -> dict:
    return next(r for r in rows if r["T"] == num_tokens)


def summary_keys(hash_rows, gather_rows, gate_rows) -> dict:
    """The headline numbers, each from a CUDA-graph replay (how an engine runs them)."""
    return {
        "hash_T8192_us": _row(hash_rows, 8192)["triton_graph_us"],
        "hash_T1_us": _row(hash_rows, 1)["triton_graph_us"],
        "hash_fused_T8192_us": _row(hash_rows, 8192)["triton_fused_graph_us"],
        "hash_fused_T1_us": _row(hash_rows, 1)["triton_fused_graph_us"],
        "hash_with_history_T8192_us": _row(hash_rows, 8192)["triton_history_graph_us"],
        "hash_with_history_T1_us": _row(hash_rows, 1)["triton_history_graph_us"],
        "hash_T8192_warm_l2_us": _row(hash_rows, 8192)["triton_graph_warm_us"],
        "hash_T1_warm_l2_us": _row(hash_rows, 1)["triton_graph_warm_us"],
        "gather_T8192_us": _row(gather_rows, 8192)["triton_bf16_us"],
        "gather_packed_T8192_us": _row(gather_rows, 8192)["triton_packed_us"],
        "gather_T1_us": _row(gather_rows, 1)["triton_bf16_us"],
        "gate_T8192_us": _row(gate_rows, 8192)["triton_graph_us"],
        "gate_T1_us": _row(gate_rows, 1)["triton_graph_us"],
    }


def print_table(report: dict, ceiling: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"engram kernels on {report['device']} (torch {report['torch']}, Triton {report['triton']}); "
                        f"copy ceiling {ceiling:,.0f} GB/s")
    # Every time is a median of CUDA-graph replays unless marked eager.
    for column in ("stage", "T", "kernel us", "GB/s", "% ceiling", "torch-native us", "speed-up"):
        table.add_column(column, justify="right" if column != "stage" else "left")
    def add(stage, tokens, kernel_us, num_bytes, torch_us, torch_note=""):
        gbps = num_bytes / (kernel_us * 1e-6) / 1e9
        table.add_row(stage, str(tokens), f"{kernel_us:.1f}", f"{gbps:,.0f}", f"{100 * gbps / ceiling:.0f}%",
                      f"{torch_us:.1f}{torch_note}", f"{torch_us / kernel_us:.1f}x")

    for row in report["hash"]:
        add("hash (cold L2)", row["T"], row["triton_graph_us"], row["bytes"], row["torch_graph_us"])
        add("hash fused (cold L2)", row["T"], row["triton_fused_graph_us"], row["bytes"], row["torch_graph_us"])
        add("hash + history (cold L2)", row["T"], row["triton_history_graph_us"], row["bytes"], row["torch_graph_us"])
        add("hash (warm L2)", row["T"], row["triton_graph_warm_us"], row["bytes"], row["torch_graph_warm_us"])
    for row in report["gather"]:
        add("gather bf16", row["T"], row["triton_bf16_us"], row["bytes_bf16"], row["torch_us"], " (eager)")
        add("gather packed", row["T"], row["triton_packed_us"], row["bytes_packed"], row["torch_us"], " (eager)")
    for row in report["gate"]:
        add("gate", row["T"], row["triton_graph_us"], row["bytes"], row["torch_graph_us"])
    Console(width=140).print(table)
    if report.get("peer_gather"):
        peer_table = Table(title="peer gather (shards on this GPU, read through the pointer table) against the "
                                 "device gather of the same rows; graph replays")
        for column in ("T", "shards", "device bf16 us", "peer bf16 us", "peer / device", "device packed us",
                       "peer packed us", "GB/s peer bf16", "bit exact"):
            peer_table.add_column(column, justify="right")
        for row in report["peer_gather"]:
            peer_table.add_row(str(row["T"]), str(row["shards"]), f"{row['device_bf16_us']:.1f}",
                               f"{row['peer_bf16_us']:.1f}", f"{row['peer_vs_device_bf16']:.2f}x",
                               f"{row['device_packed_us']:.1f}", f"{row['peer_packed_us']:.1f}",
                               f"{row['bytes_bf16'] / (row['peer_bf16_us'] * 1e-6) / 1e9:,.0f}", str(row["bit_exact"]))
        Console(width=140).print(peer_table)
    host = report["host_cost"]
    host_table = Table(title="host time of one eager call (median us; bare launches for scale)")
    host_table.add_column("call")
    host_table.add_column("host us", justify="right")
    for key, value in host.items():
        host_table.add_row(key, f"{value:.1f}")
    Console(width=140).print(host_table)


# ---- host time of one eager call ------------------------------------------------------------
def host_us(call, repeats: int = 300, warmup: int = 20) -> float:
    """Median host microseconds of ``call()``, each run alone after a device sync."""
    return median_wall_us(call, repeats, warmup, until_device_done=False)


def _layer(num_rows: int = 1 << 20):
    """An Engram layer at V4.1-Flash shapes (bf16 wkv), table on the device."""
    from engram.layer.module import Engram
    from engram.layer.wkv import WkvProjection
    from engram.table.fp8 import quantize_rows

    spec = engram.EngramSpec.from_hf_config(CONFIG)
    values, scales = quantize_rows(torch.randn(num_rows, spec.head_dim, device="cuda"))
    table = engram.EngramTable(values, scales, placement="device", device="cuda",
                               num_rows_total=num_rows, validate=False)
    in_features = spec.num_columns * spec.head_dim
    wkv = WkvProjection((torch.randn((spec.hc_mult + 1) * spec.hidden_size, in_features, device="cuda")
                         / in_features ** 0.5).to(torch.bfloat16))
    weights = torch.randn(2, spec.hc_mult, spec.hidden_size, device="cuda").to(torch.bfloat16)
    layer = Engram(table, wkv, weights[0], weights[1], eps=spec.rms_norm_eps, num_columns=spec.num_columns)
    return spec, layer


def _fp8_layer(spec, table):
    """The same layer with an FP8 wkv (128 x 128 block scales): torch._scaled_mm where the build
    has it, as a checkpoint's layer runs on the H200."""
    from engram.layer.module import Engram
    from engram.layer.wkv import WkvProjection

    in_features, out_features = spec.num_columns * spec.head_dim, (spec.hc_mult + 1) * spec.hidden_size
    weight = (torch.randn(out_features, in_features, device="cuda") * 16).to(torch.float8_e4m3fn)
    scale = torch.full((out_features // 128, in_features // 128), 2.0 ** -4 / in_features ** 0.5, device="cuda")
    wkv = WkvProjection(weight, scale, (128, 128))
    weights = torch.randn(2, spec.hc_mult, spec.hidden_size, device="cuda").to(torch.bfloat16)
    return Engram(table, wkv, weights[0], weights[1], eps=spec.rms_norm_eps, num_columns=spec.num_columns)


def record_launches(call) -> list[tuple]:
    """``[(launcher, grid, args, options, replay)]``: the Triton launches one ``call()``
    makes, in order, through a CompiledLaunch or a prepared call's BoundLaunch (``launcher``: the
    CompiledLaunch either way); ``replay()`` launches it again the same way, bare."""
    from engram import triton_launch

    recorded = []
    original, original_bound = triton_launch.CompiledLaunch.__call__, triton_launch.BoundLaunch.__call__

    inside_bound = []  # a cold BoundLaunch launches through its CompiledLaunch: record it once

    def record(self, grid, args, num_warps, device_index=0, num_stages=None):
        options = dict(num_warps=num_warps, device_index=device_index, num_stages=num_stages)
        if not inside_bound:
            recorded.append((self, grid, args, options, lambda: original(self, grid, args, **options)))
        return original(self, grid, args, **options)

    def record_bound(self, grid, args):  # a prepared call's launch, replayed through its BoundLaunch
        recorded.append((self._owner, grid, args,
                         dict(num_warps=self._num_warps, device_index=self._device_index,
                              num_stages=self._num_stages), lambda: original_bound(self, grid, args)))
        inside_bound.append(True)
        try:
            return original_bound(self, grid, args)
        finally:
            inside_bound.pop()

    triton_launch.CompiledLaunch.__call__ = record
    triton_launch.BoundLaunch.__call__ = record_bound
    try:
        call()
    finally:
        triton_launch.CompiledLaunch.__call__ = original
        triton_launch.BoundLaunch.__call__ = original_bound
    return recorded


def bare_launches_us(call, torch_ops=()) -> float:
    """Host microseconds of the launches ``call()`` makes, each replayed alone and bare (compiled
    Triton launches with their recorded arguments, plus ``torch_ops``: calls of the torch
    operators it runs, e.g. the GEMM), summed: the floor no Python around them can go below."""
    total = 0.0
    for *_, replay in record_launches(call):
        total += host_us(replay)
    for op in torch_ops:
        total += host_us(op)
    return total


def bench_host_cost() -> dict:
    from engram import triton_launch
    from engram.layer.gate import engram_gate_kv
    from engram.table.kernels.gather import gather_rows

    spec = engram.EngramSpec.from_hf_config(CONFIG)
    layout, vocab = engram.EngramLayout(spec), _random_vocab(spec)
    rng = np.random.default_rng(3)
    result = {}
    buffer = torch.zeros(1, device="cuda")
    result["empty_kernel_launch_us"] = host_us(lambda: _empty_kernel[(1,)](buffer))
    empty = triton_launch.CompiledLaunch(_empty_kernel)
    result["empty_kernel_compiled_launch_us"] = host_us(lambda: empty(1, (buffer,), num_warps=1))

    for tokens in (1, 64):
        call = hash_call(layout, vocab, tokens, rng)
        result[f"hash_host_T{tokens}_us"] = host_us(call)
        result[f"hash_bare_launches_T{tokens}_us"] = bare_launches_us(call)
    # The same hash kernel launched bare, through Triton's own path and through CompiledLaunch.
    launches = [entry for entry in record_launches(hash_call(layout, vocab, 1, rng))
                if entry[0].kernel.__name__ == "ngram_hash_kernel"]
    launcher, grid, args, options, _ = launches[0]
    kernel = launcher.kernel
    warps = options["num_warps"]
    result["hash_kernel_triton_launch_us"] = host_us(lambda: kernel[(grid,)](*args, num_warps=warps))
    result["hash_kernel_compiled_launch_us"] = host_us(lambda: launcher(grid, args, **options))

    spec, layer = _layer()
    tokens = 64
    hash_ids = torch.randint(0, 1 << 20, (tokens, spec.num_columns), device="cuda", dtype=torch.int32)
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device="cuda").to(torch.bfloat16)
    mask = torch.rand(tokens, device="cuda") > 0.05
    table = layer.table
    result["gather_host_T64_us"] = host_us(lambda: gather_rows(table._storage.value_bytes, table._storage.scale_bytes,
                                                               hash_ids))
    kv = layer.wkv(table.lookup(hash_ids))
    result["gate_host_T64_us"] = host_us(lambda: engram_gate_kv(hidden, kv, layer.q_weight, layer.k_weight,
                                                                spec.rms_norm_eps, mask))
    rows = table.lookup(hash_ids).flatten(1)
    linear = lambda: torch.nn.functional.linear(rows, layer.wkv.weight)  # noqa: E731
    result["linear_bf16_host_T64_us"] = host_us(linear)
    result["wkv_host_T64_us"] = host_us(lambda: layer.wkv(table.lookup(hash_ids)))
    layer_call = lambda: layer(hidden, hash_ids, mask)  # noqa: E731
    result["layer_host_T64_us"] = host_us(layer_call)
    result["layer_bare_launches_T64_us"] = bare_launches_us(layer_call, (linear,))

    fp8_layer = _fp8_layer(spec, table)
    if fp8_layer.wkv.backend == "scaled_mm":
        from engram.layer import wkv_gemm

        a, a_scale = wkv_gemm.quantize_gathered_rows(*fp8_layer.table.rows_in_place(hash_ids))
        weight_t, scale_t = fp8_layer.wkv.weight.t(), fp8_layer.wkv.weight_scale_blocks.t()
        scaled_mm = lambda: torch._scaled_mm(a, weight_t, scale_a=a_scale, scale_b=scale_t,  # noqa: E731
                                             out_dtype=torch.bfloat16)
        result["scaled_mm_host_T64_us"] = host_us(scaled_mm)
        fp8_call = lambda: fp8_layer(hidden, hash_ids, mask)  # noqa: E731
        result["layer_fp8_host_T64_us"] = host_us(fp8_call)
        result["layer_fp8_bare_launches_T64_us"] = bare_launches_us(fp8_call, (scaled_mm,))
    return result


if __name__ == "__main__":
    sys.exit(main())
