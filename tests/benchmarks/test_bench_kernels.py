"""benchmarks/kernels/bench_kernels.py on the CPU: it needs CUDA to time anything, so this checks its command line
(one clear error without a GPU) and its report code (the JSON's headline keys and the printed tables) on
tiny fake numbers, so the one unattended GPU run does not die on a Python error after timing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(KERNELS))
    import bench_kernels

    return bench_kernels


def _fake_rows(rng, token_counts):
    """Rows shaped as kernels_hash / kernels_gather / kernels_gate return them, random times."""
    def us():
        return float(rng.uniform(1.0, 100.0))

    hash_rows = [{"T": t, "bytes": 1000 * t, "triton_graph_us": us(), "triton_fused_graph_us": us(),
                  "triton_history_graph_us": us(), "triton_graph_warm_us": us(), "torch_graph_us": us(),
                  "torch_graph_warm_us": us()} for t in token_counts]
    gather_rows = [{"T": t, "bytes_bf16": 2000 * t, "bytes_packed": 1500 * t, "triton_bf16_us": us(),
                    "triton_packed_us": us(), "torch_us": us()} for t in token_counts]
    gate_rows = [{"T": t, "bytes": 3000 * t, "triton_graph_us": us(), "torch_graph_us": us()} for t in token_counts]
    return hash_rows, gather_rows, gate_rows


def test_report_takes_its_headline_keys_from_the_rows(bench, rng, capsys):
    hash_rows, gather_rows, gate_rows = _fake_rows(rng, bench.TOKEN_COUNTS)
    host_cost = {"empty_kernel_launch_us": 10.0, "hash_host_T1_us": 18.5, "layer_host_T64_us": 60.5}
    facts = {"device": "fake", "torch": "-", "triton": "-", "commit": "abc", "date": "2026-01-01"}
    peer_rows = [{"T": t, "shards": 8, "bit_exact": True, "bytes_bf16": 2000 * t, "device_bf16_us": 10.0 + t,
                  "peer_bf16_us": 11.0 + t, "peer_vs_device_bf16": (11.0 + t) / (10.0 + t), "device_packed_us": 9.0,
                  "peer_packed_us": 9.5} for t in bench.TOKEN_COUNTS]
    report = bench.make_report(facts, 4000.0, {"cold_us": 4.0, "warm_us": 0.7}, hash_rows, [], gather_rows,
                               gate_rows, host_cost, peer_rows)
    assert report["peer_gather_T8192_vs_device"] == (11.0 + 8192) / (10.0 + 8192) and report["peer_gather_bit_exact"]
    by_t = {name: {r["T"]: r for r in rows} for name, rows in
            (("hash", hash_rows), ("gather", gather_rows), ("gate", gate_rows))}
    assert report["hash_T8192_us"] == by_t["hash"][8192]["triton_graph_us"]
    assert report["hash_T1_us"] == by_t["hash"][1]["triton_graph_us"]
    assert report["hash_with_history_T8192_us"] == by_t["hash"][8192]["triton_history_graph_us"]
    assert report["hash_T1_warm_l2_us"] == by_t["hash"][1]["triton_graph_warm_us"]
    assert report["gather_packed_T8192_us"] == by_t["gather"][8192]["triton_packed_us"]
    assert report["gate_T1_us"] == by_t["gate"][1]["triton_graph_us"]
    assert report["layer_host_T64_us"] == 60.5 and report["hash_host_T1_us"] == 18.5
    assert report["commit"] == "abc" and report["copy_ceiling_GBps"] == 4000.0 and report["host_cost"] is host_cost

    bench.print_table(report, 4000.0)
    printed = capsys.readouterr().out
    row = by_t["gate"][8192]
    gbps = row["bytes"] / (row["triton_graph_us"] * 1e-6) / 1e9
    assert f"{row['triton_graph_us']:.1f}" in printed and f"{gbps:,.0f}" in printed
    assert "layer_host_T64_us" in printed and "60.5" in printed
    assert "peer gather" in printed and f"{8192 + 11.0:.1f}" in printed


def test_without_cuda_one_clear_error(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in ([], ["--host-cost-only"]):
        with pytest.raises(SystemExit) as stopped:
            bench.main(argv)
        assert stopped.value.code == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_unknown_option_is_refused(bench, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--tokens", "64"])
    assert stopped.value.code == 2 and "--tokens" in capsys.readouterr().err
