"""kv ahead: each layer's kv = wkv(rows) computed at the step's prefetch, so the layer runs only its
gate; bit-identical to computing it in the layer, and never served to another step's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engram


def _step(memory, rng: np.random.Generator, tokens: int):
    device = memory.device
    input_ids = torch.from_numpy(rng.integers(0, memory.vocab.vocab_size, tokens)).to(device)
    hash_ids = memory.hasher(input_ids, torch.arange(tokens, device=device), torch.tensor([0, tokens], device=device))
    spec = memory.spec
    hidden = torch.from_numpy(rng.standard_normal((tokens, spec.hc_mult, spec.hidden_size))).to(torch.bfloat16)
    mask = torch.from_numpy(rng.random(tokens) < 0.8)
    return hash_ids, hidden.to(device), mask.to(device)


@pytest.mark.parametrize("tokens", [1, 9, 63])
def test_kv_ahead_equals_the_layer_computing_it(synthetic_model_dir, rng, tokens, monkeypatch):
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    hash_ids, hidden, mask = _step(memory, rng, tokens)
    expected = {i: memory.forward_layer(i, hidden, hash_ids, mask) for i in memory.layer_ids}
    handle = memory.prefetch(hash_ids, kv_ahead=True)
    projections = []
    for layer_id in memory.layer_ids:  # the layers must not project again: only their gates run
        monkeypatch.setattr(memory.layer(layer_id), "project", lambda *a, **k: projections.append(a))
    for layer_id in memory.layer_ids:
        got = memory.forward_layer(layer_id, hidden, hash_ids, mask, prefetch=handle)
        assert torch.equal(got.view(torch.int16), expected[layer_id].view(torch.int16))
    assert projections == []


def test_kv_ahead_is_never_served_to_another_step(synthetic_model_dir, rng):
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    hash_ids, hidden, mask = _step(memory, rng, 6)
    stale = memory.prefetch(hash_ids, kv_ahead=True)
    next_ids, hidden, mask = _step(memory, rng, 6)   # the hasher ran: another step
    hash_ids.copy_(next_ids)                          # and the engine reuses the buffer
    layer_id = memory.layer_ids[0]
    expected = memory.forward_layer(layer_id, hidden, hash_ids, mask)
    got = memory.forward_layer(layer_id, hidden, hash_ids, mask, prefetch=stale)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    # the same through a plan, and a kv used twice is computed again the second time
    plan = memory.plan(hidden, hash_ids, mask)
    handle = memory.prefetch(hash_ids, kv_ahead=True)
    assert torch.equal(plan.run(layer_id, hidden, hash_ids, mask, prefetch=handle).view(torch.int16),
                       expected.view(torch.int16))
    assert torch.equal(plan.run(layer_id, hidden, hash_ids, mask, prefetch=handle).view(torch.int16),
                       expected.view(torch.int16))
    with pytest.raises(ValueError, match="kv_ahead: expected True or False"):
        memory.prefetch(hash_ids, kv_ahead="yes")


def test_kv_ahead_under_inference_mode_never_serves_ids_edited_in_place(synthetic_model_dir, rng, monkeypatch):
    """Inference tensors keep no version counter, so an in-place edit after the prefetch is invisible to the
    handle, and a kv (a product of rows) cannot be checked row by row: under inference mode no kv is computed
    ahead, and the layer's output is that of the edited ids."""
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    with torch.inference_mode():
        hash_ids, hidden, mask = _step(memory, rng, 9)
        computed = []
        for layer_id in memory.layer_ids:
            layer = memory.layer(layer_id)
            monkeypatch.setattr(layer, "kv_ahead", lambda *a, _inner=layer.kv_ahead, **k: computed.append(a) or
                                _inner(*a, **k))
        handle = memory.prefetch(hash_ids, kv_ahead=True)
        assert computed == []
        hash_ids[:, :, 0].add_(1)  # edited after the prefetch, invisibly to the handle
        for layer_id in memory.layer_ids:
            expected = memory.forward_layer(layer_id, hidden, hash_ids, mask)
            got = memory.forward_layer(layer_id, hidden, hash_ids, mask, prefetch=handle)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["device", "host"])
def test_gpu_kv_ahead_on_a_side_stream_is_bit_identical(synthetic_model_dir, rng, placement):
    from conftest import memory_on_cuda

    memory = memory_on_cuda(synthetic_model_dir, placement, placement_options=None if placement == "device"
                            else {"direct_max_rows": 0})
    for tokens in (3, 300):
        hash_ids, hidden, mask = _step(memory, rng, tokens)
        expected = {i: memory.forward_layer(i, hidden, hash_ids, mask) for i in memory.layer_ids}
        handle = memory.prefetch(hash_ids, kv_ahead=True)
        for layer_id in memory.layer_ids:
            got = memory.forward_layer(layer_id, hidden, hash_ids, mask, prefetch=handle)
            assert torch.equal(got.view(torch.int16), expected[layer_id].view(torch.int16)), (placement, tokens)


def test_kv_ahead_leaves_a_layer_with_a_host_gather_in_flight_to_its_forward(synthetic_model_dir, rng, monkeypatch):
    """A layer whose prefetch started a host gather that its lookup would wait for on the caller's
    thread (the Python worker) keeps that prefetch. Its forward computes kv itself; the other layers
    only gate."""
    from engram.table.prefetch import TablePrefetch

    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    hash_ids, hidden, mask = _step(memory, rng, 9)
    expected = {i: memory.forward_layer(i, hidden, hash_ids, mask) for i in memory.layer_ids}
    gathering = memory.layer_ids[0]
    marked = []
    real_prefetch = memory.layer(gathering).prefetch

    def prefetch_started(*args, **kwargs):
        handle = real_prefetch(*args, **kwargs)
        marked.append(handle)
        return handle

    monkeypatch.setattr(memory.layer(gathering), "prefetch", prefetch_started)
    monkeypatch.setattr(TablePrefetch, "finish_waits", property(lambda self: any(self is h for h in marked)))
    kv_calls = []
    for layer_id in memory.layer_ids:
        real_kv = memory.layer(layer_id).kv_ahead
        monkeypatch.setattr(memory.layer(layer_id), "kv_ahead",
                            lambda ids, table_prefetch, _id=layer_id, _real=real_kv: (kv_calls.append(_id),
                                                                                       _real(ids, table_prefetch))[1])
    handle = memory.prefetch(hash_ids, kv_ahead=True)
    assert marked and marked[0] is not None
    assert kv_calls == [i for i in memory.layer_ids if i != gathering]
    for layer_id in memory.layer_ids:
        got = memory.forward_layer(layer_id, hidden, hash_ids, mask, prefetch=handle)
        assert torch.equal(got.view(torch.int16), expected[layer_id].view(torch.int16))
