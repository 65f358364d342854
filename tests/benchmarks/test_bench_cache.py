"""benchmarks/cache/bench_cache.py on the CPU: the held-out counts it reports (exact on small streams), and
the script end to end in its --smoke mode under the Triton interpreter (placement "cached" on CPU
tensors, "cpu" standing in for "device"), so the one unattended GPU run does not die on a Python error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
CACHE = BENCHMARKS / "cache"


@pytest.fixture
def heldout(monkeypatch):
    monkeypatch.syspath_prepend(str(CACHE))
    import bench_cache

    return bench_cache


def test_heldout_ceiling_counts_rows_read_in_earlier_steps(heldout):
    # Steps of 3 reads; step 0 warms. Step 1: 1 (seen), 4 (new), 4 (new in this step) -> 1/3.
    # Step 2: 4 (seen in step 1), 5 (new), 1 (seen) -> 2/3.
    reads = np.array([1, 2, 3, 1, 4, 4, 4, 5, 1])
    assert heldout.heldout_ceiling(reads, 3, 1) == pytest.approx(3 / 6)
    assert heldout.heldout_ceiling(reads, 3, 0) == pytest.approx(3 / 9)


def test_best_static_share_takes_the_most_read_rows_of_the_measured_steps(heldout):
    reads = np.array([9, 9, 9, 1, 4, 4, 4, 5, 1])
    assert heldout.best_static_share(reads, 3, 1, 1) == pytest.approx(3 / 6)  # row 4
    assert heldout.best_static_share(reads, 3, 1, 2) == pytest.approx(5 / 6)  # rows 4, 1
    assert heldout.best_static_share(reads, 3, 3, 2) == 0.0


def test_measured_distinct_rows_counts_the_rows_after_the_warm_up(heldout):
    reads = np.array([9, 9, 9, 1, 4, 4, 4, 5, 1])
    assert heldout.measured_distinct_rows(reads, 3, 1) == 3  # 1, 4, 5
    assert heldout.measured_distinct_rows(reads, 3, 0) == 4
    assert heldout.measured_distinct_rows(reads, 3, 3) == 0
    # With room for all of them, the best static set serves every measured read.
    assert heldout.best_static_share(reads, 3, 1, heldout.measured_distinct_rows(reads, 3, 1)) == 1.0


def test_simulated_hit_rates_exclude_the_warm_up(heldout):
    reads = np.array([1, 2, 1, 2, 1, 2])  # steps of 2: everything after step 0 hits
    params = heldout.device_cache_params(ways=2, aging_interval=8)
    rates = heldout.simulated_hit_rates(reads, 2, 1, 2, params)
    assert rates["lru"] == {"hit_rate": 1.0, "host_fetch_ratio": 0.0}
    assert rates["dynamic"]["hit_rate"] == 1.0 and rates["set-lru"]["hit_rate"] == 1.0


def test_fold_ids(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import fold_ids

    folded = fold_ids(np.array([[0, 10, 384_006_167]]), 10)
    assert folded.dtype == np.int32 and folded.tolist() == [[0, 0, 7]]


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_bench_cache_smoke_runs_end_to_end(tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU smoke run of the benchmark: needs TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(CACHE / "bench_cache.py"), "--smoke", "--simulate"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "cache-smoke.json").read_text())
    for key in ("hit_rate_2pct_heldout", "cached_host_bytes_ratio", "cached_T64_us", "device_T64_us", "device",
                "torch", "triton", "commit", "date", "heldout_ceiling", "best_static_share", "measured_distinct_rows",
                "simulated"):
        assert key in report, key
    assert 0 <= report["hit_rate_2pct_heldout"] <= report["heldout_ceiling"] + 1e-9
    assert 0 < report["cached_host_bytes_ratio"] <= 1
    assert report["serve"]["steps_not_equal"] == 0
    assert all(row["cached_equal_to_device"] for row in report["timings"])
    # The smoke's largest lookups take the host-gather path, as T = 8192 does on the GPU; its rows moved are
    # the distinct misses (+ the zero row), fewer than the distinct rows "host" would move.
    last = report["timings"][-1]
    assert last["cached_path"] == "host_gather" and report["timings"][0]["cached_path"] == "one_kernel"
    assert 0 < last["moved_rows_cached"] <= last["moved_rows_host"] == last["distinct_rows"]
    assert report["cached_host_bytes_ratio_T64"] == last["host_bytes_ratio"]
    sweep = last["direct_share_sweep"]["0.4"]  # a share of the misses read directly instead
    assert sweep["equal_to_device"] and sweep["direct_reads"] > 0 and sweep["gathered_rows"] < last["moved_rows_cached"]
    measured = report["measured"]
    assert measured["distinct_missed_per_step_sum"] <= measured["moved_rows_cached"]
    assert measured["moved_rows_cached"] <= measured["distinct_missed_per_step_sum"] + report["serve"]["measured_steps"]
    assert "| T (tokens x 24 rows) | `cached` | `device` |" in done.stdout


def test_stream_steps_fold_the_stored_stream_into_steps(heldout, monkeypatch, rng, tmp_path):
    from test_bench_real_text import write_stream

    path = tmp_path / "stream.npz"
    write_stream(path, rng, (300, 450))
    monkeypatch.setattr(heldout, "STREAM_PATH", path)
    sizes = heldout.SMOKE
    steps, facts = heldout.stream_steps(sizes)
    ids, corpus = heldout.load_stream(path, max_tokens=sizes.max_stream_tokens)
    whole = len(ids) // sizes.step_tokens
    assert steps.shape == (whole, sizes.step_tokens, 24) and steps.dtype == np.int32
    assert np.array_equal(steps.reshape(-1, 24), ids[:whole * sizes.step_tokens] % sizes.rows)
    assert facts["corpus"] == corpus == "tiny" and facts["steps"] == whole
    assert facts["distinct_rows"] == np.unique(ids[:whole * sizes.step_tokens]).size


def test_stream_steps_without_a_stored_stream(heldout, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(heldout, "STREAM_PATH", tmp_path / "absent.npz")
    steps, facts = heldout.stream_steps(heldout.SMOKE)
    assert facts["corpus"] == "synthetic-zipf" and "synthetic" in capsys.readouterr().out
    assert 0 <= steps.min() and steps.max() < heldout.SMOKE.rows
    with pytest.raises(SystemExit, match="real_text.py stream"):  # the full run needs the real text
        heldout.stream_steps(heldout.FULL)


def test_markdown_table_reports_each_placement(heldout, rng):
    timings = []
    for tokens in (64, 8192):
        host, cached, device = (float(x) for x in rng.uniform(10, 5000, 3))
        timings.append({"T": tokens, "host_us": host, "cached_us": cached, "device_us": device,
                        "cached_speedup_vs_host": host / cached, "hit_rate": float(rng.uniform()),
                        "host_bytes_ratio": float(rng.uniform())})
    report = {"timings": timings, "measured": {"hit_rate": 0.405, "host_bytes_ratio": 0.678}, "device": "fake",
              "stream": {"corpus": "tiny", "step_tokens": 8192}, "cache": {"policy": "set-lru", "slots": 100,
                                                                          "fraction_of_v41_layer1_table": 0.02},
              "serve": {"warm_steps": 40, "measured_steps": 42}, "heldout_ceiling": 0.422,
              "best_static_share": 1.0, "measured_distinct_rows": 50, "smoke": False}
    table = heldout.markdown_table(report, heldout.PLACEMENTS).splitlines()
    for row, line in zip(timings, table[2:4]):
        assert line == (f"| {row['T']} | {row['host_us']:.1f} us | {row['cached_us']:.1f} us | "
                        f"{row['device_us']:.1f} us | {row['host_us'] / row['cached_us']:.2f}x | "
                        f"{row['hit_rate']:.1%} | {row['host_bytes_ratio']:.1%} |")
    assert "40.5% of row reads served from HBM with 2% of a V4.1 table's rows" in table[-1]
    assert "ceiling 42.2%" in table[-1] and "all of which fit in the 100 slots" in table[-1]


def test_without_cuda_one_clear_error(heldout, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        heldout.main([])
    assert stopped.value.code == 2 and "--smoke" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as stopped:
        heldout.main(["--smoke"])
    assert stopped.value.code == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_bench_cache_update_without_cuda_one_clear_error():
    """The update benchmark needs a GPU: without one it says so on stderr and exits 2, no traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a CUDA device")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "cache" / "bench_cache_update.py")], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "bench_cache_update.py: needs a CUDA device" and "Traceback" not in done.stderr
