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
from hash_bench import CONFIG, _random_vocab, hash_call  # noqa: E402

# (tokens, fused_write, request history bound)
CONFIGURATIONS = ((8192, False, False), (8192, True, False), (64, False, False), (1, False, False))


def main() -> None:
    rng = np.random.default_rng(1)
    spec = engram.EngramSpec.from_hf_config(CONFIG)
    layout, vocab = engram.EngramLayout(spec), _random_vocab(spec)
    calls = [hash_call(layout, vocab, num_tokens, rng, fused=fused, with_history=with_history)
             for num_tokens, fused, with_history in CONFIGURATIONS]
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
