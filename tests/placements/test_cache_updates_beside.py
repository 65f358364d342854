"""Cache updates beside the step (:mod:`engram.table.placements.updates_beside`).

* unmarked: the option is refused by name; without CUDA updates stay on the caller's stream;
* ``gpu`` (seeded): a cache updated beside equals one updated inline, slot for slot and row for row, step
  after step, under ``torch.inference_mode()`` and outside it; a graph replayed while an update is held
  beside waits for it (then serves the updated content); an update that fails while being enqueued leaves
  the idle word set, so later replays finish.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import engram
from conftest import capture_cuda_graph, replay_poisoned
from engram.table.placements.row_cache import RowCache
from test_cached_placement import _ids, _table

HAS_CUDA = torch.cuda.is_available()


def test_update_beside_option_refused_by_name():
    from engram.table.placements.cached import CachedOptions

    with pytest.raises(ValueError, match="update_beside"):
        CachedOptions(update_beside="yes")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU fallback")
def test_without_cuda_updates_stay_inline():
    cache = RowCache(64, 256, "cpu", ways=8)
    assert cache.run_updates_beside() is False
    assert cache.updates_beside is None
    cache.settle()  # nothing to wait for


def _tables(rows: int, generator, **options):
    table = _table(rows, 256, generator)
    common = dict(validate=False, check_values=False)
    made = {"device": engram.EngramTable(table.values.clone(), table.scales.clone(), placement="device",
                                         device="cuda", **common)}
    for name, beside in (("beside", True), ("inline", False)):
        made[name] = engram.EngramTable(table.values.clone(), table.scales.clone(), placement="cached",
                                        device="cuda", placement_options=dict(options, update_beside=beside),
                                        **common)
    return made


def _same_cache(beside: RowCache, inline: RowCache, where: str) -> None:
    torch.cuda.synchronize()
    assert torch.equal(beside.tags, inline.tags), f"tags differ {where}"
    assert torch.equal(beside.counters, inline.counters), f"counters differ {where}"
    assert torch.equal(beside.slot_rows, inline.slot_rows), f"slot bytes differ {where}"
    assert torch.equal(beside.stats, inline.stats), f"stats differ {where}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
@pytest.mark.parametrize("policy", ["set-lru", "dynamic"])
@pytest.mark.parametrize("tokens", [63, 1000])
def test_gpu_updates_beside_equal_inline(tokens, policy, inference, seed):
    generator = torch.Generator().manual_seed(seed)
    tables = _tables(6000, generator, cache_fraction=0.03, aging_interval=2, policy=policy)
    beside, inline = tables["beside"].storage.cache, tables["inline"].storage.cache
    assert beside.updates_beside is not None and inline.updates_beside is None
    context = torch.inference_mode() if inference else torch.no_grad()
    with context:
        for step in range(8):
            ids = _ids(tokens, 24, 6000, 0, generator, hot=300, hot_start=500 * (step // 2)).cuda()
            expected = tables["device"].lookup(ids).view(torch.int16)
            for name in ("beside", "inline"):
                got = tables[name].lookup(ids).view(torch.int16)
                assert torch.equal(got, expected), f"{name} rows differ at step {step} (seed {seed})"
            for name in ("beside", "inline"):
                tables[name].update_cache(ids)
            ids.fill_(0)  # the caller's buffer reused at once: the update beside read its own copy
            _same_cache(beside, inline, f"after step {step} (seed {seed})")
    assert beside.updates_beside.count == 8
    assert int(beside.stats[1]) > 0, "no read hit the cache: the test did not test hits"


def _gate(stream: torch.cuda.Stream):
    """A pinned word and an enqueued wait on it: ``stream``'s later work runs once the host sets it to 1."""
    from engram.table.host_memory import stream_memory_ops

    word = torch.zeros(1, dtype=torch.int32).pin_memory()
    stream_memory_ops.wait_value(stream, stream_memory_ops.device_address(word, torch.device("cuda")), 1)
    return word


def _finishes(event: torch.cuda.Event, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if event.query():
            return True
        time.sleep(0.005)
    return event.query()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 63])
def test_gpu_replay_waits_for_an_update_held_beside(tokens, seed):
    """A graph replayed after an eager update beside finishes only after that update: the update is held by a
    gate on its stream that a thread opens 0.3 s later (a thread, so nothing here can wait for it forever)."""
    generator = torch.Generator().manual_seed(seed)
    tables = _tables(3000, generator, cache_fraction=0.05, aging_interval=1)
    cached, device = tables["beside"], tables["device"]
    static_ids = _ids(tokens, 24, 3000, 0, generator, hot=100).cuda()
    cached.lookup(static_ids)
    cached.update_cache(static_ids)  # the update's kernels built and loaded before any gate
    graph, static_out = capture_cuda_graph(lambda: cached.lookup(static_ids))
    beside = cached.storage.cache.updates_beside
    for step in range(3):
        static_ids.copy_(_ids(tokens, 24, 3000, 0, generator, hot=100).cuda())
        torch.cuda.synchronize()
        gate = _gate(beside.stream)  # the next update beside waits for the host
        opened = {}

        def open_later(gate=gate, opened=opened):
            time.sleep(0.3)
            opened["at"] = time.monotonic()
            gate[0] = 1

        opener = threading.Thread(target=open_later)
        opener.start()
        try:
            cached.update_cache(static_ids)
            replay_poisoned(graph, static_out)
            replayed = torch.cuda.Event()
            replayed.record()
            assert _finishes(replayed, 10.0), f"the replay never finished once the update ran (step {step})"
            finished_at = time.monotonic()
        finally:
            opener.join()
        assert "at" in opened and finished_at >= opened["at"], \
            f"the replay finished while the update was held beside (step {step}, seed {seed})"
        assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))
    assert int(cached.storage.cache.stats[1]) > 0


def _beside_table_with_a_captured_lookup(generator):
    """A cached table updating beside the step (its update's buffers sized), its ``device`` twin, static ids
    (63 x 24) and a graph capturing a lookup of them with its output."""
    tables = _tables(3000, generator, cache_fraction=0.05, aging_interval=1)
    cached, device = tables["beside"], tables["device"]
    static_ids = _ids(63, 24, 3000, 0, generator, hot=100).cuda()
    cached.update_cache(static_ids)  # sizes the update's buffers
    graph, static_out = capture_cuda_graph(lambda: cached.lookup(static_ids))
    return cached, device, static_ids, graph, static_out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_failed_update_beside_leaves_the_word_idle(monkeypatch, seed):
    generator = torch.Generator().manual_seed(seed)
    cached, device, static_ids, graph, static_out = _beside_table_with_a_captured_lookup(generator)
    from engram.table.kernels import cache_admission

    def failing(*args, **kwargs):
        raise RuntimeError("injected: launch failed")

    monkeypatch.setattr(cache_admission, "admit_step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        cached.update_cache(static_ids)
    monkeypatch.undo()
    graph.replay()
    replayed = torch.cuda.Event()
    replayed.record()
    assert _finishes(replayed, 10.0), "a replay after a failed update beside never finished"
    assert int(cached.storage.cache.updates_beside.idle[0]) == 1
    assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))
    cached.update_cache(static_ids)  # and the next update runs
    torch.cuda.synchronize()
    assert torch.equal(cached.lookup(static_ids).view(torch.int16), device.lookup(static_ids).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_gpu_update_whose_idle_write_fails_still_frees_the_word_and_orders_later_reads(monkeypatch, inference, seed):
    """The stream write that sets the idle word after an update beside fails (the update's kernels are
    enqueued): the call raises, the host sets the word once the update has run (a replay after it finishes),
    and later lookups, eager and replayed, serve exact rows."""
    from engram.table.host_memory import stream_memory_ops

    generator = torch.Generator().manual_seed(seed)
    cached, device, static_ids, graph, static_out = _beside_table_with_a_captured_lookup(generator)
    beside = cached.storage.cache.updates_beside
    write = stream_memory_ops.write_value

    def failing_idle_write(stream, address, value):
        if stream == beside.stream and value == 1:
            raise RuntimeError("injected: stream write failed")
        return write(stream, address, value)

    context = torch.inference_mode() if inference else torch.no_grad()
    with context:
        fresh = _ids(600, 24, 3000, 0, generator, hot=100).cuda()
        monkeypatch.setattr(stream_memory_ops, "write_value", failing_idle_write)
        with pytest.raises(RuntimeError, match="injected"):
            cached.update_cache(fresh)
        monkeypatch.undo()
        assert int(beside.idle[0]) == 1, "the idle word stayed busy"
        assert torch.equal(cached.lookup(fresh).view(torch.int16), device.lookup(fresh).view(torch.int16))
        static_ids.copy_(fresh[:63])
        graph.replay()
        replayed = torch.cuda.Event()
        replayed.record()
        assert _finishes(replayed, 10.0), "a replay after the failed idle write never finished"
        assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))
        cached.update_cache(fresh)  # and the next update runs
        torch.cuda.synchronize()
        assert torch.equal(cached.lookup(fresh).view(torch.int16), device.lookup(fresh).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_gpu_decode_graph_with_the_update_inside_equals_eager_steps(synthetic_model_dir, inference, seed):
    """The engine's decode step captured as one graph (hasher, prefetch, both layers, then ``update_cache``)
    and replayed with fresh tokens equals the same steps run eagerly on a twin memory (its updates beside the
    step), step after step: every layer's output, equal to placement ``"device"``'s too, and both caches'
    tags, counters, slot bytes and hit counts; both admit rows from their lookups' stagings."""
    from conftest import capture_cuda_graph, memory_on_cuda

    generator = torch.Generator().manual_seed(seed)
    options = {"cache_fraction": 0.05, "aging_interval": 2}
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    captured = memory_on_cuda(synthetic_model_dir, "cached", placement_options=options)
    eager = memory_on_cuda(synthetic_model_dir, "cached", placement_options=options)
    spec, tokens = captured.spec, 64
    input_ids = torch.randint(0, 300, (tokens,), generator=generator).cuda()
    positions = torch.arange(tokens, device="cuda")
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16().cuda()

    def step(memory):
        hash_ids = memory.hasher(input_ids, positions, starts)
        handle = memory.prefetch(hash_ids)
        outputs = [memory.forward_layer(layer_id, hidden, hash_ids, prefetch=handle) for layer_id in spec.layer_ids]
        memory.update_cache(hash_ids)
        return outputs

    caches = {name: [memory.table(layer_id).storage.cache for layer_id in spec.layer_ids]
              for name, memory in (("captured", captured), ("eager", eager))}
    with torch.inference_mode() if inference else torch.no_grad():
        step(eager)  # the twin takes the warm-up step the capture helper runs once
        graph, outputs = capture_cuda_graph(lambda: step(captured))
        for replay in range(12):
            input_ids.copy_(torch.randint(0, 300, (tokens,), generator=generator).cuda())
            hidden.copy_(torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16())
            graph.replay()
            expected = step(eager)
            hash_ids = on_device.hasher(input_ids, positions, starts)
            torch.cuda.synchronize()
            for layer_id, out, twin in zip(spec.layer_ids, outputs, expected):
                reference = on_device.forward_layer(layer_id, hidden, hash_ids)
                assert torch.equal(out.view(torch.int16), twin.view(torch.int16)), f"replay {replay}, layer {layer_id}"
                assert torch.equal(out.view(torch.int16), reference.view(torch.int16)), f"replay {replay}, {layer_id}"
            for mine, twin in zip(caches["captured"], caches["eager"]):
                _same_cache(mine, twin, f"after replay {replay} (seed {seed})")
    assert sum(int(cache.stats[1]) for cache in caches["eager"]) > 0, "no read hit: the test did not test hits"
    assert all(cache.updates_beside.count > 0 for cache in caches["eager"])
    # Both admitted rows from their lookups' stagings: the graph's own, and the eager placement's.
    for name in ("captured", "eager"):
        assert all(int(cache.admission_buffers(1).from_staging) > 0 for cache in caches[name]), name
