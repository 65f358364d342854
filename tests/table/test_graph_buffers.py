"""Buffers a captured lookup keeps for its graph come from the device's ordinary memory pool, never the
capture's: inductor's CUDA graphs refuse a recording that leaves blocks of their pool alive."""

from __future__ import annotations

import pytest
import torch

from engram.table.graph_buffers import kept_for_graph


def test_kept_buffers_outside_a_capture_are_plain_tensors():
    kept = kept_for_graph((3, 5), torch.uint8, torch.device("cpu"))
    assert kept.shape == (3, 5) and kept.dtype == torch.uint8 and kept.device.type == "cpu"
    with torch.inference_mode():
        assert not kept_for_graph((2,), torch.int32, torch.device("cpu")).is_inference()


def _pool_of(tensor: torch.Tensor):
    """The memory pool id of the allocator segment that holds ``tensor`` ((0, 0): the ordinary pool)."""
    address = tensor.untyped_storage().data_ptr()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return tuple(segment["segment_pool_id"])
    raise AssertionError(f"no allocator segment holds address {address:#x}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_gpu_kept_buffers_under_capture_are_outside_the_graph_pool(mode):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.arange(4096, dtype=torch.int32, device=device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        temporary = source * 2
        kept = kept_for_graph((4096,), torch.int32, device)
        kept.copy_(temporary + 1)
        # large enough that the ordinary pool needs a fresh segment (a cudaMalloc beside the capture)
        large = kept_for_graph((64 << 20,), torch.uint8, device)
    assert _pool_of(temporary) != (0, 0), "the capture's own allocation should come from its pool"
    assert _pool_of(kept) == (0, 0) and _pool_of(large) == (0, 0)
    kept.fill_(-1)
    source.add_(5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kept, (source * 2 + 1)), "the replay writes the kept buffer"
