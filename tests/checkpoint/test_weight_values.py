"""Loading refuses a non-finite value in the small tensors of a layer (wkv weight and scales,
q_weight, k_weight), naming the tensor and the element; an FP8 wkv reaches its Engram module
as FP8 (never dequantized on the way); the demo reports a NaN update as NaN."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import engram.layer.wkv as wkv_module
from engram import EngramMemory
from engram.checkpoint import SafetensorsCheckpoint
from engram.layer import WkvProjection, dequantize_wkv_weight
from engram.tools.testing import write_synthetic_checkpoint


def _rewrite(directory, name: str, change) -> str:
    """Apply ``change(tensor) -> tensor`` to one stored tensor; returns the file's name."""
    path = SafetensorsCheckpoint(directory).file_of(name)
    tensors = load_file(path)
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.name


def _set_byte(row: int, column: int, byte: int):
    def change(tensor):
        dtype = tensor.dtype
        raw = tensor.view(torch.uint8)
        raw[raw == byte] = 0  # no other element holds the byte put in
        raw[row, column] = byte
        return raw.view(dtype)
    return change


def _set_value(row: int, column: int, value: float):
    def change(tensor):
        tensor[row, column] = value
        return tensor
    return change


CASES = {
    "fp8 wkv byte 0xff": ("fp8", "wkv.weight", lambda r, c: _set_byte(r, c, 0xFF), "value byte 0xff (E4M3 NaN)"),
    "fp8 wkv byte 0x7f": ("fp8", "wkv.weight", lambda r, c: _set_byte(r, c, 0x7F), "value byte 0x7f (E4M3 NaN)"),
    "wkv scale byte 255": ("fp8", "wkv.scale", lambda r, c: _set_byte(r % 2, c % 2, 0xFF), "scale byte 255"),
    "bf16 wkv nan": ("bf16", "wkv.weight", lambda r, c: _set_value(r, c, float("nan")), "nan (BF16)"),
    "q_weight nan": ("fp8", "q_weight", lambda r, c: _set_value(r % 4, c, float("nan")), "nan (BF16)"),
    "k_weight inf": ("fp8", "k_weight", lambda r, c: _set_value(r % 4, c, float("inf")), "inf (BF16)"),
    "k_weight -inf": ("bf16", "k_weight", lambda r, c: _set_value(r % 4, c, float("-inf")), "-inf (BF16)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_non_finite_weight_is_refused_with_its_tensor_and_index(tmp_path, case, rng):
    wkv_dtype, kind, damage, what = CASES[case]
    synthetic = write_synthetic_checkpoint(tmp_path, tokenizer="word", wkv_dtype=wkv_dtype, num_shards=2)
    name = f"layers.1.engram.{kind}"
    row, column = int(rng.integers(0, 64)), int(rng.integers(0, 64))
    if kind == "wkv.scale":
        row, column = row % 2, column % 2
    elif kind in ("q_weight", "k_weight"):
        row %= 4
    file_name = _rewrite(synthetic.directory, name, damage(row, column))
    message = rf"tensor '{re.escape(name)}' in file '.*{file_name}': element \[{row}, {column}\] is {re.escape(what)}"
    with pytest.raises(ValueError, match=message):
        EngramMemory.from_pretrained(synthetic.directory, placement="cpu", progress=False)
    # check_values=False (trusted checkpoints) loads it as it is
    if kind != "wkv.scale":  # a NaN block scale is refused when the projection is built, whatever the flag
        EngramMemory.from_pretrained(synthetic.directory, placement="cpu", progress=False, check_values=False)


def test_the_demo_reports_a_nan_update_as_nan(tmp_path, monkeypatch, capsys):
    """A NaN in q_weight (loaded with the value check switched off): the worst-token column says nan,
    never 0.00e+00 beside a NaN error."""
    import engram.checkpoint.reading as checkpoint_module
    from engram.tools.demo import run_layer_demo
    from rich.console import Console

    synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word")
    _rewrite(synthetic.directory, "layers.1.engram.q_weight", _set_value(0, 3, float("nan")))
    monkeypatch.setattr(checkpoint_module, "check_weight_values", lambda tensor, info: None, raising=False)
    console = Console(width=300, record=True)
    texts = [("a", "the table and the memory of the model " * 8), ("b", "a memory of the table " * 5)]
    assert not run_layer_demo(texts, checkpoint=str(synthetic.directory), console=console)
    row = next(line for line in console.export_text().splitlines() if line.strip("│ ").startswith("1 "))
    cells = [cell.strip() for cell in row.split("│") if cell.strip()]
    assert cells[3] == "nan" and cells[4] == "nan", row


def _fp8_weight(generator):
    out_features, in_features = 96, 256
    weight = (torch.randn(out_features, in_features, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 130, (1, 2), generator=generator, dtype=torch.int32).to(torch.uint8)
    return weight, scale


def test_an_fp8_projection_keeps_the_weight_without_a_bf16_copy(monkeypatch, seed):
    """The FP8 paths take the E4M3 weight and its UE8M0 scales as they are: nothing dequantizes it
    (315 MB per V4.1 layer), and the buffers equal those built before (weight bytes, fp32 scales)."""
    generator = torch.Generator().manual_seed(seed)
    weight, scale = _fp8_weight(generator)
    monkeypatch.setattr(wkv_module, "interpreting", lambda: True)   # the FP8 backends' CPU guard

    def refuse(*args, **kwargs):
        raise AssertionError("dequantize_wkv_weight called for an FP8 path")

    monkeypatch.setattr(wkv_module, "dequantize_wkv_weight", refuse)
    projection = WkvProjection(weight, scale, [128, 128], backend="fused")
    assert projection.fp8 and projection.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(projection.weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(projection.weight_scale_blocks, 2.0 ** (scale.to(torch.float32) - 127))
    # The checks still run before anything else.
    with pytest.raises(ValueError, match=r"scale: expected shape \[1, 2\]"):
        WkvProjection(weight, scale[:, :1], [128, 128], backend="fused")
    with pytest.raises(ValueError, match="scale: found UE8M0 byte 255"):
        WkvProjection(weight, torch.full((1, 2), 255, dtype=torch.uint8), [128, 128], backend="fused")
    monkeypatch.undo()
    bf16 = WkvProjection(weight, scale, [128, 128], backend="bf16")
    assert torch.equal(bf16.weight.view(torch.int16), dequantize_wkv_weight(weight, scale, [128, 128]).view(torch.int16))
