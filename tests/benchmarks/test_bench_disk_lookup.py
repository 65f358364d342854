"""benchmarks/disk/bench_disk_lookup.py on the CPU at a tiny size: placement "disk" against the CPU baseline on
uniform and real-text ids, prefetched and direct, with the RAM hit rate and the disk's read rate per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks" / "disk"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_disk_lookup

    return bench_disk_lookup


def test_a_tiny_run_reports_each_stream_and_size_against_the_baseline(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    report = bench.main(["--gib", "0.01", "--directory", str(tmp_path / "rows"), "--tokens", "8,50", "--steps", "4",
                         "--warm-steps", "3", "--gap-ms", "1", "--read-threads", "2"])
    printed = capsys.readouterr().out
    assert "disk_vs_host" in printed and report["baseline"] == "cpu"
    written = json.loads((tmp_path / "out" / "disk-lookup-cpu.json").read_text())
    assert written["results"] == report["results"] and written["device"] == "cpu" and "torch" in written
    from real_text import STREAM_PATH

    streams = ("uniform", "realtext") if STREAM_PATH.exists() else ("uniform",)   # the text stream when it is built
    assert [(row["stream"], row["tokens"]) for row in report["results"]] == [
        (stream, tokens) for stream in streams for tokens in (8, 50)]
    for row in report["results"]:
        for path in ("prefetched", "direct"):
            assert row[f"disk_{path}_us"] > 0 and row[f"host_{path}_us"] > 0
            assert row[f"disk_vs_host_{path}"] == pytest.approx(row[f"disk_{path}_us"] / row[f"host_{path}_us"])
        assert 0.0 <= row["ram_hit_rate"] <= 1.0 and row["disk_rows_read_per_s"] >= 0


@pytest.mark.parametrize("argv", [["--tokens", "a,b"], ["--steps", "0"], ["--gib", "-1"]])
def test_bad_arguments_exit_2(bench, capsys, argv):
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code == 2 and argv[0] in capsys.readouterr().err
