"""What a step's prefetch waits for on the GPU: the hashing of its ids, nothing the engine enqueued since.

``EngramMemory.prefetch`` runs the device work of tables that start reads (placements ``"host"`` and
``"cached"``) on the memory's own stream. Its ids are the hasher's latest output, unchanged: that stream
waits for the hashing only, so a prefetch called after the decoder layers were enqueued starts at once.
Anything else (ids the hasher did not make, or refilled since) waits for the caller's stream as it is.
The main stream is held by a wait on a pinned word that the test releases, in place of those layers.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import memory_on_cuda

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

HOST_OPTIONS = {"direct_max_rows": 0, "host_gather_worker": "native"}  # every lookup through the host gather


class MainStreamGate:
    """Holds the current stream at a wait on a pinned word until :meth:`release` (always called: a
    test that fails while the stream is held must not leave it waiting)."""

    def __init__(self):
        from engram.table.host_memory import stream_memory_ops

        self.word = torch.zeros(16, dtype=torch.int32, pin_memory=True)
        self.stream = torch.cuda.current_stream()
        stream_memory_ops.wait_value(self.stream, stream_memory_ops.device_address(self.word, self.stream.device), 1)

    def held(self) -> bool:
        return not self.stream.query()

    def release(self) -> None:
        self.word[0] = 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _batch(memory, rng: np.random.Generator, tokens: int):
    """Token ids, positions and query_start_loc of one request of ``tokens`` tokens, and its hidden states."""
    spec = memory.spec
    input_ids = torch.from_numpy(rng.integers(0, memory.vocab.vocab_size, tokens)).cuda()
    positions = torch.arange(tokens, device="cuda")
    query_start_loc = torch.tensor([0, tokens], device="cuda")
    generator = torch.Generator("cuda").manual_seed(int(rng.integers(2**31)))
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device="cuda", generator=generator).bfloat16()
    return (input_ids, positions, query_start_loc), hidden


def _wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def _assert_layers(memory, on_device, hidden, hash_ids, handle, what: str):
    for layer_id in memory.layer_ids:
        got = memory.forward_layer(layer_id, hidden, hash_ids, prefetch=handle)
        expected = on_device.forward_layer(layer_id, hidden, hash_ids)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), f"{what}: layer {layer_id}"


def test_gpu_prefetch_after_later_work_waits_for_the_hashing_only(synthetic_model_dir, rng):
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    on_host = memory_on_cuda(synthetic_model_dir, "host", placement_options=HOST_OPTIONS)
    assert on_host.hasher.marks_ready and not on_device.hasher.marks_ready
    gathers = [on_host.table(i).storage.host_gather for i in on_host.layer_ids]
    assert all(gather.worker == "native" for gather in gathers)
    batch, hidden = _batch(on_host, rng, 300)
    warm = on_host.hasher(*batch)  # kernels loaded, staging grown
    _assert_layers(on_host, on_device, hidden, warm, on_host.prefetch(warm), "warm-up")
    torch.cuda.synchronize()
    served = [on_host.table(i).prefetches["served"] for i in on_host.layer_ids]

    batch, hidden = _batch(on_host, rng, 300)
    hash_ids = on_host.hasher(*batch)
    with MainStreamGate() as gate:  # the decoder layers before the first Engram layer, enqueued
        handle = on_host.prefetch(hash_ids)
        gathered = _wait_until(lambda: all(gather.idle for gather in gathers))
        held = gate.held()
    assert gathered and held, ("the prefetch's gathers did not finish while the main stream was held after the "
                               f"hashing (gathered={gathered}, held={held}): it waited for work enqueued after it")
    _assert_layers(on_host, on_device, hidden, hash_ids, handle, "prefetched behind held work")
    assert [on_host.table(i).prefetches["served"] for i in on_host.layer_ids] == [n + 1 for n in served]


@pytest.mark.parametrize("ids_source", ["refilled", "not_hashed"])
def test_gpu_prefetch_of_ids_written_after_the_hashing_waits_for_the_caller(synthetic_model_dir, rng, ids_source):
    """Ids refilled in place after the hasher made them, or made by the caller: the prefetch orders its
    reads after the caller's stream, here after a copy held behind the gate, and reads the new ids."""
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    on_host = memory_on_cuda(synthetic_model_dir, "host", placement_options=HOST_OPTIONS)
    batch, hidden = _batch(on_host, rng, 300)
    warm = on_host.hasher(*batch)
    _assert_layers(on_host, on_device, hidden, warm, on_host.prefetch(warm), "warm-up")
    wanted = on_host.hasher(*_batch(on_host, rng, 300)[0]).clone()
    if ids_source == "refilled":
        hash_ids = on_host.hasher(*batch)           # the hasher's latest output, then refilled below
    else:
        hash_ids = warm.clone()                     # valid ids of another step, until the copy runs
    torch.cuda.synchronize()
    with MainStreamGate():
        hash_ids.copy_(wanted)                      # runs only once the gate opens
        handle = on_host.prefetch(hash_ids)
    _assert_layers(on_host, on_device, hidden, hash_ids, handle, ids_source)
    assert torch.equal(hash_ids, wanted)


def test_gpu_cached_probe_waits_for_an_update_on_another_stream(synthetic_model_dir, rng):
    """``update_cache`` after the next step's hashing, its device work late (a sleep before it): the prefetch,
    on the memory's stream, probes the cache as the update left it, and its rows equal the device's."""
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    cached = memory_on_cuda(synthetic_model_dir, "cached",
                            placement_options={"direct_max_rows": 0, "cache_fraction": 0.5,
                                               "host_gather_worker": "native"})
    batch, hidden = _batch(cached, rng, 300)
    previous = cached.hasher(*batch)
    _assert_layers(cached, on_device, hidden, previous, cached.prefetch(previous), "first step")
    for step in range(3):
        batch, hidden = _batch(cached, rng, 300)
        hash_ids = cached.hasher(*batch)
        torch.cuda._sleep(50_000_000)               # the update's kernels start late on the main stream
        cached.update_cache(previous)
        served = [cached.table(i).prefetches["served"] for i in cached.layer_ids]
        handle = cached.prefetch(hash_ids)
        _assert_layers(cached, on_device, hidden, hash_ids, handle, f"step {step}")
        assert [cached.table(i).prefetches["served"] for i in cached.layer_ids] == [n + 1 for n in served]
        previous = hash_ids


def test_gpu_aborted_step_prefetch_is_never_served_behind_a_later_one(synthetic_model_dir, rng):
    """A step hashed and prefetched on the memory's stream but never run (aborted), then the next step's
    late prefetch: the next step's layers take their own rows, and the aborted handle, given later with its
    own ids, is not served (the hasher ran since); every output equals the device's."""
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    on_host = memory_on_cuda(synthetic_model_dir, "host", placement_options=HOST_OPTIONS)
    batch, hidden = _batch(on_host, rng, 300)
    aborted_ids = on_host.hasher(*batch)
    aborted = on_host.prefetch(aborted_ids)
    batch, hidden = _batch(on_host, rng, 300)
    hash_ids = on_host.hasher(*batch)
    with MainStreamGate():
        handle = on_host.prefetch(hash_ids)
    served = [on_host.table(i).prefetches["served"] for i in on_host.layer_ids]
    _assert_layers(on_host, on_device, hidden, hash_ids, handle, "the step after an aborted one")
    _assert_layers(on_host, on_device, hidden, aborted_ids, aborted, "the aborted step's handle, given late")
    assert [on_host.table(i).prefetches["served"] for i in on_host.layer_ids] == [n + 1 for n in served]


def test_gpu_decode_sized_prefetch_stays_on_the_callers_stream(synthetic_model_dir, rng):
    """Lookups read directly (decode sizes, default options) start nothing at the prefetch: it takes no stream
    of its own and adds no wait to the layers; a prefill-sized one does."""
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    on_host = memory_on_cuda(synthetic_model_dir, "host")
    for tokens, own_stream in ((4, False), (4200, True)):  # 24 ids a layer (6 columns), and 25,200 above 1024 x 24
        batch, hidden = _batch(on_host, rng, tokens)
        hash_ids = on_host.hasher(*batch)
        handle = on_host.prefetch(hash_ids)
        assert (handle.prepared is not None) == own_stream, tokens
        _assert_layers(on_host, on_device, hidden, hash_ids, handle, f"T = {tokens}")
