#!/usr/bin/env bash
# One device call: GPU tests, memcheck of every kernel, then the kernel benchmark.
# Usage (device tool): ENGRAM_COMMIT=<sha> bash benchmarks/run_h200.sh   (logs and JSON land in $OUT;
# the device copy of the tree has no .git, so pass the sha from here)
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -m pytest tests -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -3
compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/memcheck_kernels.py 2>&1 \
  | tee "$OUT/memcheck.log" | tail -3
python benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench.log" | grep -v "^gather T=" | tail -40
