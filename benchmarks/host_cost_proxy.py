"""CPU proxy of the host cost of one eager call (issue 9 item 3), no GPU needed.

The GPU benchmark (``host_cost_bench.py``) times the Python thread of one eager call on the
H200. Here the same call paths run on CPU tensors with the CUDA code paths forced (Triton
backends, validation off, a ``"device"``-style table) and every kernel launch stubbed out:

* :class:`engram.triton_launch.CompiledLaunch` launches do their key lookup and return
  (:class:`~engram.triton_launch.BoundLaunch` launches: read their launcher and return);
* launches through Triton's own ``kernel[grid]`` path (``InterpretedFunction.run``) return at once;
* heavy torch compute that stands for one device op (``F.linear``, ``torch._scaled_mm``) returns
  an empty tensor of the right shape (one op either way).

Per path it prints the torch operators one call dispatches (``TorchDispatchMode``: every op,
views and allocations included, costs ~3-10 us on the H200's host), the launches it makes
(``compiled`` / ``triton[grid]``) and the Python microseconds per call (least of 10 batches) with launches
stubbed. What the stubs remove (a compiled launch: ~20 us on the H200 host; a ``kernel[grid]``
launch: ~45-55 us there) is the floor no Python change can lower.

Shapes are small (hidden 128, hc 4, C 24, head_dim 128; the hasher at V4.1's geometry) so the
CPU's own compute is negligible: host cost does not depend on them.

    PYTHONPATH=src python benchmarks/host_cost_proxy.py [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets backend="triton" resolve on CPU tensors

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import engram  # noqa: E402
from hash_bench import _random_vocab  # noqa: E402
from engram import triton_launch  # noqa: E402

CONFIG = Path(engram.__file__).parent / "configs" / "deepseek-v4.1-flash.json"
HIDDEN, HC, COLUMNS, HEAD_DIM = 128, 4, 24, 128
BLOCK_SIZE, HISTORY_START = 16, 4096


# ---- stubs ------------------------------------------------------------------------------
class LaunchCounts:
    compiled = 0
    raw = 0


def _stub_compiled_launch(self, grid, args, num_warps, device_index=0, num_stages=None):
    """What a warm CompiledLaunch does in Python before the C launcher: build its key, look it up."""
    key = (self.rule.key(args), num_warps, num_stages, device_index)
    self.compiled.get(key)
    LaunchCounts.compiled += 1
    return None


def _stub_bound_launch(self, grid, args):
    """What a warm BoundLaunch does in Python before the C launcher: read the pointers' alignment
    (the only per-call part of its variant) and look up its launcher."""
    prepared = self._prepared
    if prepared is None:
        prepared = self._prepared = self._owner.rule.prepare(args)
    self._direct.get(prepared.alignment(args) if prepared.positions else 0)
    LaunchCounts.compiled += 1
    return None


def _stub_raw_run(self, *args, grid, warmup, **kwargs):
    LaunchCounts.raw += 1
    return None


def _stub_linear(input, weight, bias=None):
    return torch.empty((*input.shape[:-1], weight.shape[0]), dtype=input.dtype, device=input.device)


def _stub_scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=None, **kwargs):
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)


def install_stubs() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    triton_launch.CompiledLaunch.__call__ = _stub_compiled_launch
    triton_launch.BoundLaunch.__call__ = _stub_bound_launch
    InterpretedFunction.run = _stub_raw_run
    torch.nn.functional.linear = _stub_linear
    torch._scaled_mm = _stub_scaled_mm


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


# ---- the call paths ---------------------------------------------------------------------
def hash_call(layout, vocab, num_tokens: int):
    """As ``hash_bench.hash_call``: ``min(T, 64)`` requests continuing 4096-token sequences whose
    history is in the slot cache; Triton backend, validation off (the CUDA defaults)."""
    num_requests = min(num_tokens, 64)
    counts = [num_tokens // num_requests] * num_requests
    counts[-1] += num_tokens - sum(counts)
    blocks_per_request = (HISTORY_START + max(counts)) // BLOCK_SIZE + 1
    hasher = engram.NgramHasher(layout, vocab, device="cpu", validate=False, backend="triton")
    hasher.bind_slot_cache(num_requests * blocks_per_request * BLOCK_SIZE, BLOCK_SIZE)
    rng = np.random.default_rng(1)
    table = torch.from_numpy(rng.permutation(num_requests * blocks_per_request).astype(np.int32))
    table = table.reshape(num_requests, blocks_per_request)
    request_of_token = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(counts))
    starts = torch.zeros(num_requests + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(counts), 0)
    positions = HISTORY_START + torch.arange(num_tokens) - starts.long()[request_of_token]
    slots = table.long()[request_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    input_ids = torch.randint(0, 129280, (num_tokens,))
    return lambda: hasher(input_ids, positions, starts, slot_mapping=slots, block_table=table)


def device_style_table(num_rows: int = 4096):
    """An EngramTable whose storage takes the ``"device"`` placement's Triton lookup, on CPU tensors."""
    from engram.table.fp8 import quantize_rows
    from engram.tools.testing import cpu_device_style_table

    values, scales = quantize_rows(torch.randn(num_rows, HEAD_DIM))
    return cpu_device_style_table(values, scales, COLUMNS)


def layer(fp8: bool):
    from engram.layer.module import Engram
    from engram.layer.wkv import WkvProjection
    from engram.layer.wkv_gemm import ScaledMmLayout

    in_features, out_features = COLUMNS * HEAD_DIM, (HC + 1) * HIDDEN
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    if fp8:
        scale = torch.full((out_features // 128, in_features // 128), 2.0 ** -4)
        wkv = WkvProjection((weight * 16).to(torch.float8_e4m3fn), scale, (128, 128), backend="triton")
        wkv.backend, wkv._scaled_mm_layout = "scaled_mm", ScaledMmLayout(4)  # the H200's path
    else:
        wkv = WkvProjection(weight.to(torch.bfloat16))
    weights = torch.randn(2, HC, HIDDEN).to(torch.bfloat16)
    return Engram(device_style_table(), wkv, weights[0], weights[1], eps=1e-6, num_columns=COLUMNS,
                  gate_backend="triton")


def paths() -> dict:
    from engram.layer.gate import engram_gate_kv
    from engram.table.kernels.gather import gather_rows

    spec = engram.EngramSpec.from_hf_config(CONFIG)
    layout, vocab = engram.EngramLayout(spec), _random_vocab(spec)
    tokens = 64
    hash_ids = torch.randint(0, 4096, (tokens, COLUMNS), dtype=torch.int32)
    hidden = torch.randn(tokens, HC, HIDDEN).to(torch.bfloat16)
    mask = torch.rand(tokens) > 0.05
    bf16_layer, fp8_layer = layer(fp8=False), layer(fp8=True)
    table = bf16_layer.table
    kv = torch.randn(tokens, (HC + 1) * HIDDEN).to(torch.bfloat16)
    storage = table.storage
    return {
        "hash_T1": hash_call(layout, vocab, 1),
        "hash_T64": hash_call(layout, vocab, 64),
        "gather_T64": lambda: gather_rows(storage.value_bytes, storage.scale_bytes, hash_ids),
        "lookup_T64": lambda: table.lookup(hash_ids),
        "gate_T64": lambda: engram_gate_kv(hidden, kv, bf16_layer.q_weight, bf16_layer.k_weight, 1e-6, mask,
                                           backend="triton"),
        "wkv_bf16_T64": lambda: bf16_layer.wkv(table.lookup(hash_ids)),
        "layer_bf16_T64": lambda: bf16_layer(hidden, hash_ids, mask),
        "layer_fp8_T64": lambda: fp8_layer(hidden, hash_ids, mask),
    }


# ---- measurement --------------------------------------------------------------------------
def measure(call, repeats: int = 2000) -> dict:
    for _ in range(50):
        call()
    LaunchCounts.compiled = LaunchCounts.raw = 0
    with OpCounter() as counter:
        call()
    launches = (LaunchCounts.compiled, LaunchCounts.raw)
    samples = []  # the least of 10 batches: this CPU shares its cores, noise only adds
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(repeats // 10):
            call()
        samples.append((time.perf_counter() - start) / (repeats // 10) * 1e6)
    return {"ops": sum(counter.ops.values()), "op_kinds": dict(counter.ops.most_common()),
            "compiled_launches": launches[0], "triton_grid_launches": launches[1],
            "python_us": round(min(samples), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--ops", action="store_true", help="list the torch operators of each path")
    options = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    install_stubs()
    results = {name: measure(call) for name, call in paths().items()}
    print(f"{'path':16s} {'ops':>4s} {'compiled':>8s} {'k[grid]':>7s} {'python us':>9s}")
    for name, row in results.items():
        print(f"{name:16s} {row['ops']:4d} {row['compiled_launches']:8d} {row['triton_grid_launches']:7d} "
              f"{row['python_us']:9.2f}")
        if options.ops:
            print("    " + ", ".join(f"{op} x{n}" for op, n in row["op_kinds"].items()))
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
