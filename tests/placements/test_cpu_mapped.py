"""The ``cpu`` placement serves rows from memory maps of the safetensors files
(engram.mapped): the same bytes and lookups as the streamed copy, no table-sized
anonymous memory, and the file never written."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch

import engram.checkpoint
from engram import mapped
from engram.checkpoint import SafetensorsCheckpoint, load_engram_table
from engram.layout import EngramLayout
from engram.table.host_memory.buffers import memory_report
from engram.tools.testing import write_synthetic_checkpoint


def copying_allocator(rows, width, device):
    """What the cpu placement did before: storage of its own, the rows copied in."""
    return torch.empty(rows, width, dtype=torch.uint8)


def release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``) so that later growth of
    RssAnon is new memory, not reuse of what earlier allocations left resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def random_ids(layout: EngramLayout, layer_index: int, tokens: int, rng: np.random.Generator) -> torch.Tensor:
    """int64 ``[T, C]``: a valid row id in each column's bucket."""
    primes, offsets = layout.column_primes[layer_index], layout.column_offsets[layer_index]
    return torch.from_numpy(offsets + (rng.random((tokens, len(primes))) * primes).astype(np.int64))


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("mapped"), scale="small", tokenizer="word",
                                      num_shards=2, seed=7)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_mapped_lookups_equal_copied(small_checkpoint, world_size, rng, monkeypatch):
    layout = EngramLayout(small_checkpoint.spec)
    checkpoint = SafetensorsCheckpoint(small_checkpoint.directory)
    for rank in range(world_size):
        shard = None if world_size == 1 else layout.shard(rank, world_size)
        for index in range(layout.num_layers):
            counted = []

            class Counter:
                def update(self, n):
                    counted.append(n)

            table = load_engram_table(checkpoint, layout, index, shard, chunk_bytes=4096, progress=Counter())
            with monkeypatch.context() as patch:
                patch.setitem(engram.checkpoint.loading._STORAGE_ALLOCATORS, "cpu", copying_allocator)
                copied = load_engram_table(checkpoint, layout, index, shard)
            assert sum(counted) == table.num_rows * small_checkpoint.spec.row_bytes and len(counted) > 2
            assert torch.equal(table.storage.value_bytes, copied.storage.value_bytes)
            assert torch.equal(table.storage.scale_bytes, copied.storage.scale_bytes)
            assert (table.row_start, table.column_start, table.column_end) == (
                copied.row_start, copied.column_start, copied.column_end)
            ids = random_ids(layout, index, 64, rng)
            assert torch.equal(table.lookup(ids).view(torch.int16), copied.lookup(ids).view(torch.int16))
            for mine, theirs in zip(table.lookup_packed(ids), copied.lookup_packed(ids)):
                assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_writes_never_reach_the_file(tmp_path):
    synthetic = write_synthetic_checkpoint(tmp_path / "ckpt", scale="tiny", tokenizer="word")
    layout = EngramLayout(synthetic.spec)
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    table = load_engram_table(checkpoint, layout, 0)
    before = table.storage.value_bytes[3].clone()
    table.storage.value_bytes[3] = 0x11   # copy-on-write: this process's page only
    again = load_engram_table(checkpoint, layout, 0)
    assert torch.equal(again.storage.value_bytes[3], before)
    assert bool((table.storage.value_bytes[3] == 0x11).all())


def test_tensor_location_errors(tmp_path):
    synthetic = write_synthetic_checkpoint(tmp_path / "ckpt", scale="tiny", tokenizer="word", num_shards=1,
                                           with_index=False)
    file = synthetic.directory / "model.safetensors"
    name = "layers.1.engram.embed.weight"
    location = mapped.tensor_location(file, name)
    assert location.dtype == "F8_E4M3" and location.nbytes == location.shape[0] * location.shape[1]
    with pytest.raises(ValueError, match=r"tensor 'layers\.9\.engram\.embed\.weight' in file .*no entry for it"):
        mapped.tensor_location(file, "layers.9.engram.embed.weight")
    truncated = tmp_path / "truncated.safetensors"
    shutil.copyfile(file, truncated)
    with open(truncated, "r+b") as handle:
        handle.truncate(location.offset + location.nbytes - 1)
    with pytest.raises(ValueError, match=r"past the end of the file .* the file is truncated"):
        mapped.tensor_location(truncated, name)
    with pytest.raises(ValueError, match=r"rows \[5, 5\) are not inside"):
        mapped.map_tensor_rows(location, 5, 5)


@pytest.mark.slow
def test_cpu_placement_adds_no_table_sized_anonymous_memory(tmp_path, monkeypatch):
    """~300 MB of tables: mapped, anonymous memory grows by a small fraction of it; the
    streamed copy (the old cpu placement, as control) grows by the whole table."""
    synthetic = write_synthetic_checkpoint(tmp_path / "ckpt", scale="wide", vocab_size=24000, tokenizer="word")
    layout = EngramLayout(synthetic.spec)
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    table_bytes = sum(layout.num_embeddings) * synthetic.spec.row_bytes
    mib = 2**20

    release_free_heap()
    before = memory_report()
    tables = [load_engram_table(checkpoint, layout, index) for index in range(layout.num_layers)]
    after = memory_report()
    anon_growth = after["rss_anon"] - before["rss_anon"]
    print(f"\ncpu placement, {table_bytes / mib:.0f} MiB of tables, mapped: RSS {before['rss'] / mib:.0f} -> "
          f"{after['rss'] / mib:.0f} MiB, RssAnon {before['rss_anon'] / mib:.0f} -> {after['rss_anon'] / mib:.0f} MiB "
          f"({anon_growth / mib:+.1f}), RssFile {before['rss_file'] / mib:.0f} -> {after['rss_file'] / mib:.0f} MiB")
    assert anon_growth < 0.1 * table_bytes

    monkeypatch.setitem(engram.checkpoint.loading._STORAGE_ALLOCATORS, "cpu", copying_allocator)
    release_free_heap()
    before_copy = memory_report()
    copies = [load_engram_table(checkpoint, layout, index) for index in range(layout.num_layers)]
    after_copy = memory_report()
    copy_growth = after_copy["rss_anon"] - before_copy["rss_anon"]
    print(f"streamed copy (before this change): RssAnon {before_copy['rss_anon'] / mib:.0f} -> "
          f"{after_copy['rss_anon'] / mib:.0f} MiB ({copy_growth / mib:+.1f})")
    assert copy_growth > 0.5 * table_bytes   # the measure sees a copy when there is one
    for table, copy in zip(tables, copies):
        assert torch.equal(table.storage.value_bytes, copy.storage.value_bytes)
        assert torch.equal(table.storage.scale_bytes, copy.storage.scale_bytes)
