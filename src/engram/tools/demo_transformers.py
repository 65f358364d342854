"""``engram demo --transformers``: a tiny random DeepSeek-V4.1 model in 🤗 transformers
generating from real English text with its Engram layers attached.

A V4.1-style directory is written (:func:`engram.tools.testing.write_transformers_checkpoint`,
DeepSeek-V4 tokenizer), read back with :func:`engram.integrations.transformers.load_model`,
and ``generate()`` runs greedily on a left-padded batch of prompts cut from real text.
Each forward is timed, with the Engram share (hash, layers) from the handle's timers.
Checks: the hash ids every forward used equal :func:`hash_ngrams` of each row's own
tokens (padding excluded); generate's logits of the unpadded rows equal one full
forward over their generated sequences (within 1e-3 of the largest logit; transformers'
DeepseekV4 itself is not consistent there for left-padded rows), and Engram moves them
by far more than that.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from engram.checks import check_int
from engram.tools.corpus import english_texts
from engram.hashing import hash_ngrams

__all__ = ["run_transformers_demo"]

_TOLERANCE = 1e-3   # of the largest logit


def _prompts(texts, tokenizer_file: Path, max_tokens: int, rng: np.random.Generator) -> list[tuple[str, list[int]]]:
    """(name, token ids) per text: its first 1/2 .. 1 x ``max_tokens`` tokens (uneven lengths: left padding)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    prompts = []
    for name, text in texts:
        ids = tokenizer.encode(" ".join(text.split()), add_special_tokens=False).ids
        length = int(rng.integers(max(1, max_tokens // 2), max_tokens + 1))
        if ids:
            prompts.append((name, ids[:length]))
    return prompts


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


class _ForwardTimer:
    """Hooks on the model: per forward the tokens, the wall time, the Engram hash and layer
    seconds the handle's timers gained during it, and the hash ids it used."""

    def __init__(self, model, handle, device: torch.device):
        self.handle, self.device = handle, device
        self.records: list[dict] = []
        self._started, self._before = 0.0, dict(handle.timings)
        self._hooks = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                       model.register_forward_hook(self._stop, with_kwargs=True)]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self, module, args, kwargs):
        self._sync()
        self._before = dict(self.handle.timings)
        self._started = time.perf_counter()

    def _stop(self, module, args, kwargs, output):
        self._sync()
        seconds = time.perf_counter() - self._started
        timings, before = self.handle.timings, self._before
        self.records.append({"tokens": int(self.handle.token_mask.numel()), "seconds": seconds,
                             "hash": timings["hash"] - before["hash"], "layers": timings["layers"] - before["layers"],
                             "hash_ids": self.handle.hash_ids.cpu(), "token_mask": self.handle.token_mask.cpu()})

    def restore(self) -> None:
        for hook in self._hooks:
            hook.remove()


def run_transformers_demo(*, tokenizer: str | None = None, device: str = "cpu", num_texts: int = 4,
                          prompt_tokens: int = 48, new_tokens: int = 24, seed: int = 0,
                          console: Console | None = None) -> bool:
    """Returns True when generate's logits match a full forward and Engram changed them."""
    from engram.tools.demo import _tokenizer_file
    from engram.integrations.transformers import load_model
    from engram.tools.testing import write_transformers_checkpoint

    from engram.common import resolve_device
    from engram.tools.demo import check_seed, check_text_count

    console = console or Console()
    # The arguments first: no model is written for a run that cannot go ahead.
    for flag, value in (("--texts", num_texts), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        check_int(flag, value, 1)
    check_text_count(num_texts)
    check_seed(seed)
    resolve_device(device, "engram demo --transformers --device")
    tokenizer_file = _tokenizer_file(tokenizer)
    if not tokenizer_file.is_file():
        raise ValueError(f"--tokenizer: expected a tokenizer.json or a directory holding one, found {str(tokenizer_file)!r}")
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="engram-transformers-") as workspace:
        started = time.perf_counter()
        written = write_transformers_checkpoint(workspace, seed=seed, tokenizer=tokenizer_file)
        write_seconds = time.perf_counter() - started
        started = time.perf_counter()
        model = load_model(workspace, progress=False, engram_device=device,
                           device_map=None if device == "cpu" else device).eval()
        load_seconds = time.perf_counter() - started
    handle = model.engram_handle
    handle.profile = True
    spec, config = written.spec, model.config
    console.print(f"[bold]engram demo --transformers[/]: wrote a tiny random DeepSeek-V4.1 directory in "
                  f"{write_seconds:.2f} s, load_model in {load_seconds:.2f} s: {type(model).__name__}, "
                  f"{config.num_hidden_layers} decoder layers ({', '.join(config.layer_types)}), hidden "
                  f"{config.hidden_size}, hc_mult {config.hc_mult}, vocab {config.vocab_size:,}; Engram layers "
                  f"{list(spec.layer_ids)}, {spec.num_columns} hash columns of {spec.head_dim}")

    texts = english_texts(max_texts=num_texts, max_chars=4000, seed=seed)
    prompts = _prompts(texts, tokenizer_file, prompt_tokens, rng)
    ids, mask = _left_padded([p for _, p in prompts], config.pad_token_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    timer = _ForwardTimer(model, handle, torch.device(device))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=config.pad_token_id)
    finally:
        timer.restore()
    records = timer.records

    from tokenizers import Tokenizer

    decoder = Tokenizer.from_file(str(tokenizer_file))
    listing = Table(title=f"generate(): {len(prompts)} prompts of real text, left-padded to {ids.shape[1]} tokens, "
                          f"{new_tokens} new tokens each (greedy, random weights)")
    for column in ("prompt", "tokens", "prompt ends with", "generated"):
        listing.add_column(column, justify="right" if column == "tokens" else "left", overflow="fold")
    for (name, prompt), sequence in zip(prompts, out.sequences.tolist()):
        listing.add_row(name, str(len(prompt)), repr(decoder.decode(prompt[-8:]))[:40],
                        repr(decoder.decode(sequence[ids.shape[1]:]))[:60])
    console.print(listing)

    timing = Table(title=f"per step on {device}: model forward and the Engram part of it "
                         f"(hash once for {spec.num_layers} layers; layers summed)")
    for column in ("step", "tokens", "forward (ms)", "Engram hash (ms)", "Engram layers (ms)", "Engram share"):
        timing.add_column(column, justify="left" if column == "step" else "right")
    groups = [("prefill", records[:1]), (f"decode (mean of {len(records) - 1})", records[1:])]
    for label, group in groups:
        if not group:
            continue
        mean = {key: sum(r[key] for r in group) / len(group) for key in ("tokens", "seconds", "hash", "layers")}
        timing.add_row(label, f"{mean['tokens']:.0f}", f"{mean['seconds'] * 1e3:.2f}", f"{mean['hash'] * 1e3:.2f}",
                       f"{mean['layers'] * 1e3:.2f}",
                       f"{(mean['hash'] + mean['layers']) / max(mean['seconds'], 1e-12):.0%}")
    console.print(timing)

    # The ids every forward hashed, per row, against the row's own tokens alone.
    used = torch.cat([r["hash_ids"] for r in records], dim=1).long()             # [B, W + new - 1, L, C]
    live = torch.cat([r["token_mask"] for r in records], dim=1)
    prompt_width = ids.shape[1]
    memory = handle.memory
    hashes_ok = True
    for row in range(len(prompts)):
        tokens = out.sequences[row, :-1].cpu()[live[row]]
        reference = hash_ngrams(tokens.numpy(), memory.layout, memory.vocab)
        hashes_ok &= bool(np.array_equal(used[row][live[row]].numpy(), reference))

    # Rows without padding: one forward over everything against generate's steps.
    unpadded = mask.all(dim=1)
    with torch.no_grad():
        full = model(out.sequences[unpadded], use_cache=False).logits[:, prompt_width - 1:-1]
        largest = float(full.abs().max())
        difference = float((torch.stack(out.logits, dim=1)[unpadded] - full).abs().max()) / largest
        handle.remove()
        plain = model(out.sequences[unpadded], use_cache=False).logits[:, prompt_width - 1:-1]
        moved = float((plain - full).abs().max()) / largest
    logits_ok = difference <= _TOLERANCE and moved > 100 * _TOLERANCE
    console.print(f"hash ids of every forward ({sum(r['tokens'] for r in records):,} token slots, padding dead) "
                  f"against hash_ngrams of each row alone: {'[green]match[/]' if hashes_ok else '[red]differ[/]'}")
    console.print(f"logits of generate() against one full forward ({int(unpadded.sum())} unpadded rows): max "
                  f"difference {difference:.2e} of the largest logit (tolerance {_TOLERANCE:g}); Engram moves them "
                  f"by {moved:.2e}: {'[green]match[/]' if logits_ok else '[red]differ[/]'}")
    return hashes_ok and logits_ok
