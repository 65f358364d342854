"""The host gather's protocol between the GPU, Python and the native worker, declared once.

docs/design.md ("The host-gather protocol") describes it in prose. This module holds what the three
parties must agree on: the word offsets in a table's pinned flags, the limits, the job record the native
worker takes (:class:`JobRecord`, one ``ctypes.Structure``: ``native_gather.c`` declares the same fields
and refuses to build without the constants of :func:`compile_definitions`, which the build passes as
``-D`` flags) and the rule by which every word is compared (:func:`reached`, wrap-aware over 32 bits).
:func:`build_command` is the one command that builds the worker, at install time (``setup.py``, which
loads this file by its path: it imports no torch) and at first use (``native_worker``) alike.

Sequence rules: a table's gathers are numbered 1, 2, ... (:func:`word`: the low 32 bits). Gather ``n``'s
"ids ready" word is written ``n`` by the GPU after its ids; the worker starts it once the table's
"staging free" word has reached ``n - 1`` (the GPU writes ``n`` after gather ``n``'s copies ran), stores
``waves_base + k + 1`` in "waves done" after wave ``k`` (``waves_base``: the waves of the table's earlier
gathers) and ``n`` in "job done" once it no longer touches the job's buffers. A job the worker drops (it
stops first) gets its "waves done" and "job done" words all the same, so no stream waits forever.

Replayed jobs (a gather captured in a CUDA graph, values fixed at capture): each has its own words. Every
replay writes "ids ready" = :data:`POSTED` after its ids; the worker, or the watchdog once the replay has
waited past its bound (or at once after ``stop``), takes it by moving the word back to 0 and stores "waves
done" ``k + 1`` after wave ``k`` (the watchdog: all of them, the staging unwritten), then adds 1 to "job
done". The graph's copy stream waits for "waves done" >= ``k + 1`` before wave ``k``'s copy and writes it 0
after the last.
"""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

__all__ = ["FLAG_WORDS", "IDS_READY", "STAGING_FREE", "WAVES_DONE", "JOB_DONE", "MAX_WAVES", "MAX_THREADS",
           "TIMED_WAVES", "TIMELINE_WORDS", "CHUNK_ROWS", "PREFETCH_DISTANCE", "MAX_REPLAYED", "POSTED",
           "SHARED_CONSTANTS", "SOURCE", "JobRecord", "compile_definitions", "build_identity", "build_command", "source_digest", "reached", "word"]

# Word offsets in a table's flags (int32 [FLAG_WORDS], pinned): one 64-byte line per writer's word.
FLAG_WORDS = 64
IDS_READY = 0       # free for a caller's "ids ready" word (the host gather keeps one per id buffer instead)
STAGING_FREE = 16   # written by the GPU after the copies of the previous job of this staging
WAVES_DONE = 32     # stored by the worker after each wave
JOB_DONE = 48       # stored by the worker when it no longer touches the job's buffers

MAX_WAVES = 64      # waves of one job
MAX_THREADS = 256   # threads of one service
TIMED_WAVES = 16    # waves of the last job whose end the worker times
TIMELINE_WORDS = 6 + TIMED_WAVES  # the last job's timeline (native_worker.NativeGatherService.last_job)
# Rows a worker thread copies per chunk, and how far ahead it prefetches. H200 host, 196,608 rows of 272 B:
# 16 rows ahead 1.71 ms against 2.4 without (benchmarks/NOTES.md "The served decoder step").
CHUNK_ROWS = 128
PREFETCH_DISTANCE = 16
# Replayed jobs (captured gathers) one service holds: one per table and captured structure, never removed.
MAX_REPLAYED = 1024
# What native_gather.c takes from here (-DENGRAM_<name>), in the order engram_gather_protocol reports them.
SHARED_CONSTANTS = {"MAX_WAVES": MAX_WAVES, "MAX_THREADS": MAX_THREADS, "TIMED_WAVES": TIMED_WAVES,
                    "TIMELINE_WORDS": TIMELINE_WORDS, "CHUNK_ROWS": CHUNK_ROWS, "PREFETCH_DISTANCE": PREFETCH_DISTANCE,
                    "MAX_REPLAYED": MAX_REPLAYED}
# A replayed job's "ids ready" word: the graph writes POSTED after its ids; the worker or the watchdog moves it
# back to 0 (compare-and-swap) when it takes that replay.
POSTED = 1

SOURCE = Path(__file__).with_name("native_gather.c")


class JobRecord(ctypes.Structure):
    """One job, as ``engram_gather_submit`` takes it (``native_gather.c``'s ``JobRecord``): copy ``staging[i] =
    table[ids[i]]`` for ``i < ids[num_ids]`` (the count), waves ending at ``wave_ends[:num_waves]``, after
    ``*ids_ready`` has reached ``ids_ready_value`` and ``*staging_free`` ``staging_free_value``."""

    _fields_ = [
        ("table", ctypes.c_void_p),               # uint8 [table_rows, row_bytes], the last row the zero row
        ("table_rows", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("ids", ctypes.c_void_p),                 # int32 [num_ids + 1]: rows, then their count
        ("num_ids", ctypes.c_int64),
        ("staging", ctypes.c_void_p),             # uint8 [>= num_ids, row_bytes]
        ("ids_ready", ctypes.c_void_p),           # uint32 words, compared with reached()
        ("ids_ready_value", ctypes.c_uint32),
        ("staging_free", ctypes.c_void_p),
        ("staging_free_value", ctypes.c_uint32),
        ("waves_done", ctypes.c_void_p),
        ("waves_base", ctypes.c_uint32),
        ("num_waves", ctypes.c_int32),
        ("job_done", ctypes.c_void_p),
        ("job_done_value", ctypes.c_uint32),
        ("wave_ends", ctypes.c_int64 * MAX_WAVES),  # increasing, the last num_ids
    ]


def source_digest(source: str | Path = SOURCE) -> int:
    """60 bits of the SHA-256 of ``source``: a library built from another ``native_gather.c`` reports another."""
    return int(hashlib.sha256(Path(source).read_bytes()).hexdigest()[:15], 16)


def compile_definitions() -> list[str]:
    """The ``-D`` flags ``native_gather.c`` is built with: every constant it shares with this module, then
    its own digest (:func:`source_digest`)."""
    return [*(f"-DENGRAM_{name}={value}" for name, value in SHARED_CONSTANTS.items()),
            f"-DENGRAM_SOURCE_DIGEST={source_digest()}"]


def build_identity() -> list[int]:
    """What ``engram_gather_protocol`` of a library built by :func:`build_command` reports: the values of
    :data:`SHARED_CONSTANTS`, then the source's digest."""
    return [*SHARED_CONSTANTS.values(), source_digest()]


def build_command(compiler: str, target: str | Path) -> list[str]:
    """The command that compiles ``native_gather.c`` into the shared library ``target`` with ``compiler``:
    the install-time build's and the first-use build's, so the two cannot differ."""
    return [compiler, "-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", *compile_definitions(), str(SOURCE),
            "-o", str(target)]


def word(value: int) -> int:
    """``value`` as a flag word holds it: its low 32 bits (gather numbers grow past 2**32)."""
    return value & 0xFFFFFFFF


def reached(value: int, target: int) -> bool:
    """Whether a word holding ``value`` has reached ``target``, wrap-aware, as the worker (``reached`` in C)
    and the GPU (``cuStreamWaitValue32`` with ``CU_STREAM_WAIT_VALUE_GEQ``) compare."""
    return ((int(value) - target) & 0xFFFFFFFF) < 0x80000000
