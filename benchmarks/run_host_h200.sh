#!/usr/bin/env bash
# One device call: host/cached placement GPU tests, bench_host, bench_cache, host costs.
# Usage (device tool, carry .bench-data): ENGRAM_COMMIT=<sha> bash benchmarks/run_host_h200.sh
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
timeout 120 python -m pytest tests/test_host_placement.py tests/test_cached_placement.py -m gpu -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu-tests-host-cached.log" | tail -4
timeout 200 python benchmarks/bench_host.py 2>&1 | grep -v Warning | tee "$OUT/bench-host-h200.log" | grep -v "^direct T=64"
timeout 200 python benchmarks/bench_cache.py 2>&1 | tee "$OUT/bench-cache-h200.log" | tail -30
timeout 60 python benchmarks/host_cost_bench.py 2>&1 | tee "$OUT/host-cost-h200.log" | tail -12
