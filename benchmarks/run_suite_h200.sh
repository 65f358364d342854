#!/usr/bin/env bash
# The GPU suite RUNS times in a row (issue 9: five passing runs, log committed), then the
# host cost of eager calls. Usage (device tool): RUNS=5 bash benchmarks/run_suite_h200.sh
# Run 1 prints the 40 slowest tests; TRITON_CACHE_DIR (default ~/.triton/cache) keeps the
# compiled kernels between runs.
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
RUNS=${RUNS:-1}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "compiler: $(command -v cc gcc | head -1); cores: $(nproc); THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
: > "$OUT/gpu-tests-runs.log"
for run in $(seq 1 "$RUNS"); do
  durations=$([[ $run == 1 ]] && echo "--durations=40" || echo "")
  start=$(date +%s)
  timeout 400 python -m pytest tests -q -m gpu -p no:cacheprovider $durations 2>&1 > "$OUT/gpu-tests-run$run.log"
  code=$?
  echo "GPU suite run $run of $RUNS: exit $code, $(( $(date +%s) - start )) s: $(tail -1 "$OUT/gpu-tests-run$run.log")" \
    | tee -a "$OUT/gpu-tests-runs.log"
done
du -sh "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null
if [[ -z $SKIP_HOST_COST ]]; then
  timeout 200 python benchmarks/host_cost_bench.py 2>&1 | grep -v Warning | tee "$OUT/host-cost-h200.log"
fi
