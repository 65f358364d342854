"""The prefetching C row gather (engram.table.native_gather): bit-exact against
``torch.index_select`` for any row size, thread count and prefetch distance; argument
errors name the field; without a C compiler it warns once and falls back to torch.

Needs a C compiler (``cc``/``gcc``); where there is none, the tests of the C path are
skipped (a failure in CI) and the fallback tests still run.
"""

from __future__ import annotations

import shutil
import threading
import warnings

import numpy as np
import pytest
import torch

from conftest import missing_dependency
from engram.table import native_build, native_gather
from engram.table.host_gather import gather_packed_rows_host


@pytest.fixture
def native(monkeypatch):
    """The C gather (skip where it cannot be built), with blocks of a few rows so that small
    tests run on the pool, several blocks per thread."""
    monkeypatch.setenv(native_gather.FORCE_TORCH_ENV, "native")  # opt-in (the default is torch)
    monkeypatch.setattr(native_gather, "_LOADED", [])
    available, detail = native_gather.native_gather_status()
    if not available:
        missing_dependency(f"the C row gather: {detail}")
    monkeypatch.setattr(native_gather, "BLOCK_ROWS", 4)
    return native_gather


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Forget the process's loaded library (restored after the test) and build into an
    empty cache directory; returns that directory."""
    monkeypatch.setattr(native_gather, "_LOADED", [])
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(native_gather.FORCE_TORCH_ENV, "native")
    return tmp_path


def _random_case(rng, num_rows: int, row_bytes: int, count: int, id_dtype=torch.int64):
    table = torch.from_numpy(rng.integers(0, 256, (num_rows, row_bytes), dtype="uint8"))
    ids = torch.from_numpy(rng.integers(0, num_rows, count)).to(id_dtype)
    out = torch.full((count, row_bytes), 0xAB, dtype=torch.uint8)  # poisoned
    return table, ids, out


@pytest.mark.parametrize("row_bytes", [272, 16, 48, 1, 17, 271])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_gather_equals_index_select(native, row_bytes, threads, id_dtype, rng):
    table, ids, out = _random_case(rng, int(rng.integers(1, 400)), row_bytes, int(rng.integers(1, 300)), id_dtype)
    for streaming in (False, True):
        out.fill_(0xAB)
        native.gather_rows_prefetch(table, ids, out, threads, streaming_stores=streaming)
        assert torch.equal(out, torch.index_select(table, 0, ids))


@pytest.mark.parametrize("distance", [0, 1, 7, 16, 10_000])
def test_every_prefetch_setting_gives_the_same_rows(native, distance, rng):
    table, ids, out = _random_case(rng, 97, 272, 123)
    for locality in (0, 1, 2, 3):
        out.fill_(0xAB)
        native.gather_rows_prefetch(table, ids, out, 2, prefetch_distance=distance, prefetch_locality=locality)
        assert torch.equal(out, table[ids])


def test_ids_at_both_ends_of_the_table(native, rng):
    table, _, _ = _random_case(rng, 50, 272, 0)
    ids = torch.tensor([0, 49, 49, 0, 49, 0, 0, 49, 1, 48], dtype=torch.int64)
    out = torch.empty(10, 272, dtype=torch.uint8)
    native.gather_rows_prefetch(table, ids, out, 3)
    assert torch.equal(out, table[ids])


def test_empty_and_single_row_gathers(native, rng):
    table, _, _ = _random_case(rng, 20, 272, 0)
    out = torch.empty(0, 272, dtype=torch.uint8)
    native.gather_rows_prefetch(table, torch.empty(0, dtype=torch.int64), out, 4)
    one = torch.empty(1, 272, dtype=torch.uint8)
    native.gather_rows_prefetch(table, torch.tensor([13]), one, 4)
    assert torch.equal(one[0], table[13])


def test_more_threads_than_rows(native, monkeypatch, rng):
    monkeypatch.setattr(native_gather, "BLOCK_ROWS", 1)
    table, ids, out = _random_case(rng, 30, 272, 3)
    native.gather_rows_prefetch(table, ids, out, 16)
    assert torch.equal(out, table[ids])


def test_started_gathers_finish_in_any_wait_order(native, rng):
    table, ids, out = _random_case(rng, 300, 272, 200)
    halves = [native.start_gather_rows(table, ids[:100], out[:100], 3),
              native.start_gather_rows(table, ids[100:], out[100:], 3)]
    halves[1].wait()
    halves[0].wait()
    assert torch.equal(out, table[ids])


@pytest.mark.parametrize("threads", [1, 3])
def test_waves_are_ready_in_order(native, threads, rng):
    table, ids, out = _random_case(rng, 300, 272, 203)
    wave_ends = [50, 50, np.int64(120), 203]  # an empty wave too; numpy integers count as integers
    gathered = native.start_gather_rows(table, ids, out, threads, wave_ends=wave_ends)
    assert gathered.num_waves == 4
    for wave, end in enumerate(wave_ends):
        gathered.wait(wave)
        assert torch.equal(out[:end], table[ids[:end]])
    gathered.wait()  # everything was waited for: returns at once
    with pytest.raises(ValueError, match=r"wave: expected 0 <= wave < 4, found 4"):
        gathered.wait(4)


def test_a_gather_on_the_waiting_thread_runs_wave_by_wave(native, rng):
    """threads = 1: nothing is copied before wait(), then only the waves waited for."""
    table, ids, out = _random_case(rng, 100, 48, 60)
    gathered = native.start_gather_rows(table, ids, out, 1, wave_ends=[20, 60])
    assert int((out != 0xAB).sum()) == 0
    gathered.wait(0)
    assert torch.equal(out[:20], table[ids[:20]]) and int((out[20:] != 0xAB).sum()) == 0
    gathered.wait(1)
    assert torch.equal(out, table[ids])


@pytest.mark.parametrize("wave_ends", [[], [10, 5, 40], [10, 39], [10, 41], [10.0, 40], [True, 40]])
def test_bad_wave_ends_are_named(wave_ends, rng):
    table, ids, out = _random_case(rng, 10, 16, 40)
    with pytest.raises(ValueError, match=r"wave_ends: expected ascending integers in \[0, 40\] ending at 40"):
        native_gather.start_gather_rows(table, ids, out, 2, wave_ends=wave_ends)


def test_repeated_pool_gathers_stay_exact(native, monkeypatch, rng):
    """Many small gathers on the pool (blocks of 7 rows, uneven waves): any race between
    the threads' copies and the wave counters would show as a wrong row."""
    monkeypatch.setattr(native_gather, "BLOCK_ROWS", 7)
    table, _, _ = _random_case(rng, 500, 272, 0)
    for _ in range(40):
        count = int(rng.integers(8, 400))
        ids = torch.from_numpy(rng.integers(0, 500, count))
        out = torch.full((count, 272), 0xAB, dtype=torch.uint8)
        ends = sorted({int(e) for e in rng.integers(0, count, 3)} | {count})
        gathered = native.start_gather_rows(table, ids, out, 3, wave_ends=ends)
        for wave, end in enumerate(ends):
            gathered.wait(wave)
            assert torch.equal(out[:end], table[ids[:end]])


@pytest.mark.parametrize("bad_id", [-1, 30, 2**40])
def test_an_id_outside_the_table_raises_naming_it(native, bad_id, rng):
    table, ids, out = _random_case(rng, 30, 272, 40)
    ids[25] = bad_id
    ids[33] = bad_id
    for threads in (1, 3):
        with pytest.raises(IndexError, match=rf"ids\[25\] = {bad_id} is outside the table's 30 rows"):
            native.gather_rows_prefetch(table, ids, out, threads)
        assert torch.equal(out[:24], table[ids[:24]])  # the rows before it were copied


def test_argument_errors_name_the_field():
    table = torch.zeros(10, 32, dtype=torch.uint8)
    ids = torch.zeros(4, dtype=torch.int64)
    out = torch.zeros(4, 32, dtype=torch.uint8)
    gather = native_gather.gather_rows_prefetch
    cases = [
        ((torch.zeros(10, 64, dtype=torch.uint8)[:, ::2], ids, out, 1), r"table: expected a contiguous tensor"),
        ((table, torch.zeros(8, dtype=torch.int64)[::2], out, 1), r"ids: expected a contiguous tensor"),
        ((table, ids, torch.zeros(32, 4, dtype=torch.uint8).t(), 1), r"out: expected a contiguous tensor"),
        ((table.view(torch.int16), ids, out, 1), r"table: expected uint8 \[rows, row_bytes\], found torch.int16"),
        ((table, ids.float(), out, 1), r"ids: expected int64 \(or int32\) \[N\], found torch.float32"),
        ((table, ids.view(2, 2), out, 1), r"ids: expected int64 \(or int32\) \[N\], found torch.int64 \[2, 2\]"),
        ((table, ids, torch.zeros(4, 16, dtype=torch.uint8), 1),
         r"out: expected uint8 \[4, 32\].*found torch.uint8 \[4, 16\]"),
        ((table, ids, out.view(torch.int8), 1), r"out: expected uint8 \[4, 32\].*found torch.int8"),
        ((table.to("meta"), ids, out, 1), r"table: expected a CPU tensor, found one on meta"),
        ((table, ids, out, 0), r"threads: expected an integer >= 1, found 0"),
        ((table, ids, out, 2.0), r"threads: expected an integer >= 1, found 2.0"),
        ((torch.zeros(10, 0, dtype=torch.uint8), ids, torch.zeros(4, 0, dtype=torch.uint8), 1), r"row_bytes 0"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            gather(*arguments)
    with pytest.raises(ValueError, match=r"prefetch_distance: expected an integer >= 0, found -1"):
        gather(table, ids, out, 1, prefetch_distance=-1)
    with pytest.raises(ValueError, match=r"prefetch_locality: expected 0, 1, 2 or 3, found 4"):
        gather(table, ids, out, 1, prefetch_locality=4)


def test_the_build_lands_in_the_cache_directory(fresh_build):
    if native_build.compiler_command() is None:
        missing_dependency("no C compiler (cc or gcc)")
    available, detail = native_gather.native_gather_status()
    assert available, detail
    assert [path.name for path in fresh_build.iterdir()] == [detail.rsplit("/", 1)[-1]]  # no temporary left
    assert detail.startswith(str(fresh_build)) and detail.endswith(".so")


def test_builds_at_once_each_load_a_complete_library(fresh_build):
    """Two builders into one empty cache directory (as two processes would): each renames a
    complete file into place and loads it; no temporary file stays."""
    if native_build.compiler_command() is None:
        missing_dependency("no C compiler (cc or gcc)")
    results = []
    builders = [threading.Thread(target=lambda: results.append(native_build.build_row_gather())) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert [reason for _, reason in results] == ["", ""]
    assert len({library.path for library, _ in results}) == 1
    assert [path.suffix for path in fresh_build.iterdir()] == [".so"]


def test_a_task_that_dies_raises_instead_of_hanging(native, monkeypatch, rng):
    def dies(*args):
        raise MemoryError("simulated")

    monkeypatch.setattr(native_gather, "_c_blocks", dies)
    monkeypatch.setattr(native_gather, "_CHECK_THREADS_NS", 1_000_000)
    table, ids, out = _random_case(rng, 50, 272, 100)
    with pytest.raises(MemoryError, match="simulated"):
        native.gather_rows_prefetch(table, ids, out, 3)


def test_a_forked_child_gets_its_own_pool(native, monkeypatch):
    monkeypatch.setattr(native_gather, "_POOL", [])
    parent = native_gather._pool(2)
    assert native_gather._pool(2) is parent
    monkeypatch.setattr(native_gather.os, "getpid", lambda: -1)
    assert native_gather._pool(2) is not parent


def _assert_falls_back_with_one_warning(reason_pattern: str, rng) -> None:
    table, ids, out = _random_case(rng, 40, 272, 2000)
    with pytest.warns(RuntimeWarning, match=rf"C gather is unavailable \({reason_pattern}.*index_select"):
        native_gather.gather_rows_prefetch(table, ids, out, 2)
    assert torch.equal(out, table[ids])
    available, detail = native_gather.native_gather_status()
    assert not available and detail
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call warns no more
        native_gather.gather_rows_prefetch(table, ids, out, 2)


def test_missing_compiler_falls_back_to_torch(fresh_build, monkeypatch, rng):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)
    _assert_falls_back_with_one_warning(r"no C compiler found", rng)


@pytest.mark.parametrize("compiler", ["/nonexistent/engram-cc", "false"])
def test_failing_compiler_falls_back_to_torch(fresh_build, monkeypatch, compiler, rng):
    if compiler == "false" and shutil.which("false") is None:
        pytest.skip("no `false` command")
    monkeypatch.setenv("CC", compiler)
    _assert_falls_back_with_one_warning(rf"building row_gather.c with {compiler} failed", rng)
    assert [path.name for path in fresh_build.iterdir() if path.suffix == ".tmp"] == []


def _assert_torch_path_runs_silently(rng):
    """The gather runs index_select with no warning, and the status names ENGRAM_HOST_GATHER=torch."""
    table, ids, out = _random_case(rng, 40, 48, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native_gather.gather_rows_prefetch(table, ids, out, 2)
    assert torch.equal(out, table[ids])
    assert native_gather.native_gather_status() == (False, f"{native_gather.FORCE_TORCH_ENV}=torch")


def test_forced_torch_path_is_silent(fresh_build, monkeypatch, rng):
    monkeypatch.setenv(native_gather.FORCE_TORCH_ENV, "torch")
    _assert_torch_path_runs_silently(rng)


def test_host_tables_gather_the_same_bytes_either_way(native, monkeypatch, rng):
    """gather_packed_rows_host (ids clamped to the zero row) through the C path and the fallback."""
    table, _, _ = _random_case(rng, 60, 272, 0)
    table[-1] = 0  # the zero row
    global_ids = torch.from_numpy(rng.integers(980, 1080, 500)).to(torch.int32)  # rows start at 1000
    through_c = torch.full((500, 272), 0xAB, dtype=torch.uint8)
    gather_packed_rows_host(table, global_ids, 1000, through_c)
    monkeypatch.setattr(native_gather, "_LOADED", [native_gather._Loaded(None, "test: torch path")])
    through_torch = torch.full((500, 272), 0xCD, dtype=torch.uint8)
    gather_packed_rows_host(table, global_ids, 1000, through_torch)
    assert torch.equal(through_c, through_torch)
    local = global_ids.long() - 1000
    inside = (local >= 0) & (local < 59)
    assert torch.equal(through_c[inside], table[local[inside]]) and int(through_c[~inside].sum()) == 0


def test_default_is_torch_and_a_bad_choice_is_named(fresh_build, monkeypatch, rng):
    """Without ENGRAM_HOST_GATHER the torch path runs (silently); an unknown value is refused by name."""
    monkeypatch.delenv(native_gather.FORCE_TORCH_ENV, raising=False)
    _assert_torch_path_runs_silently(rng)
    monkeypatch.setattr(native_gather, "_LOADED", [])
    monkeypatch.setenv(native_gather.FORCE_TORCH_ENV, "fast")
    with pytest.raises(ValueError, match="ENGRAM_HOST_GATHER: expected 'torch' or 'native', found 'fast'"):
        native_gather.native_gather_status()
