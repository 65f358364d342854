"""hash_ngrams against a scalar transcription of docs/design.md §2, one position at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import engram

from conftest import random_vocab, small_config


def scalar_hash(token_ids, dead, layout, vocab) -> np.ndarray:
    """Pure-Python ints: blocking, rolling XOR, modulo and offset, position by position."""
    spec = layout.spec
    pad = int(vocab.token_map[spec.pad_token_id])
    out = np.zeros((len(token_ids), spec.num_layers, spec.num_columns), dtype=np.int64)
    for t in range(len(token_ids)):
        window, blocked = [], False
        for s in range(spec.max_ngram_size):
            source = t - s
            blocked = blocked or source < 0 or bool(dead[source])
            window.append(pad if blocked else int(vocab.token_map[token_ids[source]]))
        for layer in range(spec.num_layers):
            m = [int(x) for x in layout.multipliers[layer]]
            rolling = window[0] * m[0]
            for s in range(1, spec.max_ngram_size):
                rolling ^= window[s] * m[s]
                assert 0 <= rolling < 2**63
                for h in range(spec.n_heads):
                    col = (s - 1) * spec.n_heads + h
                    out[t, layer, col] = rolling % layout.primes[layer][s - 1][h] + layout.offsets[layer][col]
    return out


@settings(max_examples=25, deadline=None)
@given(data=st.data(), order=st.integers(2, 5), heads=st.integers(1, 4))
def test_reference_matches_scalar_rule(data, order, heads):
    spec = engram.EngramSpec.from_hf_config(small_config(max_ngram_size=order, n_heads=heads))
    layout = engram.EngramLayout(spec)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    vocab = random_vocab(spec.compressed_vocab_size, 200, rng)
    length = data.draw(st.integers(1, 40))
    token_ids = rng.integers(0, 200, length)
    dead = rng.random(length) < data.draw(st.sampled_from([0.0, 0.1, 0.5]))
    ids = engram.hash_ngrams(token_ids, layout, vocab, dead)
    assert ids.dtype == np.int64 and ids.shape == (length, spec.num_layers, spec.num_columns)
    assert (ids == scalar_hash(token_ids, dead, layout, vocab)).all()
    # Every id lands inside its own column's bucket.
    low = np.asarray(layout.offsets)[None]
    assert ((ids >= low) & (ids < low + layout.column_primes[None])).all()


def test_dead_token_blocks_larger_shifts(small_layout, small_vocab, rng):
    token_ids = rng.integers(0, 300, 12)
    dead = np.zeros(12, dtype=bool)
    dead[5] = True
    with_dead = engram.hash_ngrams(token_ids, small_layout, small_vocab, dead)
    # Position 6 sees the dead token at shift 1: every order hashes pad beyond shift 0,
    # exactly as position 0 of a sequence starting with token 6.
    alone = engram.hash_ngrams(token_ids[6:], small_layout, small_vocab)
    assert (with_dead[6] == alone[0]).all()
    assert (with_dead[9:] == alone[3:]).all()
    # A dead token itself hashes an all-pad window.
    pad = small_layout.spec.pad_token_id
    assert (with_dead[5] == engram.hash_ngrams([pad], small_layout, small_vocab)[0]).all()


def test_hash_ngrams_checks_ids_as_the_hasher_does(small_layout, small_vocab, rng):
    """Float, bool and 2-D ids are refused (NgramHasher refuses them too); lists, numpy arrays
    and CPU tensors of integers give the same numpy int64 ids."""
    token_ids = rng.integers(0, 300, 9)
    expected = engram.hash_ngrams(token_ids, small_layout, small_vocab)
    assert isinstance(expected, np.ndarray) and expected.dtype == np.int64
    for same in (token_ids.tolist(), token_ids.astype(np.int32), torch.from_numpy(token_ids)):
        assert np.array_equal(engram.hash_ngrams(same, small_layout, small_vocab), expected)
    with pytest.raises(ValueError, match=r"token_ids: expected integer token ids, found dtype float64"):
        engram.hash_ngrams(token_ids.astype(np.float64), small_layout, small_vocab)
    with pytest.raises(ValueError, match=r"token_ids: expected integer token ids, found dtype bool"):
        engram.hash_ngrams(token_ids > 5, small_layout, small_vocab)
    with pytest.raises(ValueError, match=r"token_ids: expected a 1-D sequence \[T\], found shape \[3, 3\]"):
        engram.hash_ngrams(token_ids.reshape(3, 3), small_layout, small_vocab)
    with pytest.raises(ValueError, match=r"dead_mask: expected bools, found dtype int64"):
        engram.hash_ngrams(token_ids, small_layout, small_vocab, np.zeros(9, dtype=np.int64))
    with pytest.raises(ValueError, match=r"dead_mask: expected shape \[9\], found \[8\]"):
        engram.hash_ngrams(token_ids, small_layout, small_vocab, np.zeros(8, dtype=bool))
    assert engram.hash_ngrams([], small_layout, small_vocab).shape == (0, *expected.shape[1:])
