"""The Triton hash kernel against the whole-sequence reference and the torch path.

Interpreter tests (marked ``interpreter``) run on the CPU in their own pytest
process with TRITON_INTERPRET=1; GPU tests (marked ``gpu``) need CUDA.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import engram
from engram.hashing.kernels import _remainder
from engram.tools.simulation import HISTORY_SOURCES, StreamingEngine

from conftest import PACKAGED_CONFIG, fresh_seed, random_vocab, small_config

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"


def _rng() -> np.random.Generator:
    """This module's random draws: one seed per test session, reported on failure
    (``ENGRAM_TEST_SEED`` replays it; tests/conftest.py)."""
    return np.random.default_rng(fresh_seed(__name__))


def small_hasher(seed: int, device=DEVICE, **kwargs) -> engram.NgramHasher:
    spec = engram.EngramSpec.from_hf_config(small_config(n_heads=kwargs.pop("heads", 3), layer_ids=kwargs.pop("layers", (1, 3)),
                                                         vocab_size=kwargs.pop("vocab_size", 1009)))
    vocab = random_vocab(spec.compressed_vocab_size, 300, np.random.default_rng(seed))
    backend = kwargs.pop("backend", "triton")
    return engram.NgramHasher(engram.EngramLayout(spec), vocab, device=device, backend=backend, **kwargs)


def serve_and_check(hasher, source, rng, lengths, budget, fused_slot_write=False):
    engine = StreamingEngine(hasher, source, rng, block_size=int(rng.integers(1, 6)), num_blocks=512,
                             fused_slot_write=fused_slot_write)
    for k, length in enumerate(lengths):
        token_ids = rng.integers(0, hasher.vocab.vocab_size, length)
        dead = rng.random(length) < 0.1
        engine.add(f"request-{k}", token_ids, dead)
    engine.run_random(max_batch_tokens=budget)
    assert engine.tokens_checked == sum(lengths)
    assert engine.mismatches == 0


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
@pytest.mark.parametrize("source,fused", [(source, False) for source in HISTORY_SOURCES] + [("slot_cache", True)])
@pytest.mark.parametrize("heads,layers,vocab_size", [(3, (1, 3), 1009), (5, (2,), 2), (1, (0, 4, 9), 1009),
                                                     (1, (2,), 700_000_000)])  # primes near 2**29.4
def test_kernel_streaming_interpreted(source, fused, heads, layers, vocab_size):
    rng = _rng()
    hasher = small_hasher(int(rng.integers(2**31)), heads=heads, layers=layers, vocab_size=vocab_size)
    serve_and_check(hasher, source, rng, lengths=[1, 23, 9], budget=16, fused_slot_write=fused)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
def test_kernel_matches_torch_path_and_stores_interpreted():
    """Same ids, slot cache and request history afterwards, with lookback, dead tokens
    and padding: every phase of the kernel (slot writers, hashers, history writers)."""
    rng = _rng()
    seed = int(rng.integers(2**31))
    kernel, torch_path = small_hasher(seed), small_hasher(seed)
    torch_path.backend = "torch"
    rows = torch.tensor([4, 0, 2])
    for hasher in (kernel, torch_path):
        hasher.bind_slot_cache(256, 4)
        hasher.bind_request_history(5, max_draft_tokens=1)
    token_ids = torch.from_numpy(rng.integers(0, 300, 13))
    positions = torch.tensor([5, 6, 7, 8, 9, 0, 1, 2, 3, 40, 41, 0, 0])  # two padding tokens at the end
    starts = torch.tensor([0, 5, 9, 11])
    dead = torch.from_numpy(rng.random(13) < 0.2)
    lookback = torch.tensor([[4, 7, 9], [-1, -1, -1], [11, -1, 12]])
    lookback_dead = torch.tensor([[False, True, False], [False, False, False], [False, False, False]])
    table = torch.from_numpy(rng.permutation(64)[:36].reshape(3, 12).astype(np.int32))
    request_of_token = torch.tensor([0] * 5 + [1] * 4 + [2] * 2 + [0, 0])
    slot_mapping = table.long()[request_of_token, positions // 4] * 4 + positions % 4
    slot_mapping[[0, 11, 12]] = -1  # a token without a slot, and the padding
    outputs = []
    for hasher in (kernel, torch_path):
        hasher.validate = False
        outputs.append(hasher(token_ids, positions, starts, dead_mask=dead, lookback_token_ids=lookback,
                              lookback_dead_mask=lookback_dead, slot_mapping=slot_mapping, block_table=table,
                              request_rows=rows))
    assert torch.equal(outputs[0], outputs[1])
    slots = kernel.slot_cache.num_slots  # the spare slot past the end absorbs skipped writes
    assert torch.equal(kernel.slot_cache.values[:slots], torch_path.slot_cache.values[:slots])
    assert torch.equal(kernel.request_history.values[:-1], torch_path.request_history.values[:-1])
    assert torch.equal(kernel.request_history.tags[:-1], torch_path.request_history.tags[:-1])


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
@pytest.mark.parametrize("tokens_per_request", [1, 2])
def test_prepared_calls_match_torch_path_interpreted(tokens_per_request):
    """Validation off, one batch structure step after step: the first call plans it, later calls
    run its PreparedHash (slot writes, hash, history writes as separate launches when several
    programs share the batch). Ids and both stores equal the torch path's after every step."""
    from engram.hashing.launch import PreparedHash

    rng = _rng()
    seed = int(rng.integers(2**31))
    kernel, torch_path = small_hasher(seed, validate=False), small_hasher(seed, validate=False)
    torch_path.backend = "torch"
    num_requests, block_size = 3, 4
    table = torch.from_numpy(rng.permutation(48).astype(np.int32).reshape(num_requests, 16))
    for hasher in (kernel, torch_path):
        hasher.bind_slot_cache(48 * block_size, block_size)
        hasher.bind_request_history(num_requests + 1)
    rows = kernel.request_rows(range(num_requests))
    assert torch.equal(rows, torch_path.request_rows(range(num_requests)))
    starts = torch.arange(0, num_requests * tokens_per_request + 1, tokens_per_request)
    request_of_token = torch.arange(num_requests).repeat_interleave(tokens_per_request)
    first = torch.from_numpy(rng.integers(0, 3, num_requests))
    for step in range(4):
        positions = first[request_of_token] + step * tokens_per_request + torch.arange(tokens_per_request).repeat(
            num_requests)
        slot_mapping = table.long()[request_of_token, positions // block_size] * block_size + positions % block_size
        token_ids = torch.from_numpy(rng.integers(0, 300, num_requests * tokens_per_request))
        dead = torch.from_numpy(rng.random(num_requests * tokens_per_request) < 0.2)
        ids = [hasher(token_ids, positions, starts, dead_mask=dead, slot_mapping=slot_mapping, block_table=table,
                      request_rows=rows) for hasher in (kernel, torch_path)]
        assert torch.equal(ids[0], ids[1]), f"step {step}"
        assert torch.equal(kernel.slot_cache.values[:-1], torch_path.slot_cache.values[:-1]), f"step {step}"
        assert torch.equal(kernel.request_history.values[:-1], torch_path.request_history.values[:-1])
        assert torch.equal(kernel.request_history.tags[:-1], torch_path.request_history.tags[:-1])
    (entry,) = kernel._plans._entries.values()
    assert isinstance(entry[3], PreparedHash)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
@pytest.mark.parametrize("max_draft_tokens", [0, 2])
@pytest.mark.parametrize("lengths", [[1, 2, 3, 5, 6, 9, 4], [1]])
def test_history_writers_match_torch_path_interpreted(max_draft_tokens, lengths):
    """The ring after one batch: lookback seeds and the last `width` tokens, wrap-around
    collisions included (chunks longer than the ring, seeds a later token overwrites)."""
    rng = _rng()
    seed = int(rng.integers(2**31))
    kernel, torch_path = small_hasher(seed, validate=False), small_hasher(seed, validate=False)
    torch_path.backend = "torch"
    starts = torch.tensor(np.cumsum([0] + lengths))
    first_positions = rng.integers(0, 20, len(lengths))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(first_positions, lengths)])
    token_ids = torch.from_numpy(rng.integers(0, 300, int(starts[-1])))
    dead = torch.from_numpy(rng.random(int(starts[-1])) < 0.2)
    lookback = torch.from_numpy(rng.integers(-1, 300, (len(lengths), 3)))
    lookback_dead = torch.from_numpy(rng.random((len(lengths), 3)) < 0.2)
    for hasher in (kernel, torch_path):
        history = hasher.bind_request_history(len(lengths) + 2, max_draft_tokens=max_draft_tokens)
        rows = torch.from_numpy(rng.permutation(len(lengths) + 2)[:len(lengths)])
        history.values[:-1] = torch.from_numpy(rng.integers(0, 40, tuple(history.values[:-1].shape)).astype(np.int32))
        history.tags[:-1] = torch.from_numpy(rng.integers(0, 30, tuple(history.tags[:-1].shape)))  # old history
        for row, first in zip(rows.tolist(), first_positions.tolist()):  # most reads find their position
            for back in (1, 2):
                if first - back >= 0 and rng.random() < 0.8:
                    history.tags[row, (first - back) % history.width] = first - back
    kernel.request_history.values.copy_(torch_path.request_history.values)
    kernel.request_history.tags.copy_(torch_path.request_history.tags)
    ids = [hasher(token_ids, positions, starts, dead_mask=dead, lookback_token_ids=lookback,
                  lookback_dead_mask=lookback_dead, request_rows=rows) for hasher in (kernel, torch_path)]
    assert torch.equal(ids[0], ids[1])  # read before the ring was written
    assert torch.equal(kernel.request_history.values[:-1], torch_path.request_history.values[:-1])
    assert torch.equal(kernel.request_history.tags[:-1], torch_path.request_history.tags[:-1])


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
def test_kernel_same_step_prefix_hit_interpreted():
    """History another request writes in the same batch: exact with the default
    (slot writers ordered before readers in the launch); refused by validation with
    fused_write=True."""
    from test_hasher_properties import same_step_prefix_hit_batch

    rng = _rng()
    hasher = small_hasher(int(rng.integers(2**31)))
    hasher.bind_slot_cache(32 * 4, 4)
    batch, a_tokens, b_tokens, hit = same_step_prefix_hit_batch(rng)
    got = hasher(**batch).numpy()
    no_dead = np.zeros(len(b_tokens), dtype=bool)
    expected_b = engram.hash_ngrams(b_tokens, hasher.layout, hasher.vocab, no_dead)[hit:]
    assert (got[len(a_tokens):] == expected_b).all()
    hasher.bind_slot_cache(32 * 4, 4, fused_write=True)
    with pytest.raises(ValueError, match="fused_write=True needs history from earlier steps"):
        hasher(**batch)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
def test_kernel_reports_missing_history_and_undoes_writes_interpreted():
    rng = _rng()
    hasher = small_hasher(int(rng.integers(2**31)))
    cache = hasher.bind_slot_cache(32, 1)
    history = hasher.bind_request_history(2)
    table = torch.arange(32, dtype=torch.int32)[None].repeat(2, 1)
    token_ids = torch.from_numpy(rng.integers(0, 300, 6))
    positions = torch.tensor([10, 11, 12, 13, 0, 1])  # request 0 lacks its history; request 1 is fine
    rows = hasher.request_rows(["a", "b"])
    before = cache.values.clone(), history.values.clone(), history.tags.clone()
    with pytest.raises(ValueError, match=r"request 0 starts at position 10, but the token at position 9 is unknown"):
        hasher(token_ids, positions, torch.tensor([0, 4, 6]), block_table=table,
               slot_mapping=torch.tensor([10, 11, 12, 13, 0, 1]), request_rows=rows)  # the slots block_table gives
    assert torch.equal(cache.values, before[0])
    assert torch.equal(history.values, before[1]) and torch.equal(history.tags, before[2])


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
def test_malformed_metadata_never_leaves_bounds_interpreted():
    """Random malformed query_start_loc / positions / slot_mapping / block_table /
    lookback / request rows, validation off: every call returns, and every lane of
    every load and store of the three kernels stays inside the tensors the launch was
    given (tests/interpreter_bounds.py). Wrong ids are allowed."""
    from hash_fuzz import run_fuzz
    from interpreter_bounds import bounds_checked

    seed = int(_rng().integers(2**31))
    print(f"fuzz seed {seed} (replay: run_fuzz(..., seed={seed}, ...))")
    shapes = []
    with bounds_checked() as memory:
        calls = run_fuzz(lambda s: small_hasher(s, validate=False), seed, cases=40,
                         after_call=lambda hasher, batch, ids: shapes.append(tuple(ids.shape)))
    assert calls == 40 and memory.accesses > 0
    assert shapes[0] == (100, 2, 9)  # the hang reproducer returned


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
def test_bounds_checker_catches_a_stray_access_interpreted():
    """The checker itself: one element past the input, or past the output, is reported."""
    from interpreter_bounds import StrayAccess, bounds_checked

    values = torch.arange(8, dtype=torch.int32)
    with bounds_checked():
        out = torch.full((8,), -1, dtype=torch.int32)
        _copy_test_kernel[(1,)](values, out, 8, 8, BLOCK=8)
        assert torch.equal(out, values)
        with pytest.raises(Exception, match="out-of-bounds lanes; first: a 4-byte load"):
            _copy_test_kernel[(1,)](values, out, 9, 8, BLOCK=16)
        with pytest.raises(Exception, match="out-of-bounds lanes; first: a 4-byte store"):
            _copy_test_kernel[(1,)](values, out, 8, 9, BLOCK=16)
    assert StrayAccess.__mro__[1] is AssertionError


@triton.jit
def _copy_test_kernel(source_ptr, out_ptr, load_count, store_count, BLOCK: tl.constexpr):
    offset = tl.arange(0, BLOCK)
    value = tl.load(source_ptr + offset, mask=offset < load_count, other=0)
    tl.store(out_ptr + offset, value, mask=offset < store_count)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_malformed_metadata_returns():
    """The fuzz on the GPU, with a sync after each call: every launch returns (the hang
    reproducer first); compute-sanitizer runs the same fuzz in benchmarks/kernels/memcheck_kernels.py."""
    from hash_fuzz import run_fuzz

    seed = int(_rng().integers(2**31))
    print(f"fuzz seed {seed}")
    calls = run_fuzz(lambda s: small_hasher(s, device="cuda", validate=False), seed, cases=100,
                     after_call=lambda hasher, batch, ids: torch.cuda.synchronize())
    assert calls == 100


def remainder_cases(rng, count=512):
    """(values, primes) int64: random values below 2**63 and the edges of Barrett
    reduction (multiples of the prime, one below and above, the largest values)."""
    v41 = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG)).column_primes.reshape(-1)
    primes = np.concatenate([[2, 3, 5, 65521, 2**31 - 1, 4294967291], v41])
    prime = rng.choice(primes, count)
    value = rng.integers(0, 2**63 - 1, count, dtype=np.int64, endpoint=True)
    edges = np.arange(count) % 4
    multiple = (value // prime) * prime
    value = np.where(edges == 1, multiple, value)
    value = np.where(edges == 2, np.maximum(multiple - 1, 0), value)
    value = np.where(edges == 3, 2**63 - 1 - rng.integers(0, 3, count), value)
    return value.astype(np.int64), prime.astype(np.int64)


@triton.jit
def _remainder_test_kernel(value_ptr, prime_ptr, barrett_ptr, out_ptr, BLOCK: tl.constexpr):
    offset = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(value_ptr + offset)
    out = _remainder(value, tl.load(prime_ptr + offset), tl.load(barrett_ptr + offset))
    tl.store(out_ptr + offset, out)


def check_remainder(device):
    rng = _rng()
    value, prime = remainder_cases(rng)
    barrett = np.array([(2**64 - 1) // int(p) for p in prime], dtype=np.uint64).view(np.int64)
    out = torch.full((len(value),), -7, dtype=torch.int64, device=device)  # poisoned
    _remainder_test_kernel[(len(value) // 128,)](torch.from_numpy(value).to(device), torch.from_numpy(prime).to(device),
                                                 torch.from_numpy(barrett).to(device), out, BLOCK=128)
    expected = np.array([int(v) % int(p) for v, p in zip(value, prime)], dtype=np.int64)
    assert np.array_equal(out.cpu().numpy(), expected)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
def test_barrett_remainder_exact_interpreted():
    check_remainder("cpu")


# ---- GPU ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_barrett_remainder_exact():
    check_remainder("cuda")


def v41_hasher(device="cuda", **kwargs):
    spec = engram.EngramSpec.from_hf_config(PACKAGED_CONFIG)
    vocab = random_vocab(spec.compressed_vocab_size, 129280, np.random.default_rng(7))
    return engram.NgramHasher(engram.EngramLayout(spec), vocab, device=device, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 7, 63, 1024, 8192])
def test_gpu_whole_sequences_v41(num_tokens):
    rng = _rng()
    hasher = v41_hasher(validate=False)
    assert hasher._use_triton()
    token_ids = rng.integers(0, 129280, num_tokens)
    dead = rng.random(num_tokens) < 0.05
    expected = engram.hash_ngrams(token_ids, hasher.layout, hasher.vocab, dead)
    got = hasher(torch.from_numpy(token_ids).cuda(), torch.arange(num_tokens, device="cuda"),
                 torch.tensor([0, num_tokens], device="cuda"), dead_mask=torch.from_numpy(dead).cuda())
    assert got.dtype == torch.int32 and np.array_equal(got.cpu().numpy(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("source,fused", [(source, False) for source in HISTORY_SOURCES] + [("slot_cache", True)])
def test_gpu_streaming(source, fused):
    rng = _rng()
    serve_and_check(small_hasher(int(rng.integers(2**31)), device="cuda"), source, rng, [1, 63, 200, 7], budget=96,
                    fused_slot_write=fused)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_same_step_prefix_hit():
    from test_hasher_properties import same_step_prefix_hit_batch

    rng = _rng()
    hasher = small_hasher(int(rng.integers(2**31)), device="cuda", validate=False)
    hasher.bind_slot_cache(32 * 4, 4)
    batch, a_tokens, b_tokens, hit = same_step_prefix_hit_batch(rng)
    got = hasher(**{name: tensor.cuda() for name, tensor in batch.items()}).cpu().numpy()
    expected_b = engram.hash_ngrams(b_tokens, hasher.layout, hasher.vocab)[hit:]
    assert (got[len(a_tokens):] == expected_b).all()


def check_same_step_prefix_hits(hasher, pairs, block_size, prefill_blocks, tail):
    """Each request B_k hits a random number of the blocks that request A_k fills in
    this same batch, in a shuffled batch order, with the request history bound too
    (every phase of the launch)."""
    rng = _rng()
    device = hasher.device
    hasher.bind_slot_cache(pairs * 2 * (prefill_blocks + 8) * block_size, block_size)
    hasher.bind_request_history(2 * pairs)
    free_blocks = iter(rng.permutation(pairs * 2 * (prefill_blocks + 8)).tolist())
    requests = []  # (tokens of the whole sequence, first position in this batch, block row)
    for _ in range(pairs):
        a_tokens = rng.integers(0, hasher.vocab.vocab_size, prefill_blocks * block_size + 2)
        a_blocks = [next(free_blocks) for _ in range(prefill_blocks + 1)]
        hit = int(rng.integers(1, prefill_blocks))
        b_tokens = np.concatenate([a_tokens[:hit * block_size], rng.integers(0, hasher.vocab.vocab_size, tail)])
        b_blocks = a_blocks[:hit] + [next(free_blocks) for _ in range(tail // block_size + 2)]
        requests += [(a_tokens, 0, a_blocks), (b_tokens, hit * block_size, b_blocks)]
    order = rng.permutation(len(requests))
    width = max(len(blocks) for _, _, blocks in requests)
    table = torch.tensor([requests[k][2] + [0] * (width - len(requests[k][2])) for k in order], dtype=torch.int32)
    input_ids, positions, slots, starts, expected = [], [], [], [0], []
    for k in order:
        tokens, first, blocks = requests[k]
        span = np.arange(first, len(tokens))
        input_ids.append(tokens[first:])
        positions.append(span)
        slots.append(np.array(blocks)[span // block_size] * block_size + span % block_size)
        starts.append(starts[-1] + len(span))
        expected.append(engram.hash_ngrams(tokens, hasher.layout, hasher.vocab)[first:])
    rows = hasher.request_rows(range(len(requests)))
    got = hasher(torch.from_numpy(np.concatenate(input_ids)).to(device),
                 torch.from_numpy(np.concatenate(positions)).to(device), torch.tensor(starts, device=device),
                 slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device), block_table=table.to(device),
                 request_rows=rows)
    assert np.array_equal(got.cpu().numpy(), np.concatenate(expected))


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETED, reason="runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
@pytest.mark.parametrize("block_tokens", [None, 128])
def test_kernel_same_step_prefix_hits_many_requests_interpreted(block_tokens, monkeypatch):
    """``block_tokens=128``: the whole batch in one program, which then writes both
    stores itself after its reads (no slot-writer or history-writer launch)."""
    from engram.hashing import launch

    if block_tokens:
        monkeypatch.setitem(launch.LAUNCH_OVERRIDE, "block_tokens", block_tokens)
    hasher = small_hasher(int(_rng().integers(2**31)), validate=False)
    check_same_step_prefix_hits(hasher, pairs=3, block_size=4, prefill_blocks=3, tail=5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("pairs,block_tokens", [(1, None), (24, None), (2, 256)])
def test_gpu_same_step_prefix_hits_many_requests(pairs, block_tokens, monkeypatch):
    """Up to ~8k tokens, V4.1 geometry: slot writes, hash and history writes as three
    ordered launches (or one program that does all three)."""
    from engram.hashing import launch

    if block_tokens:
        monkeypatch.setitem(launch.LAUNCH_OVERRIDE, "block_tokens", block_tokens)
    check_same_step_prefix_hits(v41_hasher(validate=False), pairs, block_size=16, prefill_blocks=16, tail=64)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("with_history", [False, True])
def test_gpu_cuda_graph_capture_and_replay(with_history):
    """Decode steps captured once, replayed with new tokens copied into the static buffers
    (with the request history bound too: every phase of the launch in the graph)."""
    rng = _rng()
    hasher = v41_hasher(validate=False)
    requests, block_size, steps = 8, 16, 6
    prompt = 40
    hasher.bind_slot_cache(requests * 64 * block_size, block_size)
    rows = None
    if with_history:
        hasher.bind_request_history(requests)
        rows = hasher.request_rows(range(requests))
    sequences = rng.integers(0, 129280, (requests, prompt + steps + 2))
    expected = [engram.hash_ngrams(s, hasher.layout, hasher.vocab) for s in sequences]
    table = torch.arange(requests * 64, dtype=torch.int32, device="cuda").reshape(requests, 64)
    # Prefill every request in one eager batch.
    flat = torch.from_numpy(sequences[:, :prompt].reshape(-1)).cuda()
    positions = torch.arange(prompt, device="cuda").repeat(requests)
    starts = torch.arange(requests + 1, device="cuda") * prompt
    slots = (table.long()[:, :, None] * block_size + torch.arange(block_size, device="cuda")).reshape(requests, -1)[:, :prompt].reshape(-1)
    hasher(flat, positions, starts, slot_mapping=slots, block_table=table, request_rows=rows)
    # Static decode buffers.
    token_ids = torch.zeros(requests, dtype=torch.int64, device="cuda")
    decode_positions = torch.zeros(requests, dtype=torch.int64, device="cuda")
    decode_slots = torch.zeros(requests, dtype=torch.int64, device="cuda")
    decode_starts = torch.arange(requests + 1, dtype=torch.int32, device="cuda")

    def fill(step):
        position = prompt + step
        token_ids.copy_(torch.from_numpy(sequences[:, position]))
        decode_positions.fill_(position)
        decode_slots.copy_(table.long()[:, position // block_size] * block_size + position % block_size)

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hasher(token_ids, decode_positions, decode_starts, slot_mapping=decode_slots, block_table=table,
               request_rows=rows)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = hasher(token_ids, decode_positions, decode_starts, slot_mapping=decode_slots, block_table=table,
                            request_rows=rows)
    for step in range(steps):
        fill(step)
        static_out.fill_(-7)  # poison before each replay
        graph.replay()
        got = static_out.cpu().numpy()
        for k in range(requests):
            assert np.array_equal(got[k], expected[k][prompt + step])
