"""The host gather's native worker (``native_gather.c``) on the CPU: the GPU's part (the ids, the
"ids ready" and "staging free" words) is played by the test writing the same pinned-memory words."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch

from engram.table.host_memory import gather as host_gather
from engram.table.host_memory import native_worker
from engram.table.host_memory.native_worker import FLAG_WORDS, IDS_READY, JOB_DONE, STAGING_FREE, WAVES_DONE

pytestmark = pytest.mark.skipif(native_worker.unavailable_reason() is not None,
                                reason=f"native worker unavailable: {native_worker.unavailable_reason()}")

ROW_BYTES = 272


def _table(rng: np.random.Generator, rows: int) -> torch.Tensor:
    table = torch.from_numpy(rng.integers(0, 256, (rows + 1, ROW_BYTES), dtype=np.uint8))
    table[-1] = 0  # the zero row
    return table


def _ids(values, count: int) -> torch.Tensor:
    ids = torch.full((len(values) + 1,), -7, dtype=torch.int32)
    ids[:len(values)] = torch.as_tensor(values, dtype=torch.int32)
    ids[-1] = count
    return ids


def _wait_word(flags: torch.Tensor, word: int, value: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not native_worker.flags_reached(flags, word, value):
        assert time.monotonic() < deadline, f"flags[{word}] = {int(flags[word])} never reached {value}"
        time.sleep(0.001)


def _expected(table: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
    rows = ids[:count].to(torch.int64)
    rows = torch.where((rows >= 0) & (rows < table.shape[0]), rows, torch.full_like(rows, table.shape[0] - 1))
    return table[rows]


@pytest.mark.parametrize("num_ids, count, waves", [(1, 1, 1), (63, 40, 1), (3000, 3000, 3), (4099, 1234, 4)])
def test_native_worker_copies_each_wave_as_index_select(rng, num_ids, count, waves):
    table = _table(rng, 5000)
    ids = _ids(np.sort(rng.choice(5000, num_ids, replace=False)), count)
    staging = torch.full((num_ids, ROW_BYTES), 0xA5, dtype=torch.uint8)  # poison
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    service = native_worker.NativeGatherService(3)
    try:
        service.submit(table=table, ids=ids, staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1, staging_free=0,
                       waves_base=10, num_waves=waves, job_done=1)
        time.sleep(0.02)
        assert int(flags[WAVES_DONE]) == 0 and int(flags[JOB_DONE]) == 0  # nothing before the ids are ready
        flags[IDS_READY] = 1
        _wait_word(flags, JOB_DONE, 1)
        assert int(flags[WAVES_DONE]) == 10 + waves
        assert torch.equal(staging[:count], _expected(table, ids, count))
        assert bool((staging[count:] == 0xA5).all())  # rows past the count are neither needed nor written
        assert service.pending == 0
    finally:
        service.stop()


def test_native_worker_reports_the_last_jobs_timeline(rng):
    table = _table(rng, 5000)
    ids = _ids(np.sort(rng.choice(5000, 3000, replace=False)), 3000)
    staging = torch.empty((3000, ROW_BYTES), dtype=torch.uint8)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    service = native_worker.NativeGatherService(2)
    try:
        assert service.last_job() is None  # no job finished yet
        service.submit(table=table, ids=ids, staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1,
                       staging_free=0, waves_base=0, num_waves=3, job_done=7)
        released = time.monotonic_ns()
        flags[IDS_READY] = 1
        _wait_word(flags, JOB_DONE, 7)
        timeline = service.last_job()
        assert timeline["job"] == 7 and len(timeline["wave_end_ns"]) == 3
        marks = [timeline["ids_ready_ns"], timeline["staging_free_ns"], *timeline["wave_end_ns"], timeline["done_ns"]]
        assert marks == sorted(marks) and released <= marks[0] <= marks[-1] <= time.monotonic_ns()
        assert timeline["chunks"] == 3 * 8  # 1000 rows a wave, chunks of 128
        assert 0 <= timeline["leader_chunks"] <= timeline["chunks"]
    finally:
        service.stop()
    assert service.last_job() is None  # stopped


@pytest.mark.parametrize("threads, waves, shape", [(1, 64, "even"), (4, 7, "even"), (4, 64, "even"),
                                                 (4, 8, "shrinking"), (3, 64, "shrinking")])
def test_native_worker_publishes_waves_in_order_without_a_barrier(rng, threads, waves, shape):
    # Many small waves over several threads: a later wave can finish first, yet "waves done" only ever
    # names waves whose rows are all in (checked at every store the poller sees); waves of any sizes.
    num_ids = 20000
    table = _table(rng, 50000)
    ids = _ids(np.sort(rng.choice(50000, num_ids, replace=False)), num_ids)
    staging = torch.full((num_ids, ROW_BYTES), 0xA5, dtype=torch.uint8)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    flags[WAVES_DONE] = 100  # the waves of earlier jobs
    expected = _expected(table, ids, num_ids)
    ends = (native_worker.even_wave_ends(num_ids, waves) if shape == "even"
            else host_gather.shrinking_wave_ends(num_ids, waves))
    bounds = [0, *ends]
    service = native_worker.NativeGatherService(threads)
    try:
        service.submit(table=table, ids=ids, staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1,
                       staging_free=0, waves_base=100, num_waves=waves, job_done=1,
                       wave_ends=None if shape == "even" else ends)
        flags[IDS_READY] = 1
        seen = 100
        deadline = time.monotonic() + 20
        while int(flags[JOB_DONE]) != 1:
            done = int(flags[WAVES_DONE])
            assert 100 <= done <= 100 + waves
            if done > seen:  # every row of the waves it names is in
                assert torch.equal(staging[:bounds[done - 100]], expected[:bounds[done - 100]])
                seen = done
            assert time.monotonic() < deadline
        assert int(flags[WAVES_DONE]) == 100 + waves and torch.equal(staging, expected)
        assert len(service.last_job()["wave_end_ns"]) == min(waves, 16)
    finally:
        service.stop()


@pytest.mark.parametrize("table_offset, staging_offset, row_bytes", [(0, 0, 272), (8, 0, 272), (0, 4, 272),
                                                                   (0, 0, 20), (0, 0, 80)])
def test_native_worker_copies_unaligned_and_odd_rows(rng, table_offset, staging_offset, row_bytes):
    # streaming 16-byte stores where table, staging and row size allow them, memcpy elsewhere
    rows, num_ids = 3000, 700
    raw = torch.from_numpy(rng.integers(0, 256, ((rows + 1) * row_bytes + 64,), dtype=np.uint8))
    table = raw[table_offset:table_offset + (rows + 1) * row_bytes].view(rows + 1, row_bytes)
    staging_raw = torch.full((num_ids * row_bytes + 64,), 0xA5, dtype=torch.uint8)
    staging = staging_raw[staging_offset:staging_offset + num_ids * row_bytes].view(num_ids, row_bytes)
    ids = _ids(rng.integers(0, rows + 1, num_ids), num_ids)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    service = native_worker.NativeGatherService(2)
    try:
        service.submit(table=table, ids=ids, staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1,
                       staging_free=0, waves_base=0, num_waves=3, job_done=1)
        flags[IDS_READY] = 1
        _wait_word(flags, JOB_DONE, 1)
        assert torch.equal(staging, _expected(table, ids, num_ids))
        assert bool((staging_raw[:staging_offset] == 0xA5).all())  # nothing written outside the staging
        assert bool((staging_raw[staging_offset + num_ids * row_bytes:] == 0xA5).all())
    finally:
        service.stop()


def test_native_worker_clamps_ids_and_count_into_its_buffers(rng):
    table = _table(rng, 100)
    values = [-1, 0, 99, 100, 2**31 - 1, -(2**31), 57]
    staging = torch.full((len(values), ROW_BYTES), 0xA5, dtype=torch.uint8)
    service = native_worker.NativeGatherService(2)
    try:
        for number, count in enumerate((len(values), 10**6, 0, -5), start=1):  # counts past N clamp to N, <= 0 to 1
            flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
            ids = _ids(values, count)
            service.submit(table=table, ids=ids, staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=number, staging_free=0,
                           waves_base=0, num_waves=2, job_done=number)
            flags[IDS_READY] = number
            _wait_word(flags, JOB_DONE, number)
            kept = min(max(count, 1), len(values))
            assert torch.equal(staging[:kept], _expected(table, ids, kept)), count
        zero = table.shape[0] - 1
        assert torch.equal(staging[0], table[zero]) and torch.equal(staging[3], table[zero])  # -1 and 100
    finally:
        service.stop()


def test_native_worker_waits_for_the_staging_and_runs_jobs_in_order(rng):
    """A job rewrites its staging only once the GPU said the previous copies ran; a job whose ids
    are ready waits behind an earlier one whose ids are not (the order the GPU inputs were enqueued)."""
    table = _table(rng, 300)
    service = native_worker.NativeGatherService(2)
    try:
        first_flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
        second_flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
        first = (_ids([1, 2, 3], 3), torch.zeros(3, ROW_BYTES, dtype=torch.uint8))
        second = (_ids([7, 8], 2), torch.zeros(2, ROW_BYTES, dtype=torch.uint8))
        service.submit(table=table, ids=first[0], staging=first[1], flags=first_flags, ready=first_flags[IDS_READY:], ids_ready=5,
                       staging_free=4, waves_base=0, num_waves=1, job_done=5)
        service.submit(table=table, ids=second[0], staging=second[1], flags=second_flags, ready=second_flags[IDS_READY:], ids_ready=1,
                       staging_free=0, waves_base=0, num_waves=1, job_done=1)
        second_flags[IDS_READY] = 1          # ready, but queued behind the first
        first_flags[IDS_READY] = 5           # ready, but its staging's previous copies have not run
        time.sleep(0.02)
        assert int(first_flags[JOB_DONE]) == 0 and int(second_flags[JOB_DONE]) == 0
        assert service.pending == 2          # both jobs' buffers still held
        first_flags[STAGING_FREE] = 4
        _wait_word(first_flags, JOB_DONE, 5)
        _wait_word(second_flags, JOB_DONE, 1)
        assert torch.equal(first[1], table[[1, 2, 3]]) and torch.equal(second[1], table[[7, 8]])
        assert service.pending == 0
    finally:
        service.stop()


def test_native_worker_keeps_a_dropped_jobs_buffers_until_it_is_done(rng):
    table = _table(rng, 50)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    service = native_worker.NativeGatherService(1)
    try:
        staging = torch.zeros(4, ROW_BYTES, dtype=torch.uint8)
        service.submit(table=table, ids=_ids([4, 5, 6, 7], 4), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1,
                       staging_free=0, waves_base=0, num_waves=1, job_done=1)
        address = staging.data_ptr()
        del staging                        # the owner lets go while the job is queued
        assert service.pending == 1        # the service holds the buffers
        assert service._retained[0][2][0].staging.data_ptr() == address
        flags[IDS_READY] = 1
        _wait_word(flags, JOB_DONE, 1)
        assert service.pending == 0        # released once the worker is done with them
    finally:
        service.stop()


def test_native_worker_hold_and_stop(rng):
    table = _table(rng, 50)
    service = native_worker.NativeGatherService(2)
    latch = torch.zeros(16, dtype=torch.int32)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    staging = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    service.hold_next(latch, timeout_ms=60_000)
    service.submit(table=table, ids=_ids([1, 2], 2), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1, staging_free=0,
                   waves_base=0, num_waves=1, job_done=1)
    flags[IDS_READY] = 1
    time.sleep(0.02)
    assert int(flags[JOB_DONE]) == 0       # held
    latch[0] = 1
    _wait_word(flags, JOB_DONE, 1)
    assert service.stats()["holds_released"] == 1 and service.stats()["holds_timed_out"] == 0
    service.hold_next(torch.zeros(16, dtype=torch.int32), timeout_ms=1)  # released by its timeout
    service.submit(table=table, ids=_ids([3, 4], 2), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=2, staging_free=0,
                   waves_base=1, num_waves=1, job_done=2)
    flags[IDS_READY] = 2
    _wait_word(flags, JOB_DONE, 2)
    assert service.stats()["holds_timed_out"] == 1
    # a job whose ids never come, and one queued behind it: stop returns, writes both jobs' words (no stream
    # waits on them forever; their staging is not written), and the service refuses more work
    staging[:] = 0xA5
    service.submit(table=table, ids=_ids([5], 1), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=3, staging_free=0,
                   waves_base=2, num_waves=1, job_done=3)
    service.submit(table=table, ids=_ids([6, 7], 2), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=4,
                   staging_free=0, waves_base=3, num_waves=2, job_done=4)
    time.sleep(0.02)
    assert int(flags[JOB_DONE]) == 2 and int(flags[WAVES_DONE]) == 2  # waiting for ids that never come
    service.stop()
    assert service.stopped and int(flags[JOB_DONE]) == 4 and int(flags[WAVES_DONE]) == 5
    assert bool((staging == 0xA5).all())
    with pytest.raises(RuntimeError, match="stopped"):
        service.submit(table=table, ids=_ids([5], 1), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=4, staging_free=0,
                       waves_base=3, num_waves=1, job_done=4)


def test_native_worker_wraps_its_words(rng):
    table = _table(rng, 20)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    flags[STAGING_FREE] = -1               # 0xFFFFFFFF: the previous job's number, just before the wrap
    flags[WAVES_DONE] = -1                 # the previous job's last wave
    flags[JOB_DONE] = -1                   # the previous job
    flags[IDS_READY] = -1                  # not yet this job's 0
    staging = torch.zeros(1, ROW_BYTES, dtype=torch.uint8)
    service = native_worker.NativeGatherService(1)
    try:
        service.submit(table=table, ids=_ids([9], 1), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=0, staging_free=2**32 - 1,
                       waves_base=2**32 - 1, num_waves=1, job_done=0)
        time.sleep(0.02)
        assert int(flags[JOB_DONE]) == -1      # 0xFFFFFFFF has not reached 0
        flags[IDS_READY] = 0
        _wait_word(flags, WAVES_DONE, 0)   # 0xFFFFFFFF + 1 wraps to 0
        _wait_word(flags, JOB_DONE, 0)
        assert torch.equal(staging[0], table[9])
    finally:
        service.stop()


def test_native_worker_refuses_malformed_jobs_by_name(rng):
    table = _table(rng, 20)
    service = native_worker.NativeGatherService(1)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    staging = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    good = dict(table=table, ids=_ids([1, 2], 2), staging=staging, flags=flags, ready=flags[IDS_READY:], ids_ready=1, staging_free=0,
                waves_base=0, num_waves=1, job_done=1)
    try:
        for field, bad, message in [("ids", torch.zeros(1, dtype=torch.int32), "ids: expected"),
                                    ("ids", torch.zeros(3, dtype=torch.int64), "ids: expected"),
                                    ("staging", torch.zeros(1, ROW_BYTES, dtype=torch.uint8), "staging: expected"),
                                    ("staging", torch.zeros(2, 16, dtype=torch.uint8), "staging: expected"),
                                    ("table", table.t(), "table: expected"),
                                    ("flags", torch.zeros(8, dtype=torch.int32), "flags: expected"),
                                    ("ready", torch.zeros(2, dtype=torch.int64), "ready: expected"),
                                    ("num_waves", 3, "num_waves: expected")]:
            with pytest.raises(ValueError, match=message):
                service.submit(**{**good, field: bad})
        for ends in ([1], [2, 2], [1, 3], [0, 2], [2, 1]):  # not increasing, or not ending at the 2 ids
            with pytest.raises(ValueError, match=r"wave_ends: expected \d+ increasing row counts ending at 2"):
                service.submit(**{**good, "num_waves": 2, "wave_ends": ends})
        assert service.pending == 0
        with pytest.raises(ValueError, match="threads: expected"):
            native_worker.NativeGatherService(0)
    finally:
        service.stop()


def test_gather_worker_choice_is_checked_and_falls_back_with_one_warning(monkeypatch):
    with pytest.raises(ValueError, match="host_gather_worker: expected one of"):
        host_gather.check_gather_options(None, "C", "auto")
    from engram.options import ServingOptions

    with pytest.raises(ValueError, match="host_gather_worker"):
        ServingOptions(host_gather_worker="fast")
    assert ServingOptions(host_gather_worker="python").placement_options("host")["host_gather_worker"] == "python"
    cpu = torch.device("cpu")  # no stream memory operations here: "auto" takes the Python worker
    monkeypatch.setattr(host_gather, "_WARNED", [])
    with pytest.warns(RuntimeWarning, match="native worker is unavailable"):
        assert host_gather._resolve_worker("auto", cpu) == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # once per process
        assert host_gather._resolve_worker("auto", cpu) == "python"
        assert host_gather._resolve_worker("python", cpu) == "python"
    with pytest.raises(RuntimeError, match="host_gather_worker='native'"):
        host_gather._resolve_worker("native", cpu)


def test_native_worker_without_a_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native_worker, "c_compiler", lambda: None)
    monkeypatch.setattr(native_worker, "BUILT_LIBRARY", tmp_path / "absent.so")  # no built library either
    native_worker._library.cache_clear()
    try:
        assert "no built library" in native_worker.unavailable_reason()
        assert "no C compiler" in native_worker.unavailable_reason()
        with pytest.raises(RuntimeError, match="no C compiler"):
            native_worker.NativeGatherService(1)
    finally:
        monkeypatch.undo()
        native_worker._library.cache_clear()
    assert native_worker.unavailable_reason() is None


def _submit_in_child(service, table, queue):
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    staging = torch.zeros(1, ROW_BYTES, dtype=torch.uint8)
    try:
        service.submit(table=table, ids=_ids([1], 1), staging=staging, flags=flags, ready=flags[IDS_READY:],
                       ids_ready=1, staging_free=0, waves_base=0, num_waves=1, job_done=1)
        queue.put("queued")
    except RuntimeError as error:
        fresh = native_worker.shared_service(1)  # the child's own service
        queue.put(f"{error} | own service: {fresh is not service}")


def test_native_worker_of_the_parent_refuses_a_forked_childs_jobs(rng):
    """Its threads do not exist in a forked child: a job queued there would never run (and a stream
    waiting on it would wait forever), so the child gets an error and makes its own service."""
    import multiprocessing

    table = _table(rng, 10)
    service = native_worker.NativeGatherService(1)
    try:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_submit_in_child, args=(service, table, queue))
        child.start()
        said = queue.get(timeout=60)
        child.join(timeout=60)
        assert "belongs to the parent process" in said and "own service: True" in said, said
    finally:
        service.stop()


def test_native_worker_itself_refuses_malformed_wave_ends(rng):
    """Wave ends that skip the checks above (the C entry point called directly) are refused there too: a wave
    past the ids or out of order would copy outside the staging or never publish."""
    import ctypes

    from engram.table.host_memory.gather_protocol import JobRecord

    lib, _ = native_worker._library()
    service = native_worker.NativeGatherService(1)
    table = _table(rng, 20)
    ids = _ids([1, 2, 3], 3)
    staging = torch.zeros(3, ROW_BYTES, dtype=torch.uint8)
    flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
    word = flags.data_ptr()  # every word of the job; its ids are never marked ready: dropped with the service
    try:
        for ends, accepted in (([3, 3], False), ([2, 1], False), ([1, 4], False), ([0, 3], False), ([1, 2], False),
                               ([1, 3], True)):
            record = JobRecord(table=table.data_ptr(), table_rows=table.shape[0], row_bytes=ROW_BYTES,
                               ids=ids.data_ptr(), num_ids=3, staging=staging.data_ptr(), ids_ready=word,
                               ids_ready_value=1, staging_free=word, staging_free_value=0, waves_done=word,
                               waves_base=0, num_waves=2, job_done=word, job_done_value=0)
            record.wave_ends[:2] = ends
            status = lib.engram_gather_submit(service._handle, ctypes.byref(record))
            assert (status == 0) == accepted, ends
    finally:
        service.stop()


@pytest.mark.parametrize("num_rows, num_waves", [(1, 1), (8, 8), (9, 8), (1000, 3), (196_608, 8), (20_000, 64)])
def test_shrinking_waves_cover_every_row_and_end_small(num_rows, num_waves):
    ends = host_gather.shrinking_wave_ends(num_rows, num_waves)
    sizes = np.diff([0, *ends])
    assert len(ends) == num_waves and ends[-1] == num_rows and (sizes >= 1).all()
    if num_rows >= 100 * num_waves:  # away from rounding: sizes fall by the ratio, the last share as designed
        assert (np.diff(sizes) <= 1).all()
        shrink = host_gather._WAVE_SHRINK
        share = (1 - shrink) * shrink ** (num_waves - 1) / (1 - shrink**num_waves)
        assert abs(sizes[-1] / num_rows - share) < 2 / num_rows * num_waves
    assert host_gather.shrinking_wave_ends(num_rows, num_waves, shrink=1) == native_worker.even_wave_ends(num_rows,
                                                                                                          num_waves)
    with pytest.raises(ValueError, match="shrink: expected a number in"):
        host_gather.shrinking_wave_ends(num_rows, num_waves, shrink=0)


def test_dedup_auto_never_reads_a_count_from_a_reused_id_buffer():
    """dedup "auto" measures the repeat share of a sorted gather from the count the GPU left in its id buffer.
    When that gather's job finishes between _sort_next's look and the buffer's reuse (played here by the
    job-done word changing between them), the buffer now holds the new gather's ids: the measurement is
    forgotten, never read from the overwritten buffer."""
    gather = host_gather.HostGather.__new__(host_gather.HostGather)
    flags = np.zeros(FLAG_WORDS, dtype=np.int32)
    buffers = [(torch.zeros(16, dtype=torch.int32), None, 0) for _ in range(host_gather._ID_BUFFERS)]
    gather.dedup, gather.repeat_share, gather._since_measured = "auto", None, 0
    gather._flags_view, gather._id_buffers = flags, buffers
    gather._id_buffer_jobs = [0] * host_gather._ID_BUFFERS
    gather._measuring = None
    slots = host_gather._ID_BUFFERS
    # gather 1 sorts (nothing measured yet) and is remembered for its count, in slot 1
    assert gather._sort_next(1)
    assert gather._reuse_id_buffer(1, True, 10) is buffers[1] and gather._measuring == (1, 1, 10)
    buffers[1][0][10] = 4  # the GPU's count: 4 distinct rows of 10
    flags[JOB_DONE] = 0    # gathers 2 .. slots: gather 1 not done when _sort_next looks
    for number in range(2, slots + 2):
        sort = gather._sort_next(number)
        if number == slots + 1:  # slot 1 again: gather 1 finished just now, and its buffer is reused
            flags[JOB_DONE] = 1
        gather._reuse_id_buffer(number, sort, 10)
        if number == slots + 1:
            buffers[1][0][10] = 10  # the new gather's ids and count overwrite it
    assert gather.repeat_share is None  # never measured from the overwritten buffer
    assert gather._measuring is None or gather._measuring[1] == slots + 1
    # the normal case: the measured job is done when _sort_next looks: its count is read
    gather._measuring, flags[JOB_DONE] = (2, 7, 10), 7
    buffers[2][0][10] = 4
    gather._sort_next(8)
    assert gather.repeat_share == pytest.approx(0.6)


def test_the_job_record_is_laid_out_as_the_c_side_declares_it():
    """gather_protocol.JobRecord against native_gather.c's JobRecord: its size and every field's offset."""
    import ctypes

    from engram.table.host_memory.gather_protocol import JobRecord

    layout = native_worker.record_layout()
    expected = [ctypes.sizeof(JobRecord)] + [getattr(JobRecord, name).offset for name, _ in JobRecord._fields_]
    assert layout == expected


def test_every_constant_the_c_side_shares_comes_from_the_protocol_module(tmp_path):
    """Every ENGRAM_* constant native_gather.c uses is one of compile_definitions(), and the source refuses
    to build without them."""
    import re
    import subprocess

    from engram.environment import c_compiler
    from engram.table.host_memory.gather_protocol import compile_definitions

    source = (native_worker._SOURCE).read_text()
    used = set(re.findall(r"\bENGRAM_[A-Z_]+\b", source))
    given = {flag[2:].split("=")[0] for flag in compile_definitions()}
    assert used and used == given
    for name in ("MAX_WAVES", "MAX_THREADS", "CHUNK_ROWS", "PREFETCH_DISTANCE", "TIMED_WAVES"):
        assert re.search(rf"#define {name} ENGRAM_{name}\b", source), name  # no number of its own
    compiler = c_compiler()
    command = [compiler, "-std=gnu11", "-fsyntax-only", "-pthread", str(native_worker._SOURCE)]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "compile_definitions" in refused.stderr
    accepted = subprocess.run(command[:-1] + compile_definitions() + command[-1:], capture_output=True, text=True,
                              timeout=60)
    assert accepted.returncode == 0, accepted.stderr
