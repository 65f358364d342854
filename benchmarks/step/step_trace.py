"""One step of a variant under ``torch.profiler``: how long each CUDA stream was busy and idle within it.

The step benchmark's CUDA events say how long a step took and how long Engram's own calls held the main
stream; a trace says where the rest of the main stream's time went: ``busy`` is the union of its kernels',
copies' and memsets' intervals, ``idle`` the gaps between its first and last operation (the GPU waiting
for the host to launch, or the stream waiting on another stream or a host word). The main stream is the one
with the most busy time.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def stream_occupancy(events: list[dict]) -> dict[int, dict]:
    """``{stream: {"ops", "busy_us", "span_us", "idle_us", "first_us", "last_us"}}`` of the GPU operations
    (chrome-trace events of :data:`GPU_CATEGORIES` with ``ts`` / ``dur`` in us and ``args["stream"]``):
    ``busy`` is the union of their intervals, ``span`` first start to last end, ``idle = span - busy``."""
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in GPU_CATEGORIES:
            continue
        stream = (event.get("args") or {}).get("stream")
        if stream is None:
            continue
        start = float(event["ts"])
        by_stream.setdefault(int(stream), []).append((start, start + float(event.get("dur", 0.0))))
    figures = {}
    for stream, intervals in by_stream.items():
        intervals.sort()
        busy, (open_start, open_end) = 0.0, intervals[0]
        for start, end in intervals[1:]:
            if start > open_end:
                busy += open_end - open_start
                open_start, open_end = start, end
            else:
                open_end = max(open_end, end)
        busy += open_end - open_start
        first, last = intervals[0][0], max(end for _, end in intervals)
        figures[stream] = {"ops": len(intervals), "busy_us": busy, "span_us": last - first,
                           "idle_us": last - first - busy, "first_us": first, "last_us": last}
    return figures


def main_stream_figures(events: list[dict]) -> dict:
    """The main stream's busy and idle ms and every stream's figures (``main_stream`` None without GPU
    operations, as on the CPU)."""
    streams = stream_occupancy(events)
    if not streams:
        return {"main_stream": None, "streams": {}}
    main = max(streams, key=lambda stream: streams[stream]["busy_us"])
    figures = streams[main]
    return {"main_stream": main, "main_busy_ms": figures["busy_us"] / 1e3, "main_idle_ms": figures["idle_us"] / 1e3,
            "main_span_ms": figures["span_us"] / 1e3, "streams": {str(s): f for s, f in streams.items()}}


def profile_call(call, trace_path: Path | None = None) -> dict:
    """Run ``call()`` once under ``torch.profiler`` (CPU, and CUDA where there is a GPU) and return
    :func:`main_stream_figures` of its trace; ``trace_path`` (``.json.gz``): keep the trace there."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    handle, plain = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(plain)
        text = Path(plain).read_text()
    finally:
        os.unlink(plain)
    trace = json.loads(text)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace_path, "wt") as out:
            out.write(text)
    return main_stream_figures(events)
