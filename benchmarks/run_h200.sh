#!/usr/bin/env bash
# The GPU suite and the maintained benchmarks on an H200 machine, run from the repository root.
#
#   ENGRAM_COMMIT=<sha> bash benchmarks/run_h200.sh [--runs N] [--print] SUBCOMMAND...
#
# Subcommands, run in the order given (each fits one 10-minute device call; `all` does not):
#   suite     the GPU tests of tests/ (-m gpu) N times (default 1), each run as two pytest processes
#             sharing the GPU (test_hash_kernel.py, the slowest file, beside all the others; about
#             300 s on the H200), interrupted at 540 s so pytest still names the test it was in
#   memcheck  compute-sanitizer memcheck of every kernel (40 malformed-metadata cases)
#   kernels   bench_kernels.py: hash, gather, gate against the HBM copy ceiling; host time of eager calls
#   layer     bench_layer.py --no-sweep: the whole layer for every wkv path
#   host      bench_host.py: placement "host" on a 34 GiB table (carry .bench-data for real-text ids)
#   cache     bench_cache.py: placements host / cached / device on held-out text (carry .bench-data)
#   cache-update bench_cache_update.py: the HBM cache's update, kernels against the torch path
#   step      bench_step.py: what Engram adds to a whole served decoder step (and one traced step of
#             a few variants at T = 8192)
#   step-keys bench_step.py on the host keys' variants only (none, device, its control, host prefetched
#             right after hashing and after layer 0) at decode T = 64 and prefill T = 8192, 100 rounds
#   step-cache bench_step.py on the cached keys' variants only: cached against host prefetched, on uniform
#             ids and on held-out text (carry .bench-data), and on the text with 7 helper processes
#             gathering host rows beside each step (a node's other GPUs, a core each; the step's gather on
#             the cores left but one: 8 threads on 16), at decode T = 64 and prefill T = 8192
#   step-disk bench_step.py on placement disk (2 x 20 GiB row files in ./.bench-disk/step, written first
#             by --write-disk-tables, ~110 s): RAM caches 0.1 and 0.3, HBM cache 0.02, on held-out text (carry
#             .bench-data) against device (eager at decode) and host, at decode T = 64 and prefill T = 8192
#   disk      bench_disk.py: the disk tier's row reader against the disk's random-read ceiling (a 20 GiB
#             row file in ./.bench-disk/ on the machine's local disk, written on first use)
#   disk-lookup bench_disk_lookup.py: placement "disk" (a 2 GiB row file, RAM cache 0.1) against "host" over
#             as many rows, prefetched and direct, uniform ids and held-out text (carry .bench-data)
#   parallel  bench_parallel.py: tensor-parallel ranks over NCCL, one per visible GPU
#   node      bench_parallel.py --mode node: placement "node" (peer, exchange) against device and
#             host on one table over every visible GPU, with the peer copy ceiling
#   all       suite, memcheck, then every benchmark above but step-keys, step-cache and step-disk
# Logs (and the benchmarks' JSON) go to $OUT if set, else benchmarks/results/. --print prints the
# commands instead of running them. The device copy of the tree has no .git: pass ENGRAM_COMMIT.
# Exit status: 0 when every command passed, 1 when one failed, 2 on a bad command line.
set -o pipefail

usage() {
  sed -n '2,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

runs=1
print_only=0
commands=()
while (( $# )); do
  case $1 in
    --runs)
      [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "run_h200.sh: --runs: expected a positive integer, got '${2:-}'" >&2; usage; }
      runs=$2; shift 2 ;;
    --print) print_only=1; shift ;;
    suite|memcheck|kernels|layer|host|cache|cache-update|disk|disk-lookup|step|step-keys|step-cache|step-disk|parallel|node) commands+=("$1"); shift ;;
    all) commands+=(suite memcheck kernels layer host cache cache-update disk disk-lookup step parallel node); shift ;;
    *) echo "run_h200.sh: unknown subcommand or option '$1'" >&2; usage ;;
  esac
done
(( ${#commands[@]} )) || { echo "run_h200.sh: no subcommand given" >&2; usage; }

export PYTHONPATH=src PYTHONUNBUFFERED=1
export OUT=${OUT:-benchmarks/results}
status=0

# Run one command with its output teed into $OUT/$log (or print it with --print).
run() {
  local log=$1; shift
  if (( print_only )); then
    echo "$* > $OUT/$log"
    return 0
  fi
  mkdir -p "$OUT"
  { date -u +"# %Y-%m-%dT%H:%M:%SZ commit ${ENGRAM_COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# /'
    python -c "import torch, triton; print('# torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    echo "# $*"; } > "$OUT/$log"
  "$@" 2>&1 | tee -a "$OUT/$log" || status=1
}

suite() {
  local log=$OUT/gpu-tests-h200.log
  if (( print_only )); then
    echo "$runs x (timeout -s INT 540 python -m pytest tests/hashing/test_hash_kernel.py -q -m gpu -p no:cacheprovider &" \
         "timeout -s INT 540 python -m pytest tests -q -m gpu -p no:cacheprovider --durations=10" \
         "--ignore=tests/hashing/test_hash_kernel.py) > $log"
  else
    mkdir -p "$OUT"
    : > "$log"
    local part1 part2 run start first code1 code2
    part1=$(mktemp) part2=$(mktemp)
    for run in $(seq 1 "$runs"); do
      start=$(date +%s)
      timeout -s INT 540 python -m pytest tests/hashing/test_hash_kernel.py -q -m gpu -p no:cacheprovider > "$part1" 2>&1 &
      first=$!
      timeout -s INT 540 python -m pytest tests -q -m gpu -p no:cacheprovider --durations=10 \
        --ignore=tests/hashing/test_hash_kernel.py > "$part2" 2>&1
      code2=$?
      wait $first
      code1=$?
      { echo "== GPU suite run $run of $runs ($(( $(date +%s) - start )) s): test_hash_kernel.py exit $code1, others exit $code2"
        tail -1 "$part1"; sed -n '/slowest 10 durations/,$p' "$part2"; grep -E "FAILED|ERROR|KeyboardInterrupt" "$part1" "$part2"
      } | tee -a "$log"
      if (( code1 != 0 || code2 != 0 )); then  # keep the failures' tracebacks and seeds
        cat "$part1" "$part2" > "$OUT/gpu-tests-failed-run-$run.log"
        status=1
      fi
    done
    rm -f "$part1" "$part2"
  fi
}

memcheck() {
  run memcheck-h200.log env MEMCHECK_FUZZ_CASES=40 timeout 150 compute-sanitizer --tool memcheck \
    --error-exitcode 9 python benchmarks/kernels/memcheck_kernels.py
}

gpus() {
  local count
  count=$(nvidia-smi -L 2>/dev/null | wc -l)
  echo $(( count > 0 ? count : 1 ))
}

for command in "${commands[@]}"; do
  case $command in
    suite) suite ;;
    memcheck) memcheck ;;
    kernels) run bench-kernels-h200.log timeout 300 python benchmarks/kernels/bench_kernels.py ;;
    layer) run bench-layer-h200.log timeout 400 python benchmarks/layer/bench_layer.py --no-sweep ;;
    host) run bench-host-h200.log timeout 300 python benchmarks/host/bench_host.py ;;
    cache) run bench-cache-h200.log timeout 300 python benchmarks/cache/bench_cache.py ;;
    cache-update) run bench-cache-update-h200.log timeout 300 python benchmarks/cache/bench_cache_update.py ;;
    disk) run bench-disk-h200.log timeout 480 python benchmarks/disk/bench_disk.py --gib 20 ;;
    disk-lookup) run bench-disk-lookup-h200.log timeout 300 python benchmarks/disk/bench_disk_lookup.py --gib 2 ;;
    step) run step-h200.log timeout -s TERM 480 python benchmarks/step/bench_step.py --budget-s 360 --trace \
            --json "$OUT/step-h200.json" ;;
    step-keys) run step-keys-h200.log timeout -s TERM 480 python benchmarks/step/bench_step.py --budget-s 360 \
            --decode-tokens 64 --prefill-tokens 8192 --steps 100 \
            --variants device_again,host_prefetch,host_prefetch_late --json "$OUT/step-keys-h200.json" ;;
    step-cache) run step-cache-h200.log timeout -s TERM 480 python benchmarks/step/bench_step.py --budget-s 360 \
            --decode-tokens 64 --prefill-tokens 8192 --steps 100 --host-neighbors 7 \
            --variants device_again,host_prefetch,cached_prefetch,host_prefetch_realtext,cached_prefetch_realtext,host_prefetch_realtext_neighbors,cached_prefetch_realtext_neighbors \
            --json "$OUT/step-cache-h200.json" ;;
    step-disk)
      mkdir -p .bench-disk/step
      run step-disk-write-h200.log timeout -s TERM 200 python benchmarks/step/bench_step.py --table-gib 20 \
            --disk-directory .bench-disk/step --write-disk-tables
      run step-disk-hbm02-h200.log timeout -s TERM 420 python benchmarks/step/bench_step.py --table-gib 20 \
            --decode-tokens 64 --prefill-tokens 8192 --disk-directory .bench-disk/step --disk-hbm-fraction 0.02 \
            --variants device_again,host_prefetch_realtext,disk_prefetch_realtext_ram10,disk_prefetch_realtext_ram30 \
            --budget-s 360 --json "$OUT/step-disk-hbm02-h200.json" ;;
    parallel) run "bench-parallel-tp$(gpus)-h200.log" timeout 400 python benchmarks/parallel/bench_parallel.py ;;
    node) run "bench-parallel-node$(gpus)-h200.log" timeout 500 python benchmarks/parallel/bench_parallel.py --mode node ;;
  esac
done
exit $status
