"""benchmarks/wkv_small_m_sweep.py end to end on the CPU (Triton interpreter, K = N = 256, two
configs, timing replaced by one call): the checks, the table and the JSON, so the H200 run does
not die on a Python error."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_small_m_sweep_runs_end_to_end(tmp_path, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU smoke run of the sweep: needs TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_layer
    import wkv_small_m_sweep as sweep

    for module in (bench_layer, sweep):
        monkeypatch.setattr(module, "IN_FEATURES", 256)
        monkeypatch.setattr(module, "OUT_FEATURES", 256)
        monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "sweep_configs", lambda: [
        dict(block_n=32, split_k=2, num_warps=4, num_stages=1, swap_ab=True, reduction="partials"),
        dict(block_n=64, split_k=1, num_warps=4, num_stages=1, swap_ab=False, reduction="atomic"),
    ])
    timed = []
    monkeypatch.setattr(sweep, "graph_median_us", lambda function, rep_ms: (timed.append(function()), 50.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu (smoke)")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["wkv_small_m_sweep.py", "--tokens", "1,17", "--jobs", "1"])
    sweep.main()

    report = json.loads((tmp_path / "wkv-small-m-sweep.json").read_text())
    kernels = [(row["T"], row["kernel"]) for row in report["rows"]]
    # No torch._scaled_mm on the CPU: the Triton GEMM is the reference.
    assert kernels == [(1, "triton_block_scaled"), (1, "small_m"), (1, "small_m"),
                       (17, "triton_block_scaled"), (17, "small_m"), (17, "small_m")], kernels
    assert all(row.get("ok") for row in report["rows"]), report["rows"]
    assert report["best"]["17"]["small_m"]["us"] == 50.0 and not report["skipped"]
    assert len(timed) == 6
    # The compile workers' body, in this process.
    sweep._warm_worker([(3, dict(block_n=32, split_k=2, num_stages=1))])
