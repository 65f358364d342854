"""Host time of one eager call (GPU): what an engine's Python thread pays per launch.

Each call is timed alone with a host clock after a device sync, so the launch
queue is empty and the call never waits on the GPU; the median of many calls is
reported. V4.1-Flash shapes (hidden 5120, hc 4, C = 24, head_dim 256, wkv
[25600, 6144] bf16) on a small table (its size does not change host time).

Reported: the bare launch of the hash kernel through ``kernel[grid]`` (Triton's
own path: bind, specialize, look up, launch) and through
:class:`engram.triton_launch.CompiledLaunch`; an empty kernel's launch; the
hasher at T = 1 and 64; gather, gate and the whole layer at T = 64.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import engram  # noqa: E402
from hash_bench import CONFIG, _random_vocab, hash_call  # noqa: E402
from wall_clock import median_wall_us  # noqa: E402


def host_us(call, repeats: int = 300, warmup: int = 20) -> float:
    """Median host microseconds of ``call()``, each run alone after a device sync."""
    return median_wall_us(call, repeats, warmup, until_device_done=False)


@triton.jit
def _empty_kernel(pointer):
    pass


def _layer(num_rows: int = 1 << 20):
    """An Engram layer at V4.1-Flash shapes (bf16 wkv), table on the device."""
    from engram.layer.module import Engram
    from engram.layer.wkv import WkvProjection
    from engram.table.fp8 import quantize_rows

    spec = engram.EngramSpec.from_hf_config(CONFIG)
    values, scales = quantize_rows(torch.randn(num_rows, spec.head_dim, device="cuda"))
    table = engram.EngramTable(values, scales, placement="device", device="cuda",
                               num_rows_total=num_rows, validate=False)
    in_features = spec.num_columns * spec.head_dim
    wkv = WkvProjection((torch.randn((spec.hc_mult + 1) * spec.hidden_size, in_features, device="cuda")
                         / in_features ** 0.5).to(torch.bfloat16))
    weights = torch.randn(2, spec.hc_mult, spec.hidden_size, device="cuda").to(torch.bfloat16)
    layer = Engram(table, wkv, weights[0], weights[1], eps=spec.rms_norm_eps, num_columns=spec.num_columns)
    return spec, layer


def bench_host_cost() -> dict:
    from engram.hashing import launch as hash_launch
    from engram.layer.gate import engram_gate_kv
    from engram.table.gather import gather_rows

    spec = engram.EngramSpec.from_hf_config(CONFIG)
    layout, vocab = engram.EngramLayout(spec), _random_vocab(spec)
    rng = np.random.default_rng(3)
    result = {}
    buffer = torch.zeros(1, device="cuda")
    result["empty_kernel_launch_us"] = host_us(lambda: _empty_kernel[(1,)](buffer))

    for tokens in (1, 64):
        call = hash_call(layout, vocab, tokens, rng)
        result[f"hash_host_T{tokens}_us"] = host_us(call)
    # The same hash kernel launched bare, through Triton's own path and through CompiledLaunch:
    # record the arguments of one launch, then replay them.
    recorded = {}
    launcher = hash_launch._launchers()[0]
    original = type(launcher).__call__

    def record(self, grid, variant, args, **options):
        recorded.setdefault(self.kernel.__name__, (grid, variant, args, options))
        return original(self, grid, variant, args, **options)

    type(launcher).__call__ = record
    try:
        hash_call(layout, vocab, 1, rng)()
    finally:
        type(launcher).__call__ = original
    grid, variant, args, options = recorded["ngram_hash_kernel"]
    kernel = launcher.kernel
    warps = options["num_warps"]
    result["hash_kernel_triton_launch_us"] = host_us(lambda: kernel[(grid,)](*args, num_warps=warps))
    result["hash_kernel_compiled_launch_us"] = host_us(lambda: launcher(grid, variant, args, **options))

    spec, layer = _layer()
    tokens = 64
    hash_ids = torch.randint(0, 1 << 20, (tokens, spec.num_columns), device="cuda", dtype=torch.int32)
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device="cuda").to(torch.bfloat16)
    mask = torch.rand(tokens, device="cuda") > 0.05
    table = layer.table
    result["gather_host_T64_us"] = host_us(lambda: gather_rows(table._storage.value_bytes, table._storage.scale_bytes,
                                                               hash_ids))
    kv = layer.wkv(table.lookup(hash_ids))
    result["gate_host_T64_us"] = host_us(lambda: engram_gate_kv(hidden, kv, layer.q_weight, layer.k_weight,
                                                                spec.rms_norm_eps, mask))
    result["wkv_host_T64_us"] = host_us(lambda: layer.wkv(table.lookup(hash_ids)))
    result["layer_host_T64_us"] = host_us(lambda: layer(hidden, hash_ids, mask))
    return result


if __name__ == "__main__":
    for key, value in bench_host_cost().items():
        print(f"{key:36s} {value:8.1f}")
