"""Host-memory traffic of a node's other GPUs beside ``bench_step.py``'s steps: helper processes that
gather random rows from host memory in lockstep with each timed step.

One GPU of an 8-GPU node shares the host's memory bandwidth with seven others. Under data-parallel
attention and expert parallelism the ranks run their steps in lockstep, so their host gathers fall in the
same window at the start of each step. Each helper stands for one such neighbour: a spawned process,
pinned (``os.sched_setaffinity``) to cores the step's own host gather does not use, with a table of its own
in host memory (2 MiB pages where the OS gives them, far larger than the last-level cache, so a random
row costs what a row of the step's tables costs). When signalled it gathers one step's rows (``rows``
random rows of ``row_bytes``, ``torch.index_select`` on its cores) and reports its bytes and clock.

Protocol: one pipe per helper. The main process sends ``("gather", serial, rows)`` just before a step's
clock starts and collects ``("done", serial, bytes, start_ns, end_ns)`` after the step. Every wait has a
timeout; a helper that exits or fails is an error naming it; :meth:`HostNeighbors.close` (also run at
exit) stops every helper, and a helper whose parent is gone (its pipe closed) exits by itself.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import statistics
import time
from dataclasses import dataclass

MAX_HELPERS = 64
READY_S_PER_GIB = 30.0  # allowed fill time of a helper's table (2 MiB pages: ~0.2 s a GiB; 4 KiB pages: several s)


class NeighborError(RuntimeError):
    """A helper failed, exited, or did not answer in time."""


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def default_step_threads(helpers: int, cores: int) -> int:
    """Gather threads that leave one core per helper and one for the step's main thread (at least 1)."""
    return max(1, cores - 1 - helpers)


def plan_cores(helpers: int, step_threads: int, cores: list[int] | None = None) -> tuple[list[int], list[list[int]]]:
    """``(step cores, cores of each helper)``: the step keeps the first ``step_threads + 1`` usable cores (its
    host gather's threads and its main thread); the helpers get the rest, each its own share when there are
    at least as many cores as helpers, else all of them shared. ValueError (naming the flags) when no core
    is left for the helpers."""
    cores = usable_cores() if cores is None else sorted(cores)
    if helpers < 0 or helpers > MAX_HELPERS:
        raise ValueError(f"--host-neighbors {helpers}: expected an integer from 0 to {MAX_HELPERS}")
    keep = min(len(cores), step_threads + 1)
    step, free = cores[:keep], cores[keep:]
    if helpers == 0:
        return cores, []
    if not free:
        most = len(cores) - 2
        hint = (f"pass --gather-threads {most} or fewer" if most >= 1 else
                "this machine has too few cores for helpers beside the step")
        raise ValueError(f"--host-neighbors {helpers}: the helpers need cores the step does not use, but its "
                         f"{step_threads} gather threads and its main thread take all {len(cores)} usable cores; "
                         f"{hint}")
    if len(free) < helpers:
        return step, [list(free) for _ in range(helpers)]
    share, extra = divmod(len(free), helpers)
    sets, first = [], 0
    for index in range(helpers):
        count = share + (1 if index < extra else 0)
        sets.append(free[first:first + count])
        first += count
    return step, sets


def pin_process(cores: list[int]) -> dict[int, set[int]]:
    """Pin every thread of this process to ``cores`` (threads made later inherit it); returns each thread's
    previous cores, for :func:`unpin_process`."""
    before = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            continue
    return before


def unpin_process(before: dict[int, set[int]]) -> None:
    """Give each thread :func:`pin_process` pinned its cores back; threads made since get the main thread's."""
    main = before.get(os.getpid())
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        cores = before.get(tid, main)
        if cores:
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                continue


def _anon_huge_bytes() -> int | None:
    """AnonHugePages of this process (bytes), or None where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _helper_main(conn, index: int, cores: list[int], table_bytes: int, row_bytes: int, seed: int) -> None:
    """One helper: its table, then one gather per ``("gather", serial, rows)`` until ``("stop",)`` or the
    parent's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    try:
        import mmap

        import numpy as np
        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        started = time.perf_counter()
        rows = table_bytes // row_bytes
        memory = mmap.mmap(-1, rows * row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        table = torch.frombuffer(memory, dtype=torch.uint8).view(rows, row_bytes)
        table.fill_(0x3C)  # touched: untouched pages would all read the one zero page
        conn.send(("ready", {"pid": os.getpid(), "cores": cores, "rows": rows, "table_bytes": rows * row_bytes,
                             "huge_page_bytes": _anon_huge_bytes(), "fill_s": time.perf_counter() - started}))
        rng = np.random.default_rng(seed + 7919 * index)
        ids, out = None, None
        while True:
            if not conn.poll(1.0):
                continue
            message = conn.recv()  # EOFError once the parent is gone
            if message[0] == "stop":
                return
            _, serial, count = message
            if ids is None or ids.numel() != count:
                ids = torch.from_numpy(rng.integers(0, rows, count))
                out = torch.empty(count, row_bytes, dtype=torch.uint8)
            start = time.monotonic_ns()
            torch.index_select(table, 0, ids, out=out)
            end = time.monotonic_ns()
            conn.send(("done", serial, count * row_bytes, start, end))
            ids = torch.from_numpy(rng.integers(0, rows, count))  # the next step's, outside the window
    except (EOFError, BrokenPipeError):
        return
    except BaseException as error:  # noqa: BLE001 - said to the parent, then the helper ends
        try:
            conn.send(("error", f"{type(error).__name__}: {error}"))
        except OSError:
            pass
        raise SystemExit(1)


@dataclass
class StepRecord:
    """One signalled step: the main process's signal and each helper's bytes and clock (monotonic ns)."""

    signal_ns: int
    helpers: list[tuple[int, int, int]]  # (bytes, start_ns, end_ns)

    @property
    def bytes(self) -> int:
        return sum(b for b, _, _ in self.helpers)

    @property
    def window_s(self) -> float:
        """First helper's start to last helper's end."""
        return (max(e for _, _, e in self.helpers) - min(s for _, s, _ in self.helpers)) / 1e9

    @property
    def gbps(self) -> float:
        """All helpers' bytes over their common window: the rate the neighbours took from host memory."""
        return self.bytes / max(self.window_s, 1e-9) / 1e9


def summarize_records(records: list[StepRecord]) -> dict:
    """Medians over the steps: the helpers' rate together (GB/s) and each one's, their window, how long
    after the signal the first started and the last ended, bytes per step."""
    if not records:
        return {"steps": 0}
    per_helper = [b / max((e - s) / 1e9, 1e-9) / 1e9 for r in records for b, s, e in r.helpers]
    return {"steps": len(records), "bytes_per_step": statistics.median(r.bytes for r in records),
            "GBps": statistics.median(r.gbps for r in records),
            "GBps_min": min(r.gbps for r in records), "GBps_max": max(r.gbps for r in records),
            "per_helper_GBps": statistics.median(per_helper),
            "window_ms": statistics.median(r.window_s * 1e3 for r in records),
            "start_after_signal_us": statistics.median((min(s for _, s, _ in r.helpers) - r.signal_ns) / 1e3
                                                       for r in records),
            "end_after_signal_ms": statistics.median((max(e for _, _, e in r.helpers) - r.signal_ns) / 1e6
                                                     for r in records)}


class HostNeighbors:
    """``len(cores)`` helper processes (``cores[i]``: helper i's cores), each with a table of ``table_bytes``
    of rows of ``row_bytes``. :meth:`start`, then per step :meth:`signal` and :meth:`collect`; :meth:`close`
    always (it is also registered to run at exit)."""

    def __init__(self, cores: list[list[int]], table_bytes: int, row_bytes: int, *, seed: int = 0,
                 timeout_s: float = 60.0):
        if not cores or any(not c for c in cores):
            raise ValueError(f"cores: expected a non-empty list of cores per helper, found {cores!r}")
        if table_bytes < row_bytes or row_bytes < 1:
            raise ValueError(f"table_bytes {table_bytes} must hold at least one row of {row_bytes} bytes")
        self.cores, self.table_bytes, self.row_bytes = cores, int(table_bytes), int(row_bytes)
        self.seed, self.timeout_s = seed, float(timeout_s)
        self.processes: list = []
        self.conns: list = []
        self.facts: list[dict] = []
        self.records: list[StepRecord] = []
        self.broken: str | None = None
        self._serial = 0
        self._pending: int | None = None  # serial of a signal not collected yet
        self._signal_ns = 0
        self._closed = False

    @property
    def count(self) -> int:
        return len(self.cores)

    def start(self) -> list[dict]:
        """:meth:`spawn`, then :meth:`wait_ready`."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the helper processes (returns at once; they fill their tables meanwhile)."""
        context = multiprocessing.get_context("spawn")
        atexit.register(self.close)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the helpers: no GPU context in them, whatever they import
        try:
            for index, cores in enumerate(self.cores):
                parent, child = context.Pipe(duplex=True)
                process = context.Process(target=_helper_main, name=f"host-neighbor-{index}", daemon=True,
                                          args=(child, index, cores, self.table_bytes, self.row_bytes, self.seed))
                process.start()
                child.close()
                self.processes.append(process)
                self.conns.append(parent)
        finally:
            if visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible

    def wait_ready(self) -> list[dict]:
        """Wait (bounded) until each helper has filled its table; returns their facts."""
        limit = 60.0 + READY_S_PER_GIB * self.table_bytes / 2**30
        deadline = time.monotonic() + limit
        for index in range(self.count):
            message = self._receive(index, max(0.0, deadline - time.monotonic()), f"its table ({limit:.0f} s)")
            if message[0] != "ready":
                raise self._fail(index, f"expected 'ready', got {message!r}")
            self.facts.append(message[1])
        return self.facts

    def _fail(self, index: int, why: str) -> NeighborError:
        process = self.processes[index]
        process.join(timeout=1.0)
        code = process.exitcode
        state = "running" if code is None else f"exit code {code}"
        self.broken = f"host neighbour {index} (pid {process.pid}, {state}): {why}"
        return NeighborError(self.broken)

    def _receive(self, index: int, timeout_s: float, waiting_for: str):
        conn = self.conns[index]
        try:
            ready = conn.poll(timeout_s)
        except (EOFError, OSError) as error:
            raise self._fail(index, f"its pipe failed while waiting for {waiting_for}: {error}")
        if not ready:
            raise self._fail(index, f"sent nothing for {timeout_s:.1f} s while waiting for {waiting_for}")
        try:
            message = conn.recv()
        except (EOFError, OSError):
            raise self._fail(index, f"ended while waiting for {waiting_for}")
        if message[0] == "error":
            raise self._fail(index, message[1])
        return message

    def signal(self, rows: int) -> None:
        """Start one step's gather of ``rows`` rows in every helper (returns at once)."""
        if self.broken:
            raise NeighborError(self.broken)
        if self._pending is not None:
            self.collect()  # the last step's answers first: one gather in flight per helper
        self._serial += 1
        self._signal_ns = time.monotonic_ns()
        for index, conn in enumerate(self.conns):
            try:
                conn.send(("gather", self._serial, int(rows)))
            except OSError as error:
                raise self._fail(index, f"could not be signalled: {error}")
        self._pending = self._serial

    def collect(self) -> StepRecord | None:
        """Wait (bounded) for every helper's answer to the last :meth:`signal`; None when none is pending."""
        if self._pending is None:
            return None
        serial, self._pending = self._pending, None
        helpers = []
        for index in range(self.count):
            message = self._receive(index, self.timeout_s, f"step {serial}'s gather")
            if message[0] != "done" or message[1] != serial:
                raise self._fail(index, f"expected step {serial}'s answer, got {message!r}")
            helpers.append(tuple(message[2:5]))
        record = StepRecord(self._signal_ns, helpers)
        self.records.append(record)
        return record

    def take_records(self) -> list[StepRecord]:
        """The records since the last call (a phase's)."""
        records, self.records = self.records, []
        return records

    def close(self) -> None:
        """Stop every helper: asked to, then terminated, then killed, each wait bounded. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
        for conn in self.conns:
            conn.close()

    @property
    def alive(self) -> list[bool]:
        return [process.is_alive() for process in self.processes]

    def __enter__(self) -> "HostNeighbors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
