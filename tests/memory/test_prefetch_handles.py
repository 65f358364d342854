"""Prefetch handles never serve another step's rows.

Placement ``"cached"`` in its CPU form (``TRITON_INTERPRET=1``, every lookup sent through the
host-gather path with ``direct_max_rows = 0``) holds a prefetch's probe and gathered misses; a
lookup that took a stale one would return the old ids' rows. Each case compares the packed bytes
with a table that never prefetches. ``hash_ids`` buffers are reused in place, aliased at the same
address by a fresh tensor, superseded by a later prefetch and re-hashed, as an engine's steps do.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import engram
from engram.table.prefetch import IdsIdentity, PrefetchState

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWS, HEAD_DIM, COLUMNS = 96, 64, 5

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def _needs_interpreter():
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")


def _tables(generator: torch.Generator):
    values = torch.randint(0, 256, (ROWS, HEAD_DIM), generator=generator, dtype=torch.uint8)
    values[values == 0x7F] = 0  # no E4M3 NaN bytes
    values[values == 0xFF] = 0
    scales = torch.randint(100, 140, (ROWS, HEAD_DIM // 32), generator=generator, dtype=torch.uint8)
    plain = engram.EngramTable(values.clone(), scales.clone(), validate=False)
    cached = engram.EngramTable(values.clone(), scales.clone(), placement="cached", device="cpu", backend="triton",
                                validate=False, placement_options={"cache_fraction": 0.25, "ways": 4,
                                                                   "direct_max_rows": 0})
    return plain, cached


def _ids(generator: torch.Generator, tokens: int = 7) -> torch.Tensor:
    return torch.randint(0, ROWS, (tokens, COLUMNS), generator=generator, dtype=torch.int32)


def _assert_rows(cached, plain, hash_ids, prefetch=None, what=""):
    got = cached.lookup_packed(hash_ids, prefetch=prefetch)
    expected = plain.lookup_packed(hash_ids)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8)), f"values differ {what}"
    assert torch.equal(got[1], expected[1]), f"scales differ {what}"


def test_valid_handle_is_served_once(seed):
    plain, cached = _tables(torch.Generator().manual_seed(seed))
    hash_ids = _ids(torch.Generator().manual_seed(seed + 1))
    handle = cached.prefetch(hash_ids)
    assert handle.started
    _assert_rows(cached, plain, hash_ids, handle)
    assert cached.prefetches == {"served": 1, "dropped": 0}
    _assert_rows(cached, plain, hash_ids, handle, "(second use of a handle)")
    assert cached.prefetches == {"served": 1, "dropped": 0}


def test_buffer_refilled_in_place_never_serves_the_old_prefetch(seed):
    """The aborted step: prefetch, no lookup, the same buffer refilled with the next step's ids."""
    generator = torch.Generator().manual_seed(seed)
    plain, cached = _tables(generator)
    buffer = _ids(generator)
    stale = cached.prefetch(buffer)
    buffer.copy_(_ids(generator))  # next step, same tensor, same address
    _assert_rows(cached, plain, buffer, None, "(lookup without a handle)")
    _assert_rows(cached, plain, buffer, stale, "(the old step's handle)")
    assert cached.prefetches == {"served": 0, "dropped": 1}


def test_fresh_tensor_at_the_same_address_never_matches(seed):
    """What the caching allocator does between steps: a new tensor over the old one's bytes."""
    generator = torch.Generator().manual_seed(seed)
    plain, cached = _tables(generator)
    first = _ids(generator)
    stale = cached.prefetch(first)
    second = torch.from_numpy(first.numpy())  # another tensor object, same address, own version counter
    assert second.data_ptr() == first.data_ptr() and second._version == first._version
    second.numpy()[:] = _ids(generator).numpy()  # refilled behind torch's back: no version bump
    _assert_rows(cached, plain, second, stale, "(a fresh tensor at the old address)")
    assert cached.prefetches["served"] == 0


def test_later_prefetch_drops_the_earlier_one(seed):
    generator = torch.Generator().manual_seed(seed)
    plain, cached = _tables(generator)
    first, second = _ids(generator), _ids(generator)
    superseded = cached.prefetch(first)
    latest = cached.prefetch(second)
    _assert_rows(cached, plain, first, superseded, "(superseded handle)")
    _assert_rows(cached, plain, second, latest, "(latest handle)")
    assert cached.prefetches == {"served": 1, "dropped": 1}


def test_handle_given_with_other_ids_is_not_served(seed):
    generator = torch.Generator().manual_seed(seed)
    plain, cached = _tables(generator)
    hash_ids, other = _ids(generator), _ids(generator)
    handle = cached.prefetch(hash_ids)
    _assert_rows(cached, plain, other, handle, "(handle of other ids)")
    _assert_rows(cached, plain, hash_ids[:3], None)
    assert cached.prefetches == {"served": 0, "dropped": 1}


def test_handle_of_another_table_is_refused(seed):
    generator = torch.Generator().manual_seed(seed)
    _, cached = _tables(generator)
    _, other = _tables(generator)
    hash_ids = _ids(generator)
    handle = other.prefetch(hash_ids)
    with pytest.raises(ValueError, match="prefetch: a handle of another table"):
        cached.lookup(hash_ids, prefetch=handle)
    with pytest.raises(ValueError, match="prefetch: expected the TablePrefetch"):
        cached.lookup(hash_ids, prefetch="yes")


def test_ids_identity_tracks_views_of_one_base(seed):
    step = torch.randint(0, ROWS, (6, 2, COLUMNS), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    identity = IdsIdentity.of(step[:, 1, :])
    assert identity.matches(step[:, 1, :])          # a new view object of the same base
    assert not identity.matches(step[:, 0, :])      # another layer's slice
    assert not identity.matches(step[:3, 1, :])     # another token range
    step[0, 0, 0] += 1                              # any in-place write to the base bumps the shared version
    assert not identity.matches(step[:, 1, :])
    with torch.inference_mode():
        frozen = torch.zeros(4, COLUMNS, dtype=torch.int32)
    inference_identity = IdsIdentity.of(frozen)     # inference tensors have no version: the base decides
    assert inference_identity.version is None and inference_identity.matches(frozen)
    assert not inference_identity.matches(frozen.clone())


# ---- the step's handle (EngramMemory) -------------------------------------------
def _cached_memory(model_dir):
    """The synthetic checkpoint on the CPU, and the same layers over CPU-form cached tables."""
    plain = engram.EngramMemory.from_pretrained(model_dir, placement="cpu", progress=False, validate=False)
    tables, layers = {}, {}
    for layer_id in plain.layer_ids:
        source, layer = plain.table(layer_id), plain.layer(layer_id)
        tables[layer_id] = engram.EngramTable(
            source.storage.value_bytes, source.storage.scale_bytes, num_columns_total=plain.spec.num_columns,
            placement="cached", device="cpu", backend="triton", validate=False,
            placement_options={"cache_fraction": 0.25, "direct_max_rows": 0})
        layers[layer_id] = engram.Engram(tables[layer_id], layer.wkv, layer.q_weight, layer.k_weight, eps=layer.eps,
                                         num_columns=layer.num_columns)
    cached = engram.EngramMemory(plain.spec, plain.layout, plain.vocab, plain.hasher, layers, tables,
                                 placement="cached", device=torch.device("cpu"))
    return plain, cached


def _step(memory, rng: np.random.Generator, tokens: int):
    input_ids = torch.from_numpy(rng.integers(0, memory.vocab.vocab_size, tokens)).to(torch.int64)
    hash_ids = memory.hasher(input_ids, torch.arange(tokens), torch.tensor([0, tokens]))
    spec = memory.spec
    hidden = torch.from_numpy(rng.standard_normal((tokens, spec.hc_mult, spec.hidden_size))).to(torch.bfloat16)
    return hash_ids, hidden


def test_step_handle_serves_its_step_only(synthetic_model_dir, rng):
    plain, cached = _cached_memory(synthetic_model_dir)
    layer_ids = cached.layer_ids
    hash_ids, hidden = _step(cached, rng, 5)
    handle = cached.prefetch(hash_ids)
    assert all(handle.started.values())
    assert set(handle.states.values()) == {PrefetchState.STARTED}
    entries = dict(handle._tables)
    for layer_id in layer_ids:
        got = cached.forward_layer(layer_id, hidden, hash_ids, prefetch=handle)
        assert torch.equal(got.view(torch.int16), plain.forward_layer(layer_id, hidden, hash_ids).view(torch.int16))
    assert [cached.table(i).prefetches["served"] for i in layer_ids] == [1] * len(layer_ids)
    assert handle.states == {} and {entry.state for entry in entries.values()} == {PrefetchState.SERVED}

    # An aborted step: its handle is kept by mistake, the hasher runs for the next step and the engine
    # reuses the buffer; the layers must read the new step's rows.
    stale = cached.prefetch(hash_ids)
    next_ids, hidden = _step(cached, rng, 5)
    hash_ids.copy_(next_ids)
    for layer_id in layer_ids:
        got = cached.forward_layer(layer_id, hidden, hash_ids, prefetch=stale)
        assert torch.equal(got.view(torch.int16), plain.forward_layer(layer_id, hidden, hash_ids).view(torch.int16))
    assert [cached.table(i).prefetches["served"] for i in layer_ids] == [1] * len(layer_ids)

    # The hasher ran again since the prefetch (a later step), ids tensor untouched: not served either.
    hash_ids, hidden = _step(cached, rng, 4)
    stale = cached.prefetch(hash_ids)
    entry = stale._tables[layer_ids[0]]
    _step(cached, rng, 4)
    got = cached.forward_layer(layer_ids[0], hidden, hash_ids, prefetch=stale)
    assert torch.equal(got.view(torch.int16), plain.forward_layer(layer_ids[0], hidden, hash_ids).view(torch.int16))
    assert cached.table(layer_ids[0]).prefetches["served"] == 1
    assert entry.state is PrefetchState.STALE  # the later hashing ended its step
    # Other ids than the step's: that layer's entry is dropped, the others stay open.
    hash_ids, hidden = _step(cached, rng, 4)
    handle = cached.prefetch(hash_ids)
    entry = handle._tables[layer_ids[0]]
    cached.forward_layer(layer_ids[0], hidden, hash_ids.clone(), prefetch=handle)
    assert entry.state is PrefetchState.DROPPED
    assert set(handle.states) == set(layer_ids[1:]) and set(handle.states.values()) <= {PrefetchState.STARTED}
    with pytest.raises(ValueError, match="prefetch: expected the handle this EngramMemory's prefetch"):
        plain.forward_layer(layer_ids[0], hidden, hash_ids, prefetch=stale)


def test_cpu_step_prefetch_runs_on_the_callers_stream(synthetic_model_dir, rng):
    """On the CPU nothing runs on a stream of the memory's own: the hasher marks nothing, the handle has no
    event to wait for, and the ids of a hasher call are not claimed as marked."""
    plain, cached = _cached_memory(synthetic_model_dir)
    assert not cached.hasher.marks_ready
    hash_ids, hidden = _step(cached, rng, 5)
    assert cached.hasher.ready_event(hash_ids) is None
    handle = cached.prefetch(hash_ids)
    assert handle.prepared is None and all(handle.started.values())
    for layer_id in cached.layer_ids:
        got = cached.forward_layer(layer_id, hidden, hash_ids, prefetch=handle)
        assert torch.equal(got.view(torch.int16), plain.forward_layer(layer_id, hidden, hash_ids).view(torch.int16))
