"""The disk placement's prefetch worker: one thread that reads the rows of started prefetches.

A :class:`ReadJob` holds the ids of one prefetch on the host (``int64 [N]``: pinned and copied there on
the prefetch's stream when the ids are on a GPU, with the event ``ready`` recorded after the copy), and
its own staging ``uint8 [N, row_bytes]`` (pinned for a GPU). :class:`ReadWorker` waits for each job's
event (bounded), reads its rows through a :class:`~engram.table.disk.cached_reads.CachedRowReader` into
its staging and marks it done, with the error when the read failed. A job's staging belongs to that job:
a job that no lookup serves is read all the same and then freed, never handed to another job.

Every wait is bounded (``timeout_s``): a job not done in time is a ``TimeoutError`` naming the file.
:meth:`ReadWorker.close` stops the thread once the job it reads is done; the jobs still queued end with
an error saying the worker was closed.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from engram.table.disk.cached_reads import CachedRowReader

__all__ = ["ReadJob", "ReadWorker", "WorkerClosed", "wait_event"]

_POLL_S = 50e-6
_POLL_MAX_S = 2e-3


class WorkerClosed(RuntimeError):
    """A job the worker dropped because it was closed first."""


def wait_event(event, timeout_s: float, what: str) -> None:
    """Wait until the CUDA ``event`` completed, at most ``timeout_s`` (polling); TimeoutError naming ``what``."""
    if event is None or event.query():
        return
    deadline, pause = time.monotonic() + timeout_s, _POLL_S
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the GPU did not reach the ids' copy within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


@dataclass(eq=False)
class ReadJob:
    """One prefetch's read: ``host_ids int64 [N]`` (valid once ``ready`` completed; None: at once),
    ``staging uint8 [N, row_bytes]``; ``done`` is set when the staging holds the rows of ``host_ids``
    or ``error`` says why not."""

    host_ids: torch.Tensor
    ready: object
    staging: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    read_mask: np.ndarray | None = None
    """``bool [N]``: the positions whose rows the staging holds once done (None: all of them)."""

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()


class ReadWorker:
    """A daemon thread serving :class:`ReadJob` s in order through ``reads``; ``timeout_s`` bounds each wait.
    ``read(job)``, when given, reads a job instead of ``reads.read(job.host_ids, job.staging)`` (it may read
    part of the rows and say which in ``job.read_mask``)."""

    def __init__(self, reads: CachedRowReader, timeout_s: float = 120.0,
                 read: Callable[[ReadJob], None] | None = None):
        self.reads, self.timeout_s = reads, float(timeout_s)
        self._read = read if read is not None else (lambda job: reads.read(job.host_ids.numpy(), job.staging))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._lock = threading.Lock()   # submit against close
        self._thread = threading.Thread(target=self._run, name="engram-disk-prefetch", daemon=True)
        self._thread.start()

    @property
    def where(self) -> str:
        return str(self.reads.row_file.path)

    def submit(self, job: ReadJob) -> ReadJob:
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError(f"{self.where}: the disk prefetch worker is closed")
            self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closed.is_set():
                job.finish(WorkerClosed(f"{self.where}: the disk prefetch worker was closed before this read"))
                continue
            try:
                wait_event(job.ready, self.timeout_s, self.where)
                self._read(job)
            except BaseException as error:   # the lookup raises it
                job.finish(error)
            else:
                job.finish()

    def wait(self, job: ReadJob) -> torch.Tensor:
        """The staging of ``job`` once read (at most ``timeout_s``); the job's read error, WorkerClosed, or
        TimeoutError naming the file otherwise."""
        if not job.done.wait(self.timeout_s):
            raise TimeoutError(f"{self.where}: a prefetched read of {job.host_ids.numel()} rows did not finish "
                               f"within {self.timeout_s:g} s (read_timeout_s)")
        if job.error is not None:
            raise job.error
        return job.staging

    def close(self) -> None:
        """Stop the thread (after its current job) and end every job still queued with WorkerClosed."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s)
        while True:   # jobs queued after the sentinel
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.finish(WorkerClosed(f"{self.where}: the disk prefetch worker was closed before this read"))
