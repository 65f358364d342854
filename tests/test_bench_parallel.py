"""benchmarks/bench_parallel.py on the CPU: one gloo rank in this process (no spawned ranks, so it stays a
few seconds) through every stage, its checks and the JSON report at the small geometry, and the command
line's errors. The spawned multi-rank path is the same code per rank (``_rank_main``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_parallel

    return bench_parallel


def test_one_gloo_rank_runs_every_stage_and_writes_the_report(bench, tmp_path, seed, capsys):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    options = {"world_size": 1, "backend": "gloo", "small": True, "tokens": (16,), "iterations": 2, "warmup": 1,
               "seed": seed % 2**31, "output": str(tmp_path)}
    threads = torch.get_num_threads()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        rows = bench.run_rank(0, 1, torch.device("cpu"), "cpu", options)
        bench.report([rows], options, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "parallel-cpu-tp1.json").read_text())
    assert result["world_size"] == 1 and result["backend"] == "gloo" and result["small"] is True
    for key in ("device", "torch", "triton", "commit", "date", "geometry", "timing"):
        assert key in result, key
    (entry,) = result["results"]
    assert entry["T"] == 16 and entry["checks"] == {"stages_match_forward": True, "forward_identical_on_ranks": True}
    assert entry["forward_sp_matches_forward"] is True
    for stage in bench.STAGES:
        assert entry["slowest_rank"][f"{stage}_us"] > 0, stage
    (rank,) = entry["ranks"]
    assert rank["forward_us"] == entry["slowest_rank"]["forward_us"]  # one rank: it is the slowest
    printed = capsys.readouterr().out
    assert "Engram tensor parallel tp=1" in printed and "parallel-cpu-tp1.json" in printed


@pytest.mark.parametrize("argv, message", [
    (["--backend", "gloo", "--world-size", "0"], "--world-size"),
    (["--backend", "gloo", "--iterations", "0"], "--iterations"),
    (["--backend", "gloo", "--warmup", "-1"], "--warmup"),
    (["--backend", "gloo", "--tokens", "16", "0"], "--tokens"),
    (["--backend", "mpi"], "--backend"),
])
def test_bad_arguments_are_one_clear_error(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_nccl_without_cuda_is_one_clear_error(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--backend", "nccl"])
    assert stopped.value.code == 2 and "--backend gloo" in capsys.readouterr().err
