"""Bad batch metadata raises ValueError naming it, and leaves every store untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engram

from conftest import random_vocab, small_config


@pytest.fixture
def hasher(rng):
    spec = engram.EngramSpec.from_hf_config(small_config())
    vocab = random_vocab(spec.compressed_vocab_size, 300, rng)
    return engram.NgramHasher(engram.EngramLayout(spec), vocab)


def batch(count=6, first=0, seed=0):
    """A one-request batch of ``count`` tokens at positions ``first, ...``; the token ids do not matter here."""
    generator = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, 300, (count,), generator=generator), positions=torch.arange(first, first + count),
                query_start_loc=torch.tensor([0, count]))


@pytest.mark.parametrize("change,message", [
    (dict(input_ids=torch.tensor([1, 2, 300, 4, 5, 6])), r"input_ids\[2\] = 300 is outside the tokenizer's range \[0, 300\)"),
    (dict(input_ids=torch.tensor([1, -1, 3, 4, 5, 6])), r"input_ids\[1\] = -1 is outside"),
    (dict(input_ids=torch.zeros(6)), r"input_ids: expected an integer tensor"),
    (dict(input_ids=torch.zeros(2, 3, dtype=torch.long)), r"input_ids: expected a 1-D tensor"),
    (dict(query_start_loc=torch.tensor([0, 4, 2, 6])), r"query_start_loc is not monotone: query_start_loc\[2\] = 2 < query_start_loc\[1\] = 4"),
    (dict(query_start_loc=torch.tensor([1, 6])), r"query_start_loc\[0\] = 1: expected 0"),
    (dict(query_start_loc=torch.tensor([0, 7])), r"query_start_loc\[-1\] = 7 exceeds the 6 tokens"),
    (dict(positions=torch.tensor([0, 1, 2, 1, 2, 3])), r"positions goes backwards inside request 0: positions\[2\] = 2, positions\[3\] = 1"),
    (dict(positions=torch.tensor([0, 1, 2, 4, 5, 6])), r"positions skips inside request 0: positions\[2\] = 2, positions\[3\] = 4"),
    (dict(positions=torch.arange(5)), r"positions: expected shape \[6\], found \[5\]"),
    (dict(positions=torch.tensor([-1, 0, 1, 2, 3, 4])), r"positions\[0\] = -1 is negative"),
    (dict(positions=torch.arange(2**31 - 3, 2**31 + 3)), r"positions\[3\] = 2147483648 exceeds 2147483647"),
    (dict(dead_mask=torch.zeros(6, dtype=torch.int64)), r"dead_mask: expected a bool tensor"),
    (dict(lookback_token_ids=torch.full((1, 2), -1)), r"lookback_token_ids: expected shape \[1, 3\], found \[1, 2\]"),
    (dict(lookback_token_ids=torch.tensor([[1, 2, -2]])), r"lookback_token_ids\[0, 2\] = -2: expected a token id in \[0, 300\) or -1"),
    (dict(lookback_dead_mask=torch.zeros(1, 3, dtype=torch.bool)), r"lookback_dead_mask: given without lookback_token_ids"),
    (dict(slot_mapping=torch.arange(6)), r"slot_mapping: given, but no slot cache is bound"),
    (dict(block_table=torch.zeros(1, 4, dtype=torch.int32)), r"block_table: given, but no slot cache is bound"),
    (dict(request_rows=torch.tensor([0])), r"request_rows: given, but no request history is bound"),
])
def test_bad_metadata(hasher, change, message):
    arguments = batch() | change
    with pytest.raises(ValueError, match=message):
        hasher(**arguments)


def test_request_past_zero_without_history(hasher):
    with pytest.raises(ValueError, match=r"request 0 starts at position 5, but the token at position 4 is unknown \(no lookback and no bound history store\)"):
        hasher(**batch(first=5))
    partial = torch.tensor([[7, -1, -1]])  # position 4 known, 3 unknown
    with pytest.raises(ValueError, match=r"position 3 is unknown \(lookback_token_ids\[0\] = \[7, -1, -1\]\)"):
        hasher(**batch(first=5), lookback_token_ids=partial)
    # A dead token before the unknown one blocks it: nothing is missing then.
    out = hasher(**batch(first=5), lookback_token_ids=partial, lookback_dead_mask=torch.tensor([[True, False, False]]))
    assert out.shape == (6, 2, 9)


def test_slot_errors_leave_the_cache_untouched(hasher):
    cache = hasher.bind_slot_cache(16, 4)
    table = torch.tensor([[3, 1, 2, 0]], dtype=torch.int32)
    hasher(**batch(count=8), slot_mapping=torch.tensor([12, 13, 14, 15, 4, 5, 6, 7]), block_table=table)
    before = cache.values.clone()
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 16 is beyond the bound cache of 16 slots"):
        hasher(**batch(count=2, first=8), slot_mapping=torch.tensor([4, 16]), block_table=table)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 4 is also slot_mapping\[0\]: a slot appears twice"):
        hasher(**batch(count=2, first=8), slot_mapping=torch.tensor([4, 4]), block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9 \(the block of position 5, history of request 0\): "
                                         r"expected a block id in \[0, 4\) of the bound cache"):
        hasher(**batch(count=2, first=8), slot_mapping=torch.tensor([4, 5]), block_table=torch.tensor([[3, 9, 2, 0]]))
    with pytest.raises(ValueError, match=r"block_table\[0\] has 1 blocks; position 5 needs block index 1"):
        hasher(**batch(count=2, first=8), block_table=torch.tensor([[3]]))
    # A missing-history error after the cache write undoes the write.
    with pytest.raises(ValueError, match=r"position 11 is unknown"):
        hasher(**batch(count=2, first=12), slot_mapping=torch.tensor([0, 1]), block_table=table)
    assert torch.equal(cache.values, before)
    # History read from a slot this same batch writes is refused when the cache promised
    # fused writes (one launch both writes and reads).
    fused = hasher.bind_slot_cache(16, 4, fused_write=True)
    fused.values.copy_(before)
    with pytest.raises(ValueError, match=r"block_table\[0\]: position 9 \(history of request 0\) is slot 9, which this batch writes \(slot_mapping\[1\]\); a cache bound with fused_write=True"):
        hasher(**batch(count=2, first=12), slot_mapping=torch.tensor([0, 9]), block_table=table)
    assert torch.equal(fused.values, before)
    rebound = hasher.bind_slot_cache(16, 4)
    assert (rebound.values == engram.hashing.UNWRITTEN).all()


def test_slot_mapping_must_follow_block_table(hasher):
    """Request B writes slots 0-3 while its block-table row is [1]: that would overwrite request
    A's block 0. Refused, naming the token, and nothing is written."""
    cache = hasher.bind_slot_cache(16, 4)
    a_then_b = dict(input_ids=torch.arange(8) % 300, positions=torch.cat([torch.arange(4), torch.arange(4)]),
                    query_start_loc=torch.tensor([0, 4, 8]))
    table = torch.tensor([[2], [1]], dtype=torch.int32)
    before = cache.values.clone()
    with pytest.raises(ValueError, match=r"slot_mapping\[4\] = 0 disagrees with block_table: token 4 \(request 1, "
                                         r"position 0\) is slot 4 = block_table\[1, 0\] = 1 \* block_size 4 \+ 0"):
        hasher(**a_then_b, slot_mapping=torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), block_table=table)
    assert torch.equal(cache.values, before)
    # The same batch with B's own slots (a token without a slot, -1, is not checked) passes.
    hasher(**a_then_b, slot_mapping=torch.tensor([8, 9, 10, 11, 4, 5, 6, -1]), block_table=table)
    with pytest.raises(ValueError, match=r"slot_mapping\[6\] = 7 disagrees with block_table: token 6 \(request 1, "
                                         r"position 2\) is slot 6"):
        hasher(**a_then_b, slot_mapping=torch.tensor([8, 9, 10, 11, 4, 5, 7, 6]), block_table=table)


def test_request_history_errors(hasher):
    hasher.bind_request_history(2)
    rows = hasher.request_rows(["a", "b"])
    with pytest.raises(ValueError, match=r"request history is full: all 2 rows are taken.*request 'c'"):
        hasher.request_rows(["c"])
    with pytest.raises(ValueError, match=r"request_rows\[0\] = 5 is outside the bound history of 2 rows"):
        hasher(**batch(), request_rows=torch.tensor([5]))
    with pytest.raises(ValueError, match=r"a request appears twice"):
        hasher.request_rows(["a", "a"])
    hasher(**batch(), request_rows=rows[:1])
    # Resuming at a position the row never reached is reported, not hashed with pad.
    with pytest.raises(ValueError, match=r"request 0 starts at position 9.*position 8 is unknown.*request history row"):
        hasher(**batch(first=9), request_rows=rows[:1])
    hasher.release_requests(["a"])
    with pytest.raises(ValueError, match=r"'a' holds no history row"):
        hasher.release_requests(["a"])
    fresh = hasher.request_rows(["c"])  # gets a's row back, emptied
    with pytest.raises(ValueError, match=r"position 5 is unknown"):
        hasher(**batch(first=6), request_rows=fresh)


def test_wrong_device_and_vocab(hasher):
    with pytest.raises(ValueError, match=r"engram_compressed_vocab_size' is 40"):
        engram.NgramHasher(hasher.layout, engram.TokenCompressor(np.arange(5, dtype=np.int32)))
    with pytest.raises(ValueError, match=r"input_ids: expected a tensor on cpu, found one on meta"):
        hasher(**(batch() | dict(input_ids=torch.zeros(6, dtype=torch.long, device="meta"))))


def test_empty_batch(hasher):
    out = hasher(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.tensor([0]))
    assert out.shape == (0, 2, 9) and out.dtype == torch.int32


def _huge_allocations_fail_at_once() -> bool:
    """True where the kernel refuses a 4 TB allocation outright (overcommit heuristic or strict)."""
    try:
        return open("/proc/sys/vm/overcommit_memory").read().strip() in ("0", "2")
    except OSError:
        return False


def test_a_store_too_large_to_allocate_is_named(hasher, monkeypatch):
    if not _huge_allocations_fail_at_once():  # never touch 4 TB of pages: fail the allocation as torch would
        def refuse(*args, **kwargs):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000000000004 bytes")
        monkeypatch.setattr(engram.hashing.stores.torch, "full", refuse)
    with pytest.raises(ValueError, match=r"num_slots: 1000000000000 needs 4,000,000,000,004 bytes of cpu memory for "
                                         r"the store, which could not be allocated \(.*\)"):
        hasher.bind_slot_cache(10**12, 16)



def test_a_repeated_slot_is_named_with_both_tokens(hasher):
    hasher.bind_slot_cache(32, 4)
    table = torch.tensor([[3, 1, 2, 0, 4, 5]], dtype=torch.int32)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 14])
    with pytest.raises(ValueError, match=r"slot_mapping\[7\] = 14 is also slot_mapping\[2\]: a slot appears twice "
                                         r"in one batch"):
        hasher(**batch(count=8), slot_mapping=slots, block_table=table)


@pytest.mark.parametrize("kind", ["list", "numpy"])
@pytest.mark.parametrize("argument", ["input_ids", "positions", "query_start_loc", "slot_mapping"])
def test_arguments_that_are_not_tensors(hasher, kind, argument):
    hasher.bind_slot_cache(32, 4)
    arguments = batch() | dict(slot_mapping=torch.arange(6), block_table=torch.tensor([[0, 1]], dtype=torch.int32))
    value = arguments[argument].numpy()
    arguments[argument] = value.tolist() if kind == "list" else value
    found = "builtins.list" if kind == "list" else "numpy.ndarray"
    with pytest.raises(ValueError, match=rf"^{argument}: expected a torch.Tensor, found {found}"):
        hasher(**arguments)


@pytest.mark.parametrize("validate", ["yes", 1, 0, "False"])
def test_validate_must_be_a_bool_or_none(rng, validate):
    spec = engram.EngramSpec.from_hf_config(small_config())
    vocab = random_vocab(spec.compressed_vocab_size, 300, rng)
    with pytest.raises(ValueError, match=rf"validate: expected True, False or None .*found {validate!r}"):
        engram.NgramHasher(engram.EngramLayout(spec), vocab, validate=validate)
