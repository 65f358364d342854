"""benchmarks/parallel/bench_parallel.py on the CPU: one gloo rank in this process (no spawned ranks, so it stays a
few seconds) through every stage, its checks and the JSON report at the small geometry, the node section
(``--mode node``: device, node peer and exchange, the copy ceiling; host skipped without CUDA) the same
way, and the command line's errors. The spawned multi-rank path is the same code per rank (``_rank_main``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

PARALLEL = Path(__file__).resolve().parents[2] / "benchmarks" / "parallel"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(PARALLEL))
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


@pytest.fixture
def gloo_rank(tmp_path):
    """One gloo rank in this process for the test's duration (torch's thread count restored after)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    threads = torch.get_num_threads()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def node_options(tmp_path, seed) -> dict:
    return {"mode": "node", "no_host": False, "world_size": 1, "backend": "gloo", "small": True, "tokens": (16, 40),
            "iterations": 2, "warmup": 1, "seed": seed % 2**31, "output": str(tmp_path)}


def test_node_section_on_one_gloo_rank_times_every_placement_and_writes_the_report(bench, tmp_path, seed, capsys,
                                                                                  gloo_rank):
    import parallel_node

    options = node_options(tmp_path, seed)
    rank = parallel_node.run_node_rank(0, 1, torch.device("cpu"), "cpu", options)
    parallel_node.report_node([rank], options, torch.device("cpu"))
    result = json.loads((tmp_path / "parallel-cpu-node1.json").read_text())
    assert result["mode"] == "node" and result["world_size"] == 1 and result["small"] is True
    for key in ("device", "torch", "triton", "commit", "date", "geometry", "timing", "seed"):
        assert key in result, key
    geometry = result["geometry"]
    assert geometry["table_rows"] == geometry["layer_rows"] and geometry["row_bytes"] == 66
    assert result["host"]["measured"] is False and "CUDA" in result["host"]["note"]
    assert [entry["T"] for entry in result["results"]] == [16, 40]
    for entry in result["results"]:
        assert entry["checks"] == {"peer_equals_device": True, "exchange_equals_device": True}
        (row,) = entry["ranks"]
        assert row["host"] is None and row["remote_rows_fraction"] == 0.0  # one rank owns every row
        assert row["bytes_per_lookup"] == entry["T"] * 24 * 66
        for name in ("device", "peer", "exchange"):
            for call in parallel_node.CALLS:
                timing = row[name][call]
                assert timing["us_p10"] <= timing["us"] <= timing["us_p90"], (name, call)
                assert timing["GBps"] == pytest.approx(row["bytes_per_lookup"] / timing["us"] / 1e3)
                assert entry["slowest_rank"][f"{name}_{call}_us"] == timing["us"]  # one rank: the slowest
        assert row["peer_fraction_of_ceiling"] == pytest.approx(
            row["peer"]["lookup"]["GBps"] / result["ranks"][0]["ceiling"]["GBps"])
        assert entry["peer_fraction_of_ceiling_min"] == row["peer_fraction_of_ceiling"]
    ceiling = result["ranks"][0]["ceiling"]
    (own,) = ceiling["copy_per_source"]  # one rank: its own shard stands in for the peers
    assert ceiling["peers"] is False and own["local"] is True and own["source"] == 0
    assert ceiling["copy_bytes"] > 0 and ceiling["gather_sequential"]["rows"] % 24 == 0
    assert ceiling["GBps"] == max(own["GBps"], ceiling["copy_all_sources"]["GBps"],
                                  ceiling["gather_sequential"]["GBps"])
    printed = capsys.readouterr().out
    assert "placement 'node' over 1 ranks" in printed and "parallel-cpu-node1.json" in printed


def test_node_section_check_sees_a_row_that_differs_from_the_device_table(bench, tmp_path, seed, gloo_rank):
    import parallel_node

    options = node_options(tmp_path, seed)
    setup = parallel_node.setup_node_rank(0, 1, torch.device("cpu"), "cpu", options)
    timer = bench.StageTimer(torch.device("cpu"), 1, 0)
    same = setup.table("cpu", values=setup.values.clone(), scales=setup.scales.clone())
    assert all(entry["equals_device"] for entry in parallel_node.time_lookups(setup, timer, same).values())
    row = int(setup.ids[40][0][0, 0])  # a row the first id set of T = 40 reads
    for part in ("values", "scales"):
        values, scales = setup.values.clone(), setup.scales.clone()
        changed = values if part == "values" else scales
        changed[row, 0] ^= 1
        table = setup.table("cpu", values=values, scales=scales)
        results = parallel_node.time_lookups(setup, timer, table)
        assert results[40]["equals_device"] is False, part
        read_at_16 = any(bool((ids == row).any()) for ids in setup.ids[16])
        assert results[16]["equals_device"] is not read_at_16, part


def test_node_rows_are_hashed_fp8_without_nan_the_same_on_every_call(bench, seed):
    import parallel_node

    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 384_006_168, (500,), generator=generator)
    values, scales = parallel_node.row_content(rows, 256)
    assert values.shape == (500, 256) and scales.shape == (500, 8)
    assert values.dtype == scales.dtype == torch.uint8
    assert not ((values == 0x7F) | (values == 0xFF)).any()  # E4M3 NaN
    assert int(scales.min()) >= 112 and int(scales.max()) <= 141
    again_values, again_scales = parallel_node.row_content(rows.flip(0), 256)
    assert torch.equal(again_values.flip(0), values) and torch.equal(again_scales.flip(0), scales)
    assert torch.unique(values).numel() > 200 and torch.unique(scales).numel() == 30
    distinct = torch.unique(rows)
    assert torch.unique(parallel_node.row_content(distinct, 256)[0], dim=0).shape[0] == distinct.numel()


@pytest.mark.parametrize("argv, message", [
    (["--backend", "gloo", "--world-size", "0"], "--world-size"),
    (["--backend", "gloo", "--iterations", "0"], "--iterations"),
    (["--backend", "gloo", "--warmup", "-1"], "--warmup"),
    (["--backend", "gloo", "--tokens", "16", "0"], "--tokens"),
    (["--backend", "mpi"], "--backend"),
    (["--backend", "gloo", "--mode", "dp"], "--mode"),
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
