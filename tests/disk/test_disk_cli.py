"""``engram tables write``: every layer's row file written (then reused), its exit codes (0 done, 1 a
problem in the checkpoint or the write, 2 bad input before any byte), one ``error:`` line, no traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fresh_seed
from disk_tables import disk_checkpoint
from engram.table.disk.row_file import open_row_file
from engram.table.disk.writing import source_fingerprint
from engram.tools.cli import main

SEED = fresh_seed(__name__)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return disk_checkpoint(tmp_path_factory.mktemp("disk-cli") / "model", SEED, scale="tiny")


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(["tables", "write", *map(str, args)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def _error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_writes_every_layer_then_reuses_them(model, tmp_path, capsys):
    code, out, _ = _run(capsys, model.directory, "--directory", tmp_path, "--json")
    assert code == 0
    written = json.loads(out)
    assert [entry["layer"] for entry in written] == [1, 14] and not any(entry["reused"] for entry in written)
    for index, entry in enumerate(written):
        source = model.source(index)
        row_file = open_row_file(entry["path"], source_fingerprint(source), source.num_rows, source.head_dim)
        assert entry["rows"] == source.num_rows and entry["bytes"] == os.path.getsize(row_file.path)
    code, out, _ = _run(capsys, model.directory, "--directory", tmp_path, "--json")
    assert code == 0 and all(entry["reused"] for entry in json.loads(out))
    code, out, _ = _run(capsys, model.directory, "--directory", tmp_path, "--layers", 14)
    assert code == 0 and "reused (valid)" in out and "layer-14-table" in out and "layer-1-table" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(e["path"]).name for e in written)


@pytest.mark.parametrize("case", ["no checkpoint", "no directory", "unknown layer", "no room"])
def test_bad_input_exits_2_before_any_byte(model, tmp_path, capsys, monkeypatch, case):
    target = tmp_path / "rows"
    target.mkdir()
    args = [model.directory, "--directory", target]
    if case == "no checkpoint":
        args[0], says = tmp_path / "absent", "CHECKPOINT: expected a checkpoint directory"
    elif case == "no directory":
        args[2], says = tmp_path / "absent", "--directory: '"
    elif case == "unknown layer":
        args += ["--layers", 1, 7]
        says = "--layers: [7] are not Engram layers of this checkpoint (its layers: [1, 14])"
    else:
        real = os.statvfs

        def statvfs(path):
            stats = real(path)
            return os.statvfs_result((*tuple(stats)[:3], 1, 1, *tuple(stats)[5:]))

        monkeypatch.setattr(os, "statvfs", statvfs)
        says = "the row files still to write needs"
    code, _, err = _run(capsys, *args)
    assert code == 2 and says in _error(err), err
    assert not target.exists() or os.listdir(target) == []


def test_a_broken_checkpoint_exits_1(model, tmp_path, capsys, rng):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in model.directory.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    name = model.checkpoint.name(14, "embed.weight")
    file = broken / model.weight_map[name]
    tensors = load_file(file)
    values = tensors[name].view(torch.uint8).clone()
    row = int(rng.integers(0, values.shape[0]))
    values[row, 0] = 0xFF   # an E4M3 NaN byte
    tensors[name] = values.view(torch.float8_e4m3fn)
    save_file(tensors, file)
    target = tmp_path / "rows"
    target.mkdir()
    code, _, err = _run(capsys, broken, "--directory", target)
    assert code == 1 and f"row {row}" in _error(err) and "layer 14 table" in _error(err)
    code, _, err = _run(capsys, broken, "--directory", target, "--no-value-scan")
    assert code == 0, err
    (broken / "config.json").write_text("{}")
    code, _, err = _run(capsys, broken, "--directory", target)
    assert code == 1 and _error(err).startswith(f"error: checkpoint {broken}:")
