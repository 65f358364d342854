"""Host rows inside CUDA graphs: a prefetch captured in a graph gathers every replay's own ids on the host.

Placement ``"host"`` with the native worker against ``"device"``: captured lookups of more than
``graph_direct_max_rows`` rows, given their prefetch in the same capture, merge a staging that the worker fills
at every replay (``HostGather.start_replayed``); replays with fresh ids are bit-equal to the device table's
rows, also with the worker held up past its bound, stopped between replays, or under inference mode; an eager
gather of the same table between replays leaves both exact. GPU only (graphs, pinned memory)."""

from __future__ import annotations

import pytest
import torch

import engram
from engram.table.fp8 import quantize_rows
from engram.table.host_memory import native_worker

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
ROWS, HEAD_DIM, COLUMNS = 100_000, 256, 24
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _tables(generator: torch.Generator, threads: int = 4):
    scale = 2.0 ** torch.randint(-6, 4, (ROWS, 1), generator=generator).float()
    values, scales = quantize_rows(torch.randn(ROWS, HEAD_DIM, generator=generator) * scale)
    values = values.view(torch.uint8)
    device = engram.EngramTable(values.cuda(), scales.cuda(), placement="device", device="cuda", validate=False)
    host = engram.EngramTable(values, scales, placement="host", device="cuda", validate=False,
                              placement_options={"host_gather_worker": "native", "gather_threads": threads})
    return device, host


def _fresh(generator: torch.Generator, tokens: int) -> torch.Tensor:
    ids = torch.randint(-2, ROWS + 2, (tokens, COLUMNS), generator=generator)  # a few outside the table
    return ids.clamp(min=0).to(torch.int32)


def _capture(table, ids: torch.Tensor):
    """A graph of ``prefetch(ids)`` then ``lookup(ids, prefetch=handle)`` (after two eager warm-ups)."""
    for _ in range(2):
        table.lookup(ids, prefetch=table.prefetch(ids))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        handle = table.prefetch(ids)
        out = table.lookup(ids, prefetch=handle)
    return graph, out, handle


def _replays(graph, out, ids, device, generator, tokens, count):
    for step in range(count):
        fresh = _fresh(generator, tokens)
        ids.copy_(fresh.cuda())
        graph.replay()
        expected = device.lookup(ids)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"replay {step}"


@pytest.mark.parametrize("tokens", [65, 256, 1024])
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_replays_with_fresh_ids_equal_device(tokens, mode, seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator)
    with MODES[mode]():
        ids = _fresh(generator, tokens).cuda()
        graph, out, handle = _capture(host, ids)
        assert handle.started and handle.captured  # the capture took the captured gather, not direct reads
        service = host.storage.host_gather.native_service
        before = service.replay_stats()
        _replays(graph, out, ids, device, generator, tokens, 1000 if tokens == 256 else 100)
        after = service.replay_stats()
        assert after["replays_copied"] - before["replays_copied"] >= (1000 if tokens == 256 else 100) // 2


def test_small_captured_lookups_stay_direct(seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator)
    ids = _fresh(generator, 64).cuda()
    graph, out, handle = _capture(host, ids)
    assert not handle.started  # 64 x 24 rows: read directly in the graph
    _replays(graph, out, ids, device, generator, 64, 20)


def test_a_held_up_worker_costs_reads_never_rows(seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator, threads=5)
    ids = _fresh(generator, 256).cuda()
    graph, out, _ = _capture(host, ids)
    service = host.storage.host_gather.native_service
    _replays(graph, out, ids, device, generator, 256, 5)
    service.pause_replays(True)  # the worker ignores replays: the watchdog answers each past its bound
    try:
        released = service.replay_stats()["replays_released"]
        _replays(graph, out, ids, device, generator, 256, 5)
        assert service.replay_stats()["replays_released"] - released == 5
    finally:
        service.pause_replays(False)
    _replays(graph, out, ids, device, generator, 256, 5)


def test_replays_after_the_worker_stopped_finish_exact(seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator, threads=6)
    ids = _fresh(generator, 512).cuda()
    graph, out, _ = _capture(host, ids)
    _replays(graph, out, ids, device, generator, 512, 5)
    service = host.storage.host_gather.native_service
    ids.copy_(_fresh(generator, 512).cuda())
    graph.replay()
    service.stop()  # in the middle of replays: the one in flight and every later one finish with exact rows
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), device.lookup(ids).view(torch.int16))
    _replays(graph, out, ids, device, generator, 512, 10)
    assert service.replay_stats()["replays_released"] >= 10


def test_eager_gathers_between_replays_leave_both_exact(seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator)
    ids = _fresh(generator, 256).cuda()
    graph, out, _ = _capture(host, ids)
    host.storage.direct_max_rows = 0  # every eager lookup through the (shared) host gather
    for step in range(30):
        ids.copy_(_fresh(generator, 256).cuda())
        graph.replay()
        eager_ids = _fresh(generator, 2048 + step).cuda()
        eager = host.lookup(eager_ids, prefetch=host.prefetch(eager_ids))
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), device.lookup(ids).view(torch.int16)), f"replay {step}"
        assert torch.equal(eager.view(torch.int16), device.lookup(eager_ids).view(torch.int16)), f"eager {step}"


def test_a_captured_prefetch_is_not_served_outside_its_capture(seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator)
    ids = _fresh(generator, 256).cuda()
    graph, out, handle = _capture(host, ids)
    host.storage.prefetch_direct_max_rows = 0  # the eager prefetch starts a gather
    eager_handle = host.prefetch(ids)
    assert eager_handle.started
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        captured = host.lookup(ids, prefetch=eager_handle)  # an eager prefetch is never served in a capture
    assert eager_handle.state.value == "dropped"
    del captured
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), device.lookup(ids).view(torch.int16))
    assert native_worker.unavailable_reason() is None


@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_a_captured_step_prefetches_inside_the_graph_and_equals_device(mode, synthetic_model_dir, seed):
    """Hasher, ``memory.prefetch`` and every ``forward_layer`` captured as one graph (the engine's decode step):
    replays with fresh tokens equal placement ``"device"``'s eager layers, and the prefetch gathered on the host."""
    from conftest import capture_cuda_graph, memory_on_cuda

    generator = torch.Generator().manual_seed(seed)
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    served = memory_on_cuda(synthetic_model_dir, "host", options=engram.ServingOptions(graph_direct_max_rows=0))
    spec, tokens = served.spec, 96
    input_ids = torch.randint(0, 500, (tokens,), generator=generator).cuda()
    positions = torch.arange(tokens, device="cuda")
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16().cuda()
    handles = []

    def step():
        hash_ids = served.hasher(input_ids, positions, starts)
        handle = served.prefetch(hash_ids)
        handles.append(handle)
        return [served.forward_layer(layer_id, hidden, hash_ids, prefetch=handle) for layer_id in spec.layer_ids]

    with MODES[mode]():
        graph, outputs = capture_cuda_graph(step)
        captured = handles[-1]
        assert all(entry.captured for entry in [served.table(layer_id)._latest_prefetch
                                                for layer_id in spec.layer_ids])
        del captured
        for replay in range(20):
            input_ids.copy_(torch.randint(0, 500, (tokens,), generator=generator).cuda())
            hidden.copy_(torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16())
            graph.replay()
            hash_ids = on_device.hasher(input_ids, positions, starts)
            for layer_id, out in zip(spec.layer_ids, outputs):
                expected = on_device.forward_layer(layer_id, hidden, hash_ids)
                torch.cuda.synchronize()
                assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"replay {replay}, {layer_id}"
    copied = sum(served.table(layer_id).storage.host_gather.native_service.replay_stats()["replays_copied"]
                 for layer_id in spec.layer_ids[:1])
    assert copied >= 20


def test_a_captured_prefetch_that_no_lookup_takes_still_joins_its_capture(seed):
    generator = torch.Generator().manual_seed(seed)
    device, host = _tables(generator)
    ids, other = _fresh(generator, 256).cuda(), _fresh(generator, 256).cuda()
    host.lookup(ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        handle = host.prefetch(ids)
        out = host.lookup(other, prefetch=handle)  # other ids: the prefetch is dropped, its copies joined
    assert handle.state.value == "dropped"
    for step in range(5):
        other.copy_(_fresh(generator, 256).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), device.lookup(other).view(torch.int16)), f"replay {step}"
