"""Each Triton kernel at small awkward shapes, and the hash kernels on malformed metadata,
for ``compute-sanitizer --tool memcheck``.

    PYTHONPATH=src compute-sanitizer --tool memcheck python benchmarks/kernels/memcheck_kernels.py
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]
TESTS = BENCHMARKS.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "hashing")]  # conftest, hash_fuzz; test_hash_kernel

import engram  # noqa: E402
from engram.layer.gate import engram_gate_kv  # noqa: E402
from engram.tools.simulation import HISTORY_SOURCES, StreamingEngine  # noqa: E402
from engram.table.fp8 import quantize_rows  # noqa: E402
from engram.table.kernels.gather import gather_rows, gather_rows_packed  # noqa: E402
from conftest import random_vocab, small_config  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    spec = engram.EngramSpec.from_hf_config(small_config())
    layout = engram.EngramLayout(spec)
    vocab = random_vocab(spec.compressed_vocab_size, 300, rng)
    for source in HISTORY_SOURCES:
        hasher = engram.NgramHasher(layout, vocab, device="cuda", validate=False, backend="triton")
        engine = StreamingEngine(hasher, source, rng, block_size=3, num_blocks=128)
        for k, length in enumerate((1, 63, 17)):
            engine.add(f"r{k}", rng.integers(0, 300, length), rng.random(length) < 0.1)
        engine.run_random(max_batch_tokens=40)
        assert engine.mismatches == 0, source
    # Every launch of a step: slot writers, hash, history writers.
    from hash_fuzz import run_fuzz
    from test_hash_kernel import check_same_step_prefix_hits, small_hasher
    check_same_step_prefix_hits(small_hasher(1, device="cuda", validate=False), pairs=5, block_size=4,
                                prefill_blocks=6, tail=9)
    # Malformed metadata, validation off: wrong ids allowed, no stray access, every launch returns.
    calls = run_fuzz(lambda seed: small_hasher(seed, device="cuda", validate=False), seed=2,
                     cases=int(os.environ.get("MEMCHECK_FUZZ_CASES", "300")),
                     after_call=lambda hasher, batch, ids: torch.cuda.synchronize())
    print(f"malformed-metadata fuzz: {calls} calls returned")
    rows = 1000
    values, scales = quantize_rows(torch.randn(rows, 64, device="cuda"))
    values = values.view(torch.uint8)
    ids = torch.randint(0, rows + 200, (63, 7), device="cuda", dtype=torch.int32)
    gather_rows(values, scales, ids, row_start=100, column_start=2, column_end=6)
    gather_rows_packed(values, scales, ids[:, ::1], row_start=0)
    # Distinct rows of a lookup (host gather): a strided view, ids outside the rows, 3 blocks.
    from engram.table.kernels.dedup import distinct_rows

    wide = torch.randint(-5, rows + 200, (400, 9), device="cuda", dtype=torch.int64)
    distinct_rows(wide[:, 1:8], 100, rows)
    distinct_rows(ids, 0, 1)
    hidden = torch.randn(63, 4, 80, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(63, 5 * 80, device="cuda", dtype=torch.bfloat16)
    weights = torch.randn(2, 4, 80, device="cuda", dtype=torch.bfloat16)
    engram_gate_kv(hidden, kv, weights[0], weights[1], 1e-6, torch.rand(63, device="cuda") < 0.2, backend="triton")
    # FP8 wkv kernels: ids outside the rows, T = 63 (padded to 64), K = 7 x 64 (a partial 128-group),
    # N = 200 (a partial tile and weight block), per-column weight scales (block rows 16).
    from engram.layer import wkv_gemm
    weight = (torch.randn(200, 7 * 64, device="cuda") * 30).to(torch.float8_e4m3fn)
    for block in ((128, 128), (16, 128)):
        weight_scale = torch.full((-(-200 // block[0]), 4), 2.0 ** -8, device="cuda")
        a, a_scale = wkv_gemm.quantize_gathered_rows(values, scales, ids, row_start=100)
        wkv_gemm.block_scaled_gemm(a, a_scale, 63, weight, weight_scale, block)
        wkv_gemm.small_m_gemm(a, a_scale, 63, weight, weight_scale, block)
        wkv_gemm.fused_gather_gemm(values, scales, ids, weight, weight_scale, block, row_start=100)
        packed = gather_rows_packed(values, scales, ids)
        wkv_gemm.fused_gather_gemm(packed[0], packed[1], None, weight, weight_scale, block)
        wkv_gemm.quantize_gathered_rows(packed[0], packed[1], None)
    # Cached placement: the one-kernel lookup and the large-lookup path (probe, host gather of the
    # misses, direct share, merge) on ids outside the rows, after replacements.
    cached = engram.EngramTable(values.cpu(), scales.cpu(), placement="cached", device="cuda", validate=False,
                                row_start=100, placement_options={"cache_fraction": 0.05, "ways": 4,
                                                                  "aging_interval": 1})
    for share, limit in ((0.0, 10**9), (0.0, 0), (0.5, 0)):
        cached.storage.direct_share, cached.storage.direct_max_rows = share, limit
        for step in range(3):
            step_ids = torch.randint(-5, rows + 300, (63, 7), device="cuda", dtype=torch.int32)
            cached.lookup(step_ids)
            cached.lookup_packed(step_ids[:, 1:6])
            cached.update_cache(step_ids)
    torch.cuda.synchronize()
    print("memcheck workload done: hash (3 sources, all launches, malformed-metadata fuzz), gather (bf16, packed), distinct rows, "
          "gate, wkv (gather-quantize, block-scaled GEMM, split-K small-T GEMM, fused gather-GEMM), "
          "cached lookups (one kernel; probe, host gather, direct share, merge)")


if __name__ == "__main__":
    main()
