"""benchmarks/disk/bench_disk.py on the CPU at a tiny size: it makes a valid row file (then reuses it), runs the
C ceiling and the tier's reader at each thread count, and writes its report with the ratio per count."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks" / "disk"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_disk

    return bench_disk


def test_a_tiny_run_reports_both_rates_and_their_ratio(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    args = ["--gib", "0.004", "--directory", str(tmp_path / "rows"), "--threads", "1,3", "--seconds", "0.2",
            "--batch", "64"]
    report = bench.main(args)
    printed = capsys.readouterr().out
    assert "disk_reads_vs_ceiling" in printed and not report["file_reused"]
    written = json.loads((tmp_path / "out" / "disk-cpu.json").read_text())
    assert written["rows"] == report["rows"] and written["device"] == "cpu" and "torch" in written
    assert [row["threads"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["reader"]["tags_checked"] and row["reader_reads_per_s"] > 0
        if "skipped" not in report["ceiling"]:
            assert row["ceiling_reads_per_s"] > 0
            assert row["disk_reads_vs_ceiling"] == pytest.approx(row["reader_reads_per_s"] / row["ceiling_reads_per_s"])
    stamp = os.stat(report["file"]).st_mtime_ns
    again = bench.main(args)
    assert again["file_reused"] and os.stat(again["file"]).st_mtime_ns == stamp


def test_bad_arguments_exit_2(bench, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--threads", "a,b"])
    assert stopped.value.code == 2 and "--threads" in capsys.readouterr().err
