"""The row cache's update kernels equal their plain-torch reference, slot for slot and byte for byte.

:func:`engram.table.kernels.cache_admission.admit_step` (three or four fixed-size launches, no sort) against
:meth:`RowCache.update_with_torch`: after every step of a seeded stream the two caches hold the same tags,
counters, slot bytes (tags included) and stats, for both scores (recency and aged frequency), one to
eight ways, steps with repeats, ids outside the table, empty steps and awkward sizes. On the CPU under
``TRITON_INTERPRET=1`` (small shapes) and on the GPU (a larger stream, and a captured update replayed
with fresh ids).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engram.table.host_memory.rows import pack_rows, row_tags
from engram.table.placements.row_cache import RowCache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


def _rows(rng: np.random.Generator, num_rows: int, head_dim: int, device):
    values = torch.from_numpy(rng.integers(0, 0x7E, (num_rows, head_dim), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(100, 140, (num_rows, head_dim // 32), dtype=np.uint8))
    rows = pack_rows(values, scales)
    return rows.values.to(device), rows.scales.to(device)


def _pair(num_slots, head_dim, device, **options):
    return RowCache(num_slots, head_dim, device, **options), RowCache(num_slots, head_dim, device, **options)


def _assert_same(kernels: RowCache, reference: RowCache, what: str) -> None:
    assert torch.equal(kernels.tags, reference.tags), f"tags differ {what}"
    assert torch.equal(kernels.counters, reference.counters), f"counters differ {what}"
    assert torch.equal(kernels.slot_rows[:-1], reference.slot_rows[:-1]), f"slot bytes differ {what}"
    assert torch.equal(kernels.stats, reference.stats), f"stats differ {what}: {kernels.stats} {reference.stats}"


def _steps(rng: np.random.Generator, num_rows: int, sizes):
    for size in sizes:
        hot = rng.integers(0, max(1, num_rows // 8), size)  # repeats: a hot eighth of the rows
        cold = rng.integers(-3, num_rows + 3, size)  # and a few ids outside the table
        yield np.where(rng.random(size) < 0.5, hot, cold)


CASES = [  # (rows, slots, ways, recency, aging_interval)
    (200, 32, 8, True, 16),
    (200, 32, 8, False, 2),
    (150, 24, 4, False, 3),
    (97, 9, 1, True, 16),
    (300, 64, 2, False, 1),
]


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", CASES, ids=[f"rows{c[0]}-slots{c[1]}-ways{c[2]}-{'recency' if c[3] else 'freq'}"
                                              for c in CASES])
def test_update_kernels_equal_the_torch_reference(case, seed):
    num_rows, num_slots, ways, recency, aging = case
    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, num_rows, 64, "cpu")
    kernels, reference = _pair(num_slots, 64, "cpu", ways=ways, recency=recency, aging_interval=aging)
    sizes = [63, 1, 0, 120, 7, 63, 200, 2, 0, 90]
    for step, ids in enumerate(_steps(rng, num_rows, sizes)):
        dtype = torch.int32 if step % 2 else torch.int64
        kernels.update(torch.from_numpy(ids).to(dtype), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids).to(dtype), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")
    held = kernels.tags.reshape(-1)
    held = held[held >= 0]
    assert held.numel() > 0
    # Every held slot carries its row's bytes and, in its last 4 bytes, the row's own index.
    slots = (kernels.tags.reshape(-1) >= 0).nonzero()[:, 0]
    assert torch.equal(row_tags(kernels.slot_rows[:-1])[slots].to(torch.int64), kernels.tags.reshape(-1)[slots])
    assert torch.equal(kernels.slot_values[slots], back_values[kernels.tags.reshape(-1)[slots]])


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
def test_update_after_a_hot_set_and_a_clear(seed):
    """A hot set loaded, updated, cleared, updated: the kernels follow the reference through each."""
    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, 128, 64, "cpu")
    kernels, reference = _pair(16, 64, "cpu", ways=4, recency=False, aging_interval=2)
    hot = torch.from_numpy(rng.permutation(128)[:20])
    kernels.load_hot(hot, back_values, back_scales)
    reference.load_hot(hot, back_values, back_scales)
    for step, ids in enumerate(_steps(rng, 128, [40, 40, 5])):
        if step == 2:
            kernels.clear()
            reference.clear()
        kernels.update(torch.from_numpy(ids), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRET, reason="the update kernels run on the CPU only under TRITON_INTERPRET=1")
def test_update_buffers_grow_and_a_half_done_step_is_redone_on_fresh_buffers(seed):
    """Buffers made for a small step grow for a larger one; a step whose launches stopped half-way (its
    buffers left dirty) gets fresh buffers, with the device step counter carried over."""
    from engram.table.kernels import cache_admission

    rng = np.random.default_rng(seed)
    back_values, back_scales = _rows(rng, 100, 64, "cpu")
    kernels, reference = _pair(16, 64, "cpu", ways=4, recency=True)
    ids = list(_steps(rng, 100, [5, 80, 30]))
    kernels.update(torch.from_numpy(ids[0]), back_values, back_scales)
    reference.update_with_torch(torch.from_numpy(ids[0]), back_values, back_scales)
    small = kernels.admission_buffers(5)
    kernels.update(torch.from_numpy(ids[1]), back_values, back_scales)
    reference.update_with_torch(torch.from_numpy(ids[1]), back_values, back_scales)
    assert kernels.admission_buffers(80) is not small and kernels.admission_buffers(80).capacity >= 80
    _assert_same(kernels, reference, "after growth")
    buffers = kernels.admission_buffers(30)
    buffers.keys[:3] = 7  # what a step stopped after its first launch could leave behind
    buffers.dirty = True
    kernels.update(torch.from_numpy(ids[2]), back_values, back_scales)
    reference.update_with_torch(torch.from_numpy(ids[2]), back_values, back_scales)
    assert kernels.admission_buffers(30) is not buffers
    assert int(kernels.admission_buffers(30).step) == 3
    _assert_same(kernels, reference, "after a dirty step")
    assert cache_admission.AdmissionBuffers is type(buffers)


def test_update_refuses_float_ids():
    cache = RowCache(8, 64, "cpu", ways=4)
    values, scales = torch.zeros(10, 64, dtype=torch.uint8), torch.zeros(10, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="local_ids: expected int32 or int64 row ids, found torch.float32"):
        cache.update(torch.zeros(3), values, scales)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
@pytest.mark.parametrize("ways", [8, 16])
def test_gpu_update_kernels_equal_the_torch_reference(recency, ways, seed):
    rng = np.random.default_rng(seed)
    num_rows = 200_000
    back_values, back_scales = _rows(rng, num_rows, 256, "cuda")
    kernels, reference = _pair(4000, 256, "cuda", ways=ways, recency=recency, aging_interval=3)
    for step, ids in enumerate(_steps(rng, num_rows, [8192 * 24, 64 * 24, 1, 0, 63 * 24, 8192 * 24, 3000])):
        kernels.update(torch.from_numpy(ids).cuda(), back_values, back_scales)
        reference.update_with_torch(torch.from_numpy(ids).cuda(), back_values, back_scales)
        _assert_same(kernels, reference, f"after step {step} (seed {seed})")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("recency", [True, False], ids=["recency", "frequency"])
def test_gpu_captured_update_replayed_with_fresh_ids_equals_eager(recency, seed):
    """The update captured in a CUDA graph, replayed with fresh ids copied into its input each step, leaves
    the cache as the eager reference does after every replay."""
    rng = np.random.default_rng(seed)
    num_rows, tokens = 100_000, 64 * 24
    back_values, back_scales = _rows(rng, num_rows, 256, "cuda")
    captured, reference = _pair(2000, 256, "cuda", ways=8, recency=recency, aging_interval=2)
    static_ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    first = torch.from_numpy(next(_steps(rng, num_rows, [tokens]))).cuda()
    captured.update(first, back_values, back_scales)  # eager: sizes the buffers
    reference.update_with_torch(first, back_values, back_scales)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        captured.update(static_ids, back_values, back_scales)
    torch.cuda.current_stream().wait_stream(side)
    for step, ids in enumerate(_steps(rng, num_rows, [tokens] * 12)):
        static_ids.copy_(torch.from_numpy(ids))
        graph.replay()
        reference.update_with_torch(torch.from_numpy(ids).cuda(), back_values, back_scales)
        _assert_same(captured, reference, f"after replay {step} (seed {seed})")
