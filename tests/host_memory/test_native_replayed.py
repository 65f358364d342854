"""Replayed jobs of the native worker (gathers captured in a CUDA graph) on the CPU: the test plays the
graph's part, writing the ids, their count and the POSTED word, waiting for "waves done" and resetting it,
as the captured copy stream does (gather_protocol, "Replayed jobs")."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from engram.table.host_memory import native_worker
from engram.table.host_memory.native_worker import FLAG_WORDS, IDS_READY, JOB_DONE, POSTED, WAVES_DONE

pytestmark = pytest.mark.skipif(native_worker.unavailable_reason() is not None,
                                reason=f"native worker unavailable: {native_worker.unavailable_reason()}")

ROW_BYTES = 272


class Replay:
    """One replayed job's buffers and the graph's side of its protocol."""

    def __init__(self, service, table: torch.Tensor, num_ids: int, num_waves: int, bound_s: float = 30.0):
        self.table, self.num_ids, self.num_waves = table, num_ids, num_waves
        self.answered = 0
        self.ids = torch.zeros(num_ids + 1, dtype=torch.int32)
        self.staging = torch.full((num_ids, ROW_BYTES), 0xA5, dtype=torch.uint8)
        self.flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
        buffers = service.prepare(table=table, staging=self.staging, flags=self.flags)
        service.add_replayed(buffers, ids=self.ids, ready=self.flags[IDS_READY:], num_waves=num_waves,
                             bound_s=bound_s)

    def post(self, rows: np.ndarray, count: int | None = None) -> None:
        self.ids[:len(rows)] = torch.as_tensor(rows, dtype=torch.int32)
        self.ids[-1] = len(rows) if count is None else count
        self.flags[IDS_READY] = POSTED

    def wait(self, seconds: float = 20.0) -> float:
        """Wait as the copy stream does (every wave done), reset the word; returns the seconds waited."""
        start = time.monotonic()
        while int(self.flags[WAVES_DONE]) < self.num_waves:
            assert time.monotonic() - start < seconds, f"waves done {int(self.flags[WAVES_DONE])}, never answered"
            time.sleep(0.0005)
        self.flags[WAVES_DONE] = 0
        waited = time.monotonic() - start
        assert int(self.flags[IDS_READY]) == 0  # taken
        self.answered += 1
        while int(self.flags[JOB_DONE]) != self.answered:  # counted just after the last wave
            assert time.monotonic() - start < seconds, f"job done {int(self.flags[JOB_DONE])}, not {self.answered}"
            time.sleep(0.0005)
        return waited


def _table(rng, rows: int) -> torch.Tensor:
    table = torch.from_numpy(rng.integers(0, 256, (rows + 1, ROW_BYTES), dtype=np.uint8))
    table[-1] = 0
    return table


@pytest.mark.parametrize("num_ids, num_waves", [(1, 1), (63, 2), (3000, 5)])
def test_every_replay_copies_its_fresh_ids(rng, num_ids, num_waves):
    table = _table(rng, 5000)
    service = native_worker.NativeGatherService(3)
    try:
        replay = Replay(service, table, num_ids, num_waves)
        for step in range(1, 31):
            rows = rng.integers(0, 5000, num_ids)
            replay.post(rows)
            replay.wait()
            assert torch.equal(replay.staging, table[torch.as_tensor(rows)]), f"replay {step}"
            assert int(replay.flags[JOB_DONE]) == step
        assert service.replay_stats() == {"replayed_jobs": 1, "replays_copied": 30, "replays_released": 0}
    finally:
        service.stop()


def test_two_replayed_jobs_and_queued_jobs_share_the_worker(rng):
    table = _table(rng, 2000)
    service = native_worker.NativeGatherService(2)
    try:
        first, second = Replay(service, table, 100, 1), Replay(service, table, 700, 3)
        eager_flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
        eager_ids = torch.tensor([5, 6, 7, 3], dtype=torch.int32)
        eager_staging = torch.zeros(3, ROW_BYTES, dtype=torch.uint8)
        # a queued job whose ids come only later: replays posted meanwhile are still served
        service.submit(table=table, ids=eager_ids, staging=eager_staging, flags=eager_flags,
                       ready=eager_flags[IDS_READY:], ids_ready=1, staging_free=0, waves_base=0, num_waves=1,
                       job_done=1)
        for step in range(10):
            a, b = rng.integers(0, 2000, 100), rng.integers(0, 2000, 700)
            first.post(a)
            second.post(b)
            first.wait()
            second.wait()
            assert torch.equal(first.staging, table[torch.as_tensor(a)])
            assert torch.equal(second.staging, table[torch.as_tensor(b)])
        eager_flags[IDS_READY] = 1
        deadline = time.monotonic() + 20
        while int(eager_flags[JOB_DONE]) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert torch.equal(eager_staging, table[[5, 6, 7]])
    finally:
        service.stop()


def test_a_held_up_worker_leaves_the_replay_to_the_watchdog_within_its_bound(rng):
    table = _table(rng, 500)
    service = native_worker.NativeGatherService(2)
    try:
        replay = Replay(service, table, 64, 2, bound_s=0.05)
        first = rng.integers(0, 500, 64)
        replay.post(first)
        replay.wait()
        service.pause_replays(True)
        replay.post(rng.integers(0, 500, 64))
        waited = replay.wait()
        assert 0.04 <= waited < 10  # answered by the watchdog past its bound, not before
        # the staging holds the last copied replay's rows, whole: the consumer's id check reads the rest
        assert torch.equal(replay.staging, table[torch.as_tensor(first)])
        assert service.replay_stats()["replays_released"] == 1
        service.pause_replays(False)
        rows = rng.integers(0, 500, 64)
        replay.post(rows)
        replay.wait()
        assert torch.equal(replay.staging, table[torch.as_tensor(rows)])
        assert int(replay.flags[JOB_DONE]) == 3
    finally:
        service.stop()


def test_replays_after_stop_are_answered_at_once(rng):
    table = _table(rng, 500)
    service = native_worker.NativeGatherService(2)
    replay = Replay(service, table, 32, 1, bound_s=600)
    rows = rng.integers(0, 500, 32)
    replay.post(rows)
    replay.wait()
    # stop with a replay posted and never taken by the (paused) worker: the watchdog answers it and every later one
    service.pause_replays(True)
    replay.post(rng.integers(0, 500, 32))
    stopper = threading.Thread(target=service.stop)
    stopper.start()
    stopper.join(20)
    assert not stopper.is_alive()
    for _ in range(5):
        assert replay.wait(seconds=5) < 5
        replay.post(rng.integers(0, 500, 32))
    replay.wait(seconds=5)
    assert torch.equal(replay.staging, table[torch.as_tensor(rows)])
    stats = service.replay_stats()
    assert stats["replays_copied"] == 1 and stats["replays_released"] == 6
    with pytest.raises(RuntimeError, match="stopped"):
        Replay(service, table, 8, 1)


def test_malformed_replayed_jobs_are_refused_by_name(rng):
    table = _table(rng, 50)
    service = native_worker.NativeGatherService(1)
    try:
        flags = torch.zeros(FLAG_WORDS, dtype=torch.int32)
        staging = torch.zeros(8, ROW_BYTES, dtype=torch.uint8)
        buffers = service.prepare(table=table, staging=staging, flags=flags)
        ids = torch.zeros(9, dtype=torch.int32)
        with pytest.raises(ValueError, match="num_waves"):
            service.add_replayed(buffers, ids=ids, ready=flags[IDS_READY:], num_waves=9, bound_s=1)
        with pytest.raises(ValueError, match="bound_s"):
            service.add_replayed(buffers, ids=ids, ready=flags[IDS_READY:], num_waves=1, bound_s=0)
        with pytest.raises(ValueError, match="staging"):
            service.add_replayed(buffers, ids=torch.zeros(10, dtype=torch.int32), ready=flags[IDS_READY:],
                                 num_waves=1, bound_s=1)
        assert service.replay_stats()["replayed_jobs"] == 0
    finally:
        service.stop()


def test_ids_and_count_of_a_replay_are_clamped_into_its_buffers(rng):
    table = _table(rng, 50)
    service = native_worker.NativeGatherService(2)
    try:
        replay = Replay(service, table, 4, 1)
        replay.post(np.array([-3, 49, 50, 10**6]), count=99)  # count past the ids: all four, ids outside: zero row
        replay.wait()
        assert torch.equal(replay.staging, table[[50, 49, 50, 50]])
    finally:
        service.stop()
