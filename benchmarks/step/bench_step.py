"""Decoder-step benchmark: what Engram adds to a whole served decoder step, on one GPU, in one call.

The step: a stand-in for the 40 decoder layers of DeepSeek-V4.1-Flash as one GPU runs them under
8-way data-parallel attention and expert parallelism (``step_decoder.py``: FP8 GEMMs of the
attention projections, the shared expert and 48 local routed experts; no attention core, no
all-to-all, so Engram's shares here are upper bounds), with Engram at layers 1 and 14 through the
public API (``step_engram.py``): ``memory.hasher(...)`` once per step on the step's token ids, then
``memory.forward_layer`` before decoder layers 1 and 14.

Steps: decode, T in {1, 64, 256}, as CUDA-graph replays of the whole step (hasher and forward_layer
included); prefill / mixed, T in {4096, 8192}, eager (chunks of 2048 tokens).

Variants per T: ``none`` (no Engram); ``device`` (HBM tables); ``host`` and ``cached``, each inline,
prefetched (``memory.prefetch(hash_ids)`` right after hashing; a returned handle goes to
``forward_layer(..., prefetch=handle)``) and with kv ahead (``memory.prefetch(hash_ids,
kv_ahead=True)``, where this version has it); ``host_prefetch_late`` (the prefetch called once the
decoder layers before the first Engram layer are enqueued, so its host time overlaps them); ``seed``
(the seed's design: placement ``host`` with
every row read over PCIe by the gather kernel, on the main stream). Placement ``cached`` calls
``memory.update_cache`` once the step's last Engram layer is enqueued, inside the timed step (an engine pays
it per step): eager steps run it beside the decoder layers after that layer and end once it is done, graphs
capture it.

Real text beside uniform ids: ``host_prefetch_realtext`` and ``cached_prefetch_realtext`` (tables of their
own over the same rows) read held-out English prose in order (``real_text.py stream``'s tokens, carried in
``.bench-data``; ``--text-stream``), each variant from the same point, so the two steps of a round read the
same text: at prefill steps of T consecutive tokens, at decode T requests each at its own cursor. Each phase
empties the real-text caches and warms them on the stream's first 294,912 tokens (36 steps of 8192) and,
at decode, on each request's prompt, then counts hits and host rows over the timed steps. With
``--host-neighbors N``, ``..._realtext_neighbors`` are the same two with N helper processes
(``host_neighbors.py``, pinned to cores the step's gather does not use; the step keeps its first
``--gather-threads`` + 1 cores) gathering one neighbour GPU's rows each (T x columns x Engram layers random
rows) from host memory in lockstep with each of their steps: a node's other GPUs sharing host memory.
``cached`` against ``host`` is paired per round (``pairs``: median, its 95% interval, quartiles, min-max of
the per-round %).

Disk (with ``--disk-directory DIR``): ``disk_prefetch_realtext_ram10`` / ``_ram30`` (placement ``"disk"``: rows
in a row file in DIR, one per Engram layer, under a RAM cache of 10% / 30% of the rows (``--disk-ram-fractions``)
and an HBM cache of ``cached_realtext``'s slots; prefetched; ``--disk-read-threads``) on the same text, eager
at every T (the placement refuses capture), beside ``device_eager`` (``device`` never captured: their control at
decode; at prefill every step is eager and ``device`` is). Paired per round against ``device_eager`` (decode),
``device`` (prefill) and ``host_prefetch_realtext``. Each phase builds their tables afresh (caches empty) and
warms them with ``--disk-warm-steps`` lookups of the text before the steps (prefill: that many steps of T just
before the first; decode: 8192 tokens a lookup, the ends of the requests' prompts), then counts over the timed
steps each tier's hits (HBM, RAM of the HBM misses) and the rows read from disk (the RAM misses), both layers
(``disk_tiers``). They step in the first ``--disk-steps`` rounds only (the budget cuts them to 5 at fewest,
within half of the time left at their phase). The row files hold the step's rows (``common.host_table``, named by its
arguments; without CUDA the placement ``"cpu"`` rows, hashed) and must be there off the smoke: write them
first with ``--write-disk-tables`` (only that; about 4 minutes a 20 GiB table; an interrupted write continues).

Measuring: before a prefill phase one prefetched pass of the Engram layers per host placement grows
the host gathers' buffers (an engine's warm-up batch), then each variant's warm-up steps (on the same
token ids: every variant's output is compared with ``device``'s), then the variants interleaved
(rounds of one step each, in an order drawn afresh per round from the seed, so that no variant always
follows the same one), each step timed with CUDA events, fresh random token ids per step from a seeded
generator; medians and spreads (IQR, min-max), and each variant against ``none`` and ``device`` paired
per round with a 95% interval of that median (the headline figures use these), and for
eager steps the time Engram's calls hold the main stream (``engram_stream_ms``: CUDA events around the
hashing + prefetch and around each Engram layer, waits for prefetched rows included). A watchdog
writes the report and ends the run when a warm-up or step stalls (``--stall-s``). In the same run: one decoder layer alone, the floor (the two Engram layers'
wkv + gate with their rows already on the device), one Engram layer alone (``device``, graph), the
copy engine's rate, the host's random-row gather ceiling (``host_gather_ceiling.c``) and the host
path's own end-to-end rate at T = 8192; with ``--trace``, one more step of a few variants at the largest
prefill T under ``torch.profiler`` (``step_trace.py``: how long the main stream was busy and idle in
it). Writes ``results/step-h200.json`` (and a copy to ``$OUT``)
after every phase, so a cut-off run keeps what finished.

    PYTHONPATH=src python benchmarks/step/bench_step.py             # GPU
    PYTHONPATH=src python benchmarks/step/bench_step.py --smoke     # tiny shapes; on the CPU without CUDA
    PYTHONPATH=src python benchmarks/step/bench_step.py --table-gib 20 --disk-directory DIR --write-disk-tables
"""

from __future__ import annotations

import argparse
import datetime
import os
import json
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]
sys.path.insert(0, str(BENCHMARKS / "host"))  # host_neighbors

import step_decoder  # noqa: E402
import step_engram  # noqa: E402
import step_trace  # noqa: E402
import common  # noqa: E402
import host_neighbors  # noqa: E402
from real_text import STREAM_PATH  # noqa: E402
from step_figures import (DISK_VARIANTS, cache_figures, disk_figures, headline, pair_figures, paired_pct,  # noqa: E402
                          paired_pct_interval, spread, _pct)

DECODE_TOKENS, PREFILL_TOKENS = (1, 64, 256), (4096, 8192)
# Run order: decode and T = 4096 first (every host read there takes the direct path), then T = 8192, the one
# phase whose host variants run the host gather: a stall there (see Watchdog) loses nothing before it.
PRIORITY = (("decode", 64), ("decode", 1), ("decode", 256), ("prefill", 4096), ("prefill", 8192))
VARIANTS = (("none", None, None), ("device", "device", "inline"),
            ("host_inline", "host", "inline"), ("host_prefetch", "host", "prefetch"),
            ("host_prefetch_late", "host", "prefetch_late"), ("host_kv_ahead", "host", "kv_ahead"),
            ("cached_inline", "cached", "inline"), ("cached_prefetch", "cached", "prefetch"),
            ("cached_kv_ahead", "cached", "kv_ahead"), ("seed", "seed", "inline"),
            ("host_prefetch_realtext", "host_realtext", "prefetch"),
            ("cached_prefetch_realtext", "cached_realtext", "prefetch"),
            ("host_prefetch_realtext_neighbors", "host_realtext", "prefetch"),
            ("cached_prefetch_realtext_neighbors", "cached_realtext_neighbors", "prefetch"),
            ("device_eager", "device", "inline"),  # "device" never captured: the disk steps' control at decode
            *((name, f"disk_realtext_{name.rsplit('_', 1)[1]}", "prefetch") for name in DISK_VARIANTS),
            ("device_again", "device", "inline"))  # the same as "device": what two equal steps differ by here
REALTEXT = tuple(name for name, kind, _ in VARIANTS if kind in step_engram.REALTEXT_KINDS)
DISK = DISK_VARIANTS  # real-text ids too; eager (placement disk refuses capture)
DISK_KIND = {name: kind for name, kind, _ in VARIANTS if name in DISK}
EAGER = ("device_eager",) + DISK  # never captured
DISK_MIN_STEPS = 5  # fewest steps the time budget may cut a disk variant to
WITH_NEIGHBORS = tuple(name for name in REALTEXT if name.endswith("_neighbors"))
TEXT_WARM_TOKENS = 36 * 8192  # the real-text caches' warm-up text; the rest of fortunes holds 46 steps of 8192
SMOKE_TEXT_TOKENS = 8192  # the smoke's synthetic text where no stored stream is found
TEXT_PROMPT_TOKENS = 2048  # each decode request's prompt, warmed into the real-text caches before its steps
SMOKE_TEXT_WARM = (1024, 16)  # the smoke's warm-up text and prompts (tokens)
NEIGHBOR_TABLE_GIB, SMOKE_NEIGHBOR_TABLE_GIB = 4.0, 1 / 64  # each helper's own table
TRACED = ("none", "device", "host_prefetch", "host_prefetch_late")  # the variants --trace profiles one step of
LEFT_OUT = ("the stand-in leaves out the attention core (and its KV cache) and the all-to-all of expert "
            "parallelism; both make a real step longer, so Engram's shares here are upper bounds")


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------
class Report(dict):
    """The JSON report, written whole after every phase (and once more at the end)."""

    def __init__(self, path: Path, **fields):
        super().__init__(**fields)
        self.path = path

    def write(self) -> None:
        self.update(headline(self))
        text = json.dumps(self, indent=2, default=str)
        targets = [self.path]
        out = os.environ.get("OUT")
        if out and Path(out).is_dir() and Path(out).resolve() != self.path.parent.resolve():
            targets.append(Path(out) / self.path.name)
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)

    def error(self, what: str, error: BaseException) -> None:
        text = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        print(f"FAILED {what}: {text}", flush=True)
        traceback.print_exc(limit=4)
        self.setdefault("errors", []).append({"what": what, "error": text})


def _commit() -> str:
    if os.environ.get("ENGRAM_COMMIT"):
        return os.environ["ENGRAM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
class Clock:
    """Per-step times in ms: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def time(self, call) -> float:
        if not self.cuda:
            started = time.perf_counter()
            call()
            return (time.perf_counter() - started) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Watchdog:
    """Ends the run with its report written when one armed piece of work (a warm-up, a step) runs past
    ``limit_s``, or the run past its deadline: a step blocked inside CUDA never returns to Python, so
    neither an exception nor SIGTERM would reach the code that writes the report."""

    def __init__(self, report: "Report", limit_s: float, deadline: float, grace_s: float = 30.0):
        self.report, self.limit_s, self.deadline, self.grace_s = report, limit_s, deadline, grace_s
        self.what, self.since = None, 0.0
        self.before_exit: list = []  # called before the exit (the host neighbours' shutdown)
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="bench-step-watchdog", daemon=True).start()

    def arm(self, what: str) -> None:
        self.what, self.since = what, time.perf_counter()

    def disarm(self) -> None:
        self.what = None

    def stop(self) -> None:
        self.what = None
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(1.0):
            what, now = self.what, time.perf_counter()
            late = now > self.deadline + self.grace_s
            if what is not None and (now - self.since > self.limit_s or late):
                why = "the run's deadline" if late else f"{self.limit_s:.0f} s"
                self.report["stalled"] = {"what": what, "seconds": now - self.since, "limit": why}
                print(f"\nSTALLED: {what} ran {now - self.since:.0f} s (past {why}); writing the report and "
                      "exiting", flush=True)
                try:
                    self.report.write()
                    print_table(self.report)
                finally:
                    for call in self.before_exit:
                        try:
                            call()
                        except Exception:  # noqa: BLE001 - exiting regardless
                            pass
                    os._exit(3)


def time_us(call, cuda: bool, graph: bool = True) -> float:
    """Median us of ``call`` alone: on a GPU do_bench (L2 cleared before each run) of its graph's
    replays (``graph``) or of eager calls; on the CPU the median of 3 host-timed calls."""
    if cuda:
        from common import gpu_us

        return gpu_us(call, graph=graph)
    call()
    samples = []
    for _ in range(3):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


@dataclass
class Variant:
    """One way of running the step; ``status`` says why it does not run (None: it runs)."""

    name: str
    kind: str | None
    form: str | None
    status: str | None = None
    realtext: bool = False   # ids of real text in order (RealTextInputs), else uniform random
    neighbors: bool = False  # the host neighbours gather in lockstep with each of its steps
    eager: bool = False      # never captured in a CUDA graph


def make_variants(memories: dict, api: dict, cuda: bool, neighbors: int = 0,
                  realtext_status: str = "skipped (no real-text tables)",
                  disk_status: dict | None = None) -> list[Variant]:
    """The variants of :data:`VARIANTS` with why each does not run (None: it runs). The real-text ones run
    where ``memories`` has their kind (on the CPU as stand-ins), else ``realtext_status``; the disk ones where
    it has theirs, else ``disk_status[kind]``; ``device_eager`` beside a disk one only; the neighbours' ones
    only with ``neighbors`` helpers."""
    variants = []
    with_disk = any(kind in memories for kind in DISK_KIND.values())
    for name, kind, form in VARIANTS:
        status = None
        realtext = name in REALTEXT or name in DISK
        if name in WITH_NEIGHBORS and neighbors < 1:
            status = "n/a (--host-neighbors 0)"
        elif name in DISK and kind not in memories:
            status = (disk_status or {}).get(kind, "skipped (no --disk-directory)")
        elif realtext and kind not in memories:
            status = realtext_status
        elif name == "device_eager" and not with_disk:
            status = "skipped (the disk variants' eager control: runs beside them only)"
        elif kind is not None and not cuda and kind != "device" and not realtext:
            status = "skipped (no CUDA: placements host, cached and seed need a CUDA device)"
        elif form == "kv_ahead" and not api["kv_ahead"]:
            status = "n/a (not in this version)"
        variants.append(Variant(name, ("cpu" if not cuda and kind == "device" else kind), form, status,
                                realtext=realtext, neighbors=name in WITH_NEIGHBORS, eager=name in EAGER))
    return variants


class StreamMarks:
    """Spans of the main stream (CUDA events; the host clock on the CPU), summed once the step has run:
    the time Engram's own calls hold the stream, waits for prefetched rows included."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[list] = []

    def begin(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.spans.append([event, None])
        else:
            self.spans.append([time.perf_counter(), None])

    def end(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.spans[-1][1] = event
        else:
            self.spans[-1][1] = time.perf_counter()

    def total_ms(self) -> float:
        """The spans' sum (ms); after the step's work has finished."""
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in self.spans)
        return sum((end - start) * 1e3 for start, end in self.spans)


def engram_step(decoder, plan, inputs, memory, form: str | None, takes_prefetch: bool,
                marks: StreamMarks | None = None, update_cache: bool = False):
    """The served step: hash once, prefetch (``form``), the decoder layers with Engram before its layers.
    Form ``"prefetch_late"`` calls the prefetch once the decoder layers before the first Engram layer are
    enqueued (right after hashing where that is layer 0). ``marks``: spans around the hashing + prefetch,
    the late prefetch and each Engram layer (eager steps only). ``update_cache``: ``memory.update_cache``
    once the last Engram layer is enqueued (eager: beside the decoder layers after it, and the step ends
    only once it is done; captured: inside the graph). Returns ``(h [T, hc, hidden], hash_ids or None)``."""
    h, hash_ids, handle = inputs.hidden, None, None
    begin, end = (marks.begin, marks.end) if marks is not None else (lambda: None, lambda: None)
    late_after = None  # the decoder layer after which the late prefetch is called
    if memory is not None:
        begin()
        hash_ids = inputs.hash(memory)
        if form == "prefetch" or (form == "prefetch_late" and min(memory.layer_ids) == 0):
            handle = memory.prefetch(hash_ids)
        elif form == "kv_ahead":
            handle = memory.prefetch(hash_ids, kv_ahead=True)
        elif form == "prefetch_late":
            late_after = min(memory.layer_ids) - 1
        end()
    handed = {"prefetch": handle} if handle is not None and takes_prefetch else {}
    last_engram = max(memory.layer_ids) if memory is not None else None
    for index in range(decoder.shape.layers):
        if memory is not None and index in memory.layer_ids:
            begin()
            h = memory.forward_layer(index, h, hash_ids, **handed)
            if update_cache and index == last_engram:
                memory.update_cache(hash_ids)
            end()
        h = decoder.layer(h, plan)
        if index == late_after:
            begin()
            handle = memory.prefetch(hash_ids)
            end()
            handed = {"prefetch": handle} if handle is not None and takes_prefetch else {}
    if update_cache:
        memory.wait_cache_updates()  # the step's time includes the update beside it
    return h, hash_ids


class StepRun:
    """One variant at one T: warm-up (eager), then a captured graph (``graph``) or eager steps."""

    def __init__(self, variant: Variant, memory, decoder, plan, inputs, clock: Clock, graph: bool,
                 takes_prefetch: bool, neighbors=None, neighbor_rows: int = 0):
        self.variant, self.memory, self.decoder, self.plan, self.inputs = variant, memory, decoder, plan, inputs
        self.clock, self.use_graph, self.takes_prefetch = clock, graph and not variant.eager, takes_prefetch
        self.neighbors, self.neighbor_rows = neighbors, neighbor_rows  # signalled before each timed step
        self.updates_cache = bool(variant.kind and variant.kind.startswith("cached"))
        self.graph = None
        self.output = None
        self.hash_ids = None
        self.warm_ms = 0.0
        self.engram_stream_ms: list[float] = []  # per timed eager step: Engram's spans of the main stream

    def _eager(self, marks: StreamMarks | None = None):
        out, self.hash_ids = engram_step(self.decoder, self.plan, self.inputs, self.memory, self.variant.form,
                                         self.takes_prefetch, marks, update_cache=self.updates_cache)
        return out

    def prepare(self, warmups: int = 2) -> tuple[torch.Tensor, float]:
        """Warm-up steps on the current inputs (not refreshed: every variant's first step sees the same
        ones); returns the first step's output and the last warm-up's time (ms; a disk variant's slowest:
        its later warm-ups find their rows cached)."""
        first, last_ms, slowest = None, 0.0, 0.0
        for index in range(warmups):
            holder = {}
            last_ms = self.clock.time(lambda: holder.update(out=self._eager()))
            slowest = max(slowest, last_ms)
            if index == 0:
                first = holder["out"]
        if self.variant.name in DISK:
            last_ms = slowest
        if self.use_graph:
            self.graph, self.output = captured(self._eager)
            self.graph.replay()
            last_ms = self.clock.time(self.graph.replay)
        return first, last_ms

    @property
    def exhausted(self) -> bool:
        """Its inputs hold no further step (real text read to its end)."""
        return bool(getattr(self.inputs, "exhausted", False))

    def timed(self) -> float:
        """One step on fresh token ids (drawn before the clock starts); with neighbours, their gathers
        signalled just before the clock starts and collected after it stops."""
        self.inputs.refresh()
        self.clock.sync()
        if self.neighbors is not None:
            self.neighbors.signal(self.neighbor_rows)
        try:
            if self.graph is not None:
                return self.clock.time(self.graph.replay)
            marks = StreamMarks(self.clock.cuda) if self.memory is not None else None
            step_ms = self.clock.time(lambda: self._eager(marks))
            if marks is not None:
                self.engram_stream_ms.append(marks.total_ms())  # the clock waited for the step's end
            return step_ms
        finally:
            if self.neighbors is not None:
                self.neighbors.collect()

    def release(self) -> None:
        self.graph = None
        self.output = None
        self.hash_ids = None


# ---------------------------------------------------------------------------
# phases
# ---------------------------------------------------------------------------
@dataclass
class Setup:
    cuda: bool
    device: str
    decoder: object
    memories: dict
    variants: list
    api: dict
    spec: object
    generator: torch.Generator
    clock: Clock
    steps: int
    deadline: float
    min_steps: int
    warmups: int
    watchdog: Watchdog | None = None
    keep: list = field(default_factory=list)         # what must outlive the tables (pinned rows)
    plan_order: list = field(default_factory=list)   # the phases, in run order
    done: set = field(default_factory=set)
    path_threads: list = field(default_factory=list)  # gather_threads of the extra host-path-alone runs
    host_options_except_threads: dict = field(default_factory=dict)
    order_rng: random.Random = field(default_factory=random.Random)  # each round's order of the variants
    trace: bool = False  # one profiled step per TRACED variant at the largest prefill T (--trace)
    text: object = None  # the real-text stream (step_engram.TextStream), None without real-text variants
    neighbors: object = None  # the host neighbours (host_neighbors.HostNeighbors), None without
    rows_per_token: int = 0  # rows one token reads over every Engram layer (the neighbours' share)
    row_bytes: int = 0  # packed host row bytes
    text_warm: tuple = (TEXT_WARM_TOKENS, TEXT_PROMPT_TOKENS)  # warm-up text and decode prompts (tokens)
    disk_steps: int = 10      # timed steps per disk variant and T (before the budget's cut)
    disk_min_steps: int = DISK_MIN_STEPS
    disk_warm_steps: int = 4  # each phase's warm-up lookups of the disk tables (step_engram.disk_warm_segments)
    make_disk_memory: object = None  # kind -> a fresh disk memory (caches empty), None without disk kinds
    disk_fresh: bool = True   # the disk memories are unused since they were made


def floor_call(memory, inputs, hash_ids):
    """The two Engram layers' wkv + gate on rows already on the device (packed FP8 rows gathered once,
    beforehand): what every implementation pays."""
    from engram.layer import engram_gate_kv

    head_dim = memory.spec.head_dim
    parts = []
    for index, layer_id in enumerate(memory.layer_ids):
        values, scales = memory.table(layer_id).lookup_packed(hash_ids[:, index, :])
        packed = torch.cat([values.view(torch.uint8), scales], dim=-1)
        parts.append((memory.layer(layer_id), packed))

    def call():
        for layer, packed in parts:
            kv = layer.wkv.forward_fp8_rows(packed[..., :head_dim], packed[..., head_dim:])
            engram_gate_kv(inputs.hidden, kv, layer.q_weight, layer.k_weight, layer.eps, None,
                           backend=layer.gate_backend)

    return call


def run_phase(setup: Setup, report: Report, mode: str, tokens: int) -> dict:
    """One T: decoder layer alone, the floor, one Engram layer alone, then the interleaved steps."""
    started = time.perf_counter()
    decode = mode == "decode"
    graph = decode and setup.cuda
    device_memory = setup.memories.get("device") or setup.memories.get("cpu")
    inputs = step_engram.StepInputs(setup.spec, tokens, decode, setup.device, setup.generator)
    plan = step_decoder.routing_plan(setup.decoder.shape, tokens, setup.device)
    phase = {"mode": mode, "T": tokens, "graph": graph, "variants": {v.name: {} for v in setup.variants},
             "equal_to_device": {}}
    report.setdefault("phases", []).append(phase)

    guard = setup.watchdog.arm if setup.watchdog else (lambda what: None)
    text_plan = realtext_plan(setup, report, phase, mode, tokens)
    guard(f"{mode} T={tokens}: decoder layer, floor and Engram layer alone")
    layer_us = time_us(lambda: setup.decoder.layer(inputs.hidden, plan), setup.cuda)
    phase["decoder_layer_us"] = layer_us
    phase["decoder_layer_TFLOPs"] = setup.decoder.flops(tokens) / (layer_us * 1e-6) / 1e12
    hash_ids = inputs.hash(device_memory)
    phase["floor_us"] = time_us(floor_call(device_memory, inputs, hash_ids), setup.cuda)
    one_layer = time_us(lambda: device_memory.forward_layer(device_memory.layer_ids[0], inputs.hidden, hash_ids),
                        setup.cuda, graph=setup.cuda)
    phase["engram_layer_us"] = one_layer
    report.setdefault("layer_us", {})[str(tokens)] = one_layer
    print(f"{mode} T={tokens}: decoder layer {layer_us:.1f} us ({phase['decoder_layer_TFLOPs']:.0f} TFLOP/s), "
          f"floor (2 Engram layers, wkv + gate) {phase['floor_us']:.1f} us, one Engram layer (device) "
          f"{one_layer:.1f} us", flush=True)

    def text_inputs():  # each real-text variant its own (graphs read them in place), all from one point
        made = step_engram.RealTextInputs(setup.spec, tokens, decode, setup.device, setup.generator, setup.text,
                                          text_plan)
        made.hidden = inputs.hidden  # the same residual: one device reference serves them all
        return made

    text_reference, text_probe = None, None
    if text_plan is not None:
        text_probe = text_inputs()
        guard(f"{mode} T={tokens}: real-text caches' warm-up")
        warm_realtext_caches(setup, phase, text_plan)
        warm_disk_tables(setup, phase, text_plan, mode, tokens)
        guard(f"{mode} T={tokens}: device on real text")
        text_reference = engram_step(setup.decoder, plan, text_probe, device_memory, "inline",
                                     setup.api["forward_layer_takes_prefetch"])[0].clone()

    if not decode and setup.cuda:
        phase["prewarm_s"] = {}
        for kind in ("host", "cached", "seed") + step_engram.REALTEXT_KINDS:
            if kind in setup.memories and (text_probe is not None or kind not in step_engram.REALTEXT_KINDS):
                guard(f"{mode} T={tokens}: prewarm {kind}")
                on = text_probe if kind in step_engram.REALTEXT_KINDS else inputs
                phase["prewarm_s"][kind] = prewarm(setup.memories[kind], on, setup.api)

    runs, reference = [], None
    for variant in setup.variants:
        if variant.status is None and variant.realtext and text_plan is None:
            phase["variants"][variant.name] = {"status": "skipped (the text holds no step of this phase)"}
            continue
        if variant.status is not None:
            phase["variants"][variant.name] = {"status": variant.status}
            continue
        if variant.name == "device_eager" and not decode:
            phase["variants"][variant.name] = {"status": "n/a (prefill steps are all eager: device is the control)"}
            continue
        if variant.name == "device_eager" and text_plan is None:
            phase["variants"][variant.name] = {"status": "skipped (no disk variant runs in this phase)"}
            continue
        memory = None if variant.kind is None else setup.memories[variant.kind]
        neighbors = setup.neighbors if variant.neighbors else None
        run = StepRun(variant, memory, setup.decoder, plan, text_inputs() if variant.realtext else inputs,
                      setup.clock, graph, setup.api["forward_layer_takes_prefetch"], neighbors=neighbors,
                      neighbor_rows=tokens * setup.rows_per_token)
        try:
            guard(f"{mode} T={tokens}: {variant.name} warm-up")
            first, warm_ms = run.prepare(setup.warmups)
        except Exception as error:  # noqa: BLE001 - one variant's failure must not stop the others
            report.error(f"{mode} T={tokens} {variant.name} warm-up", error)
            phase["variants"][variant.name] = {"status": f"failed: {type(error).__name__}"}
            run.release()
            continue
        if not bool(torch.isfinite(first).all()):
            phase.setdefault("nonfinite", []).append(variant.name)
        if variant.name == "device":
            reference = first.clone()
        elif variant.realtext:
            phase["equal_to_device"][variant.name] = bool(torch.equal(first, text_reference))
        elif reference is not None and variant.kind is not None:
            phase["equal_to_device"][variant.name] = bool(torch.equal(first, reference))
        run.warm_ms = warm_ms
        runs.append(run)
        print(f"  {variant.name}: warm step {warm_ms:.2f} ms", flush=True)
    del reference, text_reference

    # As many interleaved rounds as the budget allows (the later phases keep a share); the disk variants
    # step in the first disk_steps rounds only, within half of what is left.
    disk_runs = [run for run in runs if run.variant.name in DISK]
    disk_ms = sum(run.warm_ms for run in disk_runs) / 1e3 * 1.15  # s a round of the disk variants
    round_ms = sum(run.warm_ms for run in runs if run not in disk_runs)
    phases_left = sum(1 for m, t in setup.plan_order if (m, t) not in setup.done) - 1
    remaining_s = setup.deadline - time.perf_counter() - 25 * max(phases_left, 0)
    steps = setup.steps
    disk_steps = min(setup.disk_steps, steps) if disk_runs else 0
    if disk_ms > 0 and disk_steps * disk_ms > remaining_s / 2:
        disk_steps = min(disk_steps, max(setup.disk_min_steps, int(remaining_s / 2 / disk_ms)))
        phase["disk_steps_cut"] = f"cut to {disk_steps} steps per disk variant by the time budget"
        print(f"  {phase['disk_steps_cut']}", flush=True)
    left_s = remaining_s - disk_steps * disk_ms
    if round_ms > 0 and steps * round_ms / 1e3 * 1.15 > left_s:
        steps = max(setup.min_steps, disk_steps, int(max(left_s, 0) / (round_ms / 1e3 * 1.15)))
        phase["steps_cut"] = f"cut to {steps} steps per variant by the time budget"
        print(f"  {phase['steps_cut']}", flush=True)
    samples = {run.variant.name: [] for run in runs}
    counters_before, counters_after = table_counters(setup.memories), None
    phase["steps"] = steps
    if disk_runs:
        phase["disk_steps"] = disk_steps
    if graph:
        phase["eager_variants"] = [run.variant.name for run in runs if run.variant.eager]
    disk_before = {run.variant.kind: step_engram.disk_counts(run.memory) for run in disk_runs}
    cached_kinds = [kind for kind in dict.fromkeys(run.variant.kind for run in runs if run.updates_cache)]
    for kind in cached_kinds:
        step_engram.zero_cache_counts(setup.memories[kind])
    if setup.neighbors is not None:
        setup.neighbors.take_records()
    try:
        for round_index in range(steps):
            order = list(runs)
            setup.order_rng.shuffle(order)
            for run in order:
                if run in disk_runs and round_index >= disk_steps:
                    continue
                if run.exhausted:  # real text read to its end: its rounds stop here, the others go on
                    phase.setdefault("text_steps_cut", {}).setdefault(run.variant.name, round_index)
                    continue
                try:
                    guard(f"{mode} T={tokens}: {run.variant.name} step {round_index}")
                    samples[run.variant.name].append(run.timed())
                except Exception as error:  # noqa: BLE001 - drop this variant, keep the others
                    report.error(f"{mode} T={tokens} {run.variant.name} step", error)
                    runs.remove(run)
                    run.release()
        counters_after = table_counters(setup.memories)  # of the timed steps alone
        cache_phase_figures(setup, phase, runs, samples, cached_kinds, tokens)
        disk_phase_figures(setup, phase, disk_runs, disk_before, samples)
        if setup.neighbors is not None and any(run.variant.neighbors for run in runs):
            phase["host_neighbors"] = {**host_neighbors.summarize_records(setup.neighbors.take_records()),
                                       "rows_per_step": tokens * setup.rows_per_token}
            found = phase["host_neighbors"]
            if found.get("steps"):
                print(f"  host neighbours ({setup.neighbors.count}): {found['GBps']:.2f} GB/s together "
                      f"({found['per_helper_GBps']:.2f} each), {found['bytes_per_step'] / 1e6:.1f} MB a step in "
                      f"{found['window_ms']:.2f} ms, from {found['start_after_signal_us']:.0f} us after the "
                      f"signal", flush=True)
        if setup.trace and not decode and tokens == max(t for m, t in setup.plan_order if m == "prefill"):
            phase["trace"] = trace_steps(setup, report, runs, f"{mode} T={tokens}", tokens)
    finally:  # what was measured is kept, also when the run is stopped mid-phase
        for run in runs:
            run.release()
        summarize(phase, samples, setup)
        for name, pair in phase.get("pairs", {}).items():
            interval = pair["ci95_pct"]
            print(f"  {name}: {pair['pct']:+.2f}% paired over {pair['rounds']} rounds"
                  + ("" if interval is None else f", 95% [{interval[0]:+.2f}, {interval[1]:+.2f}]")
                  + f", IQR [{pair['p25_pct']:+.2f}, {pair['p75_pct']:+.2f}]", flush=True)
        for run in runs:
            stats = phase["variants"].get(run.variant.name)
            if run.engram_stream_ms and stats is not None and "median_ms" in stats:
                stats["engram_stream_ms"] = statistics.median(run.engram_stream_ms)
        phase["table_counters"] = counter_changes(counters_before, counters_after or table_counters(setup.memories))
    if "cached" in setup.memories:
        guard(f"{mode} T={tokens}: update_cache alone")
        times = update_cache_times(setup.memories["cached"], inputs, setup.clock)
        phase["update_cache_ms"] = times["gpu_us"] / 1e3
        phase["update_cache_host_us"], phase["update_cache_gpu_us"] = times["host_us"], times["gpu_us"]
        if "graph_us" in times:
            phase["update_cache_graph_us"] = times["graph_us"]
    if tokens == 8192 and setup.cuda and "host" in setup.memories:
        host = setup.memories["host"]

        def make_ids():
            inputs.refresh()
            return inputs.hash(host)[:, 0, :]

        try:
            guard("host path alone at T=8192")
            table = host.table(host.layer_ids[0])
            report["host_path_T8192"] = common.host_path_alone(table, make_ids)
            print(f"  host path alone, T=8192 (prefetch to rows ready): {report['host_path_T8192']}", flush=True)
            by_threads = {}
            for threads in setup.path_threads:  # the same rows through tables of other gather_threads
                guard(f"host path alone at T=8192, {threads} gather threads")
                other = common.table_over_rows(table, "host", gather_threads=threads,
                                               **setup.host_options_except_threads)
                by_threads[str(threads)] = common.host_path_alone(other, make_ids)
                print(f"  host path alone, T=8192, {threads} gather threads: {by_threads[str(threads)]}", flush=True)
                del other
            if by_threads:
                report["host_path_T8192_by_threads"] = by_threads
        except Exception as error:  # noqa: BLE001
            report.error("host path alone at T=8192", error)
    if setup.watchdog:
        setup.watchdog.disarm()
    phase["seconds"] = time.perf_counter() - started
    return phase


def realtext_plan(setup: Setup, report: Report, phase: dict, mode: str, tokens: int):
    """Where this phase's real-text variants read the stream (``step_engram.TextPlan``), or None when none
    runs or the text holds no step of this T (then they are skipped, saying why)."""
    if setup.text is None or not any(v.realtext and v.status is None for v in setup.variants):
        return None
    try:
        plan = step_engram.text_plan(len(setup.text), tokens, mode == "decode", *setup.text_warm)
    except ValueError as error:
        report.setdefault("notes", []).append(f"{mode} T={tokens}: {error}")
        return None
    phase["text"] = {**setup.text.facts(), "warm_tokens": plan.warm, "prompt_tokens": plan.prompt,
                     "requests": len(plan.cursors) if mode == "decode" else None, "steps_held": plan.steps}
    return plan


def warm_realtext_caches(setup: Setup, phase: dict, plan) -> None:
    """Empty each real-text cache and warm it on the phase's warm-up text (``step_engram.warm_cache``)."""
    started = time.perf_counter()
    for kind in step_engram.REALTEXT_KINDS:
        memory = setup.memories.get(kind)
        if memory is not None and step_engram.row_caches(memory):
            phase["text"]["warm_updates"] = step_engram.warm_cache(memory, setup.text, plan, setup.device, 8192)
    setup.clock.sync()
    phase["text"]["warm_s"] = time.perf_counter() - started


def warm_disk_tables(setup: Setup, phase: dict, plan, mode: str, tokens: int) -> None:
    """The disk memories afresh (caches empty; the first phase's as built), then each warmed by lookups of
    the text before this phase's steps (``step_engram.disk_warm_segments``: ``--disk-warm-steps`` lookups)."""
    kinds = [v.kind for v in setup.variants if v.name in DISK and v.status is None and v.kind in setup.memories]
    if not kinds:
        return
    guard = setup.watchdog.arm if setup.watchdog else (lambda what: None)
    decode = mode == "decode"
    segments = step_engram.disk_warm_segments(plan, tokens, decode, setup.disk_warm_steps)
    piece = step_engram.DISK_WARM_PIECE if decode else tokens
    found = {"segments": len(segments), "tokens_each": segments[0][1] if segments else 0, "piece_tokens": piece,
             "what": ("the last tokens of each request's prompt" if decode else "the tokens just before the steps")}
    for kind in kinds:
        if not setup.disk_fresh:
            step_engram.close_tables(setup.memories[kind])
            setup.memories[kind] = setup.make_disk_memory(kind)
        guard(f"{mode} T={tokens}: {kind} warm-up lookups")
        started = time.perf_counter()
        warmed = step_engram.warm_disk(setup.memories[kind], setup.text, segments, setup.device, piece)
        setup.clock.sync()
        found[kind] = {**warmed, "seconds": time.perf_counter() - started,
                       "counts": step_engram.disk_counts(setup.memories[kind])}
        print(f"  {kind}: warmed by {warmed['lookups']} lookups of {warmed['tokens']} tokens in "
              f"{found[kind]['seconds']:.1f} s", flush=True)
    setup.disk_fresh = False
    phase["disk_warm"] = found


def disk_phase_figures(setup: Setup, phase: dict, runs: list, before: dict, samples: dict) -> None:
    """Per disk variant that ran: its tiers over the timed steps (``step_figures.disk_figures``)."""
    for run in runs:
        kind = run.variant.kind
        figures = disk_figures(before[kind], step_engram.disk_counts(run.memory),
                               len(samples.get(run.variant.name, [])), setup.row_bytes)
        phase.setdefault("disk_tiers", {})[kind] = figures
        hbm = figures["hbm_hit_rate"]
        print(f"  {kind}: HBM hits {'n/a' if hbm is None else f'{hbm:.1%}'}, RAM hits "
              f"{figures['ram_hit_rate'] or 0:.1%} of the HBM misses, {figures['disk_reads_per_step']:.0f} rows "
              f"from disk a step ({figures['disk_bytes_per_step'] / 1e6:.2f} MB)", flush=True)


def cache_phase_figures(setup: Setup, phase: dict, runs: list, samples: dict, kinds: list, tokens: int) -> None:
    """Per cached memory that ran: its caches' hit rate and the host bytes of ``cached`` and ``host`` over the
    timed steps (``step_figures.cache_figures``; its updates are the steps of every variant on it)."""
    for kind in kinds:
        memory = setup.memories[kind]
        counts = step_engram.cache_counts(memory)
        if counts is None:
            continue
        steps = sum(len(samples.get(run.variant.name, [])) for run in runs if run.variant.kind == kind)
        figures = cache_figures(counts, steps, tokens * setup.spec.num_columns, step_engram.direct_max_rows(memory),
                                setup.row_bytes)
        phase.setdefault("row_cache", {})[kind] = figures
        if figures["hit_rate"] is not None:
            print(f"  {kind}: hit rate {figures['hit_rate']:.1%}, host bytes {figures['host_bytes_ratio']:.1%} of "
                  f"host's ({figures['cached_bytes_per_step'] / 1e6:.2f} against "
                  f"{figures['host_bytes_per_step'] / 1e6:.2f} MB a step, {figures['path']})", flush=True)
    host = setup.memories.get("host_realtext")
    gather = None if host is None else getattr(host.table(host.layer_ids[0]).storage, "host_gather", None)
    if gather is not None and "text" in phase:
        phase["text"]["host_gather_repeat_share"] = gather.repeat_share  # the host path dedups from 10%


def trace_steps(setup: Setup, report: Report, runs: list, label: str, tokens: int) -> dict:
    """One more step of each variant of :data:`TRACED` under ``torch.profiler`` (``step_trace``): the main
    stream's busy and idle ms, every stream's figures, and the gzipped trace's file name (next to the
    report, or in ``$OUT``)."""
    out = os.environ.get("OUT")
    directory = Path(out) if out and Path(out).is_dir() else report.path.parent
    guard = setup.watchdog.arm if setup.watchdog else (lambda what: None)
    found = {}
    for run in runs:
        if run.variant.name not in TRACED:
            continue
        guard(f"{label}: {run.variant.name} traced step")
        path = directory / f"step-trace-{run.variant.name}-T{tokens}.json.gz"
        try:
            run.inputs.refresh()
            setup.clock.sync()
            found[run.variant.name] = {**step_trace.profile_call(run._eager, path),
                                       "trace": path.name}
        except Exception as error:  # noqa: BLE001 - a trace is a diagnostic: the figures stand without it
            report.error(f"{label} {run.variant.name} traced step", error)
            continue
        figures = found[run.variant.name]
        if figures["main_stream"] is not None:
            print(f"  traced {run.variant.name}: main stream busy {figures['main_busy_ms']:.2f} ms, idle "
                  f"{figures['main_idle_ms']:.2f} ms of {figures['main_span_ms']:.2f}", flush=True)
    return found


def prewarm(memory, inputs, api: dict) -> float:
    """One prefetched pass of the Engram layers alone at this T (as an engine's warm-up batch), synced:
    the host gathers' staging and pinned id buffers are allocated here, outside any step. Seconds."""
    started = time.perf_counter()
    hash_ids = inputs.hash(memory)
    handle = memory.prefetch(hash_ids)
    handed = {"prefetch": handle} if handle is not None and api["forward_layer_takes_prefetch"] else {}
    h = inputs.hidden
    for layer_id in memory.layer_ids:
        h = memory.forward_layer(layer_id, h, hash_ids, **handed)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def update_cache_ms(memory, inputs, clock: Clock, repeats: int = 5) -> float:
    """Median ms of ``memory.update_cache`` alone on fresh hash ids (part of each ``cached`` step)."""
    return update_cache_times(memory, inputs, clock, repeats)["gpu_us"] / 1e3


def update_cache_times(memory, inputs, clock: Clock, repeats: int = 5) -> dict:
    """``memory.update_cache`` on fresh hash ids as a served step calls it, after that step's lookups of the
    same ids (a large lookup's staging is what the update admits rows from) and a sync: the median host
    time of the call (``host_us``: until it returns) and of the work it enqueued (``gpu_us``: CUDA events
    around it, the host clock on the CPU), over ``repeats`` calls."""
    host, gpu = [], []
    for _ in range(repeats):
        inputs.refresh()
        hash_ids = inputs.hash(memory)
        ticket = memory.prefetch(hash_ids)
        for layer_id in memory.layer_ids:
            memory.forward_layer(layer_id, inputs.hidden, hash_ids, prefetch=ticket)
        clock.sync()

        def call():
            started = time.perf_counter()
            memory.update_cache(hash_ids)
            host.append((time.perf_counter() - started) * 1e6)
            memory.wait_cache_updates()  # the events around it include the update run beside
        gpu.append(clock.time(call) * 1e3)
    times = {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu)}
    if clock.cuda and inputs.tokens <= 1024:  # decode sizes: what a graph-replayed step pays for the update
        times["graph_us"] = update_cache_graph_us(memory, inputs, clock, repeats)
    return times


def captured(body):
    """``(graph, body())`` captured thread-local: the host gather's worker threads may touch CUDA meanwhile."""
    return common.captured_graph(body, capture_error_mode="thread_local")


def update_cache_graph_us(memory, inputs, clock: Clock, repeats: int) -> float:
    """What ``memory.update_cache`` adds to a decode step's graph: a graph of the step's Engram lookups then the
    update (which admits rows from those lookups' stagings, as in the served step) less a graph of the lookups
    alone, both replayed after fresh hash ids were copied into their input; the median GPU-time difference of
    a replay pair, over ``4 * repeats`` pairs (each replay takes a few hundred us)."""
    static_ids = inputs.hash(memory).clone()

    def lookups():
        for layer_id in memory.layer_ids:
            memory.forward_layer(layer_id, inputs.hidden, static_ids)

    def step():
        lookups()
        memory.update_cache(static_ids)

    graphs = [captured(body)[0] for body in (step, lookups)]  # step first: the update's buffers fit the size
    clock.sync()
    samples = []
    for _ in range(4 * repeats):
        times = []
        for graph in graphs:
            inputs.refresh()
            static_ids.copy_(inputs.hash(memory))
            clock.sync()
            times.append(clock.time(graph.replay) * 1e3)
        samples.append(times[0] - times[1])
    return statistics.median(samples)


def summarize(phase: dict, samples: dict[str, list[float]], setup: Setup) -> None:
    """Each variant's spread, its median against ``none`` and ``device`` (in %), and the same paired
    per round (:func:`paired_pct`)."""
    none_ms = statistics.median(samples["none"]) if samples.get("none") else None
    device_ms = statistics.median(samples["device"]) if samples.get("device") else None
    for name, values in samples.items():
        if values:
            stats = spread(values)
            stats["vs_none_pct"] = _pct(stats["median_ms"], none_ms)
            stats["vs_device_pct"] = _pct(stats["median_ms"], device_ms) if name != "none" else None
            for base in ("none", "device"):
                if name != base and samples.get(base):
                    stats[f"paired_vs_{base}_pct"] = paired_pct(values, samples[base])
                    interval = paired_pct_interval(values, samples[base])
                    if interval is not None:
                        stats[f"paired_vs_{base}_ci95_pct"] = list(interval)
            phase["variants"][name] = stats
    phase["pairs"] = pair_figures(samples)
    if none_ms:
        phase["decoder_layer_share_of_none"] = phase["decoder_layer_us"] * setup.decoder.shape.layers / 1e3 / none_ms
        phase["floor_pct_of_none"] = 100 * phase["floor_us"] / 1e3 / none_ms


def table_counters(memories: dict) -> dict:
    """Per memory and layer, the host-side counters tables keep where this version has them: prefetches
    served / dropped (``EngramTable.prefetches``) and, for ``cached``, lookups per path."""
    found = {}
    for kind, memory in memories.items():
        for layer_id in memory.layer_ids:
            table = memory.table(layer_id)
            counts = dict(getattr(table, "prefetches", {}) or {})
            counts.update({f"lookups_{k}": v for k, v in (getattr(table.storage, "lookups", {}) or {}).items()})
            if counts:
                found[f"{kind}/{layer_id}"] = counts
    return found


def counter_changes(before: dict, after: dict) -> dict:
    return {key: {name: value - before.get(key, {}).get(name, 0) for name, value in counts.items()}
            for key, counts in after.items()}


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------
def wanted(args, name: str) -> bool:
    return args.variants is None or name in args.variants


def realtext_kinds(args) -> list[str]:
    """The real-text table kinds the asked variants need."""
    kinds = []
    if wanted(args, "host_prefetch_realtext") or (args.host_neighbors and wanted(args, "host_prefetch_realtext_neighbors")):
        kinds.append("host_realtext")
    if wanted(args, "cached_prefetch_realtext"):
        kinds.append("cached_realtext")
    if args.host_neighbors and wanted(args, "cached_prefetch_realtext_neighbors"):
        kinds.append("cached_realtext_neighbors")
    if args.disk_directory is not None:
        kinds += [DISK_KIND[name] for name in DISK if wanted(args, name) and DISK_KIND[name] in args.disk_ram_fractions]
    return kinds


def disk_statuses(args, realtext_status: str) -> dict:
    """Why each disk kind's variant does not run where its tables were not built."""
    found = {}
    for name in DISK:
        kind = DISK_KIND[name]
        if args.disk_directory is None:
            found[kind] = "skipped (no --disk-directory)"
        elif kind not in args.disk_ram_fractions:
            found[kind] = "skipped (not in --disk-ram-fractions)"
        elif not wanted(args, name):
            found[kind] = "not asked for (--variants)"
        else:
            found[kind] = realtext_status
    return found


def build(args, report: Report, watchdog: Watchdog | None, neighbors=None) -> Setup:
    from engram.table.host_memory.rows import packed_row_bytes

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        report["notes"].append("no CUDA: placement 'cpu' stands in for 'device'; host, cached and seed, CUDA "
                               "graphs, pinned memory, the copy engine and the C ceiling are skipped")
        print(report["notes"][-1], flush=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    started = time.perf_counter()
    shape = step_decoder.SMOKE if args.smoke else step_decoder.V41_FLASH
    fp8 = step_decoder.fp8_gemm_available(device)
    decoder = step_decoder.Decoder(shape, step_decoder.Gemms(fp8=fp8), generator, device)
    report["gemm_forms"] = step_decoder.choose_forms(decoder, generator)
    forms = report["gemm_forms"]
    report["decoder"] = {**shape.__dict__, "weight_bytes": decoder.weight_bytes}
    print(f"decoder stand-in: {shape}, {decoder.weight_bytes / 1e9:.2f} GB of weights (one layer's, serving "
          f"every layer); GEMMs: {'torch._scaled_mm rowwise FP8' if fp8 else 'bf16 torch.mm'}, experts "
          f"{forms['expert_form']}, o {forms['o_form']}", flush=True)
    if fp8 and forms["expert_form"] == "loop":
        report["notes"].append(f"torch._scaled_grouped_mm failed for the experts: a loop of GEMMs (one per local "
                               f"expert) instead: {forms['errors']}")
        print(report["notes"][-1], flush=True)
    elif fp8 and forms["o_form"] != "grouped":
        report["notes"].append(f"the o GEMM runs as {forms['o_form']!r}: {forms['errors']}")

    vocab_size = None if args.smoke else step_engram.v41_vocab_size_for(args.table_gib)
    spec = step_engram.make_spec(vocab_size, args.smoke)
    layout = step_engram.EngramLayout(spec)
    vocab = step_engram.synthetic_vocab(spec)
    weights = step_engram.layer_weights(spec, generator, device)
    text, text_kinds = None, realtext_kinds(args)
    realtext_status = "skipped (not asked for)"
    if text_kinds:
        try:
            text = step_engram.load_text_stream(args.text_stream, spec,
                                                synthetic_tokens=SMOKE_TEXT_TOKENS if args.smoke else None)
        except FileNotFoundError:
            realtext_status = (f"skipped (no {args.text_stream}: make it with `PYTHONPATH=src python "
                               "benchmarks/real_text.py stream` where the DeepSeek-V4 tokenizer is, and carry "
                               ".bench-data)")
            report["notes"].append(f"real-text variants {realtext_status[:-1].split('(', 1)[1]}")
            print(report["notes"][-1], flush=True)
            text_kinds = []
    disk_kinds = [kind for kind in text_kinds if kind in step_engram.DISK_KINDS]
    kinds = (["device", "host", "cached", "seed"] + text_kinds) if cuda else ["cpu"] + disk_kinds
    host_options = {key: value for key, value in (("gather_threads", args.gather_threads),
                                                  ("host_gather_worker", args.host_gather_worker)) if value is not None}
    cpu_rows, row_files = {}, {}
    # off the smoke the row files must be there (--write-disk-tables): writing them takes minutes
    disk = {"directory": args.disk_directory, "read_threads": args.disk_read_threads, "write": args.smoke,
            "hbm_fraction": args.disk_hbm_fraction}
    tables, facts, keep = step_engram.build_tables(spec, layout, kinds, device, distinct_rows=args.distinct_rows,
                                                   generator=generator, host_options=host_options, smoke=args.smoke,
                                                   cpu_rows=cpu_rows, disk=disk, row_files=row_files)
    disk_status = disk_statuses(args, realtext_status)
    if "disk_missing" in facts:
        disk_status = {kind: "skipped (no row files: run --write-disk-tables first)" if kind in disk_kinds else status
                       for kind, status in disk_status.items()}
        disk_kinds = []
        report["notes"].append(f"disk variants skipped: {facts['disk_missing']}")
        print(report["notes"][-1], flush=True)
    facts["host_options"] = host_options
    if cuda:
        gather = tables["host"][spec.layer_ids[0]].storage.host_gather
        facts["host_gather"] = {"worker": gather.worker, "gather_threads": gather.gather_threads}
    memories = step_engram.build_memories(spec, layout, vocab, tables, weights, device)
    stand_ins = [kind for kind in text_kinds if kind not in step_engram.DISK_KINDS]
    if not cuda and stand_ins:  # stand-ins: "cpu" lookups, and beside them a row cache counting hits
        for kind in stand_ins:
            memories[kind] = (memories["cpu"] if kind == "host_realtext" else
                              step_engram.StandInCachedMemory(memories["cpu"], cpu_rows, step_engram.REALTEXT_CACHE_SHARE))
        report["notes"].append(f"no CUDA: {', '.join(stand_ins)} stand in on placement 'cpu' (cached: a RowCache "
                               "beside it, fed each step's ids, counts its hits)")
    make_disk_memory = None
    if disk_kinds:
        disk_options = {kind: dict(zip(spec.layer_ids, facts["disk_options"][kind])) for kind in disk_kinds}

        def make_disk_memory(kind):  # the kind's tables afresh over the same row files, caches empty
            made = step_engram.disk_tables(layout, row_files, device, disk_options[kind])
            return step_engram.build_memories(spec, layout, vocab, {kind: made}, weights, device)[kind]

        storage = tables[disk_kinds[0]][spec.layer_ids[0]].storage
        facts["disk"] = {"directory": str(args.disk_directory), "read_backend": storage.reads.reader.backend,
                         "direct_reads": storage.reads.reader.direct, "read_threads": args.disk_read_threads,
                         "page_bytes": storage.row_file.layout.page_bytes,
                         "ram_slots": {kind: [t.storage.reads.cache.num_slots for t in tables[kind].values()]
                                       for kind in disk_kinds},
                         "hbm_slots": {kind: [0 if t.storage.hbm_cache is None else t.storage.hbm_cache.num_slots
                                              for t in tables[kind].values()] for kind in disk_kinds},
                         "steps": args.disk_steps, "warm_steps": args.disk_warm_steps}
        files = ", ".join(f"{'written' if f['written'] else 'reused'} in {f['seconds']:.1f} s"
                          for f in facts["disk_row_files"])
        print(f"disk tables ({', '.join(disk_kinds)}): row files in {args.disk_directory} ({files}), reads "
              f"{facts['disk']['read_backend']}, O_DIRECT {facts['disk']['direct_reads']}", flush=True)
    api = step_engram.prefetch_api(next(iter(memories.values())))
    kinds = list(tables)  # without the disk kinds whose row files are missing
    report["engram"] = {"spec": spec.to_hf_config(), **facts, "kinds": kinds, "api": api,
                        "table_GiB": [rows * packed_row_bytes(spec.head_dim) / 2**30 for rows in layout.num_embeddings],
                        "cached_slots": {str(k): t.storage.cache.num_slots for k, t in tables.get("cached", {}).items()},
                        "token_ids": "uniform random over 129,280 raw ids (a synthetic map to the compressed "
                                     "vocabulary), fresh every step: hash rows nearly uniform, so the cached "
                                     "placement hits about its cache fraction (real text: 40-55%)",
                        "realtext": None if text is None else {**text.facts(), "kinds": text_kinds}}
    print(f"Engram: layers {list(spec.layer_ids)}, tables {[f'{g:.1f} GiB' for g in report['engram']['table_GiB']]} "
          f"({', '.join(kinds)}); prefetch API {api}; setup {time.perf_counter() - started:.1f} s", flush=True)
    variants = make_variants(memories, api, cuda, neighbors=args.host_neighbors, realtext_status=realtext_status,
                             disk_status=disk_status)
    if args.variants is not None:
        for variant in variants:
            if variant.status is None and variant.name not in args.variants and variant.name != "device_eager":
                variant.status = "not asked for (--variants)"
    return Setup(cuda, device, decoder, memories, variants, api, spec, generator, Clock(cuda), args.steps,
                 report.deadline, args.min_steps, 1 if args.smoke else 2, watchdog, keep,
                 path_threads=args.path_threads,
                 host_options_except_threads={k: v for k, v in host_options.items() if k != "gather_threads"},
                 order_rng=random.Random(args.seed), trace=args.trace, text=text, neighbors=neighbors,
                 rows_per_token=spec.num_columns * len(spec.layer_ids), row_bytes=packed_row_bytes(spec.head_dim),
                 text_warm=SMOKE_TEXT_WARM if args.smoke else (TEXT_WARM_TOKENS, TEXT_PROMPT_TOKENS),
                 disk_steps=args.disk_steps, disk_min_steps=min(DISK_MIN_STEPS, args.disk_steps),
                 disk_warm_steps=args.disk_warm_steps, make_disk_memory=make_disk_memory)


def token_counts(text: str) -> list[int]:
    """``--decode-tokens`` / ``--prefill-tokens``: comma-separated positive integers (empty: none)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 1,64,256, found {text!r}")
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"expected token counts >= 1, found {text!r}")
    return counts


def variant_names(text: str) -> set[str]:
    """``--variants``: comma-separated names of :data:`VARIANTS`; ``none`` and ``device`` (the bases of every
    comparison) always run."""
    known = [name for name, _, _ in VARIANTS]
    names = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; expected names among {known}")
    return names | {"none", "device"}


def ram_fractions(text: str) -> list[str]:
    """``--disk-ram-fractions``: comma-separated RAM cache fractions among those of the disk kinds
    (``step_engram.DISK_KINDS``: 0.1, 0.3); returns their kinds."""
    known = step_engram.DISK_KINDS
    choices = ",".join(f"{fraction:g}" for fraction in known.values())
    kinds = []
    for part in (part.strip() for part in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            value = None
        kind = next((k for k, f in known.items() if value is not None and abs(value - f) < 1e-9), None)
        if kind is None:
            raise argparse.ArgumentTypeError(f"expected RAM cache fractions among {choices} (comma-separated), "
                                             f"found {text!r}")
        kinds.append(kind)
    return list(dict.fromkeys(kinds))


def count_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, found {text!r}")
        return value
    return parse


def neighbor_count(text: str) -> int:
    """``--host-neighbors``: an integer from 0 to :data:`host_neighbors.MAX_HELPERS`."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected the number of helper processes (an integer from 0 to "
                                         f"{host_neighbors.MAX_HELPERS}), found {text!r}")
    if not 0 <= count <= host_neighbors.MAX_HELPERS:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {host_neighbors.MAX_HELPERS}, found {text!r}")
    return count


def hbm_fraction(text: str) -> float:
    """``--disk-hbm-fraction``: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], found {text!r}")
    return value


def positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size in GiB above 0, found {text!r}")
    return value


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def check_arguments(parser, args, cuda: bool) -> tuple[list[int], list[list[int]]] | None:
    """What the flags ask checked before any work (``parser.error``: exit 2, naming the flag and value);
    returns the host neighbours' plan of cores (the step's, each helper's), None without neighbours."""
    asked = set(args.variants or ())
    if asked & set(WITH_NEIGHBORS) and not args.host_neighbors:
        parser.error(f"--variants names {sorted(asked & set(WITH_NEIGHBORS))}, which need --host-neighbors 1 or more")
    if args.disk_directory is None:
        if asked & set(DISK):
            parser.error(f"--variants names {sorted(asked & set(DISK))}, which need --disk-directory")
        if args.write_disk_tables:
            parser.error("--write-disk-tables needs --disk-directory (where the row files go)")
    elif not args.disk_directory.is_dir():
        parser.error(f"--disk-directory {str(args.disk_directory)!r} is not a directory: make it first, on a local "
                     "disk with room for one row file per Engram layer (about --table-gib each)")
    elif not os.access(args.disk_directory, os.W_OK | os.X_OK):
        parser.error(f"--disk-directory {str(args.disk_directory)!r} is not writable")
    off = sorted(name for name in asked & set(DISK) if DISK_KIND[name] not in args.disk_ram_fractions)
    if off:
        parser.error(f"--variants names {off}, whose RAM cache fractions --disk-ram-fractions leaves out")
    if args.disk_steps is None:
        args.disk_steps = 2 if args.smoke else 10
    if asked & set(REALTEXT + DISK) and not args.smoke and not args.text_stream.is_file():
        parser.error(f"--variants names real-text variants but --text-stream {args.text_stream} is not a file: make "
                     "it with `PYTHONPATH=src python benchmarks/real_text.py stream` where the DeepSeek-V4 tokenizer "
                     "is, and carry .bench-data")
    if args.neighbor_table_gib is None:
        args.neighbor_table_gib = SMOKE_NEIGHBOR_TABLE_GIB if args.smoke else NEIGHBOR_TABLE_GIB
    if not args.host_neighbors:
        return None
    cores = host_neighbors.usable_cores()
    if cuda and args.gather_threads is None:  # one core per helper and one for the step's main thread
        args.gather_threads = host_neighbors.default_step_threads(args.host_neighbors, len(cores))
    try:
        plan = host_neighbors.plan_cores(args.host_neighbors, args.gather_threads if cuda else 0, cores)
    except ValueError as error:
        parser.error(str(error))
    total = _mem_total_gib()
    need = args.host_neighbors * args.neighbor_table_gib + (2 * args.table_gib if cuda and not args.smoke else 0)
    if total is not None and need + 8 > total:
        parser.error(f"--host-neighbors {args.host_neighbors} x --neighbor-table-gib {args.neighbor_table_gib:g} "
                     f"beside the step's tables needs {need:.1f} GiB of this machine's {total:.1f} GiB (8 GiB kept "
                     "free): fewer helpers or smaller tables")
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few steps (the CPU smoke test)")
    parser.add_argument("--json", type=Path, default=None, help="report path (default results/step-h200.json, "
                                                                 "with --smoke results/step-smoke.json)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant and T (default 40, smoke 2)")
    parser.add_argument("--min-steps", type=int, default=10, help="fewest steps the time budget may cut a phase to")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the whole run")
    parser.add_argument("--decode-tokens", type=token_counts, default=None,
                        help="comma-separated decode T (default 1,64,256)")
    parser.add_argument("--prefill-tokens", type=token_counts, default=None,
                        help="comma-separated prefill T (default 4096,8192; smoke 128)")
    parser.add_argument("--table-gib", type=float, default=25.5, help="size of each Engram table (GiB)")
    parser.add_argument("--distinct-rows", type=int, default=1 << 22,
                        help="random rows drawn per host table, repeated through it")
    parser.add_argument("--ceiling-gib", type=int, default=26, help="table of the C ceiling probe (GiB)")
    parser.add_argument("--ceiling-threads", default="8,12,14,16")
    parser.add_argument("--gather-threads", type=int, default=None,
                        help="placement option gather_threads of the host and cached tables (default: the library's)")
    parser.add_argument("--path-threads", type=token_counts, default=[],
                        help="comma-separated gather_threads for extra runs of the host path alone at T=8192")
    parser.add_argument("--host-gather-worker", choices=("auto", "native", "python"), default=None,
                        help="placement option host_gather_worker of the host and cached tables")
    parser.add_argument("--variants", type=variant_names, default=None,
                        help="comma-separated variants to run (default all; none and device always run): more "
                             "rounds of the ones a question is about in the same time")
    parser.add_argument("--trace", action="store_true",
                        help="after the timed steps of the largest prefill T, one step of each of "
                             f"{', '.join(TRACED)} under torch.profiler: the main stream's busy and idle time "
                             "(traces gzipped next to the report)")
    parser.add_argument("--text-stream", type=Path, default=STREAM_PATH,
                        help="token ids of held-out text for the real-text variants (real_text.py stream; default "
                             ".bench-data/cache_stream_v41.npz; with --smoke a synthetic stream where it is missing)")
    parser.add_argument("--host-neighbors", type=neighbor_count, default=0,
                        help="helper processes that gather one neighbour GPU's host rows each in lockstep with the "
                             "steps of the *_neighbors variants (a node's GPUs sharing host memory), pinned to the "
                             "cores after the step's first --gather-threads + 1 (default then: one core per helper)")
    parser.add_argument("--neighbor-table-gib", type=positive_gib, default=None,
                        help=f"each helper's own host table (default {NEIGHBOR_TABLE_GIB:g} GiB; smoke 16 MiB)")
    parser.add_argument("--disk-directory", type=Path, default=None,
                        help="directory of the disk variants' row files (an existing one, on a local disk with room "
                             "for one file of --table-gib per Engram layer); without it they are skipped")
    parser.add_argument("--disk-ram-fractions", type=ram_fractions, default=ram_fractions("0.1,0.3"),
                        help="RAM cache fractions of the disk variants to run, among 0.1 and 0.3 (default both)")
    parser.add_argument("--disk-hbm-fraction", type=hbm_fraction, default=None,
                        help="the disk tables' HBM cache, a fraction of their own rows in [0, 1] (default: the slots "
                             "of the cached real-text variant, 2%% of V4.1's rows)")
    parser.add_argument("--disk-read-threads", type=count_at_least(0), default=8,
                        help="placement option read_threads of the disk tables")
    parser.add_argument("--disk-steps", type=count_at_least(1), default=None,
                        help=f"timed steps per disk variant and T (default 10, smoke 2; the budget cuts them to "
                             f"{DISK_MIN_STEPS} at fewest), in the first rounds")
    parser.add_argument("--disk-warm-steps", type=count_at_least(0), default=4,
                        help="each phase's warm-up lookups of the disk tables: prefill, this many steps of T tokens "
                             f"before the first step; decode, {step_engram.DISK_WARM_PIECE} tokens each, the ends of "
                             "the requests' prompts")
    parser.add_argument("--write-disk-tables", action="store_true",
                        help="only build the host tables and write (or reuse) their row files in --disk-directory, "
                             "print how long, and exit")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--stall-s", type=float, default=120.0,
                        help="a warm-up or step running longer ends the run, its report written")
    args = parser.parse_args(argv)
    cores_plan = check_arguments(parser, args, torch.cuda.is_available())
    if args.write_disk_tables:
        return write_disk_tables(args)
    begun = time.perf_counter()
    if args.steps is None:
        args.steps = 2 if args.smoke else 40
    args.min_steps = min(args.min_steps, args.steps)
    decode = list(DECODE_TOKENS) if args.decode_tokens is None else args.decode_tokens
    prefill = ([128] if args.smoke else list(PREFILL_TOKENS)) if args.prefill_tokens is None else args.prefill_tokens
    path = args.json or BENCHMARKS / "results" / ("step-smoke.json" if args.smoke else "step-h200.json")

    import triton

    cuda = torch.cuda.is_available()
    report = Report(path, device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                    triton=triton.__version__, commit=_commit(),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    smoke=args.smoke, steps_per_variant=args.steps, notes=[LEFT_OUT])
    report.deadline = begun + args.budget_s

    def stop(signum, frame):  # a kill from outside still leaves the report of what finished
        raise SystemExit(f"stopped by signal {signum}")

    previous_handler = signal.signal(signal.SIGTERM, stop)
    watchdog, neighbors, pinned = None, None, None
    try:
        if cuda:  # before the pinned tables take the host's memory
            report["host_gather_ceiling"] = common.host_gather_ceiling(args.ceiling_gib, args.ceiling_threads,
                                                                            "0,16")
            ceiling = report["host_gather_ceiling"]
            print(f"host gather ceiling (C, {ceiling.get('table_gib')} GiB, 196,608 rows of 272 B): "
                  f"{ceiling.get('best_GBps', ceiling.get('skipped'))} GB/s, best {ceiling.get('best')}", flush=True)
            from bench_host import copy_engine_gbps

            report["copy_engine_GBps"] = copy_engine_gbps()
            print(f"copy engine, pinned host -> device: {report['copy_engine_GBps']:.1f} GB/s", flush=True)
        else:
            report["host_gather_ceiling"] = {"skipped": "no CUDA (smoke on the CPU)"}
        watchdog = Watchdog(report, args.stall_s, report.deadline)
        if cores_plan is not None:  # after the ceiling probe and the copy engine, which use every core
            step_cores, helper_cores = cores_plan
            from engram.table.host_memory.rows import packed_row_bytes

            neighbors = host_neighbors.HostNeighbors(helper_cores, int(args.neighbor_table_gib * 2**30),
                                                     packed_row_bytes(step_engram.head_dim(args.smoke)),
                                                     seed=args.seed, timeout_s=min(60.0, args.stall_s))
            watchdog.before_exit.append(neighbors.close)
            pinned = (host_neighbors.pin_process(step_cores), torch.get_num_threads())
            torch.set_num_threads(len(step_cores))  # torch's CPU threads on the step's cores only
            neighbors.spawn()  # their tables fill while the step's are built
            report["host_neighbors_setup"] = {"count": neighbors.count, "step_cores": step_cores,
                                              "helper_cores": helper_cores, "table_bytes": neighbors.table_bytes,
                                              "row_bytes": neighbors.row_bytes, "gather_threads": args.gather_threads}
        watchdog.arm("setup (tables, weights, GEMM checks)")
        setup = build(args, report, watchdog, neighbors)
        if neighbors is not None:
            watchdog.arm("host neighbours' tables")
            report["host_neighbors_setup"]["helpers"] = neighbors.wait_ready()
            print(f"host neighbours: {neighbors.count} helper processes on cores {report['host_neighbors_setup']['helper_cores']} "
                  f"(the step on {report['host_neighbors_setup']['step_cores']}), "
                  f"{neighbors.table_bytes / 2**30:.2f} GiB each, rows of {neighbors.row_bytes} B", flush=True)
        watchdog.disarm()
        report.write()
        wanted = [(m, t) for m, t in PRIORITY if (m == "decode" and t in decode) or (m == "prefill" and t in prefill)]
        wanted += [("decode", t) for t in decode if ("decode", t) not in wanted]
        wanted += [("prefill", t) for t in prefill if ("prefill", t) not in wanted]
        setup.plan_order = wanted
        for mode, tokens in wanted:
            if time.perf_counter() > setup.deadline - 20:
                report.setdefault("skipped_phases", []).append(f"{mode} T={tokens} (time budget)")
                print(f"skipped {mode} T={tokens}: time budget", flush=True)
                continue
            try:
                run_phase(setup, report, mode, tokens)
            except Exception as error:  # noqa: BLE001 - keep the phases that can still run
                report.error(f"{mode} T={tokens}", error)
            setup.done.add((mode, tokens))
            report.write()
            if cuda:
                torch.cuda.empty_cache()
    finally:
        if neighbors is not None:
            neighbors.close()
        if pinned is not None:
            host_neighbors.unpin_process(pinned[0])
            torch.set_num_threads(pinned[1])
        if watchdog is not None:
            watchdog.stop()
        signal.signal(signal.SIGTERM, previous_handler)
        report["seconds"] = time.perf_counter() - begun
        report.write()
        print_table(report)
    return 1 if report.get("errors") else 0


def write_disk_tables(args) -> int:
    """``--write-disk-tables``: each Engram layer's rows as the step builds them (``step_engram.layer_rows``),
    and their row files in ``--disk-directory`` written (layers at once) or reused. Prints how long."""
    from concurrent.futures import ThreadPoolExecutor

    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    spec = step_engram.make_spec(None if args.smoke else step_engram.v41_vocab_size_for(args.table_gib), args.smoke)
    layout = step_engram.EngramLayout(spec)
    layers = [step_engram.layer_rows(layout, index, cuda, args.distinct_rows) for index in range(len(spec.layer_ids))]
    built_s = time.perf_counter() - started
    print(f"rows of {len(layers)} layers built in {built_s:.1f} s; row files in {args.disk_directory}", flush=True)
    with ThreadPoolExecutor(len(layers), thread_name_prefix="bench-step-write") as pool:
        futures = [pool.submit(step_engram.disk_row_file, values, scales, args.disk_directory, layer_id, digest)
                   for layer_id, (values, scales, digest, _) in zip(spec.layer_ids, layers)]
        failed = 0
        for layer_id, future in zip(spec.layer_ids, futures):
            try:
                row_file, seconds, written = future.result()
            except (OSError, ValueError) as error:
                print(f"FAILED layer {layer_id}'s row file: {type(error).__name__}: {error}", flush=True)
                failed += 1
                continue
            print(f"layer {layer_id}: {'wrote' if written else 'reused'} {row_file.path} "
                  f"({row_file.layout.file_bytes / 2**30:.2f} GiB) in {seconds:.1f} s", flush=True)
    print(f"row files done in {time.perf_counter() - started:.1f} s", flush=True)
    return 1 if failed else 0


def _rounded(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{part:.3f}" for part in value) + "]"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _signed(value) -> str:
    return "" if value is None else f"{value:+.2f}%"


def print_table(report: dict) -> None:
    phases = sorted(report.get("phases", []), key=lambda p: (p["mode"] != "decode", p["T"]))
    print(f"\nEngram in a served decoder step: {report['device']} (torch {report['torch']}, Triton {report['triton']}), "
          f"commit {report['commit'][:12]}; step = {report.get('decoder', {}).get('layers')} stand-in layers")
    width = max([18] + [len(name) for phase in phases for name in phase["variants"]])
    print(f"{'step':>14} {'variant':>{width}} {'median ms':>10} {'IQR ms':>15} {'min-max ms':>17} {'vs none':>8} "
          f"{'vs device':>9} {'paired vs none':>14} {'paired vs device':>16} {'its 95% interval':>17}")
    for phase in phases:
        label = f"{phase['mode']} T={phase['T']}"
        for name, stats in phase["variants"].items():
            if "median_ms" not in stats:
                print(f"{label:>14} {name:>{width}} {stats.get('status', '')}")
                continue
            vs_none = "" if stats.get("vs_none_pct") is None else f"{stats['vs_none_pct']:+.2f}%"
            vs_device = "" if stats.get("vs_device_pct") is None else f"{stats['vs_device_pct']:+.2f}%"
            interval = stats.get("paired_vs_device_ci95_pct")
            interval = "" if interval is None else f"[{interval[0]:+.2f}, {interval[1]:+.2f}]"
            print(f"{label:>14} {name:>{width}} {stats['median_ms']:10.3f} "
                  f"{stats['p25_ms']:7.3f}-{stats['p75_ms']:<7.3f} {stats['min_ms']:8.3f}-{stats['max_ms']:<8.3f} "
                  f"{vs_none:>8} {vs_device:>9} {_signed(stats.get('paired_vs_none_pct')):>14} "
                  f"{_signed(stats.get('paired_vs_device_pct')):>16} {interval:>17}")
        stream = {name: stats["engram_stream_ms"] for name, stats in phase["variants"].items()
                  if stats.get("engram_stream_ms") is not None}
        if stream:
            print(f"{label:>14} {'':>{width}} Engram's spans of the main stream (hash + prefetch, each layer; median "
                  "ms a step): " + ", ".join(f"{name} {ms:.3f}" for name, ms in stream.items()))
        traced = {name: figures for name, figures in (phase.get("trace") or {}).items()
                  if figures.get("main_stream") is not None}
        if traced:
            print(f"{label:>14} {'':>{width}} one traced step, main stream busy / idle ms: " + ", ".join(
                f"{name} {f['main_busy_ms']:.2f} / {f['main_idle_ms']:.2f}" for name, f in traced.items()))
        for name, pair in (phase.get("pairs") or {}).items():
            interval = pair.get("ci95_pct")
            print(f"{label:>14} {'':>{width}} paired {name}: {pair['pct']:+.2f}% over {pair['rounds']} rounds"
                  + ("" if interval is None else f" [{interval[0]:+.2f}, {interval[1]:+.2f}]")
                  + f", min-max [{pair['min_pct']:+.2f}, {pair['max_pct']:+.2f}]")
        for kind, cache in (phase.get("row_cache") or {}).items():
            if cache.get("hit_rate") is not None:
                print(f"{label:>14} {'':>{width}} {kind}: hit rate {cache['hit_rate']:.1%} over {cache['steps']} steps, "
                      f"host bytes {cache['host_bytes_ratio']:.1%} of host's ({cache['path']})")
        for kind, tiers in (phase.get("disk_tiers") or {}).items():
            hbm, ram = tiers.get("hbm_hit_rate"), tiers.get("ram_hit_rate")
            print(f"{label:>14} {'':>{width}} {kind}: HBM hits {'n/a' if hbm is None else f'{hbm:.1%}'}, RAM hits "
                  f"{'n/a' if ram is None else f'{ram:.1%}'} of the HBM misses, {tiers['disk_reads_per_step']:.0f} "
                  f"rows from disk a step over {tiers['steps']} steps")
        found = phase.get("host_neighbors") or {}
        if found.get("steps"):
            print(f"{label:>14} {'':>{width}} host neighbours: {found['GBps']:.2f} GB/s together over {found['steps']} "
                  f"steps ({found['bytes_per_step'] / 1e6:.1f} MB a step in {found['window_ms']:.2f} ms)")
        floor = phase.get("floor_pct_of_none")
        print(f"{label:>14} {'':>{width}} decoder layer alone {phase.get('decoder_layer_us', 0):.1f} us, floor (2 Engram "
              f"layers' wkv + gate) {phase.get('floor_us', 0):.1f} us"
              + ("" if floor is None else f" = {floor:.2f}% of the step without Engram")
              + f", {phase.get('steps')} steps per variant" + (f" ({phase['steps_cut']})" if phase.get("steps_cut") else "")
              + ("" if not phase.get("equal_to_device") else
                 f"; outputs equal to device: {sum(phase['equal_to_device'].values())}/{len(phase['equal_to_device'])}"))
    ceiling = report.get("host_gather_ceiling") or {}
    print(f"copy engine {report.get('copy_engine_GBps', 'n/a')} GB/s; host gather ceiling (C) "
          f"{ceiling.get('best_GBps', ceiling.get('skipped'))}; host path alone at T=8192 "
          f"{(report.get('host_path_T8192') or {}).get('GBps', 'n/a')} GB/s")
    for note in report.get("notes", []):
        print(f"note: {note}")
    keys = headline(report)
    print("headline: " + ", ".join(f"{k} {_rounded(v)}" for k, v in keys.items()))
    if report.get("errors"):
        print(f"{len(report['errors'])} errors (see JSON): " + "; ".join(e["what"] for e in report["errors"]))


if __name__ == "__main__":
    sys.exit(main())
