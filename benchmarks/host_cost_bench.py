"""Host time of one eager call (GPU): what an engine's Python thread pays per launch.

Each call is timed alone with a host clock after a device sync, so the launch
queue is empty and the call never waits on the GPU; the median of many calls is
reported. V4.1-Flash shapes (hidden 5120, hc 4, C = 24, head_dim 256, wkv
[25600, 6144] bf16) on a small table (its size does not change host time).

Reported: the bare launch of the hash kernel through ``kernel[grid]`` (Triton's
own path: bind, specialize, look up, launch) and through
:class:`engram.triton_launch.CompiledLaunch`; an empty kernel's launch both ways;
the hasher at T = 1 and 64; gather, gate, the bf16 GEMM alone and the whole layer
at T = 64, with bf16 wkv and with FP8 wkv (``torch._scaled_mm``). ``*_bare_launches_*``:
the same call's launches each replayed alone and summed (issue 9's yardstick: host
time <= 1.3x that).
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


def _fp8_layer(spec, table):
    """The same layer with an FP8 wkv (128 x 128 block scales): torch._scaled_mm where the build
    has it, as a checkpoint's layer runs on the H200."""
    from engram.layer.module import Engram
    from engram.layer.wkv import WkvProjection

    in_features, out_features = spec.num_columns * spec.head_dim, (spec.hc_mult + 1) * spec.hidden_size
    weight = (torch.randn(out_features, in_features, device="cuda") * 16).to(torch.float8_e4m3fn)
    scale = torch.full((out_features // 128, in_features // 128), 2.0 ** -4 / in_features ** 0.5, device="cuda")
    wkv = WkvProjection(weight, scale, (128, 128))
    weights = torch.randn(2, spec.hc_mult, spec.hidden_size, device="cuda").to(torch.bfloat16)
    return Engram(table, wkv, weights[0], weights[1], eps=spec.rms_norm_eps, num_columns=spec.num_columns)


def record_launches(call) -> list[tuple]:
    """``[(launcher, grid, args, options, replay)]``: the Triton launches one ``call()``
    makes, in order, through a CompiledLaunch or a prepared call's BoundLaunch (``launcher``: the
    CompiledLaunch either way); ``replay()`` launches it again the same way, bare."""
    from engram import triton_launch

    recorded = []
    original, original_bound = triton_launch.CompiledLaunch.__call__, triton_launch.BoundLaunch.__call__

    inside_bound = []  # a cold BoundLaunch launches through its CompiledLaunch: record it once

    def record(self, grid, args, num_warps, device_index=0, num_stages=None):
        options = dict(num_warps=num_warps, device_index=device_index, num_stages=num_stages)
        if not inside_bound:
            recorded.append((self, grid, args, options, lambda: original(self, grid, args, **options)))
        return original(self, grid, args, **options)

    def record_bound(self, grid, args):  # a prepared call's launch, replayed through its BoundLaunch
        recorded.append((self._owner, grid, args,
                         dict(num_warps=self._num_warps, device_index=self._device_index,
                              num_stages=self._num_stages), lambda: original_bound(self, grid, args)))
        inside_bound.append(True)
        try:
            return original_bound(self, grid, args)
        finally:
            inside_bound.pop()

    triton_launch.CompiledLaunch.__call__ = record
    triton_launch.BoundLaunch.__call__ = record_bound
    try:
        call()
    finally:
        triton_launch.CompiledLaunch.__call__ = original
        triton_launch.BoundLaunch.__call__ = original_bound
    return recorded


def bare_launches_us(call, torch_ops=()) -> float:
    """Host microseconds of the launches ``call()`` makes, each replayed alone and bare (compiled
    Triton launches with their recorded arguments, plus ``torch_ops``: calls of the torch
    operators it runs, e.g. the GEMM), summed: the floor no Python around them can go below."""
    total = 0.0
    for *_, replay in record_launches(call):
        total += host_us(replay)
    for op in torch_ops:
        total += host_us(op)
    return total


def bench_host_cost() -> dict:
    from engram import triton_launch
    from engram.layer.gate import engram_gate_kv
    from engram.table.kernels.gather import gather_rows

    spec = engram.EngramSpec.from_hf_config(CONFIG)
    layout, vocab = engram.EngramLayout(spec), _random_vocab(spec)
    rng = np.random.default_rng(3)
    result = {}
    buffer = torch.zeros(1, device="cuda")
    result["empty_kernel_launch_us"] = host_us(lambda: _empty_kernel[(1,)](buffer))
    empty = triton_launch.CompiledLaunch(_empty_kernel)
    result["empty_kernel_compiled_launch_us"] = host_us(lambda: empty(1, (buffer,), num_warps=1))

    for tokens in (1, 64):
        call = hash_call(layout, vocab, tokens, rng)
        result[f"hash_host_T{tokens}_us"] = host_us(call)
        result[f"hash_bare_launches_T{tokens}_us"] = bare_launches_us(call)
    # The same hash kernel launched bare, through Triton's own path and through CompiledLaunch.
    launches = [entry for entry in record_launches(hash_call(layout, vocab, 1, rng))
                if entry[0].kernel.__name__ == "ngram_hash_kernel"]
    launcher, grid, args, options, _ = launches[0]
    kernel = launcher.kernel
    warps = options["num_warps"]
    result["hash_kernel_triton_launch_us"] = host_us(lambda: kernel[(grid,)](*args, num_warps=warps))
    result["hash_kernel_compiled_launch_us"] = host_us(lambda: launcher(grid, args, **options))

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
    rows = table.lookup(hash_ids).flatten(1)
    linear = lambda: torch.nn.functional.linear(rows, layer.wkv.weight)  # noqa: E731
    result["linear_bf16_host_T64_us"] = host_us(linear)
    result["wkv_host_T64_us"] = host_us(lambda: layer.wkv(table.lookup(hash_ids)))
    layer_call = lambda: layer(hidden, hash_ids, mask)  # noqa: E731
    result["layer_host_T64_us"] = host_us(layer_call)
    result["layer_bare_launches_T64_us"] = bare_launches_us(layer_call, (linear,))

    fp8_layer = _fp8_layer(spec, table)
    if fp8_layer.wkv.backend == "scaled_mm":
        from engram.layer import wkv_gemm

        a, a_scale = wkv_gemm.quantize_gathered_rows(*fp8_layer.table.rows_in_place(hash_ids))
        weight_t, scale_t = fp8_layer.wkv.weight.t(), fp8_layer.wkv.weight_scale_blocks.t()
        scaled_mm = lambda: torch._scaled_mm(a, weight_t, scale_a=a_scale, scale_b=scale_t,  # noqa: E731
                                             out_dtype=torch.bfloat16)
        result["scaled_mm_host_T64_us"] = host_us(scaled_mm)
        fp8_call = lambda: fp8_layer(hidden, hash_ids, mask)  # noqa: E731
        result["layer_fp8_host_T64_us"] = host_us(fp8_call)
        result["layer_fp8_bare_launches_T64_us"] = bare_launches_us(fp8_call, (scaled_mm,))
    return result


if __name__ == "__main__":
    for key, value in bench_host_cost().items():
        print(f"{key:36s} {value:8.1f}")
