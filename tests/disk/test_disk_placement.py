"""Placement "disk": rows bit-equal to placement "cpu" (from a checkpoint, through the table and the layer
API, and from tensors), prefetches that never serve rows of other ids (ids edited in place, inside and outside
inference mode; superseded and reused ids), read errors and timeouts named and nothing cached wrongly, options
refused by name, close(). The GPU tests compare it with placement "device"."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import engram
from conftest import fresh_seed
from disk_tables import disk_checkpoint
from engram.checkpoint import load_engram_table
from engram.table import EngramTable
from engram.table.disk.read_worker import WorkerClosed
from engram.table.disk.reads import RowReadError
from engram.table.fp8 import quantize_rows
from engram.table.placements.disk import DiskOptions

SEED = fresh_seed(__name__)
HAS_CUDA = torch.cuda.is_available()
ROWS, HEAD_DIM = 3000, 256


def tensors(seed: int, rows: int = ROWS):
    generator = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(rows, HEAD_DIM, generator=generator) * 4)


def tables(tmp_path, seed: int, device="cpu", reference="cpu", **options):
    """``(disk table, reference table)`` of the same random rows."""
    values, scales = tensors(seed)
    options = {"directory": tmp_path, "ram_cache_fraction": 0.05, "read_threads": 2, **options}
    disk = EngramTable(values, scales, placement="disk", device=device, placement_options=options)
    return disk, EngramTable(values, scales, placement=reference, device=None if reference == "cpu" else device)


def random_ids(rng, tokens: int, rows: int = ROWS, columns: int = 24, device="cpu") -> torch.Tensor:
    ids = torch.from_numpy(rng.integers(0, rows, (tokens, columns)))
    if tokens:
        ids[0, 0] = 0   # the first row
        ids[-1, -1] = rows - 1
    return ids.to(device)


def assert_equal(disk, reference, ids: torch.Tensor, prefetch=None, where: str = "") -> None:
    got = disk.lookup(ids, prefetch=prefetch)
    assert torch.equal(got.view(torch.int16), reference.lookup(ids.to(reference.device)).view(torch.int16).to(
        got.device)), f"bf16 rows differ {where}"
    values, scales = disk.lookup_packed(ids)
    expected = reference.lookup_packed(ids.to(reference.device))
    assert torch.equal(values.view(torch.uint8).cpu(), expected[0].view(torch.uint8).cpu()), f"FP8 differ {where}"
    assert torch.equal(scales.cpu(), expected[1].cpu()), f"scales differ {where}"


# ---------------------------------------------------------------------------
# from a checkpoint
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return disk_checkpoint(tmp_path_factory.mktemp("disk-placement") / "model", SEED)


def test_checkpoint_tables_equal_cpu_and_reuse_the_row_file(model, tmp_path):
    rng = np.random.default_rng(SEED)
    options = {"directory": tmp_path, "ram_cache_fraction": 0.1}
    for index in range(model.layout.num_layers):
        disk = load_engram_table(model.checkpoint, model.layout, index, placement="disk", placement_options=options)
        cpu = load_engram_table(model.checkpoint, model.layout, index, placement="cpu")
        rows = model.layout.num_embeddings[index]
        assert disk.num_rows == rows and disk.storage.nbytes < rows * 264   # no whole table in memory
        for tokens in (0, 1, 63, 100, 257):
            ids = random_ids(rng, tokens, rows, model.layout.num_columns)
            assert_equal(disk, cpu, ids, where=f"layer {index}, T = {tokens}")
            assert_equal(disk, cpu, ids, disk.prefetch(ids), where=f"layer {index}, T = {tokens}, prefetched")
        disk.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == model.layout.num_layers and all(name.endswith(".engram-rows") for name in files)
    mtimes = [os.stat(tmp_path / name).st_mtime_ns for name in files]
    again = load_engram_table(model.checkpoint, model.layout, 0, placement="disk", placement_options=options)
    assert [os.stat(tmp_path / name).st_mtime_ns for name in files] == mtimes, "a valid row file was rewritten"
    again.close()


def test_memory_layers_equal_cpu(model, tmp_path):
    generator = torch.Generator().manual_seed(SEED)
    options = engram.ServingOptions(placements={"disk": {"directory": str(tmp_path), "ram_cache_fraction": 0.2}},
                                    progress=False)
    disk = engram.EngramMemory.from_pretrained(model.directory, placement="disk", device="cpu", options=options)
    cpu = engram.EngramMemory.from_pretrained(model.directory, placement="cpu", device="cpu", progress=False)
    spec = cpu.spec
    for tokens in (1, 37):
        token_ids = torch.randint(0, cpu.vocab.vocab_size, (tokens,), generator=generator).numpy()
        hash_ids = torch.from_numpy(engram.hash_ngrams(token_ids, cpu.layout, cpu.vocab))
        hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16()
        ticket = disk.prefetch(hash_ids)
        for layer_id in spec.layer_ids:
            a = disk.forward_layer(layer_id, hidden, hash_ids, prefetch=ticket)
            b = cpu.forward_layer(layer_id, hidden, hash_ids)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"layer {layer_id}, T = {tokens}"
    disk.close()


def test_bad_options_are_refused_by_name_before_any_write(model, tmp_path):
    bad = [({"directory": None}, "directory: placement 'disk' needs"),
           ({"ram_cache_fraction": 1.5}, r"ram_cache_fraction: expected a number in \[0, 1\], found 1.5"),
           ({"ram_cache_fraction": True}, "ram_cache_fraction: expected a number in"),
           ({"read_threads": -1}, "read_threads: expected an integer in"),
           ({"read_backend": "fast"}, "read_backend: expected one of 'auto', 'native', 'python', found 'fast'"),
           ({"ram_cache_ways": 0}, "ram_cache_ways: expected an integer >= 1, found 0"),
           ({"read_timeout_s": 0}, "read_timeout_s: expected a number of seconds > 0, found 0"),
           ({"cache_fraction": -0.1}, r"cache_fraction: expected a number in \[0, 1\], found -0.1"),
           ({"cache_ways": 0}, "cache_ways: expected an integer >= 1, found 0")]
    for change, message in bad:
        options = {"directory": tmp_path, **change}
        with pytest.raises(ValueError, match=message):
            load_engram_table(model.checkpoint, model.layout, 0, placement="disk", placement_options=options)
        if change.get("directory", 1) is not None:
            with pytest.raises(ValueError, match=message):
                DiskOptions(**options)
    assert not list(tmp_path.iterdir()), "a refused load wrote a file"
    with pytest.raises(ValueError, match=r"placements\['disk'\]: read_threads: expected an integer"):
        engram.ServingOptions(placements={"disk": {"read_threads": -1}}).options_for("disk")
    with pytest.raises(ValueError, match="placement 'disk' has no option 'policy'"):
        engram.ServingOptions(placements={"disk": {"policy": "set-lru"}})
    with pytest.raises(ValueError, match="directory"):
        load_engram_table(model.checkpoint, model.layout, 0, placement="disk",
                          placement_options={"directory": tmp_path / "missing"})
    with pytest.raises(ValueError, match="share_host_tables"):
        engram.ServingOptions(share_host_tables=True).placement_options("disk")


# ---------------------------------------------------------------------------
# from tensors: prefetches, errors, close
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "python"])
def test_tensor_tables_equal_cpu(tmp_path, backend, rng, seed):
    disk, cpu = tables(tmp_path, seed, read_backend=backend, read_threads=0 if backend == "python" else 3)
    for tokens in (0, 1, 63, 100, 513):
        ids = random_ids(rng, tokens)
        assert_equal(disk, cpu, ids, where=f"T = {tokens}")
        assert_equal(disk, cpu, ids, disk.prefetch(ids), where=f"T = {tokens}, prefetched")
    outside = torch.tensor([[ROWS, -1, 5, ROWS + 7]])
    disk.validate = cpu.validate = False
    assert torch.equal(disk.lookup(outside)[0, [0, 1, 3]].float(), torch.zeros(3, HEAD_DIM))
    assert torch.equal(disk.lookup(outside).view(torch.int16), cpu.lookup(outside).view(torch.int16))
    assert disk.storage.reads.cache.stats["hits"] > 0
    disk.close()


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
def test_ids_edited_in_place_after_the_prefetch(tmp_path, inference, rng, seed):
    disk, cpu = tables(tmp_path, seed)
    with torch.inference_mode(inference):
        ids = random_ids(rng, 80)
        ticket = disk.prefetch(ids)
        time.sleep(0.01)
        ids[::3] = torch.from_numpy(rng.integers(0, ROWS, (ids[::3].shape)))
        ids[5, 7] = 0
        assert_equal(disk, cpu, ids, ticket, where="after an in-place edit")
    if inference:   # no version counter: the prefetch is served and its stale rows read again
        assert disk.prefetches["served"] == 1 and disk.storage.stats["reread_rows"] > 0
    else:
        assert disk.prefetches["dropped"] == 1
    disk.close()


def test_staged_rows_are_checked_against_the_lookups_ids(tmp_path, rng, seed):
    """The placement's own check, below the ticket rules: a job of other ids serves none of its rows."""
    disk, cpu = tables(tmp_path, seed)
    ids, other = random_ids(rng, 40), random_ids(rng, 40)
    other[:20] = ids[:20]
    job = disk.storage.prefetch(other, 0)
    got = disk.storage.gather_fused(ids, 0, packed=False, pending=job)
    assert torch.equal(got.view(torch.int16), cpu.lookup(ids).view(torch.int16))
    assert disk.storage.stats["reread_rows"] == int((ids != other).sum())
    short = disk.storage.prefetch(ids[:3], 0)   # a job of fewer ids: every row read again
    assert torch.equal(disk.storage.gather_fused(ids, 0, packed=False, pending=short).view(torch.int16),
                       cpu.lookup(ids).view(torch.int16))
    disk.close()


def test_superseded_and_reused_prefetches(tmp_path, rng, seed):
    disk, cpu = tables(tmp_path, seed)
    first, second = random_ids(rng, 50), random_ids(rng, 50)
    stale = disk.prefetch(first)
    fresh = disk.prefetch(second)   # the step of `first` was aborted: its prefetch is never served
    assert_equal(disk, cpu, second, fresh, where="the latest prefetch")
    assert_equal(disk, cpu, first, stale, where="a superseded prefetch")
    assert disk.prefetches == {"served": 1, "dropped": 1}
    with torch.inference_mode():
        buffer = first.clone()
        ticket = disk.prefetch(buffer)
        buffer.copy_(second)   # the engine's ids buffer, refilled for the next step
        assert_equal(disk, cpu, buffer, ticket, where="a refilled ids buffer")
    disk.close()


def test_read_error_mid_lookup_is_named_and_caches_nothing(tmp_path, rng, seed):
    disk, cpu = tables(tmp_path, seed, ram_cache_fraction=0.5)
    warm = random_ids(rng, 10, rows=ROWS // 4)   # rows of pages the truncation keeps
    assert_equal(disk, cpu, warm)
    cache = disk.storage.reads.cache
    tags, admitted = cache.tags.copy(), cache.stats["admitted"]
    layout = disk.storage.row_file.layout
    keep = layout.page_offset(layout.num_pages // 2)
    os.truncate(disk.storage.row_file.path, keep)
    beyond = torch.full((2, 24), ROWS - 1)
    with pytest.raises(RowReadError, match=rf"reading row {ROWS - 1} at file offset \d+ failed") as caught:
        disk.lookup(beyond)
    assert str(caught.value).startswith(str(disk.storage.row_file.path))
    with pytest.raises(RowReadError) as caught:
        disk.lookup(beyond, prefetch=disk.prefetch(beyond))
    assert caught.value.path == disk.storage.row_file.path and caught.value.offset >= keep
    assert np.array_equal(cache.tags, tags) and cache.stats["admitted"] == admitted
    assert_equal(disk, cpu, warm, where="rows cached before the error")
    disk.close()


def test_reader_failure_and_timeout(tmp_path, rng, seed):
    disk, cpu = tables(tmp_path, seed, read_timeout_s=0.3)
    reads = disk.storage.reads
    real = reads.reader.read
    ids = random_ids(rng, 20)

    def failing(row_ids, out):
        raise RowReadError(reads.row_file.path, int(row_ids[0]), 65536, 5, -1, 4096)

    reads.reader.read = failing
    with pytest.raises(RowReadError, match="reading row .* at file offset 65536 failed: Input/output error"):
        disk.lookup(ids, prefetch=disk.prefetch(ids))
    assert reads.cache.stats["admitted"] == 0

    def slow(row_ids, out):
        time.sleep(1.0)
        real(row_ids, out)

    reads.reader.read = slow
    with pytest.raises(TimeoutError, match=rf"{tmp_path}.*did not finish within 0.3 s"):
        disk.lookup(ids, prefetch=disk.prefetch(ids))
    reads.reader.read = real
    time.sleep(1.0)
    assert_equal(disk, cpu, ids, disk.prefetch(ids), where="after a timeout")
    disk.close()


def test_close_stops_the_worker_and_refuses_lookups(tmp_path, rng, seed):
    disk, cpu = tables(tmp_path, seed)
    storage = disk.storage
    reads = storage.reads
    real = reads.reader.read
    reading = threading.Event()
    reads.reader.read = lambda row_ids, out: (reading.set(), time.sleep(0.2), real(row_ids, out))
    ids = random_ids(rng, 10)
    first, second = storage.prefetch(ids, 0), storage.prefetch(ids, 0)
    assert reading.wait(10), "the worker never started the first read"  # close() comes with a job in hand
    disk.close()
    assert not storage.worker._thread.is_alive()
    assert first.done.is_set() and second.done.is_set()
    assert first.error is None and isinstance(second.error, WorkerClosed)
    for call in (lambda: disk.lookup(ids), lambda: disk.prefetch(ids), lambda: disk.lookup_packed(ids)):
        with pytest.raises(RuntimeError, match=r"placement 'disk' \(.*\): a (lookup|prefetch) after close\(\)"):
            call()
    disk.close()   # a second close is a no-op


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
def test_gpu_disk_equals_device(tmp_path, inference, rng, seed):
    disk, device = tables(tmp_path, seed, device="cuda", reference="device")
    assert disk.device.type == "cuda"
    with torch.inference_mode(inference):
        for tokens in (0, 1, 63, 100, 4099):
            ids = random_ids(rng, tokens, device="cuda")
            assert_equal(disk, device, ids, where=f"T = {tokens}")
            assert_equal(disk, device, ids, disk.prefetch(ids), where=f"T = {tokens}, prefetched")
        stream = torch.cuda.Stream()
        ids = random_ids(rng, 300, device="cuda")
        with torch.cuda.stream(stream):   # prefetched on a side stream, as EngramMemory does
            stream.wait_stream(torch.cuda.default_stream())
            ticket = disk.prefetch(ids)
        torch.cuda.current_stream().wait_stream(stream)
        ids[::2] = (ids[::2] + 1) % ROWS   # edited after the prefetch, on the GPU
        assert_equal(disk, device, ids, ticket, where="edited after a prefetch")
    disk.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_capture_is_refused(tmp_path, rng, seed):
    disk, _ = tables(tmp_path, seed, device="cuda", reference="cpu")
    ids = random_ids(rng, 8, device="cuda")
    disk.lookup(ids)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="placement 'disk'.*cannot capture"):
        with torch.cuda.graph(graph):
            disk.lookup(ids)
    disk.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_memory_from_pretrained_disk_equals_device(model, tmp_path):
    generator = torch.Generator().manual_seed(SEED)
    options = {"directory": str(tmp_path), "ram_cache_fraction": 0.1}
    disk = engram.EngramMemory.from_pretrained(model.directory, placement="disk", device="cuda", progress=False,
                                               placement_options=options)
    device = engram.EngramMemory.from_pretrained(model.directory, placement="device", device="cuda", progress=False)
    spec = device.spec
    with torch.inference_mode():
        for tokens in (5, 700):
            token_ids = torch.randint(0, device.vocab.vocab_size, (tokens,), generator=generator).numpy()
            hash_ids = torch.from_numpy(engram.hash_ngrams(token_ids, device.layout, device.vocab)).cuda()
            hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, generator=generator).bfloat16().cuda()
            ticket = disk.prefetch(hash_ids)
            for layer_id in spec.layer_ids:
                a = disk.forward_layer(layer_id, hidden, hash_ids, prefetch=ticket)
                b = device.forward_layer(layer_id, hidden, hash_ids)
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"layer {layer_id}, T = {tokens}"
    disk.close()
