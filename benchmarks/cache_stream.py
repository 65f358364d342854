"""The real-text read stream of bench_cache.py: make_cache_stream.py's token ids hashed here
at V4.1-Flash's layout, one stream per file, as the engine's hasher would (numpy reference,
~1 s per 700k tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import engram
from engram.tools.defaults import packaged_config
from engram.hashing.reference import hash_ngrams

STREAM_PATH = Path(__file__).resolve().parents[1] / ".bench-data" / "cache_stream_v41.npz"


def v41_layout() -> engram.EngramLayout:
    return engram.EngramLayout(engram.EngramSpec.from_hf_config(packaged_config()))


def load_stream(path: Path = STREAM_PATH, layer_index: int = 0, max_tokens: int | None = None) -> tuple[np.ndarray, str]:
    """``(ids int64 [N, 24], corpus name)``: the hash ids of layer ``layer_index`` (0: V4.1's layer
    1) of the stored tokens, global ids of that layer's table (``[0, 384,006,168)`` for layer 1)."""
    stored = np.load(path)
    tokens, starts = stored["tokens"], stored["file_starts"]
    vocab = engram.TokenCompressor(stored["token_map"])
    layout = v41_layout()
    pieces, count = [], 0
    for first, last in zip(starts[:-1], starts[1:]):
        if max_tokens is not None:
            last = min(last, first + max_tokens - count)
        if last <= first:
            break
        pieces.append(hash_ngrams(tokens[first:last].astype(np.int64), layout, vocab)[:, layer_index, :])
        count += last - first
    return np.concatenate(pieces), str(stored["corpus"])


def synthetic_stream(tokens: int, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """``int64 [tokens, columns]`` Zipf-skewed ids in ``[0, rows)`` (a stand-in when no stored stream exists)."""
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.2, size=(tokens, columns)), rows) - 1
    return rng.permutation(rows)[ranks].astype(np.int64)
