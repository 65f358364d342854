#!/usr/bin/env bash
# Issue 13 on one H200, unattended: GPU tests of the wkv paths and of everything built on them,
# a compute-sanitizer memcheck of every kernel (the wkv kernels included), then bench_layer.py.
# Usage (device tool, repository root): ENGRAM_COMMIT=<sha> bash benchmarks/run_layer_h200.sh [tests|memcheck|bench|small_m|all]
# small_m (not part of all): GPU tests of the split-K small-T GEMM, its launch-shape sweep (~1 min), then
# the layer at T = 1, 64, 128 with every path (a_small_m among them).
# (the device copy of the tree has no .git, so pass the sha). Logs and layer-h200.json land in $OUT.
# Expected (not yet run): tests ~4-6 min, memcheck ~2-4 min, bench ~3-5 min: one 10-minute call each.
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
status=0
if [[ $what == tests || $what == all ]]; then
  python -m pytest tests/test_wkv_fp8.py -q -m "gpu or interpreter" -p no:cacheprovider -rs 2>&1 | tee "$OUT/wkv-tests.log" | tail -15 || status=1
  python -m pytest tests/test_wkv.py tests/test_memory.py tests/test_gather_kernel.py \
      tests/test_gate_kernel.py tests/test_table.py tests/test_fp8.py -q -m gpu -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/layer-gpu-tests.log" | tail -25 || status=1
fi
if [[ $what == memcheck || $what == all ]]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/memcheck_kernels.py 2>&1 \
    | tee "$OUT/layer-memcheck.log" | tail -3 || status=1
fi
if [[ $what == bench || $what == all ]]; then
  python benchmarks/bench_layer.py 2>&1 | tee "$OUT/bench-layer.log" | tail -60 || status=1
fi
if [[ $what == small_m ]]; then
  python -m pytest tests/test_wkv_small_m.py -q -m gpu -p no:cacheprovider -rs 2>&1 | tee "$OUT/wkv-small-m-tests.log" | tail -8 || status=1
  python benchmarks/wkv_small_m_sweep.py 2>&1 | tee "$OUT/wkv-small-m-sweep.log" | tail -90 || status=1
  python benchmarks/bench_layer.py --tokens 1,64,128 --no-sweep 2>&1 | tee "$OUT/bench-layer-small-m.log" | tail -40 || status=1
fi
exit $status
