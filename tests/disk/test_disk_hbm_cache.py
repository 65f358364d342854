"""Placement "disk" with its HBM cache above the RAM cache: rows bit-equal to placement "cpu" directly and
prefetched, the two tiers' hits against engram.tools.cache_policy's set-lru replay of the same lookups (what
`engram profile tiers` predicts: the RAM cache sees only the HBM cache's misses), prefetches that skip the
cached rows and stay exact when the cache changes or the ids change in place (inside and outside inference
mode), a failed read that leaves both caches as they were, and close(). On the CPU the HBM cache's rows live
in host memory; the GPU test puts them on the device."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from conftest import fresh_seed
from engram.table import EngramTable
from engram.table.disk.hbm_cache import HbmRowCache
from engram.table.disk.reads import RowReadError
from engram.table.fp8 import quantize_rows
from engram.tools.cache_policy import CompactStream, DynamicParams, replay

SEED = fresh_seed(__name__)
HAS_CUDA = torch.cuda.is_available()
ROWS, HEAD_DIM = 2000, 256


def make_tables(tmp_path, seed: int, device="cpu", reference="cpu", **options):
    generator = torch.Generator().manual_seed(seed)
    values, scales = quantize_rows(torch.randn(ROWS, HEAD_DIM, generator=generator) * 4)
    options = {"directory": tmp_path, "ram_cache_fraction": 0.05, "cache_fraction": 0.05, "read_threads": 2,
               **options}
    disk = EngramTable(values, scales, placement="disk", device=device, placement_options=options)
    return disk, EngramTable(values, scales, placement=reference, device=None if reference == "cpu" else device)


def skewed_ids(rng, tokens: int, device="cpu") -> torch.Tensor:
    """``int64 [tokens, 24]``: half from 60 hot rows, half uniform (so both caches hit and miss)."""
    hot = np.random.default_rng(7).integers(0, ROWS, 60)
    ids = np.where(rng.random((tokens, 24)) < 0.5, rng.choice(hot, (tokens, 24)), rng.integers(0, ROWS, (tokens, 24)))
    return torch.from_numpy(ids).to(device)


def assert_equal(disk, reference, ids, prefetch=None, where=""):
    got = disk.lookup(ids, prefetch=prefetch)
    expected = reference.lookup(ids.to(reference.device)).to(got.device)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), f"rows differ {where}"


def test_rows_equal_cpu_direct_and_prefetched(tmp_path, rng, seed):
    disk, cpu = make_tables(tmp_path, seed)
    storage = disk.storage
    assert storage.hbm_cache is not None and storage.cache_nbytes == storage.hbm_cache.num_slots * 272
    for tokens in (0, 1, 63, 100, 257):
        ids = skewed_ids(rng, tokens)
        assert_equal(disk, cpu, ids, where=f"T = {tokens}")
        assert_equal(disk, cpu, ids, disk.prefetch(ids), where=f"T = {tokens}, prefetched")
        values, scales = disk.lookup_packed(ids)
        expected = cpu.lookup_packed(ids)
        assert torch.equal(values.view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(scales, expected[1])
    outside = torch.tensor([[ROWS, 3, ROWS + 9]])
    disk.validate = cpu.validate = False
    assert_equal(disk, cpu, outside, where="ids outside the table")
    assert storage.hbm_cache.stats["hits"] > 0 and storage.reads.cache.stats["calls"] > 0
    disk.close()
    assert storage.cache_nbytes == 0


@pytest.mark.parametrize("hbm, ram", [(0.05, 0.1), (0.02, 0.3), (0.2, 0.0)])
def test_tiers_hit_as_the_set_lru_replay_of_the_same_lookups(tmp_path, hbm, ram, rng, seed):
    """Each lookup is one step of the HBM cache over its distinct ids; the RAM cache's steps are the HBM
    cache's misses (an empty step where it had none): as `engram profile tiers` replays them."""
    disk, cpu = make_tables(tmp_path, seed, cache_fraction=hbm, ram_cache_fraction=ram)
    storage = disk.storage
    steps = []
    for step in range(40):
        ids = skewed_ids(rng, 30)
        if step % 2:
            assert_equal(disk, cpu, ids, disk.prefetch(ids), where=f"step {step}, prefetched")
        else:
            assert_equal(disk, cpu, ids, where=f"step {step}")
        steps.append(np.unique(ids.numpy()))
    hbm_misses = []
    top = replay(CompactStream.from_steps(steps), storage.hbm_cache.num_slots, "set-lru",
                 params=DynamicParams(ways=8), misses=hbm_misses)
    stats = storage.hbm_cache.stats
    assert stats["hits"] == top.hits > 0 and stats["calls"] == len(steps)
    assert stats["misses"] == sum(step.size for step in hbm_misses)
    ram_stats = storage.reads.cache.stats
    if ram:
        below = replay(CompactStream.from_steps(hbm_misses), storage.reads.cache.num_slots, "set-lru",
                       params=DynamicParams(ways=8))
        assert ram_stats["hits"] == below.hits
    assert ram_stats["misses"] == sum(step.size for step in hbm_misses) - ram_stats["hits"]
    disk.close()


def test_the_prefetch_skips_cached_rows_and_stays_exact_when_they_leave(tmp_path, rng, seed):
    disk, cpu = make_tables(tmp_path, seed, cache_fraction=0.02, ram_cache_fraction=0.0)
    storage = disk.storage
    ids = skewed_ids(rng, 20)
    assert_equal(disk, cpu, ids)   # its rows enter the HBM cache (as far as their sets allow)
    held = storage.hbm_cache.cached(ids.numpy().reshape(-1))
    assert held.any()
    ticket = disk.prefetch(ids)
    job = ticket.pending
    storage.worker.wait(job)
    assert np.array_equal(job.read_mask, ~held), "the prefetch read rows the HBM cache held"
    for _ in range(6):   # other lookups evict some of them before this prefetch's lookup
        assert_equal(disk, cpu, skewed_ids(rng, 40))
    assert not storage.hbm_cache.cached(ids.numpy().reshape(-1)).all()
    reread = storage.stats["reread_rows"]
    assert_equal(disk, cpu, ids, ticket, where="after the cache changed")
    assert storage.stats["reread_rows"] > reread, "evicted rows were not read again"
    disk.close()


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
def test_ids_edited_in_place_after_the_prefetch(tmp_path, inference, rng, seed):
    disk, cpu = make_tables(tmp_path, seed)
    with torch.inference_mode(inference):
        for step in range(5):
            ids = skewed_ids(rng, 50)
            ticket = disk.prefetch(ids)
            time.sleep(0.005)
            ids[::2] = skewed_ids(rng, 25)   # another step's ids, in place
            ids[1, 1] = step
            assert_equal(disk, cpu, ids, ticket, where=f"step {step}, edited after the prefetch")
    disk.close()


def test_a_failed_read_leaves_both_caches_as_they_were(tmp_path, rng, seed):
    disk, cpu = make_tables(tmp_path, seed)
    storage = disk.storage
    warm = skewed_ids(rng, 10) % (ROWS // 4)   # rows of pages the truncation keeps
    assert_equal(disk, cpu, warm)
    hbm, ram = storage.hbm_cache, storage.reads.cache
    before = (hbm.index.tags.copy(), hbm.index.scores.copy(), dict(hbm.stats), ram.tags.copy())
    layout = storage.row_file.layout
    os.truncate(storage.row_file.path, layout.page_offset(layout.num_pages // 2))
    beyond = torch.full((2, 24), ROWS - 1)
    for prefetch in (None, disk.prefetch(beyond)):
        with pytest.raises(RowReadError, match=rf"reading row {ROWS - 1} at file offset"):
            disk.lookup(beyond, prefetch=prefetch)
    assert np.array_equal(hbm.index.tags, before[0]) and np.array_equal(hbm.index.scores, before[1])
    assert hbm.stats == before[2] and np.array_equal(ram.tags, before[3])
    assert_equal(disk, cpu, warm, where="rows cached before the error")
    disk.close()


def test_a_dropped_table_stops_its_reader_and_drops_its_caches(tmp_path, rng, seed):
    import gc

    disk, cpu = make_tables(tmp_path, seed)
    assert_equal(disk, cpu, skewed_ids(rng, 20), disk.prefetch(skewed_ids(rng, 20)))
    thread, hbm = disk.storage.worker._thread, disk.storage.hbm_cache
    del disk
    gc.collect()
    thread.join(5)
    assert not thread.is_alive() and hbm.num_slots == 0, "the table outlived its last reference"


def test_sizing_and_no_cache_at_zero():
    assert HbmRowCache.for_fraction(0.0, 1000, 272, 8, torch.device("cpu")) is None
    for fraction, rows in ((0.02, 1000), (0.001, 50), (1.0, 7)):
        cache = HbmRowCache.for_fraction(fraction, rows, 272, 8, torch.device("cpu"))
        capacity = max(1, int(fraction * rows))
        assert cache.index.ways == min(8, capacity) and cache.num_slots == max(1, capacity // cache.index.ways) * cache.index.ways


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
def test_gpu_disk_with_hbm_cache_equals_device(tmp_path, inference, rng, seed):
    disk, device = make_tables(tmp_path, seed, device="cuda", reference="device")
    assert disk.storage.hbm_cache.rows.device.type == "cuda"
    side = torch.cuda.Stream()
    with torch.inference_mode(inference):
        for step in range(12):
            ids = skewed_ids(rng, (1, 63, 300, 1000)[step % 4], device="cuda")
            if step % 3 == 2:   # prefetched on a side stream, as EngramMemory does, then edited on the GPU
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    ticket = disk.prefetch(ids)
                torch.cuda.current_stream().wait_stream(side)
                ids[::2] = (ids[::2] + 1) % ROWS
                assert_equal(disk, device, ids, ticket, where=f"step {step}, edited after a side-stream prefetch")
            elif step % 3 == 1:
                with torch.cuda.stream(side):   # a lookup on another stream between the main stream's
                    side.wait_stream(torch.cuda.default_stream())
                    assert_equal(disk, device, ids, where=f"step {step}, on a side stream")
            else:
                assert_equal(disk, device, ids, disk.prefetch(ids), where=f"step {step}, prefetched")
    assert disk.storage.hbm_cache.stats["hits"] > 0
    disk.close()


def test_real_text_through_both_caches_equals_cpu(deepseek_tokenizer_path, tmp_path):
    """Python standard library sources, tokenized by the DeepSeek-V4 tokenizer and hashed as the checkpoint's
    rules say, in steps of 160 tokens through a memory of disk tables (both caches) and one of "cpu" tables:
    every layer's output bit-equal, prefetched or not, and the repeats of real text served by the HBM cache."""
    import difflib
    import textwrap

    import engram
    from tokenizers import Tokenizer

    from engram.tools.testing import write_synthetic_checkpoint

    model = tmp_path / "model"
    write_synthetic_checkpoint(model, seed=SEED % 2**31, scale="wide", tokenizer=deepseek_tokenizer_path)
    text = "".join(open(module.__file__, encoding="utf-8").read() for module in (textwrap, difflib))
    token_ids = np.array(Tokenizer.from_file(str(deepseek_tokenizer_path)).encode(text).ids[:3200], dtype=np.int64)
    options = engram.ServingOptions(placements={"disk": {"directory": str(tmp_path / "rows"), "ram_cache_fraction": 0.05,
                                                         "cache_fraction": 0.02, "read_threads": 2}}, progress=False)
    (tmp_path / "rows").mkdir()
    disk = engram.EngramMemory.from_pretrained(model, placement="disk", device="cpu", options=options)
    cpu = engram.EngramMemory.from_pretrained(model, placement="cpu", device="cpu", progress=False)
    spec = cpu.spec
    hash_ids = torch.from_numpy(engram.hash_ngrams(token_ids, cpu.layout, cpu.vocab))
    generator = torch.Generator().manual_seed(SEED)
    with torch.inference_mode():
        for step, start in enumerate(range(0, token_ids.size, 160)):
            ids = hash_ids[start:start + 160]
            hidden = torch.randn(ids.shape[0], spec.hc_mult, spec.hidden_size, generator=generator).bfloat16()
            ticket = disk.prefetch(ids) if step % 2 else None
            for layer_id in spec.layer_ids:
                handed = {"prefetch": ticket} if ticket is not None else {}
                got = disk.forward_layer(layer_id, hidden, ids, **handed)
                expected = cpu.forward_layer(layer_id, hidden, ids)
                assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), f"step {step}, layer {layer_id}"
    for layer_id in spec.layer_ids:
        stats = disk.table(layer_id).storage.hbm_cache.stats
        assert stats["calls"] == 20 and stats["hits"] > 0, f"layer {layer_id}: {stats}"
    disk.close()
