"""The invariant of docs/design.md §2: every way of serving a sequence gives the ids of
hashing the whole sequence at once, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import engram
from engram.tools.simulation import HISTORY_SOURCES, StreamingEngine

from conftest import random_vocab, small_config

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_hasher(seed: int, *, order: int = 4, heads: int = 3, validate=None):
    spec = engram.EngramSpec.from_hf_config(small_config(max_ngram_size=order, n_heads=heads))
    layout = engram.EngramLayout(spec)
    vocab = random_vocab(spec.compressed_vocab_size, 300, np.random.default_rng(seed))
    return engram.NgramHasher(layout, vocab, validate=validate)


def sequence_with_dead_spans(rng: np.random.Generator, length: int, dead_spans: int):
    """Random tokens with a few runs of dead positions (image-like spans)."""
    token_ids = rng.integers(0, 300, length)
    dead = np.zeros(length, dtype=bool)
    for _ in range(dead_spans):
        start = int(rng.integers(0, length))
        dead[start:start + int(rng.integers(1, 6))] = True
    return token_ids, dead


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), source=st.sampled_from(HISTORY_SOURCES), order=st.integers(2, 5),
       num_requests=st.integers(1, 5), budget=st.integers(1, 48), dead_spans=st.integers(0, 3))
def test_random_chunking_drafts_and_preemption(seed, source, order, num_requests, budget, dead_spans):
    rng = np.random.default_rng(seed)
    engine = StreamingEngine(make_hasher(seed, order=order), source, rng, block_size=int(rng.integers(1, 9)),
                             num_blocks=512)
    total = 0
    for k in range(num_requests):
        length = int(rng.integers(1, 70))
        engine.add(f"request-{k}", *sequence_with_dead_spans(rng, length, dead_spans))
        total += length
    engine.run_random(max_batch_tokens=budget)
    assert engine.tokens_checked == total
    assert engine.mismatches == 0


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), shared=st.integers(0, 60), block_size=st.integers(1, 8))
def test_slot_cache_prefix_shared_blocks(seed, shared, block_size):
    rng = np.random.default_rng(seed)
    engine = StreamingEngine(make_hasher(seed), "slot_cache", rng, block_size=block_size, num_blocks=256)
    prefix, prefix_dead = sequence_with_dead_spans(rng, 60, 1)
    engine.add("donor", prefix, prefix_dead)
    engine.run_random(max_batch_tokens=32)
    tail = rng.integers(0, 300, 30)
    tail[0] = (prefix[shared] + 1) % 300 if shared < 60 else tail[0]  # the prefixes part right at `shared`
    engine.add("sharer", np.concatenate([prefix[:shared], tail]),
               np.concatenate([prefix_dead[:shared], np.zeros(30, dtype=bool)]), share_prefix_with="donor")
    reused = engine.requests["sharer"].computed
    assert reused == (shared // block_size) * block_size
    engine.run_random(max_batch_tokens=16)
    assert engine.mismatches == 0 and engine.tokens_checked == 60 + (shared + 30 - reused)


def whole(hasher, token_ids, dead):
    return engram.hash_ngrams(token_ids, hasher.layout, hasher.vocab, dead)


def call(hasher, token_ids, dead, first, **kwargs):
    count = len(token_ids)
    return hasher(torch.as_tensor(token_ids), torch.arange(first, first + count), torch.tensor([0, count]),
                  dead_mask=torch.as_tensor(dead), **kwargs).numpy()


def lookback_of(token_ids, dead, first, history):
    ids = [[int(token_ids[first - 1 - j]) if first - 1 - j >= 0 else -1 for j in range(history)]]
    flags = [[bool(dead[first - 1 - j]) if first - 1 - j >= 0 else False for j in range(history)]]
    return torch.tensor(ids), torch.tensor(flags)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), prompt=st.integers(1, 40), decode=st.integers(1, 12),
       store=st.sampled_from(["request_history", "slot_cache"]))
def test_decode_instance_seeded_only_by_lookback(seed, prompt, decode, store):
    """Prefill/decode split: the decode instance never saw the prompt, only a lookback window."""
    rng = np.random.default_rng(seed)
    token_ids, dead = sequence_with_dead_spans(rng, prompt + decode, 1)
    expected = whole(make_hasher(seed), token_ids, dead)
    decoder = make_hasher(seed)
    history = decoder.history_length
    block_size = 4
    if store == "request_history":
        decoder.bind_request_history(4)
        extra = {"request_rows": decoder.request_rows(["r"])}
    else:
        decoder.bind_slot_cache(64 * block_size, block_size)
        blocks = torch.from_numpy(rng.permutation(64)[None, :]).int()  # KV transferred into these blocks
        extra = {"block_table": blocks}
    for position in range(prompt, prompt + decode):
        kwargs = dict(extra)
        if position == prompt:
            kwargs["lookback_token_ids"], kwargs["lookback_dead_mask"] = lookback_of(token_ids, dead, prompt, history)
        if store == "slot_cache":
            slot = int(blocks[0, position // block_size]) * block_size + position % block_size
            kwargs["slot_mapping"] = torch.tensor([slot])
        got = call(decoder, token_ids[position:position + 1], dead[position:position + 1], position, **kwargs)
        assert (got[0] == expected[position]).all()


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), first=st.integers(1, 30), known=st.lists(st.booleans(), min_size=3, max_size=3))
def test_lookback_takes_priority_over_a_store(seed, first, known):
    """Known lookback columns win over a store holding wrong ids; unknown ones fall through to it."""
    rng = np.random.default_rng(seed)
    token_ids, dead = sequence_with_dead_spans(rng, first + 10, 1)
    hasher = make_hasher(seed)
    expected = whole(hasher, token_ids, dead)
    hasher.bind_slot_cache(64, 1)
    table = torch.arange(64, dtype=torch.int32)[None]
    wrong = token_ids.copy()
    for j, is_known in enumerate(known):  # the store holds a wrong token wherever lookback knows better
        if is_known and first - 1 - j >= 0:
            wrong[first - 1 - j] = (wrong[first - 1 - j] + 1) % 300
    call(hasher, wrong[:first], dead[:first], 0, slot_mapping=torch.arange(first), block_table=table)
    lookback, lookback_dead = lookback_of(token_ids, dead, first, 3)
    lookback[0, ~torch.tensor(known)] = -1
    got = call(hasher, token_ids[first:], dead[first:], first, lookback_token_ids=lookback,
               lookback_dead_mask=lookback_dead, block_table=table)
    assert (got == expected[first:]).all()


def test_batch_of_many_requests_at_once(rng):
    """Whole sequences of several requests laid end to end in one batch, with padding after them."""
    hasher = make_hasher(int(rng.integers(2**31)))
    sequences = [sequence_with_dead_spans(rng, n, 2) for n in (1, 63, 7, 20)]
    token_ids = np.concatenate([s[0] for s in sequences] + [np.zeros(5, dtype=np.int64)])
    dead = np.concatenate([s[1] for s in sequences] + [np.zeros(5, dtype=bool)])
    positions = np.concatenate([np.arange(len(s[0])) for s in sequences] + [np.zeros(5, dtype=np.int64)])
    starts = np.cumsum([0] + [len(s[0]) for s in sequences])
    got = hasher(torch.from_numpy(token_ids), torch.from_numpy(positions), torch.from_numpy(starts),
                 dead_mask=torch.from_numpy(dead)).numpy()
    expected = np.concatenate([whole(hasher, *s) for s in sequences])
    assert got.dtype == np.int32 and (got[: starts[-1]] == expected).all()
    padding = whole(hasher, [hasher.layout.spec.pad_token_id], [True])
    assert (got[starts[-1]:] == padding).all()


# ---- negative controls: the checks above would notice a wrong history -------------

def test_wrong_lookback_changes_the_ids(rng):
    hasher = make_hasher(int(rng.integers(2**31)))
    token_ids = rng.integers(0, 300, 20)
    dead = np.zeros(20, dtype=bool)
    expected = whole(hasher, token_ids, dead)
    lookback, lookback_dead = lookback_of(token_ids, dead, 10, 3)
    right = call(hasher, token_ids[10:], dead[10:], 10, lookback_token_ids=lookback, lookback_dead_mask=lookback_dead)
    assert (right == expected[10:]).all()
    for j in range(3):
        bad = lookback.clone()
        bad[0, j] = int(np.flatnonzero(hasher.vocab.token_map != hasher.vocab.token_map[bad[0, j]])[0])
        wrong = call(hasher, token_ids[10:], dead[10:], 10, lookback_token_ids=bad, lookback_dead_mask=lookback_dead)
        reach = 3 - j  # position 9 - j is shift 1 + j of positions 10 .. 12 - j
        assert (wrong[:reach] != expected[10:10 + reach]).any(axis=(1, 2)).all()
        assert (wrong[reach:] == expected[10 + reach:]).all()  # beyond the window nothing changes


def test_unseeded_cache_changes_the_ids_or_raises(rng):
    seed = int(rng.integers(2**31))
    unchecked = make_hasher(seed, validate=False)
    # Tokens whose compressed id is not pad's, so hashing them as pad must change the ids.
    not_pad = np.flatnonzero(unchecked.vocab.token_map != unchecked.pad_id)
    token_ids = rng.choice(not_pad, 20)
    dead = np.zeros(20, dtype=bool)
    table = torch.arange(32, dtype=torch.int32)[None]
    unchecked.bind_slot_cache(32, 1)
    expected = whole(unchecked, token_ids, dead)
    got = call(unchecked, token_ids[10:], dead[10:], 10, block_table=table, slot_mapping=torch.arange(10, 20))
    assert (got[:3] != expected[10:13]).any(axis=(1, 2)).all()
    assert (got[3:] == expected[13:]).all()
    checked = make_hasher(seed)
    checked.bind_slot_cache(32, 1)
    with pytest.raises(ValueError, match=r"request 0 starts at position 10.*position 9 is unknown.*slot cache"):
        call(checked, token_ids[10:], dead[10:], 10, block_table=table, slot_mapping=torch.arange(10, 20))


def same_step_prefix_hit_batch(rng, block_size=4):
    """Request A is prefilled in this batch; request B, with the same prefix, hits A's
    blocks that this very batch fills (as an engine that caches blocks at scheduling
    does) and starts right after them: B's history is in slots the batch writes."""
    prefix_blocks, tail = 3, 5
    hit = prefix_blocks * block_size
    prefix = rng.integers(0, 300, hit + 2)
    a_tokens = prefix
    b_tokens = np.concatenate([prefix[:hit], rng.integers(0, 300, tail)])
    blocks = rng.permutation(32)
    a_blocks = list(blocks[:4])
    b_blocks = a_blocks[:prefix_blocks] + list(blocks[4:6])
    table = torch.tensor([a_blocks + [0], b_blocks], dtype=torch.int32)
    a_slots = [a_blocks[p // block_size] * block_size + p % block_size for p in range(len(a_tokens))]
    b_slots = [b_blocks[p // block_size] * block_size + p % block_size for p in range(hit, hit + tail)]
    batch = dict(
        input_ids=torch.from_numpy(np.concatenate([a_tokens, b_tokens[hit:]])),
        positions=torch.cat([torch.arange(len(a_tokens)), torch.arange(hit, hit + tail)]),
        query_start_loc=torch.tensor([0, len(a_tokens), len(a_tokens) + tail]),
        slot_mapping=torch.tensor(a_slots + b_slots), block_table=table,
    )
    return batch, a_tokens, b_tokens, hit


@pytest.mark.parametrize("repeat", range(3))
def test_same_step_prefix_hit(repeat, rng):
    hasher = make_hasher(int(rng.integers(2**31)))
    hasher.bind_slot_cache(32 * 4, 4)
    batch, a_tokens, b_tokens, hit = same_step_prefix_hit_batch(rng)
    got = hasher(**batch).numpy()
    assert (got[:len(a_tokens)] == whole(hasher, a_tokens, np.zeros(len(a_tokens), bool))).all()
    assert (got[len(a_tokens):] == whole(hasher, b_tokens, np.zeros(len(b_tokens), bool))[hit:]).all()
