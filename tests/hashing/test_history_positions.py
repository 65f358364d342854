"""Positions that repeat or skip inside a request (token-tree drafts) with the per-request history
bound: refused under validation; without it no token is read for a position it does not hold.

A request's tokens must be at consecutive positions. Token trees give siblings one position (or
leave gaps): the hash would read a sibling as a token's predecessor, and the history ring would
write one cell twice and keep whichever sibling landed last under that position's tag. Without
validation the hash treats such an in-batch source as unknown (pad from that shift on) and the
ring clears the request's row (later reads of it are missing: reported under validation, pad
without). The torch path runs here; the Triton kernels under the interpreter must agree with it
in ids and ring contents.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import engram
from engram.hashing.stores import UNWRITTEN

from conftest import random_vocab, small_config

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_DRAFTS = 2  # ring width N - 1 + 2 + 1 = 6 with N = 4


def _hasher(seed: int, backend: str) -> engram.NgramHasher:
    spec = engram.EngramSpec.from_hf_config(small_config())
    vocab = random_vocab(spec.compressed_vocab_size, 300, np.random.default_rng(seed))
    hasher = engram.NgramHasher(engram.EngramLayout(spec), vocab, device="cpu", validate=False, backend=backend)
    hasher.bind_request_history(4, max_draft_tokens=MAX_DRAFTS)
    return hasher


def _expected(hasher, history, token, blocked_from: int | None = None) -> np.ndarray:
    """Reference ids ``[L, C]`` of ``token`` after ``history`` (raw ids, oldest first), with every
    shift from ``blocked_from`` on blocked (hashed as pad) when given."""
    sequence = list(history) + [token]
    if blocked_from is not None:
        sequence = [0] * max(0, blocked_from - len(history)) + sequence
    dead = np.zeros(len(sequence), dtype=bool)
    if blocked_from is not None:
        dead[len(sequence) - 1 - blocked_from] = True
    return engram.hash_ngrams(np.array(sequence), hasher.layout, hasher.vocab, dead)[-1]


def _steps(seed: int):
    """Two requests: ``tree`` (a prompt, then drafts a, b, c with b and c siblings at one position)
    and ``chain`` (consecutive throughout). Yields ``(batch kwargs, expected [T, L, C] or None)``
    per step, the last step's after the tree's row is cleared."""
    rng = np.random.default_rng(seed)
    prompt_tree, prompt_chain = rng.integers(0, 300, 6), rng.integers(0, 300, 5)
    a, b, c, d = rng.integers(0, 300, 4)
    chain_next = rng.integers(0, 300, 2)
    step1 = dict(input_ids=torch.from_numpy(np.concatenate([prompt_tree, prompt_chain])),
                 positions=torch.cat([torch.arange(6), torch.arange(5)]), query_start_loc=torch.tensor([0, 6, 11]))
    step2 = dict(input_ids=torch.tensor([a, b, c, *chain_next]), positions=torch.tensor([6, 7, 7, 5, 6]),
                 query_start_loc=torch.tensor([0, 3, 5]))
    step3 = dict(input_ids=torch.tensor([d]), positions=torch.tensor([8]), query_start_loc=torch.tensor([0, 1]))
    return prompt_tree, prompt_chain, (a, b, c, d), chain_next, (step1, step2, step3)


def _run_tree_steps(hasher, seed):
    """The steps through ``hasher`` (validation off), with the ids checked against the reference;
    returns the ring's (values, tags) after each step."""
    prompt_tree, prompt_chain, (a, b, c, d), chain_next, (step1, step2, step3) = _steps(seed)
    rows = hasher.request_rows(["tree", "chain"])
    states = []
    hasher(**step1, request_rows=rows)
    states.append((hasher.request_history.values.clone(), hasher.request_history.tags.clone()))

    ids = hasher(**step2, request_rows=rows)
    expected = np.stack([_expected(hasher, prompt_tree, a),
                         _expected(hasher, [*prompt_tree, a], b),
                         _expected(hasher, [*prompt_tree, a], c, blocked_from=1),  # b is no predecessor of c
                         _expected(hasher, prompt_chain, chain_next[0]),
                         _expected(hasher, [*prompt_chain, chain_next[0]], chain_next[1])])
    np.testing.assert_array_equal(ids.numpy(), expected, err_msg=f"seed {seed}: tree step")
    history = hasher.request_history
    tree_row, chain_row = int(rows[0]), int(rows[1])
    assert bool((history.values[tree_row] == UNWRITTEN).all()) and bool((history.tags[tree_row] == -1).all()), (
        f"seed {seed}: the tree request's row keeps entries")
    assert sorted(history.tags[chain_row].tolist()) == [1, 2, 3, 4, 5, 6], f"seed {seed}: the chain's row"
    states.append((history.values.clone(), history.tags.clone()))

    ids = hasher(**step3, request_rows=rows[:1])  # the accepted branch goes on: its history is gone
    np.testing.assert_array_equal(ids[0].numpy(), _expected(hasher, [], d, blocked_from=1),
                                  err_msg=f"seed {seed}: step after the tree")
    states.append((history.values.clone(), history.tags.clone()))
    return states


def test_validation_refuses_token_tree_positions(seed):
    hasher = _hasher(seed, "torch")
    hasher.validate = True
    *_, (step1, step2, _) = _steps(seed)
    rows = hasher.request_rows(["tree", "chain"])
    hasher(**step1, request_rows=rows)
    before = hasher.request_history.values.clone(), hasher.request_history.tags.clone()
    with pytest.raises(ValueError, match=r"positions repeats inside request 0: positions\[1\] = 7, positions\[2\] = 7 "
                                         r"\(expected 8\); .*token-tree drafts are not supported"):
        hasher(**step2, request_rows=rows)
    assert torch.equal(hasher.request_history.values, before[0]) and torch.equal(hasher.request_history.tags, before[1])


def test_tree_drafts_read_no_wrong_token_without_validation(seed):
    """Torch path, validation off: the sibling is not hashed as its sibling's successor, the tree
    request's row is cleared, and the next step's reads of it are missing, not wrong: under
    validation that step is refused (reported), without it hashed as pad."""
    _run_tree_steps(_hasher(seed, "torch"), seed)

    hasher = _hasher(seed, "torch")
    *_, (step1, step2, step3) = _steps(seed)
    rows = hasher.request_rows(["tree", "chain"])
    hasher(**step1, request_rows=rows)
    hasher(**step2, request_rows=rows)
    hasher.validate = True
    with pytest.raises(ValueError, match=r"request history row \d+ holds no entry for that position"):
        hasher(**step3, request_rows=rows[:1])


def test_skipped_positions_clear_the_row_and_block_the_gap(seed):
    """A gap inside a request (positions 6, 8) is no predecessor either."""
    hasher = _hasher(seed, "torch")
    rng = np.random.default_rng(seed)
    prompt, tokens = rng.integers(0, 300, 6), rng.integers(0, 300, 2)
    rows = hasher.request_rows(["gap"])
    hasher(torch.from_numpy(prompt), torch.arange(6), torch.tensor([0, 6]), request_rows=rows)
    ids = hasher(torch.from_numpy(tokens), torch.tensor([6, 8]), torch.tensor([0, 2]), request_rows=rows)
    np.testing.assert_array_equal(ids[0].numpy(), _expected(hasher, prompt, tokens[0]), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(ids[1].numpy(), _expected(hasher, [], tokens[1], blocked_from=1),
                                  err_msg=f"seed {seed}")
    assert bool((hasher.request_history.tags[int(rows[0])] == -1).all()), f"seed {seed}"


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
@pytest.mark.parametrize("separate_writer", [False, True], ids=["one-program", "history-writer-launch"])
def test_kernels_guard_token_tree_positions_interpreted(seed, separate_writer, monkeypatch):
    """The Triton kernels, validation off: the same ids as the reference and the same ring as the
    torch path after every step, with the ring written by the hash kernel's lone program and by
    the separate history writer (a batch of several hash programs)."""
    from engram.hashing import launch

    # 16 tokens per hash program: each step is one program, which writes the ring after its reads;
    # one token per program: the ring writes are a launch of their own.
    monkeypatch.setattr(launch, "_BLOCK_TOKENS_BY_BATCH", ((1 << 20, 1 if separate_writer else 16),))
    kernel_states = _run_tree_steps(_hasher(seed, "triton"), seed)
    torch_states = _run_tree_steps(_hasher(seed, "torch"), seed)
    for step, ((kernel_values, kernel_tags), (torch_values, torch_tags)) in enumerate(zip(kernel_states, torch_states)):
        # the spare row past the end absorbs skipped writes: not compared
        assert torch.equal(kernel_values[:-1], torch_values[:-1]), f"seed {seed}: ring values after step {step + 1}"
        assert torch.equal(kernel_tags[:-1], torch_tags[:-1]), f"seed {seed}: ring tags after step {step + 1}"
