"""Placement "host": packed rows, the host-side gather, both read paths and prefetch.

CPU tests cover the row packing and the host gather (pure torch); GPU tests (marked
``gpu``) check both read paths and the prefetch pipeline bit for bit against the
``device`` placement, under CUDA-graph capture and with torch's sync debug mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engram
from conftest import assert_layers_equal, assert_lookups_equal, capture_cuda_graph, memory_on_cuda, replay_poisoned
from engram.table.fp8 import quantize_rows
from engram.table.kernels.dedup import DistinctRows, distinct_rows, rows_in_lookup_order
from engram.table.kernels.reference import rows_in_lookup_order_reference
from engram.table.host_memory.gather import gather_packed_rows_host
from engram.table.host_memory.rows import PackedRows, pack_rows, packed_row_bytes, row_tags

HAS_CUDA = torch.cuda.is_available()


def _table(rows: int, head_dim: int, seed: int, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-6, 4, (rows, 1), generator=generator).float()
    values, scales = quantize_rows((torch.randn(rows, head_dim, generator=generator) * scale).to(device))
    return values.view(torch.uint8), scales


@pytest.mark.parametrize("head_dim", [32, 64, 256, 96])
def test_packed_rows_hold_values_scales_and_a_zero_row(head_dim, seed):
    values, scales = _table(37, head_dim, seed)
    rows = pack_rows(values, scales)
    assert rows.packed.shape == (38, packed_row_bytes(head_dim)) and packed_row_bytes(head_dim) % 16 == 0
    assert torch.equal(rows.values, values) and torch.equal(rows.scales, scales)
    # The zero row and the padding are zero but for each row's tag, its own index (the zero row's: 37).
    row_bytes = packed_row_bytes(head_dim)
    assert int(rows.packed[-1, :row_bytes - 4].sum()) == 0
    assert int(rows.packed[:, head_dim + head_dim // 32: row_bytes - 4].sum()) == 0
    assert rows.tags.tolist() == list(range(38))
    assert torch.equal(rows.packed[:, -4:].contiguous().view(torch.int32)[:, 0], torch.arange(38, dtype=torch.int32))
    # The loader's views are recognized as packed (no second copy).
    again = PackedRows.matching(rows.values, rows.scales)
    assert again is not None and again.packed.data_ptr() == rows.packed.data_ptr()
    assert PackedRows.matching(values, scales) is None


def test_rows_packed_in_own_pages_share_no_page(seed):
    """Host tables are registered with CUDA page by page, and a range touching a page another
    registered range holds is refused (CUDA error 712): each table packed for the host placement
    starts on a page of its own and no two of them share a page, small ones included."""
    import mmap

    from engram.table.host_memory.rows import owns_its_pages, pack_rows_in_own_pages

    page = mmap.PAGESIZE
    spans = []
    for index, rows in enumerate((1, 37, 5000)):
        values, scales = _table(rows, 64, seed + index)
        packed = pack_rows_in_own_pages(values, scales)
        assert owns_its_pages(packed) and packed.packed.data_ptr() % page == 0
        assert torch.equal(packed.values, values) and torch.equal(packed.scales, scales)
        assert int(packed.packed[-1, :-4].sum()) == 0 and int(packed.tags[-1]) == packed.num_rows
        first = packed.packed.data_ptr() // page
        spans.append((first, (packed.packed.data_ptr() + packed.packed.numel() - 1) // page, packed))
    spans.sort(key=lambda span: span[0])
    assert all(earlier[1] < later[0] for earlier, later in zip(spans, spans[1:])), "two tables share a page"


@pytest.mark.parametrize("count", [1, 63, 1000])
def test_host_gather_matches_the_reference_with_out_of_range_ids(count, rng):
    values, scales = _table(101, 64, int(rng.integers(2**31)))
    rows = pack_rows(values, scales)
    row_start = 1000
    ids = torch.from_numpy(rng.integers(row_start - 20, row_start + 121, count)).to(torch.int32)
    out = torch.full((count, rows.packed.shape[1]), 0xAB, dtype=torch.uint8)  # poisoned
    gather_packed_rows_host(rows.packed, ids, row_start, out)
    local = ids.long() - row_start
    inside = (local >= 0) & (local < 101)
    assert torch.equal(out[inside, :64], values[local[inside]])
    assert torch.equal(out[inside, 64:66], scales[local[inside]])
    assert int(out[~inside, :-4].sum()) == 0 and bool((row_tags(out)[~inside] == 101).all())  # the zero row


def _expected_local(ids, row_start, num_rows):
    local = ids.reshape(-1).long() - row_start
    return torch.where((local >= 0) & (local < num_rows), local, torch.full_like(local, num_rows))


def _poisoned(length):
    return torch.full((length,), -7, dtype=torch.int32)


def _check_distinct_rows(ids, row_start, num_rows, into_buffers=False):
    out = DistinctRows(_poisoned(ids.numel() + 1), _poisoned(ids.numel())) if into_buffers else None
    distinct = distinct_rows(ids, row_start, num_rows, out=out)
    if into_buffers:  # written in place: a captured gather's buffers, kept for its graph
        assert distinct.rows_and_count is out.rows_and_count and distinct.inverse is out.inverse
    local = _expected_local(ids, row_start, num_rows)
    expected = torch.unique(local)
    found = int(distinct.rows_and_count[-1])
    assert found == expected.numel()
    assert distinct.rows_and_count.dtype == distinct.inverse.dtype == torch.int32
    assert torch.equal(distinct.rows_and_count[:found].long(), expected)
    assert torch.equal(distinct.rows_and_count[distinct.inverse.long()].long(), local)


def _check_rows_in_lookup_order(ids, row_start, num_rows, into_buffers=False):
    out = _poisoned(ids.numel() + 1) if into_buffers else None
    rows_and_count = rows_in_lookup_order(ids, row_start, num_rows, out=out)
    if into_buffers:
        assert rows_and_count is out
    local = _expected_local(ids, row_start, num_rows)
    assert torch.equal(rows_and_count, rows_in_lookup_order_reference(ids, row_start, num_rows))
    assert rows_and_count.dtype == torch.int32 and rows_and_count.shape == (local.numel() + 1,)
    assert int(rows_and_count[-1]) == local.numel()
    assert torch.equal(rows_and_count[:-1].long(), local)


_GATHER_FORMS = {"sorted": _check_distinct_rows, "lookup_order": _check_rows_in_lookup_order}


def _lookup_ids(rng, count, columns, num_rows, row_start, dtype):
    """Ids around a table of ``num_rows`` rows at ``row_start``, some outside it, many repeated;
    every other call a strided column view."""
    ids = torch.from_numpy(rng.integers(row_start - 40, row_start + num_rows + 40, (count, columns + 2))).to(dtype)
    return ids[:, 1:-1] if rng.integers(2) else ids[:, :columns].contiguous()


@pytest.mark.parametrize("into_buffers", [False, True])
@pytest.mark.parametrize("count", [1, 2, 63, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("form", list(_GATHER_FORMS))
def test_gather_rows_of_both_forms_invert_to_the_lookups(form, count, dtype, into_buffers, rng):
    """Sorted: distinct rows ascending, their count, an inverse back to every lookup; lookup order:
    every lookup's row and their number. Into fresh tensors or (``out=``) poisoned buffers of the caller's."""
    num_rows = int(rng.integers(1, 300))
    row_start = int(rng.integers(0, 2**20 if dtype == torch.int32 else 2**33))
    _GATHER_FORMS[form](_lookup_ids(rng, count, 3, num_rows, row_start, dtype), row_start, num_rows, into_buffers)


@pytest.mark.interpreter
@pytest.mark.parametrize("into_buffers", [False, True])
@pytest.mark.parametrize("count,columns", [(1, 1), (63, 3), (700, 3)])
@pytest.mark.parametrize("form", list(_GATHER_FORMS))
def test_gather_row_kernels_of_both_forms_match_the_reference(form, count, columns, into_buffers, rng):
    """The kernels under the interpreter: 1 to 3 blocks of 1024 ids (sorted: runs of equal rows across
    block edges), strided ids, ids outside the table."""
    num_rows = int(rng.integers(1, 1500))
    row_start = int(rng.integers(0, 2**33))
    _GATHER_FORMS[form](_lookup_ids(rng, count, columns, num_rows, row_start, torch.int64), row_start, num_rows,
                        into_buffers)


@pytest.mark.parametrize("launch", [distinct_rows, rows_in_lookup_order])
def test_gather_rows_refuse_tables_past_int32(launch):
    with pytest.raises(ValueError, match="num_rows"):
        launch(torch.zeros(3, 1, dtype=torch.int64), 0, 2**31)


@pytest.mark.parametrize("field,length,dtype", [("rows_and_count", 4, torch.int32), ("rows_and_count", 5, torch.int64),
                                                ("inverse", 3, torch.int32)])
def test_gather_rows_refuse_buffers_of_another_shape(field, length, dtype):
    """A buffer given to write into that does not fit is named, with what it is, before anything is written."""
    ids = torch.zeros(4, 1, dtype=torch.int64)
    buffers = {"rows_and_count": _poisoned(5), "inverse": _poisoned(4)}
    buffers[field] = torch.full((length,), -7, dtype=dtype)
    with pytest.raises(ValueError, match=rf"out\.{field}: expected a contiguous int32 \[{4 + (field == 'rows_and_count')}\]"):
        distinct_rows(ids, 0, 10, out=DistinctRows(**buffers))
    assert all(int(buffer.min()) == -7 == int(buffer.max()) for buffer in buffers.values())
    if field == "rows_and_count":
        with pytest.raises(ValueError, match=r"out: expected a contiguous int32 \[5\]"):
            rows_in_lookup_order(ids, 0, 10, out=buffers[field])


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_host_placement_without_cuda_names_cpu():
    values, scales = _table(8, 32, 0)
    with pytest.raises(ValueError, match="placement='cpu'"):
        engram.EngramTable(values, scales, placement="host")
    from engram.memory import resolve_placement

    with pytest.raises(ValueError, match="use placement='cpu'"):
        resolve_placement("host")
    assert resolve_placement("auto", table_bytes=10**12)[0] == "cpu"


# ---- GPU ---------------------------------------------------------------------------
def _device_and_host(rows, head_dim, seed, row_start=0, worker="auto"):
    values, scales = _table(rows, head_dim, seed)
    common = dict(row_start=row_start, validate=False)
    device = engram.EngramTable(values, scales, placement="device", device="cuda", **common)
    host = engram.EngramTable(values, scales, placement="host", device="cuda",
                              placement_options={"host_gather_worker": worker}, **common)
    return device, host


def _ids(rng, tokens, columns, rows, row_start=0):
    ids = rng.integers(row_start - 5, row_start + rows + 5, (tokens, columns))  # a few outside the table
    return torch.from_numpy(ids.astype(np.int32)).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 63, 700, 4096])
@pytest.mark.parametrize("direct_max_rows", [0, 10**9])  # host gather everywhere / direct reads everywhere
@pytest.mark.parametrize("worker", ["native", "python"])
def test_gpu_host_paths_equal_device_placement(tokens, direct_max_rows, worker, rng):
    if direct_max_rows and worker == "python":
        pytest.skip("direct reads use no worker")
    device, host = _device_and_host(5000, 256, int(rng.integers(2**31)), row_start=777, worker=worker)
    assert host.storage.host_gather.worker == worker
    host.storage.direct_max_rows = direct_max_rows
    for _ in range(3):  # the persistent staging reused
        assert_lookups_equal(host, device, _ids(rng, tokens, 24, 5000, row_start=777))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 63, 700])
@pytest.mark.parametrize("dedup", ["always", "never", "auto"])
def test_gpu_host_gather_forms_equal_device_placement(tokens, dedup, rng):
    """Sorted (each distinct row once) and lookup-order gathers return the device placement's rows."""
    values, scales = _table(5000, 256, int(rng.integers(2**31)))
    device = engram.EngramTable(values, scales, placement="device", device="cuda", row_start=777, validate=False)
    host = engram.EngramTable(values, scales, placement="host", device="cuda", row_start=777, validate=False,
                              placement_options={"host_gather_worker": "native", "host_gather_dedup": dedup,
                                                 "direct_max_rows": 0})
    for _ in range(4):
        assert_lookups_equal(host, device, _ids(rng, tokens, 24, 5000, row_start=777))
    gathers = host.storage.host_gather.native_gathers
    if dedup == "always":
        assert gathers["lookup_order"] == 0 and gathers["sorted"] > 0
    elif dedup == "never":
        assert gathers["sorted"] == 0 and gathers["lookup_order"] > 0
    else:
        assert gathers["sorted"] > 0  # the first gather sorts to measure


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_host_gather_sorts_while_measured_repeats_pay(rng):
    """``host_gather_dedup="auto"``: the first gather sorts and measures; few repeats -> lookup order,
    with a sorted gather every _DEDUP_REMEASURE-th to measure again; many repeats -> sorted again."""
    from engram.table.host_memory import gather as host_gather

    rows = 200_000
    values, scales = _table(rows, 256, int(rng.integers(2**31)))
    device = engram.EngramTable(values, scales, placement="device", device="cuda", validate=False)
    host = engram.EngramTable(values, scales, placement="host", device="cuda", validate=False,
                              placement_options={"host_gather_worker": "native", "direct_max_rows": 0})
    gather = host.storage.host_gather
    every = host_gather._DEDUP_REMEASURE
    lookups = every + 4
    for _ in range(lookups):  # 1,536 ids over 200,000 rows: under 1% repeats
        ids = torch.from_numpy(rng.integers(0, rows, (64, 24)).astype(np.int32)).cuda()
        assert torch.equal(host.lookup(ids).view(torch.int16), device.lookup(ids).view(torch.int16))
        gather.wait_idle()  # its count readable at the next start
    assert gather.repeat_share < host_gather._DEDUP_MIN_REPEATS
    assert gather.native_gathers == {"sorted": 2, "lookup_order": lookups - 2}  # gathers 1 and every + 1
    for _ in range(lookups):  # the same 50 rows over and over
        ids = torch.from_numpy(rng.integers(0, 50, (64, 24)).astype(np.int32)).cuda()
        assert torch.equal(host.lookup(ids).view(torch.int16), device.lookup(ids).view(torch.int16))
        gather.wait_idle()
    assert gather.repeat_share > 0.9
    # gather 2 * every + 1 measures the repeats, every later one sorts
    sorted_after = 2 * lookups - 2 * every
    assert gather.native_gathers == {"sorted": 2 + sorted_after, "lookup_order": 2 * lookups - 2 - sorted_after}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_auto_dedup_reads_the_count_of_its_own_gather_once_the_worker_is_done(rng):
    """The measured gather's count is read from its id buffer only once its job is done, and that
    buffer is not reused before: with the worker held on the measured gather, a gather landing on the
    same buffer slot takes a fresh buffer, and the share read after the release is the measured one's."""
    from engram.table.host_memory import gather as host_gather

    rows, tokens = 4000, 700
    values, scales = _table(rows, 256, int(rng.integers(2**31)))
    options = {"host_gather_worker": "native", "direct_max_rows": 0}
    device = engram.EngramTable(values, scales, placement="device", device="cuda", validate=False)
    warm = engram.EngramTable(values, scales, placement="host", device="cuda", validate=False,
                              placement_options={**options, "host_gather_dedup": "never"})
    warm.lookup(_ids(rng, tokens, 24, rows))  # kernels loaded before the worker is held (a module load
    torch.cuda.synchronize()                  # would wait for a stream that waits for the worker)
    host = engram.EngramTable(values, scales, placement="host", device="cuda", validate=False,
                              placement_options=options)
    gather = host.storage.host_gather
    measured = torch.from_numpy(rng.integers(0, 50, (tokens, 24)).astype(np.int32)).cuda()  # 50 rows, repeated
    later = [_ids(rng, tokens, 24, rows) for _ in range(host_gather._ID_BUFFERS)]
    # the fresh id buffer comes from torch's pinned-block cache, not a new host allocation, while held
    cached_block = torch.empty(tokens * 24 + 17, dtype=torch.int32, pin_memory=True)
    del cached_block
    latch = torch.zeros(16, dtype=torch.int32)
    gather.native_service.hold_next(latch, timeout_ms=60_000)
    got = [host.lookup(ids) for ids in (measured, *later)]  # the last one lands on the measured gather's slot
    held = not gather.idle
    latch[0] = 1
    torch.cuda.synchronize()
    gather.wait_idle()
    assert held and gather.native_service.stats()["holds_timed_out"] == 0
    for ids, rows_got in zip((measured, *later), got):
        assert torch.equal(rows_got.view(torch.int16), device.lookup(ids).view(torch.int16))
    host.lookup(later[0])  # the next start reads the measured gather's count
    distinct = torch.unique(measured).numel()
    assert gather.repeat_share == 1.0 - distinct / measured.numel()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_many_small_host_tables_register_side_by_side(rng):
    """Small host tables alive at once, as a test suite or a multi-layer model makes them: each
    registers with CUDA (no range shares a page with another) and reads its own rows."""
    sizes = [int(size) for size in rng.integers(1, 300, 12)]
    tables = [_device_and_host(rows, 64, int(rng.integers(2**31))) for rows in sizes]
    for rows, (device, host) in zip(sizes, tables):
        ids = _ids(rng, 5, 24, rows)
        assert torch.equal(host.lookup(ids).view(torch.int16), device.lookup(ids).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_host_table_reads_its_rows_while_neighbours_come_and_go(rng):
    """Host tables made and released around a live one (as a test suite's garbage collector
    unregisters earlier tables at any point): the live table keeps reading its own rows, on the
    direct path (GPU reads of its host memory) and through the host gather."""
    import gc

    device, host = _device_and_host(3000, 256, int(rng.integers(2**31)))
    for round_index in range(8):
        neighbours = [_device_and_host(int(rng.integers(1, 3000)), 256, int(rng.integers(2**31)))
                      for _ in range(3)]
        del neighbours
        gc.collect()  # their registrations end here, between the live table's lookups
        for direct_max_rows in (10**9, 0):
            host.storage.direct_max_rows = direct_max_rows
            ids = _ids(rng, 63, 24, 3000)
            assert torch.equal(host.lookup(ids).view(torch.int16), device.lookup(ids).view(torch.int16)), (
                f"round {round_index}, direct_max_rows {direct_max_rows}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_prefetch_equals_the_synchronous_path_without_host_sync(rng):
    """Prefetch of both layers, then the lookups, over several steps of varying size, with
    torch's sync debug mode raising on any host sync in the caller's calls."""
    tables = [_device_and_host(20000, 256, int(rng.integers(2**31))) for _ in range(2)]
    for _, host in tables:
        host.storage.direct_max_rows = 64
        host.lookup(_ids(rng, 4096, 24, 20000))  # grow the staging buffers outside the checked region
    torch.cuda.synchronize()
    for tokens in (4096, 1000, 4096, 3):
        hash_ids = torch.stack([_ids(rng, tokens, 24, 20000) for _ in range(2)], dim=1)  # [T, L, C]
        expected = [device.lookup(hash_ids[:, index, :]) for index, (device, _) in enumerate(tables)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            handles = [host.prefetch(hash_ids[:, index, :]) for index, (_, host) in enumerate(tables)]
            got = [host.lookup(hash_ids[:, index, :], prefetch=handle)
                   for index, ((_, host), handle) in enumerate(zip(tables, handles))]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b in zip(got, expected):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_forward_layer_returns_before_its_host_rows_are_there(synthetic_model_dir, rng):
    """With the native worker held before it copies a row, every layer's forward_layer (inline, then
    prefetched) returns to the caller; the rows arrive once the worker is let go, bit-identical."""
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    on_host = memory_on_cuda(synthetic_model_dir, "host",
                             placement_options={"direct_max_rows": 0, "host_gather_worker": "native"})
    spec = on_device.spec
    tokens = 300
    hash_ids = torch.stack([_ids(rng, tokens, spec.num_columns, on_device.layout.num_embeddings[i])
                            for i in range(spec.num_layers)], dim=1)
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device="cuda",
                         generator=torch.Generator("cuda").manual_seed(int(rng.integers(2**31)))).bfloat16()
    expected = {i: on_device.forward_layer(i, hidden, hash_ids) for i in on_device.layer_ids}
    gathers = [on_host.table(i).storage.host_gather for i in on_host.layer_ids]
    assert all(gather.worker == "native" for gather in gathers)
    for layer_id in on_host.layer_ids:  # warm-up: kernels loaded, staging grown
        on_host.forward_layer(layer_id, hidden, hash_ids)
    torch.cuda.synchronize()
    service = gathers[0].native_service
    for prefetched in (False, True):
        latch = torch.zeros(16, dtype=torch.int32)
        service.hold_next(latch, timeout_ms=60_000)
        handle = on_host.prefetch(hash_ids) if prefetched else None
        got = {i: on_host.forward_layer(i, hidden, hash_ids, prefetch=handle) for i in on_host.layer_ids}
        back_before_rows = not any(gather.idle for gather in gathers) and not torch.cuda.current_stream().query()
        latch[0] = 1
        torch.cuda.synchronize()
        assert back_before_rows, f"prefetched={prefetched}: forward_layer returned only after the worker copied rows"
        assert service.stats()["holds_timed_out"] == 0
        for layer_id in on_host.layer_ids:
            assert torch.equal(got[layer_id].view(torch.int16), expected[layer_id].view(torch.int16)), (prefetched,
                                                                                                       layer_id)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_prefetched_lookups_below_the_direct_switch_take_the_host_gather(rng):
    """A prefetched lookup larger than prefetch_direct_max_rows starts the host gather at its prefetch
    even where an unprefetched one of its size reads directly; both equal the device placement."""
    values, scales = _table(4000, 256, int(rng.integers(2**31)))
    device = engram.EngramTable(values, scales, placement="device", device="cuda", validate=False)
    host = engram.EngramTable(values, scales, placement="host", device="cuda", validate=False,
                              placement_options={"prefetch_direct_max_rows": 100})
    for tokens, starts in ((4, False), (63, True), (700, True)):  # 96, 1512 and 16,800 rows, all <= direct_max_rows
        ids = _ids(rng, tokens, 24, 4000)
        handle = host.prefetch(ids)
        assert handle.started == starts, tokens
        assert torch.equal(host.lookup(ids, prefetch=handle).view(torch.int16), device.lookup(ids).view(torch.int16))
        assert torch.equal(host.lookup(ids).view(torch.int16), device.lookup(ids).view(torch.int16))
    with pytest.raises(ValueError, match="prefetch_direct_max_rows: expected an integer >= 0"):
        engram.EngramTable(values, scales, placement="host", device="cuda",
                           placement_options={"prefetch_direct_max_rows": -1})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_direct_path_under_cuda_graph_capture(rng):
    device, host = _device_and_host(3000, 256, int(rng.integers(2**31)))
    host.storage.direct_max_rows = 0  # even so, capture takes the direct path
    static_ids = _ids(rng, 64, 24, 3000)
    host.lookup(static_ids)
    graph, static_out = capture_cuda_graph(lambda: host.lookup(static_ids))
    for _ in range(3):
        static_ids.copy_(_ids(rng, 64, 24, 3000))
        replay_poisoned(graph, static_out)
        assert torch.equal(static_out.view(torch.int16), device.lookup(static_ids).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_memory_from_pretrained_host_equals_device(synthetic_model_dir, rng):
    on_device = memory_on_cuda(synthetic_model_dir, "device")
    on_host = memory_on_cuda(synthetic_model_dir, "host")
    assert on_host.placement == "host"
    spec = on_device.spec
    for tokens in (5, 3000):
        hash_ids = torch.stack([_ids(rng, tokens, spec.num_columns, on_device.layout.num_embeddings[i])
                                for i in range(spec.num_layers)], dim=1)
        hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device="cuda",
                             generator=torch.Generator("cuda").manual_seed(int(rng.integers(2**31)))).bfloat16()
        handle = on_host.prefetch(hash_ids)
        assert_layers_equal(on_host, on_device, hidden, hash_ids, prefetch=handle)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_shared_host_tables_are_filled_once_and_equal(synthetic_model_dir, rng):
    """Two loads with share_host_tables=True: the second maps the first's shared file
    (filled_here False) and gives the same forward as the device placement."""
    from engram.table.host_memory.buffers import remove_shared_buffer

    first = memory_on_cuda(synthetic_model_dir, "host", share_host_tables=True)
    try:
        second = memory_on_cuda(synthetic_model_dir, "host", share_host_tables=True)
        on_device = memory_on_cuda(synthetic_model_dir, "device")
        for layer_id in first.layer_ids:
            assert first.table(layer_id).storage.host_buffer.shared_path is not None
            assert first.table(layer_id).storage.host_buffer.filled_here
            assert not second.table(layer_id).storage.host_buffer.filled_here
        spec = first.spec
        hash_ids = torch.stack([_ids(rng, 40, spec.num_columns, first.layout.num_embeddings[i])
                                for i in range(spec.num_layers)], dim=1)
        hidden = torch.randn(40, spec.hc_mult, spec.hidden_size, device="cuda",
                             generator=torch.Generator("cuda").manual_seed(int(rng.integers(2**31)))).bfloat16()
        assert_layers_equal(second, on_device, hidden, hash_ids)
    finally:
        for layer_id in first.layer_ids:
            remove_shared_buffer(first.table(layer_id).storage.share_key)


@pytest.mark.parametrize("chunk_bytes", [64, 64 * 7, 2**20])
def test_host_fill_copies_rows_into_packed_rows_and_names_a_nan(tmp_path, chunk_bytes, rng):
    """The host placement's fill (CPU part): rows of a checkpoint copied through the memory
    map into packed rows, chunks in parallel, bit for bit; a NaN byte named with its file row."""
    from safetensors.torch import load_file, save_file

    from engram.checkpoint import SafetensorsCheckpoint, copy_checked_rows
    from engram.tools.testing import write_synthetic_checkpoint

    synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word")
    checkpoint = SafetensorsCheckpoint(synthetic.directory)
    infos = [checkpoint.info(checkpoint.name(1, kind)) for kind in ("embed.weight", "embed.scale")]
    values_file = synthetic.directory / synthetic.weight_map[infos[0].name]
    values = load_file(values_file)[infos[0].name].view(torch.uint8)
    scales = load_file(synthetic.directory / synthetic.weight_map[infos[1].name])[infos[1].name].view(torch.uint8)
    row_start, row_end = 3, values.shape[0] - 2
    rows = PackedRows.view_of(torch.full(((row_end - row_start + 1) * packed_row_bytes(values.shape[1]),), 0xEE,
                                         dtype=torch.uint8), row_end - row_start, values.shape[1])
    copy_checked_rows(infos[0], rows.values, row_start, row_end, chunk_bytes, None, "e4m3")
    copy_checked_rows(infos[1], rows.scales, row_start, row_end, chunk_bytes, None, "ue8m0")
    assert torch.equal(rows.values, values[row_start:row_end]) and torch.equal(rows.scales, scales[row_start:row_end])
    assert int(rows.packed[-1, :-4].sum()) == 0 and int(rows.tags[-1]) == rows.num_rows

    bad = values.clone()
    bad[bad & 0x7F == 0x7F] = 0
    row, column = int(rng.integers(row_start, row_end)), int(rng.integers(0, values.shape[1]))
    bad[row, column] = 0xFF
    tensors = load_file(values_file)
    tensors[infos[0].name] = bad.view(torch.float8_e4m3fn)
    save_file(tensors, values_file)
    with pytest.raises(ValueError, match=rf"row {row} holds value byte 0xff \(E4M3 NaN\) at column {column}"):
        copy_checked_rows(checkpoint.info(infos[0].name), rows.values, row_start, row_end, chunk_bytes, None, "e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_lookup_between_a_prefetch_and_its_lookup_makes_it_stale(rng):
    """A lookup of other ids reuses the table's staging: the earlier prefetch is never served."""
    device, host = _device_and_host(20000, 256, int(rng.integers(2**31)))
    host.storage.direct_max_rows = 0
    first, other = _ids(rng, 2000, 24, 20000), _ids(rng, 2000, 24, 20000)
    handle = host.prefetch(first)
    assert torch.equal(host.lookup(other).view(torch.int16), device.lookup(other).view(torch.int16))
    assert torch.equal(host.lookup(first, prefetch=handle).view(torch.int16), device.lookup(first).view(torch.int16))
    assert host.prefetches == {"served": 0, "dropped": 1}
    # Refilled in place after its prefetch: not served either.
    handle = host.prefetch(first)
    first.copy_(other)
    assert torch.equal(host.lookup(first, prefetch=handle).view(torch.int16), device.lookup(other).view(torch.int16))
    assert host.prefetches == {"served": 0, "dropped": 2}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["set-lru", "dynamic"])
def test_gpu_decode_graph_with_the_cache_update_inside_equals_eager(policy, rng):
    """A decode step's lookup and ``update_cache`` captured in one graph, replayed with fresh ids: every
    replay's rows equal ``device``'s, and the cache holds what an eager twin's holds, step after step. Before
    an eager update of that size the capture is refused, naming the ids it needs."""
    values, scales = _table(3000, 256, int(rng.integers(2**31)))
    device = engram.EngramTable(values, scales, placement="device", device="cuda", validate=False)
    options = {"policy": policy, "aging_interval": 2}
    captured = engram.EngramTable(values, scales, placement="cached", device="cuda", validate=False,
                                  placement_options=options)
    eager = engram.EngramTable(values, scales, placement="cached", device="cuda", validate=False,
                               placement_options=options)
    static_ids = _ids(rng, 8, 24, 3000)
    captured.lookup(static_ids)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            with pytest.raises(RuntimeError, match="update buffers hold 0 ids and this step has 192"):
                captured.update_cache(static_ids)
    first = _ids(rng, 8, 24, 3000)
    for table in (captured, eager):
        table.lookup(first)
        table.update_cache(first)
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = captured.lookup(static_ids)
            captured.update_cache(static_ids)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(20):
        ids = _ids(rng, 8, 24, 3000) if step % 3 else _ids(rng, 8, 24, 60)  # some steps repeat hot rows
        static_ids.copy_(ids)
        graph.replay()
        expected = eager.lookup(ids)
        eager.update_cache(ids)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"step {step}"
        assert torch.equal(out.view(torch.int16), device.lookup(ids).view(torch.int16)), f"step {step}"
        assert torch.equal(captured.storage.cache.tags, eager.storage.cache.tags), f"step {step}"
        assert torch.equal(captured.storage.cache.counters, eager.storage.cache.counters), f"step {step}"
    assert int((captured.storage.cache.tags >= 0).sum()) > 0


def test_row_tags_written_tells_rows_whose_tags_a_whole_row_copy_erased(seed):
    """The host placement warns when its rows carry no tags (exact, but every staged row is read again):
    packed rows carry them; a copy of whole rows over them (as a benchmark's random fill did) erases them."""
    from engram.table.host_memory.rows import row_tags_written, write_row_tags

    values, scales = _table(300, 64, seed)
    rows = pack_rows(values, scales)
    assert row_tags_written(rows.packed)
    rows.packed[:-1] = torch.randint(0, 256, rows.packed[:-1].shape, dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed))
    assert not row_tags_written(rows.packed)
    write_row_tags(rows.packed)
    assert row_tags_written(rows.packed) and rows.tags.tolist() == list(range(301))
