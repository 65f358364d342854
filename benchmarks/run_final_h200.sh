#!/usr/bin/env bash
# Session 4's device calls. Usage (device tool, carry .bench-data): ENGRAM_COMMIT=<sha> bash benchmarks/run_final_h200.sh a|b
#  a: the split-K small-T GEMM (tests, sweep, layer at T = 1, 64, 128), host/cached GPU tests, memcheck
#     of every kernel (malformed-metadata fuzz cut to MEMCHECK_FUZZ_CASES calls)
#  b: the whole GPU suite once, then bench_host
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
if [[ $1 == a ]]; then
  timeout 330 bash benchmarks/run_layer_h200.sh small_m 2>&1 | grep -v "^ *skipped"
  timeout 90 python -m pytest tests/test_host_placement.py tests/test_cached_placement.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu-tests-host-cached.log" | tail -4
  MEMCHECK_FUZZ_CASES=${MEMCHECK_FUZZ_CASES:-40} timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python benchmarks/memcheck_kernels.py 2>&1 | tee "$OUT/memcheck.log" | tail -4
  echo "memcheck exit: $?"
else
  timeout 330 python -m pytest tests -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -6
  timeout 200 python benchmarks/bench_host.py 2>&1 | grep -v Warning | tee "$OUT/bench-host-h200.log" | grep -v "^direct T=64"
fi
