#!/usr/bin/env bash
# Session 8 probes on one H200 machine (one device call each); outputs under $OUT.
#   bash benchmarks/run_session8_probe.sh host-and-gemm   # call 1: host DRAM gather ceiling, L2 warm-up of the wkv weight
#   bash benchmarks/run_session8_probe.sh pages-split-layer  # call 2: page size / table size, GEMM split forms, layer T=64
#   bash benchmarks/run_session8_probe.sh benches         # call 3 (carry .bench-data): quantize/gate shapes at T = 1, 64,
#                                                         # the whole layer at every T, the host placement
set -x
export PYTHONPATH=src
case "${1:-}" in
host-and-gemm)
  lscpu | head -25; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; free -g
  nvcc --version | tail -2; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  cc -O3 -pthread -o /tmp/host_gather_ceiling benchmarks/host_gather_ceiling.c && /tmp/host_gather_ceiling 32 1,2,4,8,12,14,16 0,16,32 2>&1 | tee $OUT/host-dram-h200.log
  python benchmarks/probe_wkv_l2_prefetch.py --json $OUT/wkv-l2-prefetch-h200.json 2>&1 | grep -v Warn | tee $OUT/wkv-l2-prefetch-h200.log
  for w in 1024 131072; do CUBLASLT_WORKSPACE_SIZE=$w python benchmarks/probe_wkv_l2_prefetch.py --gemm-only 2>&1 | grep -v Warn | tee -a $OUT/wkv-l2-prefetch-h200.log; done
  ;;
pages-split-layer)
  cc -O3 -pthread -o /tmp/host_gather_ceiling benchmarks/host_gather_ceiling.c
  { /tmp/host_gather_ceiling 4 8,14,16 0,16
    /tmp/host_gather_ceiling 32 8,14,16 0,16
    echo 34 > /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages; cat /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
    /tmp/host_gather_ceiling 32 8,14,16 0,16 1g
    echo 0 > /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages; } 2>&1 | tee $OUT/host-dram-pages-h200.log
  python benchmarks/probe_scaled_mm_split.py --json $OUT/scaled-mm-split-h200.json 2>&1 | grep -v Warn | tee $OUT/scaled-mm-split-h200.log
  python benchmarks/bench_layer.py --no-sweep --tokens 64,8192 2>&1 | grep -v Warn | tail -40 | tee $OUT/bench-layer-t64-t8192.log
  ;;
benches)
  timeout 120 python benchmarks/small_t_sweep.py --tokens 1,64 --json $OUT/small-t-sweep-h200.json 2>&1 | grep -v Warn | tail -30
  timeout 240 python benchmarks/bench_layer.py --no-sweep 2>&1 | grep -v Warn | tee $OUT/bench-layer-h200.log | tail -30
  timeout 200 python benchmarks/bench_host.py 2>&1 | grep -v Warn | tee $OUT/bench-host-h200.log | grep -v "^direct T=64" | tail -30
  ;;
*) echo "usage: $0 host-and-gemm | pages-split-layer | benches"; exit 2 ;;
esac
