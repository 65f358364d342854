"""Host-clock timing for the benchmarks that need it (host work, or host + device)."""

from __future__ import annotations

import statistics
import time

import torch


def median_wall_us(call, repeats: int = 30, warmup: int = 3, *, until_device_done: bool = True) -> float:
    """Median microseconds of ``call()``, each run alone after a device sync. With
    ``until_device_done`` the clock stops after a second sync (the call's whole latency);
    without, when the call returns (the host time an engine's thread pays)."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if until_device_done:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)
