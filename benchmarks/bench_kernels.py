"""Kernel benchmark on one GPU, one call: hash, row gather, gate at V4.1-Flash shapes.

Prints a table (median time, achieved GB/s against the HBM copy ceiling measured
in the same run, speed-up over the torch-native path measured in the same run)
and writes ``kernels-<device>.json`` to ``$OUT`` (or benchmarks/results/).

    PYTHONPATH=src ENGRAM_COMMIT=$(git rev-parse HEAD) python benchmarks/bench_kernels.py
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

TOKEN_COUNTS = (1, 64, 1024, 8192, 32768)


def main() -> None:
    from ceiling import copy_ceiling_gbps
    from gather_bench import bench_gather
    from gate_bench import bench_gate
    from hash_bench import bench_hash, compiled_variants, empty_kernel_floor
    from host_cost_bench import bench_host_cost

    ceiling = copy_ceiling_gbps()
    print(f"HBM copy ceiling: {ceiling:,.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    floor = empty_kernel_floor()
    print(f"harness floor (empty kernel, graph replay): {floor}", flush=True)
    hash_rows = bench_hash(TOKEN_COUNTS)
    gate_rows = bench_gate(TOKEN_COUNTS)
    gather_rows = bench_gather(TOKEN_COUNTS)
    host_cost = bench_host_cost()
    print("host time per eager call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in host_cost.items()), flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_ceiling_GBps": ceiling,
        "harness_floor_us": floor,
        "hash": hash_rows,
        "hash_compiled": compiled_variants(),
        "gather": gather_rows,
        "gate": gate_rows,
        "host_cost": host_cost,
    }
    report.update(summary_keys(hash_rows, gather_rows, gate_rows))
    report["layer_host_T64_us"] = host_cost["layer_host_T64_us"]
    report["hash_host_T1_us"] = host_cost["hash_host_T1_us"]
    out_dir = Path(os.environ.get("OUT", HERE / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels-h200.json").write_text(json.dumps(report, indent=2))
    print_table(report, ceiling)


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
    host = report["host_cost"]
    host_table = Table(title="host time of one eager call (median us; bare launches for scale)")
    host_table.add_column("call")
    host_table.add_column("host us", justify="right")
    for key, value in host.items():
        host_table.add_row(key, f"{value:.1f}")
    Console(width=140).print(host_table)


if __name__ == "__main__":
    main()
