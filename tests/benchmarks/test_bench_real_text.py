"""benchmarks/real_text.py on the CPU: its command line, and the stored read stream that bench_cache.py
hashes on the device (one stream per file, cut at ``max_tokens``) against the numpy reference hasher."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engram
from engram.hashing.reference import hash_ngrams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def real_text(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import real_text

    return real_text


def write_stream(path: Path, rng, file_lengths) -> tuple[np.ndarray, np.ndarray, engram.TokenCompressor]:
    """A stored stream of random token ids over a random token map at V4.1's compressed size."""
    spec = engram.EngramSpec.from_hf_config(engram.tools.defaults.packaged_config())
    compressed = spec.compressed_vocab_size
    token_map = np.concatenate([np.arange(compressed), rng.integers(0, compressed, 500)]).astype(np.int32)
    tokens = rng.integers(0, len(token_map), sum(file_lengths)).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(file_lengths)]).astype(np.int64)
    np.savez_compressed(path, tokens=tokens, file_starts=starts, token_map=token_map, corpus=np.array("tiny"))
    return tokens, starts, engram.TokenCompressor(token_map)


def test_load_stream_hashes_each_file_as_its_own_stream(real_text, rng, tmp_path):
    path = tmp_path / "stream.npz"
    tokens, starts, vocab = write_stream(path, rng, (7, 12, 5))
    layout = real_text.v41_layout()
    per_file = [hash_ngrams(tokens[a:b].astype(np.int64), layout, vocab) for a, b in zip(starts[:-1], starts[1:])]
    ids, corpus = real_text.load_stream(path)
    assert corpus == "tiny" and ids.shape == (24, layout.num_columns)
    assert np.array_equal(ids, np.concatenate([h[:, 0, :] for h in per_file]))
    # The whole stream hashed as one differs: history does not cross files.
    assert not np.array_equal(ids, hash_ngrams(tokens.astype(np.int64), layout, vocab)[:, 0, :])
    cut, _ = real_text.load_stream(path, layer_index=1, max_tokens=10)  # 7 tokens of file 0, 3 of file 1
    assert np.array_equal(cut, np.concatenate([per_file[0][:, 1, :], per_file[1][:3, 1, :]]))


def test_synthetic_stream_is_seeded_and_in_range(real_text):
    first = real_text.synthetic_stream(200, 1000, 24, seed=3)
    assert first.shape == (200, 24) and first.dtype == np.int64
    assert 0 <= first.min() and first.max() < 1000
    assert np.array_equal(first, real_text.synthetic_stream(200, 1000, 24, seed=3))
    # Zipf-skewed: the most read id takes far more than a uniform share.
    assert np.bincount(first.reshape(-1)).max() > 20 * first.size / 1000


@pytest.mark.parametrize("argv", [[], ["words"], ["ids", "--tokens", "0"], ["ids", "--tokens", "x"],
                                  ["stream", "--corpus", "nope"]])
def test_bad_command_lines_are_one_clear_error(real_text, capsys, argv):
    with pytest.raises(SystemExit) as stopped:
        real_text.main(argv)
    assert stopped.value.code == 2
    assert "usage:" in capsys.readouterr().err
