#!/usr/bin/env bash
# One device call: GPU tests (RUNS times), memcheck of every kernel, the gate-flake probe,
# then the kernel benchmark with host costs.
# Usage (device tool): ENGRAM_COMMIT=<sha> RUNS=1 bash benchmarks/run_h200.sh   (logs and JSON land in
# $OUT; the device copy of the tree has no .git, so pass the sha from here)
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
RUNS=${RUNS:-1}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for run in $(seq 1 "$RUNS"); do
  echo "GPU suite run $run of $RUNS"
  python -m pytest tests -q -m gpu -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -3
done
compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/memcheck_kernels.py 2>&1 \
  | tee "$OUT/memcheck.log" | tail -4
echo "memcheck exit: $?"
python benchmarks/gate_flake_probe.py 40 2>&1 | tee "$OUT/gate-flake.log" | tail -6
python benchmarks/bench_kernels.py 2>&1 | tee "$OUT/bench.log" | grep -v "^gather T=" | tail -45
