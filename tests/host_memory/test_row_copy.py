"""The host row copy (engram.table.host_memory.row_copy): bit-exact against ``torch.index_select`` for any
row size, id type and thread count; copies only in ``wait``, wave by wave, on the waiting
thread; an id outside the table raises naming it; argument errors name the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.table.host_memory import row_copy
from engram.table.host_memory.gather import gather_packed_rows_host

POISON = 0xAB


def _random_case(rng, num_rows: int, row_bytes: int, count: int, id_dtype=torch.int64):
    table = torch.from_numpy(rng.integers(0, 256, (num_rows, row_bytes), dtype="uint8"))
    ids = torch.from_numpy(rng.integers(0, num_rows, count)).to(id_dtype)
    out = torch.full((count, row_bytes), POISON, dtype=torch.uint8)
    return table, ids, out


def _untouched(rows: torch.Tensor) -> bool:
    return bool((rows == POISON).all())


@pytest.mark.parametrize("row_bytes", [272, 16, 48, 1, 17, 271])
@pytest.mark.parametrize("threads", [1, 3, 16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_gather_equals_index_select(row_bytes, threads, id_dtype, rng):
    table, ids, out = _random_case(rng, int(rng.integers(1, 400)), row_bytes, int(rng.integers(1, 3000)), id_dtype)
    row_copy.gather_rows(table, ids, out, threads)
    assert torch.equal(out, torch.index_select(table, 0, ids))


def test_ids_at_both_ends_of_the_table(rng):
    table, _, _ = _random_case(rng, 50, 272, 0)
    ids = torch.tensor([0, 49, 49, 0, 49, 0, 0, 49, 1, 48], dtype=torch.int64)
    out = torch.empty(10, 272, dtype=torch.uint8)
    row_copy.gather_rows(table, ids, out, 3)
    assert torch.equal(out, table[ids])


def test_zero_ids_and_one_id(rng):
    table, _, _ = _random_case(rng, 20, 272, 0)
    empty = torch.empty(0, 272, dtype=torch.uint8)
    row_copy.gather_rows(table, torch.empty(0, dtype=torch.int64), empty, 4)
    gathered = row_copy.start_gather_rows(table, torch.empty(0, dtype=torch.int32), empty, 2, wave_ends=[0])
    gathered.wait(0)
    row = int(rng.integers(0, 20))
    one = torch.full((1, 272), POISON, dtype=torch.uint8)
    row_copy.gather_rows(table, torch.tensor([row]), one, 4)
    assert torch.equal(one[0], table[row])


def test_nothing_is_copied_before_wait_then_only_the_waves_waited_for(rng):
    table, ids, out = _random_case(rng, 100, 48, 60)
    gathered = row_copy.start_gather_rows(table, ids, out, 4, wave_ends=[20, 60])
    assert _untouched(out)
    gathered.wait(0)
    assert torch.equal(out[:20], table[ids[:20]]) and _untouched(out[20:])
    gathered.wait(1)
    assert torch.equal(out, table[ids])


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 0, 1, 2], [1, 3, 0, 2], [2, 2, 0, 3]])
def test_waves_are_ready_in_any_order_of_waiting(order, rng):
    """``wait(k)`` leaves waves 0..k in ``out`` whatever was waited for before; an empty wave and
    numpy integers are fine."""
    table, ids, out = _random_case(rng, 300, 272, 203)
    wave_ends = [50, 50, np.int64(120), 203]
    gathered = row_copy.start_gather_rows(table, ids, out, 3, wave_ends=wave_ends)
    assert gathered.num_waves == 4
    ready = 0
    for wave in order:
        gathered.wait(wave)
        ready = max(ready, int(wave_ends[wave]))
        assert torch.equal(out[:ready], table[ids[:ready]]) and _untouched(out[ready:])
    gathered.wait()  # everything was waited for: returns at once
    assert torch.equal(out, table[ids])
    with pytest.raises(ValueError, match=r"wave: expected 0 <= wave < 4, found 4"):
        gathered.wait(4)
    with pytest.raises(ValueError, match=r"wave: expected 0 <= wave < 4, found -1"):
        gathered.wait(-1)


def test_started_gathers_finish_in_any_wait_order(rng):
    table, ids, out = _random_case(rng, 300, 272, 200)
    halves = [row_copy.start_gather_rows(table, ids[:100], out[:100], 3),
              row_copy.start_gather_rows(table, ids[100:], out[100:], 3)]
    halves[1].wait()
    assert _untouched(out[:100])
    halves[0].wait()
    assert torch.equal(out, table[ids])


def test_repeated_gathers_in_uneven_waves_stay_exact(rng):
    table, _, _ = _random_case(rng, 500, 272, 0)
    for _ in range(40):
        count = int(rng.integers(1, 400))
        ids = torch.from_numpy(rng.integers(0, 500, count))
        out = torch.full((count, 272), POISON, dtype=torch.uint8)
        ends = sorted({int(e) for e in rng.integers(0, count, 3)} | {count})
        gathered = row_copy.start_gather_rows(table, ids, out, 3, wave_ends=ends)
        for wave, end in enumerate(ends):
            gathered.wait(wave)
            assert torch.equal(out[:end], table[ids[:end]])


@pytest.mark.parametrize("bad_id", [-1, 30, 2**40])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_an_id_outside_the_table_raises_in_wait_naming_it(bad_id, id_dtype, rng):
    """The wave holding the id raises, naming it, before any of its rows is copied (numpy would wrap a
    negative id); the waves before it are copied, the ones after it never written, also after
    ``join``; a later wait raises again."""
    if id_dtype == torch.int32 and bad_id == 2**40:
        bad_id = 2**31 - 1
    table, ids, out = _random_case(rng, 30, 272, 40, id_dtype)
    ids[25] = bad_id
    ids[33] = bad_id
    gathered = row_copy.start_gather_rows(table, ids, out, 3, wave_ends=[20, 30, 40])
    message = rf"ids\[25\] = {bad_id} is outside the table's 30 rows"
    with pytest.raises(IndexError, match=message):
        gathered.wait()
    gathered.join()
    assert torch.equal(out[:20], table[ids[:20]]) and _untouched(out[20:])
    with pytest.raises(IndexError, match=message):
        gathered.wait(1)
    with pytest.raises(IndexError, match=message):
        row_copy.gather_rows(table, ids, out, 1)


def test_argument_errors_name_the_argument():
    table = torch.zeros(10, 32, dtype=torch.uint8)
    ids = torch.zeros(4, dtype=torch.int64)
    out = torch.full((4, 32), POISON, dtype=torch.uint8)
    cases = [
        ((torch.zeros(10, 64, dtype=torch.uint8)[:, ::2], ids, out, 1), r"table: expected a contiguous tensor"),
        ((table, torch.zeros(8, dtype=torch.int64)[::2], out, 1), r"ids: expected a contiguous tensor"),
        ((table, ids, torch.zeros(32, 4, dtype=torch.uint8).t(), 1), r"out: expected a contiguous tensor"),
        ((table.view(torch.int16), ids, out, 1), r"table: expected uint8 \[rows, row_bytes\], found torch.int16"),
        ((table.view(-1), ids, out, 1), r"table: expected uint8 \[rows, row_bytes\], found torch.uint8 \[320\]"),
        ((table, ids.float(), out, 1), r"ids: expected int64 \(or int32\) \[N\], found torch.float32"),
        ((table, ids.view(2, 2), out, 1), r"ids: expected int64 \(or int32\) \[N\], found torch.int64 \[2, 2\]"),
        ((table, ids, torch.zeros(4, 16, dtype=torch.uint8), 1),
         r"out: expected uint8 \[4, 32\].*found torch.uint8 \[4, 16\]"),
        ((table, ids, out.view(torch.int8), 1), r"out: expected uint8 \[4, 32\].*found torch.int8"),
        ((table.to("meta"), ids, out, 1), r"table: expected a CPU tensor, found one on meta"),
        ((table, ids.to("meta"), out, 1), r"ids: expected a CPU tensor, found one on meta"),
        ((table, ids, out, 0), r"threads: expected an integer >= 1, found 0"),
        ((table, ids, out, 2.0), r"threads: expected an integer >= 1, found 2.0"),
        ((table, ids, out, True), r"threads: expected an integer >= 1, found True"),
        ((torch.zeros(10, 0, dtype=torch.uint8), ids, torch.zeros(4, 0, dtype=torch.uint8), 1), r"row_bytes 0"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            row_copy.gather_rows(*arguments)
        with pytest.raises(ValueError, match=message):
            row_copy.start_gather_rows(*arguments)
    assert _untouched(out)


@pytest.mark.parametrize("wave_ends", [[], [10, 5, 40], [10, 39], [10, 41], [10.0, 40], [True, 40], [-1, 40]])
def test_bad_wave_ends_are_named(wave_ends, rng):
    table, ids, out = _random_case(rng, 10, 16, 40)
    with pytest.raises(ValueError, match=r"wave_ends: expected ascending integers in \[0, 40\] ending at 40"):
        row_copy.start_gather_rows(table, ids, out, 2, wave_ends=wave_ends)
    assert _untouched(out)


@pytest.mark.parametrize("contiguous_out", [True, False])
def test_host_tables_gather_their_rows_and_the_zero_row_outside(contiguous_out, rng):
    """gather_packed_rows_host: ids outside the table's rows read the zero row (``packed[-1]``),
    through the row copy (contiguous ``out``) and index_select alike."""
    table, _, _ = _random_case(rng, 60, 272, 0)
    table[-1] = 0
    global_ids = torch.from_numpy(rng.integers(980, 1080, 500)).to(torch.int32)  # rows start at 1000
    out = torch.full((500, 272), POISON, dtype=torch.uint8)
    if not contiguous_out:
        out = torch.full((272, 500), POISON, dtype=torch.uint8).t()
    gather_packed_rows_host(table, global_ids, 1000, out, threads=2)
    local = global_ids.long() - 1000
    inside = (local >= 0) & (local < 59)
    assert bool(inside.any()) and bool((~inside).any())
    assert torch.equal(out[inside], table[local[inside]]) and int(out[~inside].sum()) == 0


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_large_wave_without_openmp_is_copied_by_exactly_threads_threads(threads, rng, monkeypatch):
    """Without an OpenMP runtime to set per thread, each wave is split into ``threads`` parts,
    copied by the waiting thread and at most ``threads - 1`` pool threads; torch's thread count is
    not changed."""
    import threading

    monkeypatch.setattr(row_copy.openmp_team, "available", lambda: False)
    rows = 4 * row_copy.MIN_ROWS_PER_THREAD * threads
    table, ids, out = _random_case(rng, 5000, 48, rows, torch.int64)
    copiers, parts, copy_part = set(), [], row_copy.RowGather._copy_part

    def recording(self, begin, end):
        copiers.add(threading.current_thread().name)
        parts.append((begin, end))
        copy_part(self, begin, end)

    monkeypatch.setattr(row_copy.RowGather, "_copy_part", recording)
    before = torch.get_num_threads()
    row_copy.start_gather_rows(table, ids, out, threads, wave_ends=[rows // 2, rows]).wait()
    assert torch.equal(out, torch.index_select(table, 0, ids))
    assert len(parts) == 2 * threads and sorted(parts)[0][0] == 0 and sorted(parts)[-1][1] == rows
    assert len(copiers) <= threads and threading.current_thread().name in copiers
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [1, 3])
def test_a_wave_is_copied_on_a_library_thread_with_threads_openmp_threads(threads, rng, monkeypatch):
    """With torch's OpenMP runtime, each wave is one index_select on a library thread whose own
    team is ``threads`` large; the caller's count, and that of a thread started afterwards, stay."""
    import threading

    from engram.table.host_memory import openmp_team

    if not openmp_team.available():
        pytest.skip("torch's parallel backend here is not a per-thread OpenMP runtime")
    table, ids, out = _random_case(rng, 5000, 48, 3000, torch.int32)
    seen, copy_in_team = [], row_copy.RowGather._copy_in_team

    def recording(self, begin, end):
        copy_in_team(self, begin, end)
        seen.append((threading.current_thread().name, torch.get_num_threads()))

    monkeypatch.setattr(row_copy.RowGather, "_copy_in_team", recording)
    before = torch.get_num_threads()
    row_copy.start_gather_rows(table, ids, out, threads, wave_ends=[1000, 3000]).wait()
    assert torch.equal(out, torch.index_select(table, 0, ids))
    assert [count for _, count in seen] == [threads, threads]
    assert all(name.startswith("engram-row-copy") for name, _ in seen)
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == before and later == [before]


def test_team_size_is_set_only_on_library_threads():
    from engram.table.host_memory import openmp_team

    with pytest.raises(RuntimeError, match="not one of the library's own"):
        openmp_team.use(1)
