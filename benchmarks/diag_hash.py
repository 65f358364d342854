"""Diagnosis of the hash kernel's time: harness floor (an empty kernel in a graph),
and the hash kernel alone at T = 1 and 8192 (run under ncu for kernel durations)."""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hash_bench import bench_hash  # noqa: E402


@triton.jit
def empty_kernel(pointer):
    tl.store(pointer + tl.program_id(0), 1)


def main():
    buffer = torch.zeros(1024, dtype=torch.int32, device="cuda")
    empty_kernel[(1,)](buffer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        empty_kernel[(1,)](buffer)
    flushed = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(1000):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"empty kernel graph replay: do_bench {flushed:.1f} us, back-to-back {start.elapsed_time(end):.1f} us / 1000 ")
    if "--hash" in sys.argv:
        for row in bench_hash((1, 8192)):
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
