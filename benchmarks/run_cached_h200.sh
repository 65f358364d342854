#!/usr/bin/env bash
# One device call (under 10 minutes): the host/cached placement GPU tests, then bench_cache.
# Usage (device tool, carry .bench-data): ENGRAM_COMMIT=<sha> bash benchmarks/run_cached_h200.sh
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
timeout 240 python -m pytest tests/test_cached_large_lookups.py tests/test_cached_placement.py tests/test_host_placement.py \
  -m gpu -q -p no:cacheprovider -ra 2>&1 | tee "$OUT/gpu-tests-cached.log" | tail -15
timeout 300 python benchmarks/bench_cache.py 2>&1 | tee "$OUT/bench-cache-h200.log" | tail -45
