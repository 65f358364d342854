"""engram info --checkpoint runs the loader's checks: a checkpoint that from_pretrained refuses
exits 1 with the loader's problem, one that loads says "checkpoint ok"; a broken file is one problem."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram import EngramMemory
from engram.checkpoint import INDEX_FILE, SafetensorsCheckpoint
from engram.tools.cli import main
from engram.tools.testing import write_synthetic_checkpoint


def _problems(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"  \d+\. ", line)]


def _info(directory, *flags, capsys) -> tuple[int, str]:
    """Exit code and stdout (the report); an error line, never a traceback, goes to stderr (returned
    appended after stdout when there is one, so a test sees the whole of what the user saw)."""
    code = main(["info", "--checkpoint", str(directory), *flags])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out + captured.err


def _edit(directory, name: str, change) -> None:
    path = SafetensorsCheckpoint(directory).file_of(name)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _loader_error(directory) -> str:
    with pytest.raises(ValueError) as error:
        EngramMemory.from_pretrained(directory, placement="cpu", progress=False)
    return str(error.value)


@pytest.fixture
def checkpoint(tmp_path):
    return write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", num_shards=2).directory


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


def test_fp8_wkv_without_its_scales(checkpoint, capsys):
    name = "layers.14.engram.wkv.scale"
    _edit(checkpoint, name, lambda tensors: tensors.pop(name) is None)
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    del index["weight_map"][name]
    (checkpoint / INDEX_FILE).write_text(json.dumps(index))
    code, out = _info(checkpoint, capsys=capsys)
    assert code == 1 and "checkpoint ok" not in out
    assert any(f"tensor '{name}' is missing" in line and "F8_E4M3" in line for line in _problems(out)), out
    assert _loader_error(checkpoint).startswith(f"tensor '{name}' is missing")


def test_bf16_wkv_with_leftover_scales(tmp_path, capsys):
    directory = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", wkv_dtype="bf16",
                                           with_index=False).directory

    def add_scale(tensors):
        tensors["layers.1.engram.wkv.scale"] = torch.full((1, 2), 127, dtype=torch.uint8)
    _edit(directory, "layers.1.engram.wkv.weight", add_scale)
    code, out = _info(directory, capsys=capsys)
    assert code == 1 and "checkpoint ok" not in out
    expected = _loader_error(directory)
    assert "found block scales" in expected
    assert [line.split(". ", 1)[1] for line in _problems(out)] == [expected]


def test_nan_byte_in_a_table(checkpoint, capsys):
    name = "layers.1.engram.embed.weight"

    def poison(tensors):
        values = tensors[name].view(torch.uint8).clone()
        values[values & 0x7F == 0x7F] = 0
        values[77, 5] = 0xFF
        tensors[name] = values.view(torch.float8_e4m3fn)
    _edit(checkpoint, name, poison)
    code, out = _info(checkpoint, capsys=capsys)
    assert code == 1
    lines = _problems(out)
    assert len(lines) == 1 and "row 77 holds value byte 0xff (E4M3 NaN) at column 5" in lines[0], out
    assert _loader_error(checkpoint) in lines[0]
    # --no-value-scan skips the table bytes (and says so)
    code, out = _info(checkpoint, "--no-value-scan", capsys=capsys)
    assert code == 0 and "checkpoint ok" in out and "not scanned" in out


def test_nan_in_a_gate_weight_is_found_without_the_table_scan(checkpoint, capsys):
    name = "layers.14.engram.q_weight"

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][2, 9] = float("nan")
    _edit(checkpoint, name, poison)
    code, out = _info(checkpoint, "--no-value-scan", capsys=capsys)
    assert code == 1
    assert any(f"'{name}'" in line and "element [2, 9] is nan" in line for line in _problems(out)), out


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not utf-8"])
def test_corrupt_tokenizer(checkpoint, capsys, damage):
    path = checkpoint / "tokenizer.json"
    data = path.read_bytes()
    path.write_bytes({"garbage": b"{\"model\": 12", "truncated": data[: len(data) // 2],
                      "not utf-8": b"\xff\xfe" + data}[damage])
    code, out = _info(checkpoint, capsys=capsys)
    assert code == 1 and "checkpoint ok" not in out
    lines = _problems(out)
    assert len(lines) == 1 and "tokenizer.json" in lines[0], out
    assert _loader_error(checkpoint) in lines[0]


def test_a_corrupt_shard_is_one_problem(checkpoint, capsys):
    path = SafetensorsCheckpoint(checkpoint).file_of("layers.1.engram.k_weight")
    path.write_bytes(path.read_bytes()[:-100])
    code, out = _info(checkpoint, capsys=capsys)
    assert code == 1
    lines = _problems(out)
    assert len(lines) == 1 and path.name in lines[0] and "not a readable safetensors file" in lines[0], out
    assert out.count("not a readable safetensors file") == 1


def test_a_sound_checkpoint_is_ok(checkpoint, capsys):
    code, out = _info(checkpoint, capsys=capsys)
    assert code == 0 and "checkpoint ok" in out and not _problems(out)


def test_checkpoint_given_a_file(checkpoint, capsys):
    code, out = _info(checkpoint / "config.json", capsys=capsys)
    assert code == 2 and "--checkpoint: expected a checkpoint directory" in out and "found a file" in out
    assert "not valid JSON" not in out
