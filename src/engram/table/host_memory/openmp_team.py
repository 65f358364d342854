"""The OpenMP team size of the threads this library owns, set without touching the process's setting.

A torch CPU op's parallel loop runs on an OpenMP team as large as the calling thread's own
``nthreads-var`` (``omp_get_max_threads()``, what ``torch.get_num_threads()`` returns there).
``torch.set_num_threads`` sets that value and also a process-wide count that every thread torch
initializes later adopts; ``omp_set_num_threads``, called through the OpenMP runtime torch loaded,
changes the calling thread's value alone. :func:`use` does the latter, on library threads only
(:func:`run_owned` moves other callers' work onto one), so the engine's threads keep their count.

Where no OpenMP runtime is found, or setting it does not show in ``torch.get_num_threads()`` on
that thread (another parallel backend), :func:`available` is False and callers copy without torch.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from typing import Callable, TypeVar

import torch

__all__ = ["available", "use", "owned", "mark_owned", "run_owned"]

_RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")
_STATE: dict = {}                      # "runtime": ctypes.CDLL | None, once found
_STATE_LOCK = threading.Lock()
_LOCAL = threading.local()             # .owned: a library thread; .initialized: torch's first loop ran
_EXECUTOR: list[tuple[concurrent.futures.ThreadPoolExecutor, int]] = []  # (thread, process id)

Result = TypeVar("Result")


def _loaded_runtime_paths() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, torch's own directory first."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    found = [p for p in paths if any(os.path.basename(p).startswith(name) for name in _RUNTIME_NAMES)]
    torch_dir = os.path.dirname(torch.__file__)
    return sorted(found, key=lambda p: (not p.startswith(torch_dir), p))


def _runtime():
    with _STATE_LOCK:
        if "runtime" not in _STATE:
            _STATE["runtime"] = None
            if "OpenMP" in torch.__config__.parallel_info():
                for path in _loaded_runtime_paths():
                    try:
                        library = ctypes.CDLL(path)  # the mapped copy: dlopen returns its handle
                        library.omp_set_num_threads.argtypes = [ctypes.c_int]
                    except (OSError, AttributeError):
                        continue
                    _STATE["runtime"] = library
                    break
        return _STATE["runtime"]


def owned() -> bool:
    """Whether the calling thread is one of the library's own (its team size is the library's)."""
    return getattr(_LOCAL, "owned", False)


def mark_owned() -> None:
    """Mark the calling thread as the library's (a ``ThreadPoolExecutor`` initializer)."""
    _LOCAL.owned = True


def use(threads: int) -> bool:
    """Make the calling library thread's torch CPU ops run on ``threads`` OpenMP threads; True when
    ``torch.get_num_threads()`` there now says so. Refuses threads the library does not own."""
    if not owned():
        raise RuntimeError("openmp_team.use: the calling thread is not one of the library's own; "
                           "use run_owned to move the work onto one")
    library = _runtime()
    if library is None:
        return False
    if not getattr(_LOCAL, "initialized", False):
        # torch sets a thread's team size on that thread's first parallel loop (from its process-wide
        # count): run one now, so that it cannot overwrite the value set below later.
        torch.ones(1 << 17, dtype=torch.int32).add_(1)
        _LOCAL.initialized = True
    if torch.get_num_threads() != threads:
        library.omp_set_num_threads(threads)
    return torch.get_num_threads() == threads


def _owned_thread() -> concurrent.futures.ThreadPoolExecutor:
    with _STATE_LOCK:
        if not _EXECUTOR or _EXECUTOR[0][1] != os.getpid():  # a forked child makes its own
            _EXECUTOR[:] = [(concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="engram-row-copy", initializer=mark_owned), os.getpid())]
        return _EXECUTOR[0][0]


def run_owned(work: Callable[[], Result]) -> Result:
    """``work()`` on a library thread: this one if it is, else the library's copy thread (waited for)."""
    if owned():
        return work()
    return _owned_thread().submit(work).result()


def available() -> bool:
    """Whether :func:`use` can set a library thread's team size in this process (checked once, on
    the copy thread)."""
    if "available" not in _STATE:
        _STATE["available"] = run_owned(lambda: _probe(max(1, torch.get_num_threads())))
    return _STATE["available"]


def _probe(threads: int) -> bool:
    return use(1 if threads > 1 else 2) and use(threads)
