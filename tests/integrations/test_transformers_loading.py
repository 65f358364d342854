"""load_model on checkpoints as DeepSeek ships them (an FP8 quantization_config, E4M3 linear
weights with block scales, an FP8 Engram wkv), and its errors for paths that are no checkpoint."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors import safe_open

from conftest import missing_dependency

try:
    from transformers import DeepseekV4ForCausalLM
except ImportError:  # pragma: no cover - reported by the fixture below
    DeepseekV4ForCausalLM = None

from engram.integrations.transformers import load_model
from engram.tools.testing import write_transformers_checkpoint


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    if DeepseekV4ForCausalLM is None:
        missing_dependency("transformers >= 5.23 with DeepseekV4ForCausalLM (pip install -e '.[transformers]')")
    if importlib.util.find_spec("accelerate") is None:
        missing_dependency("accelerate, which transformers needs for FP8 checkpoints (pip install -e '.[transformers]')")
    return write_transformers_checkpoint(tmp_path_factory.mktemp("deepseek-v4.1-fp8"), seed=5, fp8=True)


def _stored(directory, weight_map, name) -> torch.Tensor:
    with safe_open(str(directory / weight_map[name]), framework="pt") as handle:
        return handle.get_tensor(name)


def test_an_fp8_checkpoint_loads_with_its_weights_dequantized_exactly(fp8_checkpoint, seed):
    directory, weight_map = fp8_checkpoint.directory, fp8_checkpoint.weight_map
    assert fp8_checkpoint.config["quantization_config"]["fmt"] == "e4m3"
    model = load_model(directory, progress=False).eval()
    state = model.state_dict()
    fp8_names = [name for name in weight_map if name.endswith(".weight_scale_inv")]
    assert len(fp8_names) > 10
    for scale_name in fp8_names:
        name = scale_name.removesuffix("_scale_inv")
        values = _stored(directory, weight_map, name)
        assert values.dtype == torch.float8_e4m3fn, name
        scale = _stored(directory, weight_map, scale_name)
        expected = values.to(torch.float32) * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[
            : values.shape[0], : values.shape[1]]
        assert torch.equal(state[name].to(torch.float32), expected), name   # E4M3 x 2**k: exact in fp32
    memory = model.engram_handle.memory
    assert memory.spec.weight_block_size == (128, 128)
    assert _stored(directory, weight_map, "model.layers.1.engram.wkv.weight").dtype == torch.float8_e4m3fn
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (2, 9), generator=generator)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
    assert out.shape == (2, 12)
    assert model.engram_handle.hash_ids.shape[-2:] == (memory.spec.num_layers, memory.spec.num_columns)


def test_without_accelerate_the_error_names_it(fp8_checkpoint, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(ValueError, match=r"quantization_config .*accelerate, which is not installed: "
                                         r"pip install 'engram\[transformers\]'"):
        load_model(fp8_checkpoint.directory, progress=False)


def test_a_missing_directory_is_named(tmp_path):
    if DeepseekV4ForCausalLM is None:
        missing_dependency("transformers >= 5.23 with DeepseekV4ForCausalLM (pip install -e '.[transformers]')")
    with pytest.raises(ValueError, match=r"model_dir '/nonexistent' does not exist"):
        load_model("/nonexistent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is not a directory"):
        load_model(tmp_path / "file")
    with pytest.raises(ValueError, match=r"config file '.*config.json' does not exist"):
        load_model(tmp_path)
