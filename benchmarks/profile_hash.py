"""One launch of the hash kernel per configuration, between cudaProfilerStart/Stop,
for Nsight Compute (V4.1-Flash geometry, the setup of hash_bench):

    PYTHONPATH=src ncu --clock-control none --profile-from-start off --set full \
        -o hash python benchmarks/profile_hash.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import engram  # noqa: E402
from hash_bench import BLOCK_SIZE, CONFIG, HISTORY_START, _random_vocab  # noqa: E402

# (tokens, fused_write, request history bound)
CONFIGURATIONS = ((8192, False, False), (8192, True, False), (64, False, False), (1, False, False))


def setup(num_tokens: int, fused: bool, with_history: bool, rng):
    spec = engram.EngramSpec.from_hf_config(CONFIG)
    hasher = engram.NgramHasher(engram.EngramLayout(spec), _random_vocab(spec), device="cuda", validate=False)
    num_requests = min(num_tokens, 64)
    counts = [num_tokens // num_requests] * num_requests
    counts[-1] += num_tokens - sum(counts)
    blocks = (HISTORY_START + max(counts)) // BLOCK_SIZE + 1
    hasher.bind_slot_cache(num_requests * blocks * BLOCK_SIZE, BLOCK_SIZE, fused_write=fused)
    hasher.slot_cache.values[:-1] = torch.randint(0, spec.compressed_vocab_size, (hasher.slot_cache.num_slots,),
                                                  dtype=torch.int32, device="cuda")
    rows = None
    if with_history:
        hasher.bind_request_history(num_requests)
        rows = hasher.request_rows(range(num_requests))
    table = torch.from_numpy(rng.permutation(num_requests * blocks).astype(np.int32)).reshape(num_requests, blocks).cuda()
    request_of_token = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(counts)).cuda()
    starts = torch.zeros(num_requests + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(counts), 0)
    starts = starts.cuda()
    positions = HISTORY_START + torch.arange(num_tokens, device="cuda") - starts.long()[request_of_token]
    slots = table.long()[request_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    input_ids = torch.randint(0, 129280, (num_tokens,), device="cuda")
    return lambda: hasher(input_ids, positions, starts, slot_mapping=slots, block_table=table, request_rows=rows)


def main() -> None:
    rng = np.random.default_rng(1)
    calls = [setup(*configuration, rng) for configuration in CONFIGURATIONS]
    for call in calls:  # compile and warm up outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", CONFIGURATIONS)


if __name__ == "__main__":
    main()
