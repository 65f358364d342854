"""Writes through a temporary file leave none behind when they fail: the token-map cache (target
a directory, a failed rename, a failed write) and the checkpoint writer."""

from __future__ import annotations

import pytest

import engram
import engram.vocab as vocab_module
from engram.tools.testing import write_synthetic_checkpoint

from test_vocab import word_level_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(directory))
    return directory


def _cache_file(directory, tokenizer):
    import hashlib

    fingerprint = hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()
    return directory / f"token_map-{vocab_module._RULE_VERSION}-{fingerprint}.npz"


def _leftovers(directory):
    return sorted(p.name for p in directory.rglob("*.tmp"))


def test_cache_target_that_is_a_directory(cache):
    tokenizer = word_level_tokenizer(["<unk>", "a", "b", "c"])
    target = _cache_file(cache, tokenizer)
    target.mkdir(parents=True)
    for _ in range(3):
        compressor = engram.TokenCompressor.from_tokenizer(tokenizer)
        assert compressor.vocab_size == 4
    assert _leftovers(cache) == [] and target.is_dir()


def test_a_failed_rename_or_write_leaves_no_temp_file(cache, monkeypatch):
    tokenizer = word_level_tokenizer(["<unk>", "a", "b"])

    def no_rename(*args):
        raise PermissionError("rename refused")

    monkeypatch.setattr(vocab_module.os, "replace", no_rename)
    engram.TokenCompressor.from_tokenizer(tokenizer)
    assert _leftovers(cache) == [] and not _cache_file(cache, tokenizer).exists()
    monkeypatch.undo()
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(cache))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vocab_module.np, "savez", full_disk)
    engram.TokenCompressor.from_tokenizer(tokenizer)
    assert _leftovers(cache) == []
    monkeypatch.undo()
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(cache))
    engram.TokenCompressor.from_tokenizer(tokenizer)   # and a normal run still caches it
    assert _cache_file(cache, tokenizer).is_file() and _leftovers(cache) == []


def test_a_failed_checkpoint_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import engram.checkpoint.writing as checkpoint_module

    def no_rename(*args):
        raise PermissionError("rename refused")

    monkeypatch.setattr(checkpoint_module.os, "replace", no_rename)
    with pytest.raises(PermissionError):
        write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", num_shards=2)
    assert _leftovers(tmp_path) == []
