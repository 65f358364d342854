"""A model step (hash, prefetch, every Engram layer) compiles with torch.compile(fullgraph=True)
and equals the eager step bit for bit: the engine-facing calls are custom ops (engram.ops) with
fake implementations, and their checks run when the graph runs, outside the trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engram


def _memory(model_dir, validate: bool):
    return engram.EngramMemory.from_pretrained(model_dir, placement="cpu", progress=False, validate=validate)


def _batch(memory, rng: np.random.Generator, lengths):
    total = sum(lengths)
    input_ids = torch.from_numpy(rng.integers(0, memory.vocab.vocab_size, total)).to(torch.int64)
    positions = torch.cat([torch.arange(n) for n in lengths])
    query_start_loc = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int64)
    spec = memory.spec
    hidden = torch.from_numpy(rng.standard_normal((total, spec.hc_mult, spec.hidden_size))).to(torch.bfloat16)
    return input_ids, positions, query_start_loc, hidden


def _step(memory):
    def step(input_ids, positions, query_start_loc, hidden):
        hash_ids = memory.hasher(input_ids, positions, query_start_loc)
        ticket = memory.prefetch(hash_ids)
        for layer_id in memory.layer_ids:
            hidden = memory.forward_layer(layer_id, hidden, hash_ids, prefetch=ticket)
        return hash_ids, hidden
    return step


@pytest.mark.parametrize("validate", [False, True])
def test_compiled_step_equals_eager_bit_for_bit(synthetic_model_dir, rng, validate):
    torch._dynamo.reset()
    memory = _memory(synthetic_model_dir, validate)
    step = _step(memory)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for lengths in ([5, 3], [1], [7, 2, 4]):
        batch = _batch(memory, rng, lengths)
        eager_ids, eager_out = step(*batch)
        compiled_ids, compiled_out = compiled(*batch)
        assert torch.equal(compiled_ids, eager_ids)
        assert torch.equal(compiled_out.view(torch.int16), eager_out.view(torch.int16))


def test_compiled_step_with_inductor(synthetic_model_dir, rng):
    """The default backend (inductor, C++ on the CPU) around the ops: same results."""
    torch._dynamo.reset()
    memory = _memory(synthetic_model_dir, False)
    step = _step(memory)
    compiled = torch.compile(step, fullgraph=True)
    batch = _batch(memory, rng, [6, 2])
    eager_ids, eager_out = step(*batch)
    compiled_ids, compiled_out = compiled(*batch)
    assert torch.equal(compiled_ids, eager_ids)
    assert torch.equal(compiled_out.view(torch.int16), eager_out.view(torch.int16))


def test_checks_run_when_the_compiled_graph_runs(synthetic_model_dir, rng):
    """Validation lives in the op's real implementation: bad metadata still gets its clear error."""
    torch._dynamo.reset()
    memory = _memory(synthetic_model_dir, True)
    compiled = torch.compile(_step(memory), fullgraph=True, backend="aot_eager")
    input_ids, positions, query_start_loc, hidden = _batch(memory, rng, [4, 4])
    compiled(input_ids, positions, query_start_loc, hidden)
    bad = input_ids.clone()
    bad[3] = memory.vocab.vocab_size + 5
    with pytest.raises(ValueError, match=r"input_ids\[3\]"):
        compiled(bad, positions, query_start_loc, hidden)


def test_ops_declare_the_history_stores_they_mutate(synthetic_model_dir, rng):
    """With a per-request history bound, the compiled step writes it exactly as the eager one."""
    torch._dynamo.reset()
    eager_memory, compiled_memory = _memory(synthetic_model_dir, False), _memory(synthetic_model_dir, False)
    for memory in (eager_memory, compiled_memory):
        memory.hasher.bind_request_history(4)

    def hashed(memory):
        def step(input_ids, positions, query_start_loc, rows):
            return memory.hasher(input_ids, positions, query_start_loc, request_rows=rows)
        return step

    compiled = torch.compile(hashed(compiled_memory), fullgraph=True, backend="aot_eager")
    eager = hashed(eager_memory)
    rows = torch.tensor([0, 1])
    start = [0, 0]
    for lengths in ([3, 2], [1, 1], [2, 4]):
        input_ids, _, query_start_loc, _ = _batch(eager_memory, rng, lengths)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start, lengths)])
        start = [s + n for s, n in zip(start, lengths)]
        assert torch.equal(compiled(input_ids, positions, query_start_loc, rows),
                           eager(input_ids, positions, query_start_loc, rows))
    assert torch.equal(compiled_memory.hasher.request_history.values, eager_memory.hasher.request_history.values)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host"])
def test_gpu_compiled_step_in_a_cuda_graph_equals_eager(synthetic_model_dir, rng, placement):
    """On CUDA with the Triton paths: the step compiled with inductor (fullgraph), then captured in a
    CUDA graph and replayed on refilled inputs of the same lengths, equals the eager step bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from conftest import capture_cuda_graph, replay_poisoned

    torch._dynamo.reset()
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement=placement, device="cuda",
                                                 progress=False, validate=False)
    step = _step(memory)
    compiled = torch.compile(step, fullgraph=True)
    lengths = [5, 1, 3]
    batch = [t.cuda() for t in _batch(memory, rng, lengths)]
    eager_ids, eager_out = step(*batch)
    compiled_ids, compiled_out = compiled(*batch)
    assert torch.equal(compiled_ids, eager_ids)
    assert torch.equal(compiled_out.view(torch.int16), eager_out.view(torch.int16))
    static = [t.clone() for t in batch]
    graph, (graph_ids, graph_out) = capture_cuda_graph(lambda: compiled(*static))
    for _ in range(2):
        fresh = [t.cuda() for t in _batch(memory, rng, lengths)]
        for target, source in zip(static, fresh):
            target.copy_(source)
        replay_poisoned(graph, graph_ids, graph_out)
        torch.cuda.synchronize()
        eager_ids, eager_out = step(*fresh)
        assert torch.equal(graph_ids, eager_ids)
        assert torch.equal(graph_out.view(torch.int16), eager_out.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("placement,tokens", [("device", 9), ("host", 9), ("host", 400), ("cached", 400)])
def test_gpu_reduce_overhead_step_equals_eager(synthetic_model_dir, rng, placement, tokens):
    """``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graphs) over the whole step, replayed on
    fresh inputs of one shape, equals the eager step bit for bit. At 400 tokens the host tables' lookups
    have more rows than ``graph_direct_max_rows``: their prefetch is the host gather captured in the graph.
    Inductor captures the whole step, the hash with it (its stores are marked as fixed addresses): no graph
    is skipped, and the buffers a captured gather or cached lookup keeps for replays are outside its pool."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement=placement, device="cuda",
                                                 progress=False, validate=False,
                                                 placement_options={"graph_direct_max_rows": 0}
                                                 if placement == "host" and tokens > 9 else None)
    step = _step(memory)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    lengths = [tokens - 2, 1, 1]
    for index in range(6):  # the first calls warm up and record; the later ones replay
        batch = [t.cuda() for t in _batch(memory, rng, lengths)]
        compiled_ids, compiled_out = (t.clone() for t in compiled(*batch))
        eager_ids, eager_out = step(*batch)
        assert torch.equal(compiled_ids, eager_ids), f"hash ids differ at call {index}"
        assert torch.equal(compiled_out.view(torch.int16), eager_out.view(torch.int16)), f"rows differ at call {index}"
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped CUDA graphs for part of the step"
    if placement == "host" and tokens > 9:  # the prefetch was captured as a host gather of the graph
        gather = memory.tables[memory.layer_ids[0]].storage.host_gather
        if gather.worker == "native":
            assert gather.replayed, "no host gather was captured in the compiled step's graphs"
    if placement == "cached":  # the lookups were captured, each staging its rows in a buffer of the graph's
        assert memory.tables[memory.layer_ids[0]].storage._captured_stagings, "no cached lookup was captured"


def test_ticket_tensors_name_their_handle_by_storage():
    """The compiled prefetch's ticket: a scalar on the ids' device holding the ticket's number, found
    again by its storage (no read of its value); no ticket names nothing."""
    from engram import ops

    class Handle:  # weakly referenced, as prefetch handles are
        pass

    like = torch.zeros(3, dtype=torch.int64)
    first, second = Handle(), Handle()
    first_tensor, second_tensor = ops.ticket_tensor(first, like), ops.ticket_tensor(second, like)
    assert first_tensor.shape == () and first_tensor.dtype == torch.int64 and first_tensor.device == like.device
    assert int(second_tensor) == int(first_tensor) + 1
    assert ops.ticket_of(first_tensor) is first and ops.ticket_of(second_tensor) is second
    assert ops.ticket_of(None) is None
