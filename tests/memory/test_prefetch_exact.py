"""Rows exact by construction: a prefetched, staged or cached row serves only the id it was read for.

The consuming kernel compares, per row, the id a copy was read for (a packed row's tag, a cache slot's tag,
the probe's direct-read id) with the lookup's own id at that position, and reads every other row itself in
the same launch. So an edit of the ids between a prefetch and its lookup, a refill with another step's ids,
an aborted step, a failed start or a growth of the staging can cost reads, never rows, whether or not the
ticket rules see the edit: under ``torch.inference_mode()`` (how engines serve) tensors have no version
counter, so the rules cannot.

* ``interpreter`` tests (``TRITON_INTERPRET=1``): placement ``"cached"``'s CPU form (its large lookups run the
  same probe, dedup, staging and checked merge as on the GPU) against placement ``"cpu"``, seeded;
* ``gpu`` tests: placements ``"host"`` and ``"cached"`` against ``"device"``, also through
  ``EngramMemory.prefetch``, and a seeded stress of interleaved prefetches, lookups, edits, aborted steps,
  growth and failures injected at each step of a start.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

import engram
from engram.table.fp8 import quantize_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
EDITS = ("some_positions", "all_positions", "refill_with_another_step")


def _table(rows: int, head_dim: int, generator: torch.Generator, device="cpu"):
    scale = 2.0 ** torch.randint(-6, 4, (rows, 1), generator=generator).float()
    values, scales = quantize_rows(torch.randn(rows, head_dim, generator=generator) * scale)
    return values.view(torch.uint8).to(device), scales.to(device)


def _ids(generator: torch.Generator, tokens: int, columns: int, rows: int, device) -> torch.Tensor:
    """``int32 [T, C]``: half from 64 hot rows (so the dedup and the cache see repeats), a few outside the table."""
    ids = torch.randint(-3, rows + 3, (tokens, columns), generator=generator)
    hot = torch.randint(0, 64, (tokens, columns), generator=generator)
    ids = torch.where(torch.rand(tokens, columns, generator=generator) < 0.5, hot, ids)
    return ids.clamp(min=0).to(torch.int32).to(device)


def _edit(ids: torch.Tensor, kind: str, other: torch.Tensor, generator: torch.Generator) -> None:
    """Change ``ids`` in place: a column of some positions, every position, or a copy of another step's ids."""
    if kind == "some_positions":
        ids[:, 0] = 5
    elif kind == "all_positions":
        ids.add_(1)
    else:
        ids.copy_(other)


def _equal(got, expected) -> bool:
    if isinstance(got, tuple):
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected))
    return torch.equal(got.view(torch.int16), expected.view(torch.int16))


# ---------------------------------------------------------------------------
# CPU (interpreter): placement "cached"'s CPU form
# ---------------------------------------------------------------------------
def _cpu_tables(generator):
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    values, scales = _table(300, 64, generator)
    plain = engram.EngramTable(values.clone(), scales.clone(), validate=False)
    cached = engram.EngramTable(values.clone(), scales.clone(), placement="cached", device="cpu", backend="triton",
                                validate=False, placement_options={"cache_fraction": 0.05, "aging_interval": 2})
    cached.storage.direct_max_rows = 0  # every lookup: probe, host gather of the misses, checked merge
    return plain, cached


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
def test_prefetch_then_in_place_edit_reads_the_lookups_rows(mode, edit, packed, seed):
    generator = torch.Generator().manual_seed(seed)
    plain, cached = _cpu_tables(generator)
    with MODES[mode]():
        cached.update_cache(_ids(generator, 40, 3, 300, "cpu"))  # some rows held
        ids, other = _ids(generator, 5, 3, 300, "cpu"), _ids(generator, 5, 3, 300, "cpu")
        handle = cached.prefetch(ids)
        _edit(ids, edit, other, generator)
        lookup = (lambda table, **kw: table.lookup_packed(ids, **kw)) if packed else (
            lambda table, **kw: table.lookup(ids, **kw))
        assert _equal(lookup(cached, prefetch=handle), lookup(plain))


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_randomized_steps_with_edits_aborts_and_content_changes(mode, seed):
    """Interleaved prefetches (consumed, aborted, superseded), lookups with and without handles, in-place
    edits, cache updates between prefetch and lookup: every lookup equals placement "cpu"'s."""
    generator = torch.Generator().manual_seed(seed)
    plain, cached = _cpu_tables(generator)
    rng = np.random.default_rng(seed % 2**32)
    handles: list = []
    with MODES[mode]():
        for step in range(24):
            tokens = int(rng.choice([1, 2, 7, 13]))
            ids = _ids(generator, tokens, 3, 300, "cpu")
            action = rng.random()
            if action < 0.2:  # an aborted step: its prefetch is never consumed
                handles.append(cached.prefetch(ids))
                continue
            handle = cached.prefetch(ids)
            if rng.random() < 0.5:
                _edit(ids, EDITS[int(rng.integers(3))], _ids(generator, tokens, 3, 300, "cpu"), generator)
            if rng.random() < 0.3:
                cached.update_cache(_ids(generator, 20, 3, 300, "cpu"))
            if rng.random() < 0.2 and handles:  # an older handle, of another step
                handle = handles[int(rng.integers(len(handles)))]
            assert _equal(cached.lookup(ids, prefetch=handle), plain.lookup(ids)), f"step {step}"
            if rng.random() < 0.5:
                cached.update_cache(ids)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def _gpu_tables(placement: str, generator, rows=200_000, worker="auto"):
    values, scales = _table(rows, 256, generator, "cuda")
    device = engram.EngramTable(values, scales, placement="device", device="cuda", validate=False)
    options = {"host_gather_worker": worker}
    if placement == "cached":
        options.update(cache_fraction=0.02, aging_interval=2)
    table = engram.EngramTable(values.cpu(), scales.cpu(), placement=placement, device="cuda", validate=False,
                               placement_options=options)
    table.storage.direct_max_rows = 0
    return device, table


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["host", "cached"])
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
@pytest.mark.parametrize("edit", EDITS)
def test_gpu_prefetch_then_in_place_edit_reads_the_lookups_rows(placement, mode, edit, seed):
    generator = torch.Generator().manual_seed(seed)
    device, table = _gpu_tables(placement, generator)
    with MODES[mode]():
        if placement == "cached":
            table.update_cache(_ids(generator, 4096, 24, 200_000, "cuda"))
        for trial in range(3):
            ids, other = _ids(generator, 8192, 24, 200_000, "cuda"), _ids(generator, 8192, 24, 200_000, "cuda")
            handle = table.prefetch(ids)
            _edit(ids, edit, other, generator)
            got = table.lookup(ids, prefetch=handle)
            assert _equal(got, device.lookup(ids)), f"trial {trial}"
            handle = table.prefetch(ids)
            _edit(ids, edit, other, generator)
            assert _equal(table.lookup_packed(ids, prefetch=handle), device.lookup_packed(ids)), f"trial {trial}"
    if mode == "inference_mode" and edit != "refill_with_another_step":
        # Inference tensors keep no version counter: the ticket rules saw no edit and served the prefetch, and
        # the per-row check alone kept the rows exact.
        assert table.prefetches["served"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["host", "cached"])
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_gpu_memory_prefetch_after_an_in_place_edit_of_the_hashers_output(placement, mode, synthetic_model_dir,
                                                                          seed):
    """``EngramMemory.prefetch`` of the hasher's output (edited in place before it, or not), then the output
    edited in place, then the layers: each layer equals ``device``'s on the edited ids."""
    from conftest import assert_layers_equal, memory_on_cuda

    generator = torch.Generator().manual_seed(seed)
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    served = memory_on_cuda(synthetic_model_dir, placement)
    for layer_id in served.spec.layer_ids:
        served.table(layer_id).storage.direct_max_rows = 0
    spec = served.spec
    with MODES[mode]():
        for tokens in (3000, 700):
            input_ids = torch.randint(0, 500, (tokens,), generator=generator).cuda()
            positions = torch.arange(tokens, device="cuda")
            starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
            hash_ids = served.hasher(input_ids, positions, starts)
            if tokens == 700:
                # Edited before the prefetch: under inference mode the hasher's ready mark cannot see it, so
                # the prefetch is ordered after the hashing only and races with the edit.
                hash_ids[tokens // 2:, 1].add_(3)
            handle = served.prefetch(hash_ids)
            hash_ids[: tokens // 2, 0].add_(1)  # after the prefetch, before the layers
            hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16().cuda()
            assert_layers_equal(served, on_device, hidden, hash_ids, prefetch=handle)


class _FailingOnce:
    """Wraps a function: raises ``error`` on its ``when``-th call, passes every other call through."""

    def __init__(self, inner, when: int, error: BaseException):
        self.inner, self.when, self.error, self.calls = inner, when, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.when:
            raise self.error
        return self.inner(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["host", "cached"])
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_gpu_randomized_steps_with_edits_aborts_growth_and_failures(placement, mode, seed, monkeypatch):
    """Seeded: interleaved prefetches, lookups, in-place edits, aborted steps, growth of the staging (T rising),
    and one failure injected into a start (the staging allocation, the stream write of "ids ready", the
    submission to the worker, a wave's copy) or into a cache update beside the step (its stream words):
    every row a lookup returns equals ``device``'s; a start or update that failed raises and the table then
    refuses (by name) or serves exact rows."""
    from engram.table.host_memory import gather as host_gather
    from engram.table.host_memory import stream_memory_ops

    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed % 2**32)
    device, table = _gpu_tables(placement, generator, rows=50_000)
    host_side = table.storage if placement == "host" else table.storage.host
    gather = host_side.host_gather
    targets = [(stream_memory_ops, "write_value"), (stream_memory_ops, "copy_to_device")]
    if gather.worker == "native":
        targets.append((gather.native_service, "submit_prepared"))
    target = targets[int(rng.integers(len(targets)))]
    failing = _FailingOnce(getattr(*target), int(rng.integers(1, 40)), RuntimeError("injected failure"))
    monkeypatch.setattr(*target, failing)
    failed = False
    with MODES[mode]():
        for step in range(30):
            tokens = int(rng.choice([300, 700, 1500, 4000, 9000]))
            ids = _ids(generator, tokens, 24, 50_000, "cuda")
            try:
                handle = table.prefetch(ids)
                if rng.random() < 0.2:
                    continue  # an aborted step
                if rng.random() < 0.5:
                    _edit(ids, EDITS[int(rng.integers(3))], _ids(generator, tokens, 24, 50_000, "cuda"), generator)
                got = table.lookup(ids, prefetch=handle)
            except RuntimeError as error:
                assert "injected failure" in str(error) or "unusable after an earlier failure" in str(error)
                failed = True
                continue
            assert _equal(got, device.lookup(ids)), f"step {step} (failure injected into {target[1]})"
            if placement == "cached" and rng.random() < 0.5:
                try:  # an update beside its step writes stream words too: the failure may land here
                    table.update_cache(ids)
                except RuntimeError as error:
                    assert "injected failure" in str(error)
                    failed = True
    torch.cuda.synchronize()  # nothing left waiting on a word no one writes
    assert failing.calls > 0
    if failing.calls >= failing.when:
        assert failed, "the injected failure was swallowed"


@pytest.mark.interpreter
def test_prefetch_states_move_one_way(seed):
    """EMPTY or STARTED, then exactly one of SERVED, STALE (superseded) or DROPPED (not worth trying)."""
    from engram.table.prefetch import PrefetchState

    generator = torch.Generator().manual_seed(seed)
    plain, cached = _cpu_tables(generator)
    ids = _ids(generator, 6, 3, 300, "cpu")
    first = cached.prefetch(ids)
    assert first.state is PrefetchState.STARTED
    second = cached.prefetch(ids)
    assert first.state is PrefetchState.STALE and second.state is PrefetchState.STARTED
    assert _equal(cached.lookup(ids, prefetch=first), plain.lookup(ids))  # a stale handle: read again
    assert first.state is PrefetchState.STALE
    assert _equal(cached.lookup(ids, prefetch=second), plain.lookup(ids))
    assert second.state is PrefetchState.SERVED
    assert _equal(cached.lookup(ids, prefetch=second), plain.lookup(ids))  # used once only
    assert second.state is PrefetchState.SERVED and cached.prefetches == {"served": 1, "dropped": 1}
    other = _ids(generator, 7, 3, 300, "cpu")
    third = cached.prefetch(ids)
    assert _equal(cached.lookup(other, prefetch=third), plain.lookup(other))  # other ids: not worth trying
    assert third.state is PrefetchState.DROPPED
    plain_handle = plain.prefetch(ids)  # rows at hand: nothing started
    assert plain_handle.state is PrefetchState.EMPTY
    assert _equal(plain.lookup(ids, prefetch=plain_handle), plain.lookup(ids))
    assert plain_handle.state is PrefetchState.DROPPED


def test_job_numbers_past_two_to_the_31_keep_their_low_32_bits():
    from engram.table.host_memory.gather import _as_int32
    from engram.table.host_memory.native_worker import _reached

    for value in (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**31 + 7):
        word = _as_int32(value)
        assert -(2**31) <= word < 2**31 and word % 2**32 == value % 2**32
        assert _reached(word, value & 0xFFFFFFFF) and not _reached(word, (value + 1) & 0xFFFFFFFF)
    torch.zeros(1, dtype=torch.int32).fill_(_as_int32(2**31 + 3))  # an id buffer's word: no overflow error


def _host_gather_of(table):
    return (table.storage if table.placement == "host" else table.storage.host).host_gather


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("stage", ["device_staging", "worker_prepare"])
def test_gpu_growth_that_fails_part_way_keeps_the_old_buffers(stage, seed, monkeypatch):
    """A growth whose second allocation fails (CUDA OOM, Ctrl-C) replaces nothing: later gathers that fit the
    old size serve exact rows from the old staging, and the next growth succeeds."""
    generator = torch.Generator().manual_seed(seed)
    device, table = _gpu_tables("host", generator, rows=50_000)
    gather = _host_gather_of(table)
    small = _ids(generator, 100, 24, 50_000, "cuda")
    assert _equal(table.lookup(small), device.lookup(small))
    capacity, staging = gather.capacity, gather.staging_host
    if stage == "worker_prepare" and gather.worker != "native":
        pytest.skip("the Python worker prepares no job buffers")
    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        if kwargs.get("device") is not None and str(kwargs["device"]).startswith("cuda"):
            raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
        return real_empty(*args, **kwargs)

    large = _ids(generator, 3000, 24, 50_000, "cuda")
    if stage == "device_staging":
        monkeypatch.setattr(torch, "empty", failing_empty)
    else:
        monkeypatch.setattr(gather.native_service, "prepare",
                            lambda **kwargs: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises((torch.cuda.OutOfMemoryError, KeyboardInterrupt)):
        table.lookup(large)
    monkeypatch.undo()
    assert gather.capacity == capacity and gather.staging_host is staging
    for _ in range(3):
        small = _ids(generator, 100, 24, 50_000, "cuda")
        handle = table.prefetch(small)
        assert _equal(table.lookup(small, prefetch=handle), device.lookup(small))
    assert _equal(table.lookup(large), device.lookup(large))
    assert gather.capacity > capacity


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_failed_start_makes_the_earlier_ticket_stale(seed, monkeypatch):
    from engram.table.host_memory import stream_memory_ops

    generator = torch.Generator().manual_seed(seed)
    device, table = _gpu_tables("host", generator, rows=50_000)
    gather = _host_gather_of(table)
    if gather.worker != "native":
        pytest.skip("the native worker's start enqueues its copies itself")
    first, second = _ids(generator, 2000, 24, 50_000, "cuda"), _ids(generator, 2000, 24, 50_000, "cuda")
    table.lookup(first)  # the staging at its size
    handle = table.prefetch(first)
    real_copy = stream_memory_ops.copy_to_device
    calls = []

    def copy_then_fail(*args):
        calls.append(args)
        if len(calls) == 2:  # one wave's copy queued, then the start fails
            raise RuntimeError("injected failure")
        return real_copy(*args)

    monkeypatch.setattr(stream_memory_ops, "copy_to_device", copy_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        gather.start(second, 0, torch.cuda.current_stream())
    monkeypatch.undo()
    assert not gather.current(handle.pending)  # its staging may be overwritten by the failed job's queued copy
    for ids, prefetch in ((first, handle), (second, None)):  # refused by name, never served
        with pytest.raises(RuntimeError, match="unusable after an earlier failure: RuntimeError.'injected failure"):
            table.lookup(ids, prefetch=prefetch)
    assert handle.spent
    small = _ids(generator, 4, 24, 50_000, "cuda")  # decode-sized lookups read directly: still exact
    table.storage.direct_max_rows = 1000
    assert _equal(table.lookup(small), device.lookup(small))
    torch.cuda.synchronize()  # nothing waits on a word no one writes


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_wait_for_a_worker_that_never_finishes_is_bounded(seed):
    """A worker held (its ids never seen done): wait_idle raises after its bound, naming the gather, instead
    of hanging; released, the rows are exact."""
    generator = torch.Generator().manual_seed(seed)
    device, table = _gpu_tables("host", generator, rows=50_000)
    gather = _host_gather_of(table)
    if gather.worker != "native":
        pytest.skip("the hold is the native worker's test hook")
    ids = _ids(generator, 2000, 24, 50_000, "cuda")
    table.lookup(ids)
    latch = torch.zeros(16, dtype=torch.int32)
    gather.native_service.hold_next(latch, timeout_ms=60_000)
    handle = table.prefetch(ids)
    with pytest.raises(RuntimeError, match=r"gather \d+ of this table was not done after 0.3 s"):
        gather.wait_idle(timeout_s=0.3)
    latch[0] = 1
    assert _equal(table.lookup(ids, prefetch=handle), device.lookup(ids))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["host", "cached"])
def test_gpu_every_stream_operation_runs_under_the_table_devices_context(placement, seed, monkeypatch):
    """The one-GPU half of the two-GPU case below: every raw stream write, wait and copy of a gather is issued
    inside ``torch.cuda.device(table device)``, so the default stream's handle 0 means the table's device
    whatever device the caller made current."""
    from engram.table.host_memory import stream_memory_ops

    generator = torch.Generator().manual_seed(seed)
    device, table = _gpu_tables(placement, generator, rows=50_000)
    if _host_gather_of(table).worker != "native":
        pytest.skip("the raw stream operations are the native worker's")
    entered: list[int] = []
    real_device = torch.cuda.device

    class RecordingDevice:
        def __init__(self, index):
            self.inner = real_device(index)
            self.index = torch.device(index).index if isinstance(index, (str, torch.device)) else index
            if self.index is None:
                self.index = torch.cuda.current_device()

        def __enter__(self):
            entered.append(self.index)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            entered.pop()
            return self.inner.__exit__(*exc)

    calls: list[tuple[str, list[int]]] = []
    for name in ("write_value", "wait_value", "copy_to_device"):
        def recording(*args, _real=getattr(stream_memory_ops, name), _name=name, **kwargs):
            calls.append((_name, list(entered)))
            return _real(*args, **kwargs)
        monkeypatch.setattr(stream_memory_ops, name, recording)
    monkeypatch.setattr(torch.cuda, "device", RecordingDevice)
    for step in range(4):
        ids = _ids(generator, 3000, 24, 50_000, "cuda")
        handle = table.prefetch(ids) if step % 2 else None
        assert _equal(table.lookup(ids, prefetch=handle), device.lookup(ids)), f"step {step}"
    table_device = table.device.index if table.device.index is not None else torch.cuda.current_device()
    assert {name for name, _ in calls} == {"write_value", "wait_value", "copy_to_device"}
    outside = [(name, stack) for name, stack in calls if not stack or stack[-1] != table_device]
    assert not outside, f"stream operations outside the table device's context: {outside[:4]}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("placement", ["host", "cached"])
def test_gpu_another_current_device_while_a_table_of_device_0_prefetches(placement, seed):
    """One process driving two GPUs (transformers' device_map="auto"): with GPU 1 current and the caller on
    GPU 0's default stream (handle 0), the "ids ready" write and the copies are still ordered on GPU 0's stream,
    so the worker never copies an earlier gather's ids: rows exact, prefetched or not."""
    generator = torch.Generator().manual_seed(seed)
    with torch.cuda.device(0):
        device, table = _gpu_tables(placement, generator, rows=50_000)
    for step in range(6):
        ids = _ids(generator, 3000, 24, 50_000, "cuda:0")
        with torch.cuda.device(1):
            handle = table.prefetch(ids) if step % 2 else None
            got = table.lookup(ids, prefetch=handle)
        assert _equal(got, device.lookup(ids)), f"step {step}"
