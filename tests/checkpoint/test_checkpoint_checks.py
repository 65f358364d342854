"""What the loader and ``engram info --checkpoint`` refuse beyond one tensor's header, and that they
agree: a table scale that makes a finite value infinite (every read path), a tensor named as an
Engram tensor the config has no place for, a stray unreadable file no tensor is read from, a file
that is a directory, and the per-file counts of the files table."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engram import EngramLayout, EngramMemory
from engram.checkpoint import INDEX_FILE, SafetensorsCheckpoint, load_engram_table
from engram.checkpoint.loading import TableSource
from engram.tools.cli import main
from engram.tools.testing import write_synthetic_checkpoint


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")


def _checkpoint(tmp_path, **kwargs):
    return write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", **kwargs)


def _edit(directory, name: str, change) -> str:
    path = SafetensorsCheckpoint(directory).file_of(name)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.name


def _info(directory, capsys, *flags) -> tuple[int, str, str]:
    code = main(["info", "--checkpoint", str(directory), *flags])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def _problems(out: str) -> list[str]:
    return [line.split(". ", 1)[1] for line in out.splitlines() if re.match(r"  \d+\. ", line)]


def _loader_error(directory) -> str:
    with pytest.raises(ValueError) as error:
        EngramMemory.from_pretrained(directory, placement="cpu", progress=False)
    return str(error.value)


def _overflowing_scale(directory, rng) -> tuple[int, int]:
    """Put scale byte 0xFE (2**127) over a block of layer 1's table that holds a value >= 2; (row, block)."""
    values_name, scales_name = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"
    values = load_file(SafetensorsCheckpoint(directory).file_of(values_name))[values_name].view(torch.uint8)
    rows, width = values.shape
    row, block = int(rng.integers(1, rows)), int(rng.integers(0, width // 32))
    exponent = (values[row, block * 32:(block + 1) * 32].to(torch.int32) >> 3) & 0xF
    if int(exponent.max()) < 8:   # no value >= 2 there: make one
        _edit(directory, values_name, lambda t: t.__setitem__(values_name, _with_byte(t[values_name], row, block * 32)))

    def scale(tensors):
        data = tensors[scales_name].view(torch.uint8).clone()
        data[row, block] = 0xFE
        tensors[scales_name] = data.view(tensors[scales_name].dtype)
    _edit(directory, scales_name, scale)
    return row, block


def _with_byte(tensor, row, column):
    data = tensor.view(torch.uint8).clone()
    data[row, column] = 0x40   # 2.0
    return data.view(tensor.dtype)


def test_a_scale_that_makes_a_value_infinite_is_refused_everywhere(tmp_path, rng, capsys):
    synthetic = _checkpoint(tmp_path, num_shards=2)
    row, block = _overflowing_scale(synthetic.directory, rng)
    expected = rf"row {row} holds scale byte 254 \(2\*\*127\) at column {block}, under which .* >= 2\*\*128"
    assert re.search(expected, _loader_error(synthetic.directory))
    code, out, _ = _info(synthetic.directory, capsys)
    assert code == 1 and "checkpoint ok" not in out
    assert any(re.search(expected, problem) for problem in _problems(out)), out
    # check_values=False still refuses it (the scales are always checked), and so does every read path
    with pytest.raises(ValueError, match=expected):
        EngramMemory.from_pretrained(synthetic.directory, placement="cpu", progress=False, check_values=False)
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    layout = EngramLayout(synthetic.spec)
    source = None
    for chunk_bytes in (64, 4096, 1 << 20):
        with pytest.raises(ValueError, match=expected):
            load_engram_table(checkpoint, layout, 0, chunk_bytes=chunk_bytes)
        table = load_engram_table(checkpoint, layout, 1, chunk_bytes=chunk_bytes)   # the other layer is sound
        assert table.storage.value_bytes.shape[0] == layout.num_embeddings[1]
        values_info = checkpoint.info("layers.1.engram.embed.weight")
        scales_info = checkpoint.info("layers.1.engram.embed.scale")
        source = TableSource(checkpoint, values_info, scales_info, 0, values_info.shape[0], synthetic.spec.head_dim,
                             "layer 1 table", chunk_bytes)
        rows = values_info.shape[0]
        # contiguous targets: the checkpoint's chunked reader; packed rows: through a memory map
        contiguous = (torch.empty(rows, values_info.shape[1], dtype=torch.uint8),
                      torch.empty(rows, scales_info.shape[1], dtype=torch.uint8))
        packed = torch.empty(rows, 96, dtype=torch.uint8)
        strided = (packed[:, :values_info.shape[1]], packed[:, 64:64 + scales_info.shape[1]])
        for targets in (contiguous, strided):
            with pytest.raises(ValueError, match=expected):
                source.read_into(*targets)
    assert source is not None


@pytest.mark.parametrize("case", ["value 0x7f", "value 0xff", "scale 255", "scale 0xfe"])
def test_the_loader_info_and_the_table_refuse_the_same_bytes(case, tmp_path, rng, capsys, monkeypatch):
    """Every byte the table's own check refuses (engram.table.fp8.check_table_values) the loader refuses
    with the same row and byte, and info lists exactly the loader's error."""
    from engram.checkpoint import load_engram_table
    from engram.table import EngramTable

    synthetic = _checkpoint(tmp_path, num_shards=2)
    values_name, scales_name = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"
    if case == "scale 0xfe":
        row, block = _overflowing_scale(synthetic.directory, rng)
        shown = rf"row {row} holds scale byte 254 \(2\*\*127\) at column {block}, under which "
    else:
        kind, byte = case.split()
        name = values_name if kind == "value" else scales_name
        rows, width = SafetensorsCheckpoint(synthetic.directory).info(name).shape
        row, column = int(rng.integers(0, rows)), int(rng.integers(0, width))

        def poke(tensors):
            data = tensors[name].view(torch.uint8).clone()
            data[row, column] = int(byte, 16) if byte.startswith("0x") else int(byte)
            tensors[name] = data.view(tensors[name].dtype)
        _edit(synthetic.directory, name, poke)
        shown = (rf"row {row} holds value byte {byte} \(E4M3 NaN\) at column {column}" if kind == "value"
                 else rf"row {row} holds scale byte 255 \(UE8M0 NaN\) at column {column}")
    error = _loader_error(synthetic.directory)
    assert re.search(shown, error), error
    code, out, _ = _info(synthetic.directory, capsys)
    assert code == 1 and _problems(out) == [error], out
    # the same bytes handed to EngramTable directly: the same row and byte
    tensors = {**load_file(SafetensorsCheckpoint(synthetic.directory).file_of(values_name)),
               **load_file(SafetensorsCheckpoint(synthetic.directory).file_of(scales_name))}
    values, scales = tensors[values_name].view(torch.uint8), tensors[scales_name].view(torch.uint8)
    with pytest.raises(ValueError, match=shown):
        EngramTable(values, scales)
    with pytest.raises(ValueError, match=shown):
        EngramTable.from_layout(EngramLayout(synthetic.spec), 0, None, values, scales)
    # the loader checked these bytes itself: the table it builds does not scan them again
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    scans = []
    original = EngramTable.__init__

    def counting(self, *args, **kwargs):
        scans.append(kwargs.get("check_values", True))
        original(self, *args, **kwargs)
    monkeypatch.setattr(EngramTable, "__init__", counting)
    load_engram_table(checkpoint, EngramLayout(synthetic.spec), 1)
    assert scans == [False]


def test_tensors_the_config_has_no_place_for(tmp_path, capsys):
    directory = _checkpoint(tmp_path, num_shards=1, with_index=False).directory
    added = {"layers.1.engram.foo": torch.zeros(3, dtype=torch.bfloat16),
             "layers.5.engram.q_weight": torch.zeros(4, 64, dtype=torch.bfloat16)}
    file_name = _edit(directory, "layers.1.engram.q_weight", lambda tensors: tensors.update(added))
    code, out, _ = _info(directory, capsys)
    assert code == 1 and "checkpoint ok" not in out
    problems = _problems(out)
    assert any("'layers.1.engram.foo'" in p and "unknown Engram tensor 'foo'" in p for p in problems), out
    assert any("'layers.5.engram.q_weight'" in p and "layer 5 is not an Engram layer" in p and "[1, 14]" in p
               for p in problems), out
    assert "layers.5.engram.q_weight" in _loader_error(directory) or "layers.1.engram.foo" in _loader_error(directory)
    # the files table counts every tensor of the file: Engram ones (known or not) and the others
    with safe_open(str(directory / file_name), framework="pt") as handle:
        names = list(handle.keys())
    engram_count = sum(".engram." in name for name in names)
    row = next(line for line in out.splitlines() if line.startswith("│ " + file_name))
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    assert cells[1] == str(engram_count) and cells[3] == str(len(names) - engram_count), row
    assert engram_count == 14 and len(names) == 15


def test_a_stray_unreadable_file_warns_in_info_and_loads(tmp_path, capsys):
    """Without an index the loader reads no tensor from a file it cannot open; info agrees (a warning)."""
    directory = _checkpoint(tmp_path, num_shards=2, with_index=False).directory
    (directory / "garbage.safetensors").write_bytes(b"not a safetensors file at all")
    memory = EngramMemory.from_pretrained(directory, placement="cpu", progress=False)
    assert memory.nbytes > 0
    code, out, err = _info(directory, capsys)
    assert code == 0 and "checkpoint ok" in out, out + err
    assert "warning: file" in err and "garbage.safetensors" in err and "not a readable safetensors file" in err
    assert "unreadable" in out   # its row in the files table


def test_a_shard_that_is_a_directory(tmp_path, capsys):
    synthetic = _checkpoint(tmp_path, num_shards=2, with_index=True)
    name = "layers.1.engram.wkv.weight"
    shard = synthetic.directory / synthetic.weight_map[name]
    shard.unlink()
    shard.mkdir()
    error = _loader_error(synthetic.directory)
    assert f"{shard.name}' (named by" in error and "is a directory; expected a file" in error
    assert "does not exist" not in error
    code, out, _ = _info(synthetic.directory, capsys)
    assert code == 1 and any("is a directory" in p and shard.name in p for p in _problems(out)), out


def test_a_tensor_in_two_files_without_an_index_is_one_problem(tmp_path, capsys):
    directory = _checkpoint(tmp_path, num_shards=2, with_index=False).directory
    name = "layers.14.engram.k_weight"
    holder = SafetensorsCheckpoint(directory).file_of(name)
    other = next(p for p in directory.glob("*.safetensors") if p != holder)
    tensors = load_file(other)
    tensors[name] = torch.zeros(4, 64, dtype=torch.bfloat16)
    save_file(tensors, str(other), metadata={"format": "pt"})
    code, out, err = _info(directory, capsys)
    assert code == 1 and err == ""
    (problem,) = _problems(out)
    assert f"tensor '{name}' is in two files" in problem


def test_host_bytes_count_the_packed_rows(tmp_path, capsys):
    from engram.table.host_memory.rows import packed_row_bytes

    synthetic = _checkpoint(tmp_path, num_shards=1)
    spec = synthetic.spec
    code, out, _ = _info(synthetic.directory, capsys, "--no-value-scan")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("│ host"))
    packed = packed_row_bytes(spec.head_dim)
    share = packed / spec.row_bytes - 1
    assert f"rows packed to {packed} B of {spec.row_bytes}" in row and f"+{share:.0%}" in row and "+3%" not in row
    from engram.tools.checkpoint_report import format_bytes

    assert format_bytes(sum(EngramLayout(spec).num_embeddings) * packed) in row
    if spec.head_dim == 64:
        assert packed == 80 and f"{share:.0%}" == "21%"


def test_the_loader_refuses_what_info_refuses_for_unknown_names_of_another_prefix(tmp_path):
    directory = _checkpoint(tmp_path, num_shards=1, with_index=False).directory
    _edit(directory, "layers.1.engram.q_weight",
          lambda tensors: tensors.update({"layers.1.engram.embed.extra.weight": torch.zeros(2, dtype=torch.bfloat16)}))
    assert "unknown Engram tensor 'embed.extra.weight'" in _loader_error(directory)


def test_index_that_is_garbage_is_one_problem(tmp_path, capsys):
    directory = _checkpoint(tmp_path, num_shards=2, with_index=True).directory
    (directory / INDEX_FILE).write_bytes(b"\x00garbage")
    code, out, err = _info(directory, capsys)
    assert code == 1 and err == ""
    (problem,) = _problems(out)
    assert INDEX_FILE in problem and "not valid JSON" in problem
    json.loads((directory / "config.json").read_text())   # the config itself is fine
