"""benchmarks/layer/bench_layer.py on the CPU: end to end under the Triton interpreter (a small geometry, timing
replaced by one call of each timed function: every path, stage, check and the JSON keys), and in the
plain suite its command line and its printed table on fake numbers, so the one unattended GPU run does
not die on a Python error."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

LAYER = Path(__file__).resolve().parents[2] / "benchmarks" / "layer"


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_bench_layer_runs_end_to_end(tmp_path, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU smoke run of the benchmark: needs TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(LAYER))
    import bench_layer

    calls = []

    def fake_time_us(functions, *, graph, rep_ms=200):
        for function in functions:
            function()
        calls.append(graph)
        return 1.0

    geometry = dict(HIDDEN=128, HC=1, COLUMNS=2, HEAD_DIM=128, DEVICE="cpu")
    for name, value in geometry.items():
        monkeypatch.setattr(bench_layer, name, value)
    monkeypatch.setattr(bench_layer, "IN_FEATURES", 2 * 128)
    monkeypatch.setattr(bench_layer, "OUT_FEATURES", 2 * 128)
    monkeypatch.setattr(bench_layer, "time_us", fake_time_us)
    monkeypatch.setattr(bench_layer, "_l2_bytes", lambda: 1 << 16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu (smoke)")
    table_rows = 5000
    monkeypatch.setattr(bench_layer, "make_table", lambda recorder: (
        torch.zeros(table_rows, 128, dtype=torch.uint8), torch.full((table_rows, 4), 127, dtype=torch.uint8),
        table_rows))
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--tokens", "1,64"])
    bench_layer.main()

    report = json.loads((tmp_path / "layer-h200.json").read_text())
    for key in ("layer_T8192_us", "layer_T64_us", "layer_bf16_T8192_us", "wkv_bytes_per_layer", "device", "torch",
                "triton", "commit", "date", "update_rel_error", "errors"):
        assert key in report, key
    assert report["layer_T64_us"] == 1.0 and report["layer_T8192_us"] is None  # T = 8192 not run here
    # On the CPU only torch._scaled_mm is missing; every other path ran and was checked.
    failed = [error["what"] for error in report["errors"]]
    assert failed == ["build a_scaled_mm"], report["errors"]
    numerics = report["update_rel_error"]
    for path in ("bf16", "a_triton", "b_fused", "a_small_m", "default"):
        assert numerics[path] < 3e-2, numerics
    assert numerics["b_fused_vs_bf16"] < 1.5 and numerics["a_triton_vs_bf16"] < 1.5, numerics
    assert numerics["a_small_m_vs_bf16"] < 1.5, numerics
    assert report["update_rel_error_T64"]["a_small_m_vs_bf16"] < 1.5, report["update_rel_error_T64"]
    stage = report["stages"][0]
    assert {"gather_bf16_us", "gather_quantize_us", "gemm_bf16_us", "gemm_fused_us", "gemm_triton_block_scaled_us",
            "gemm_small_m_us", "gate_us"} <= set(stage), stage
    assert report["layer_small_m_T64_us"] == 1.0
    assert report["fused_sweep"], "the fused tile sweep did not run at T = 64"
    assert report["wkv_bytes_per_layer_bf16"] == 256 * 256 * 2


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(LAYER))
    import bench_layer

    return bench_layer


@pytest.mark.parametrize("tokens", ["1,x", "0,64", "", "64,-1"])
def test_bad_token_counts_are_one_clear_error(bench, capsys, tokens):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--tokens", tokens])
    assert stopped.value.code == 2
    assert "--tokens" in capsys.readouterr().err


def test_without_cuda_one_clear_error(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--tokens", "1,64"])
    assert stopped.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_table_prints_each_path_against_the_ceiling(bench, rng, capsys):
    """print_table on a report of tiny fake numbers: every path's time, its GEMM rate and share of the
    bf16 ceiling, its ratio to the bf16 layer; paths without a time are left out."""
    ceiling = 700.0
    rows = []
    for tokens in (1, 64):
        row = {"T": tokens}
        for path in ("default",) + bench.PATHS:
            row[f"{path}_us"] = float(rng.uniform(50.0, 200.0))
            row[f"{path}_eager_us"] = float(rng.uniform(50.0, 200.0))
        row["b_fused_us"] = None  # a path that failed
        rows.append(row)
    report = {"device": "fake", "torch": "-", "triton": "-", "bf16_gemm_ceiling_TFLOPs": ceiling,
              "default_backend": "scaled_mm", "layer": rows, "stages": [{"T": 64, "gate_us": 8.5}],
              "update_rel_error": {}, "update_rel_error_T64": {}, "wkv_bytes_per_layer": 1,
              "wkv_bytes_per_layer_bf16": 2, "layer_T8192_us": None, "layer_T64_us": rows[1]["default_us"],
              "layer_bf16_T8192_us": None, "layer_small_m_T64_us": None, "errors": [{"what": "x", "error": "y"}]}
    bench.print_table(report)
    printed = capsys.readouterr().out
    for row in rows:
        line = next(text for text in printed.splitlines()
                    if text.split()[:2] == [str(row["T"]), "a_triton"])
        us = row["a_triton_us"]
        tflops = bench.gemm_tflops(row["T"], us)
        assert line.split()[2:6] == [f"{us:.1f}", f"{tflops:.0f}", f"{100 * tflops / ceiling:.0f}%",
                                     f"{row['bf16_us'] / us:.2f}x"]
        assert not any(text.split()[:2] == [str(row["T"]), "b_fused"] for text in printed.splitlines())
    assert "gate 8.5" in printed and "1 errors" in printed
