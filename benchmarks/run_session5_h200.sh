#!/usr/bin/env bash
# Session 5's device calls (carry .bench-data). Usage: ENGRAM_COMMIT=<sha> bash benchmarks/run_session5_h200.sh MODE
#  measure: GPU tests of this session's new code (eager step, direct launches, cached misses through the
#           host gather, the host row copy), bench_host, bench_cache, bench_kernels
#  suite:   the GPU suite RUNS (5) times in a row, each run as two pytest processes sharing the GPU
#           (test_hash_kernel.py, the slowest file, beside all the others), then memcheck, then
#           bench_host if the call has time left
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $1 == measure ]]; then
  timeout 200 python -m pytest tests/test_eager_step.py tests/test_triton_launch.py tests/test_row_copy.py \
    tests/test_cached_large_lookups.py tests/test_cached_placement.py tests/test_host_placement.py \
    -m "gpu or not interpreter" -q -p no:cacheprovider -ra -x 2>&1 | tee "$OUT/gpu-tests-new.log" | tail -8
  timeout 170 python benchmarks/bench_host.py 2>&1 | grep -v Warning | tee "$OUT/bench-host-h200.log" \
    | grep -v "^direct T=64" | tail -40
  timeout 150 python benchmarks/bench_cache.py 2>&1 | tee "$OUT/bench-cache-h200.log" | tail -30
  timeout 150 python benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench-kernels-h200.log" | grep -v "^gather T=" | tail -30
else
  RUNS=${RUNS:-5}
  : > "$OUT/gpu-tests-h200.log"
  for run in $(seq 1 "$RUNS"); do
    start=$(date +%s)
    timeout 300 python -m pytest tests/test_hash_kernel.py -q -m gpu -p no:cacheprovider > /tmp/part1.log 2>&1 &
    first=$!
    timeout 300 python -m pytest tests -q -m gpu -p no:cacheprovider --deselect tests/test_hash_kernel.py \
      --ignore=tests/test_hash_kernel.py > /tmp/part2.log 2>&1
    code2=$?
    wait $first
    code1=$?
    { echo "== GPU suite run $run of $RUNS ($(( $(date +%s) - start )) s): test_hash_kernel.py exit $code1, others exit $code2"
      tail -1 /tmp/part1.log; tail -1 /tmp/part2.log; grep -E "FAILED|ERROR" /tmp/part1.log /tmp/part2.log; } \
      | tee -a "$OUT/gpu-tests-h200.log"
    if (( code1 != 0 || code2 != 0 )); then  # keep the failures' tracebacks and seeds
      cat /tmp/part1.log /tmp/part2.log > "$OUT/gpu-tests-failed-run-$run.log"
    fi
  done
  MEMCHECK_FUZZ_CASES=40 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python benchmarks/memcheck_kernels.py 2>&1 | tee "$OUT/memcheck.log" | tail -4
  echo "memcheck exit: $?"
  left=$(( 575 - SECONDS ))  # what is left of one device call's 600 s
  if [[ ${SUITE_TAIL:-} == kernels ]] && (( left > 60 )); then  # issue 9's timings on the code the suite ran
    timeout $left python benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench-kernels-h200.log" | tail -22
  elif (( left > 120 )); then
    timeout $left python benchmarks/bench_host.py 2>&1 | grep -v Warning | tee "$OUT/bench-host-h200.log" \
      | grep -v "^direct T=64" | tail -24
  fi
fi
