#!/usr/bin/env bash
# Session 6's device calls (carry .bench-data). Usage: ENGRAM_COMMIT=<sha> bash benchmarks/run_session6_h200.sh MODE
#  measure: GPU tests of the prepared launches (BoundLaunch, the gather's and gate's bound launches),
#           bench_kernels (issue 9's host timings), the hash kernel's GPU tests (PreparedHash), then the C
#           gather probe under passive and active OpenMP waits (issue 11's open lead) if time is left
#  suite:   the GPU suite RUNS (5) times in a row, then memcheck, then bench_kernels if time is left
#           (run_session5_h200.sh suite)
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if [[ $1 == measure ]]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 150 python -m pytest tests/test_triton_launch.py tests/test_eager_step.py tests/test_gate_kernel.py \
    tests/test_gather_kernel.py -m gpu -q -p no:cacheprovider -ra 2>&1 | tee "$OUT/gpu-tests-new.log" | tail -6
  timeout 170 python benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench-kernels-h200.log" | grep -v "^gather T=" | tail -32
  timeout 170 python -m pytest tests/test_hash_kernel.py -m gpu -q -p no:cacheprovider -ra -x 2>&1 \
    | tee -a "$OUT/gpu-tests-new.log" | tail -4
  left=$(( 560 - SECONDS ))
  if (( left > 60 )); then
    OUT=$OUT timeout $left bash benchmarks/run_session5_h200.sh omp
  fi
else
  SUITE_TAIL=kernels bash benchmarks/run_session5_h200.sh suite
fi
