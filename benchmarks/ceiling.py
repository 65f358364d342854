"""The HBM copy ceiling every benchmark reports against, measured in the same run."""

import torch
import triton.testing


def copy_ceiling_gbps(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy of ``num_bytes`` random bytes: (read + written) / median time."""
    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    milliseconds = triton.testing.do_bench(lambda: target.copy_(source), warmup=50, rep=300, return_mode="median")
    return 2 * num_bytes / (milliseconds * 1e-3) / 1e9
