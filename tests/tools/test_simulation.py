"""The streaming engine and the demo end on every input: empty texts are refused or skipped,
and every loop over steps advances (a 0-token request once spun forever)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import engram
from engram.tools.cli import main
from engram.tools.corpus import english_texts
from engram.tools.simulation import HISTORY_SOURCES, StreamingEngine

from conftest import random_vocab, small_config


def finishes(function, seconds: float = 60.0) -> bool:
    """Run ``function`` in a thread; True when it returned (or raised) within ``seconds``."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_call(function)), daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(outcome)


def _call(function):
    try:
        return function()
    except Exception as error:  # the caller inspects what came back
        return error


def make_engine(rng, source: str) -> StreamingEngine:
    spec = engram.EngramSpec.from_hf_config(small_config())
    vocab = random_vocab(spec.compressed_vocab_size, 300, rng)
    return StreamingEngine(engram.NgramHasher(engram.EngramLayout(spec), vocab), source, rng, num_blocks=64)


@pytest.mark.parametrize("source", HISTORY_SOURCES)
def test_empty_request_is_refused(rng, source):
    engine = make_engine(rng, source)
    with pytest.raises(ValueError, match=r"token_ids: request 'empty' has no tokens; expected at least one"):
        engine.add("empty", np.zeros(0, dtype=np.int64))


@pytest.mark.parametrize("source", HISTORY_SOURCES)
@pytest.mark.parametrize("prompt_fraction", [0.0, 0.5, 1.0])
def test_one_token_requests_finish(rng, source, prompt_fraction):
    engine = make_engine(rng, source)
    for k, length in enumerate((1, 1, 2, 5)):
        engine.add(f"r{k}", rng.integers(0, 300, length))
    assert finishes(lambda: engine.run_prefill_then_decode(prompt_fraction=prompt_fraction, chunk_sizes=(1, 3)))
    assert engine.tokens_checked == 9 and engine.mismatches == 0


def test_every_request_paused_still_advances(rng):
    engine = make_engine(rng, "lookback")
    for k in range(3):
        engine.add(f"r{k}", rng.integers(0, 300, 6))
    assert finishes(lambda: engine.run_random(max_batch_tokens=4, pause_probability=1.0))
    assert engine.tokens_checked == 18 and engine.mismatches == 0


def test_bad_schedule_arguments(rng):
    engine = make_engine(rng, "lookback")
    engine.add("r", rng.integers(0, 300, 4))
    with pytest.raises(ValueError, match=r"max_batch_tokens: expected an integer >= 1, found 0"):
        engine.run_random(max_batch_tokens=0)
    with pytest.raises(ValueError, match=r"chunk_sizes: expected \(smallest, largest\)"):
        engine.run_prefill_then_decode(chunk_sizes=(0, 3))


def test_corpus_refuses_zero_and_skips_empty_texts():
    with pytest.raises(ValueError, match=r"max_chars: expected an integer >= 1, found 0"):
        english_texts(max_texts=2, max_chars=0)
    with pytest.raises(ValueError, match=r"max_texts: expected an integer >= 1, found 0"):
        english_texts(max_texts=0)
    assert all(text.strip() for _, text in english_texts(max_texts=3, max_chars=1))


@pytest.mark.parametrize("flag", ["--max-chars", "--texts"])
def test_demo_refuses_zero_with_exit_2(flag, capsys):
    done = []
    assert finishes(lambda: done.append(main(["demo", flag, "0", "--skip-layers", "--tokenizer", "unused"])), 30)
    assert done == [2]
    captured = capsys.readouterr()
    assert captured.out == "" and f"{flag}: expected an integer >= 1, found 0" in captured.err
    assert "num_slots" not in captured.err
