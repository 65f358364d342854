"""benchmarks/host/bench_host.py on the CPU: it needs CUDA to time anything, so this checks its command line
(one clear error without a GPU), the id sets it reads (uniform, and real-text ids folded into the table)
and the headline keys of its report on tiny fake numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

HOST = Path(__file__).resolve().parents[2] / "benchmarks" / "host"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(HOST))
    import bench_host

    return bench_host


def test_id_sets_fold_layer_one_of_the_real_ids(bench, rng, tmp_path, capsys):
    rows = 1000
    real = rng.integers(0, 384_006_168, (50, 2, 24)).astype(np.int32)
    path = tmp_path / "real_ids.npy"
    np.save(path, real)
    sets = bench.id_sets(np.random.default_rng(5), rows, path)
    assert sets["uniform"].shape == (max(bench.TOKENS), 24) and sets["uniform"].dtype == np.int32
    assert 0 <= sets["uniform"].min() and sets["uniform"].max() < rows
    assert sets["real_text"].dtype == np.int32 and sets["real_text"].tolist() == (real[:, 0, :] % rows).tolist()
    missing = bench.id_sets(np.random.default_rng(5), rows, tmp_path / "absent.npy")
    assert list(missing) == ["uniform"] and "real-text ids skipped" in capsys.readouterr().out
    assert np.array_equal(missing["uniform"], sets["uniform"])  # same seed, same uniform ids


def test_headline_takes_the_faster_path(bench, rng):
    def row(ids, tokens, direct, gather):
        return {"ids": ids, "T": tokens, "direct_us": direct, "host_gather_us": gather,
                "unique_bytes": tokens * 24 * 264}

    direct_64, gather_8192 = rng.uniform(10, 30), rng.uniform(2000, 5000)
    paths = [row("uniform", 64, direct_64, 900.0), row("uniform", 8192, 7000.0, gather_8192),
             row("real_text", 8192, 1.0, 1.0)]  # real text never enters the headline
    keys = bench.headline(paths, {"overlap_slowdown_pct": 9.0})
    assert keys["host_T64_us"] == direct_64 and keys["host_T8192_us"] == gather_8192
    assert keys["host_T8192_GBps"] == pytest.approx(8192 * 24 * 264 / (gather_8192 * 1e-6) / 1e9)
    assert keys["overlap_slowdown_pct"] == 9.0


def test_without_cuda_one_clear_error(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        bench.main([])
    assert stopped.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--rows", "5"])
    assert stopped.value.code == 2
