"""GPU benchmark of the fused Engram gate (DESIGN §2 "Gate", §4).

Bytes counted per call: hidden read + kv read + out written,
``T * (hc * D * 2 * 2 + (hc + 1) * D * 2)`` (bf16; the weights are L2-resident and
not counted): 1.09 GB at T = 8192, hc = 4, D = 5120.

:func:`bench_gate` is the entry point for ``benchmarks/kernels/bench_kernels.py``. Run as a
script for the tuning sweep: ``PYTHONPATH=src python benchmarks/kernels/kernels_gate.py --sweep short``
(copy ceiling, launch configs at several T, then :func:`bench_gate`; ``--json PATH``
writes every number).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]
from common import copy_ceiling_gbps  # noqa: E402

EPS = 1e-6
DEFAULT_L2_BYTES = 60 * 2 ** 20  # H200: 60 MB (torch reports 50 MiB on some builds)
MAX_INPUT_SETS = 1024


def gate_bytes(tokens: int, hc_mult: int, hidden: int) -> int:
    """HBM bytes of one call: bf16 hidden read + kv read + out written."""
    return tokens * (hc_mult * hidden * 2 * 2 + (hc_mult + 1) * hidden * 2)


@dataclasses.dataclass
class _GateInputs:
    hidden_states: torch.Tensor  # bf16 [T, hc, D]
    kv: torch.Tensor             # bf16 [T, (hc + 1) * D]
    q_weight: torch.Tensor       # bf16 [hc, D]
    k_weight: torch.Tensor       # bf16 [hc, D]
    token_mask: torch.Tensor     # bool [T]
    out: torch.Tensor            # bf16 [T, hc, D], poisoned with NaN


def _random_inputs(tokens, hc_mult, hidden, masked_fraction, generator) -> _GateInputs:
    """Fresh random inputs on the GPU (normal values, never zero tensors)."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(torch.bfloat16)

    hidden_states = randn(tokens, hc_mult, hidden, scale=3.0)
    kv = randn(tokens, (hc_mult + 1) * hidden)
    mask = torch.rand(tokens, device="cuda", generator=generator) >= masked_fraction
    out = torch.full_like(hidden_states, float("nan"))
    return _GateInputs(hidden_states, kv, randn(hc_mult, hidden), randn(hc_mult, hidden), mask, out)


def _l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or DEFAULT_L2_BYTES


def _input_sets(tokens, hc_mult, hidden, masked_fraction, generator) -> list[_GateInputs]:
    """Enough input sets to span twice the L2 (one set at large T), rotated call by call.
    (triton.testing.do_bench also clears the L2 before each timed call.)"""
    count = min(MAX_INPUT_SETS, max(1, math.ceil(2 * _l2_bytes() / gate_bytes(tokens, hc_mult, hidden))))
    return [_random_inputs(tokens, hc_mult, hidden, masked_fraction, generator) for _ in range(count)]


def _rotating(sets, call):
    """A no-argument function calling ``call(inputs)`` on the next input set each time."""
    counter = itertools.count()
    return lambda: call(sets[next(counter) % len(sets)])


def _check_written(sets) -> None:
    for inputs in sets:
        if bool(torch.isnan(inputs.out).any()):
            raise RuntimeError("gate kernel left NaN (unwritten) outputs")


def bench_gate(T_values, *, hc: int = 4, hidden: int = 5120, masked_fraction: float = 0.05) -> list[dict]:
    """Per ``T``: median us of the Triton gate kernel (``engram_gate_kv``, default launch
    config) and of the torch-native path (``engram_gate_torch`` on split views of kv),
    achieved GB/s of :func:`gate_bytes`, and the speedup.

    ``triton_us`` / ``torch_us``: ``triton.testing.do_bench(return_mode="median")``,
    eager launches, so they include the host's launch overhead wherever the GPU work is
    shorter than it (small T). ``triton_graph_us`` / ``torch_graph_us``: the same calls
    captured in a CUDA graph and replayed (``do_bench_cudagraph``, median), the time
    an engine that replays graphs sees. ``masked_fraction`` of the tokens are masked
    (all bytes are still read and written)."""
    import triton.testing

    from engram.layer.gate import engram_gate_kv, engram_gate_torch, gate_launch_config
    from engram.layer.wkv import split_kv

    generator = torch.Generator(device="cuda")
    generator.seed()
    results = []
    for tokens in T_values:
        sets = _input_sets(tokens, hc, hidden, masked_fraction, generator)

        def triton_call(inputs):
            engram_gate_kv(inputs.hidden_states, inputs.kv, inputs.q_weight, inputs.k_weight, EPS,
                           inputs.token_mask, out=inputs.out, backend="triton")

        def torch_call(inputs):
            key, value = split_kv(inputs.kv, hc)
            engram_gate_torch(inputs.hidden_states, key, value, inputs.q_weight, inputs.k_weight, EPS,
                              inputs.token_mask)

        for inputs in sets:
            triton_call(inputs)
        torch.cuda.synchronize()
        _check_written(sets)
        timings = {}
        for name, call in (("triton", triton_call), ("torch", torch_call)):
            timings[f"{name}_us"] = 1e3 * triton.testing.do_bench(_rotating(sets, call), return_mode="median")
            timings[f"{name}_graph_us"] = 1e3 * triton.testing.do_bench_cudagraph(_rotating(sets, call),
                                                                                  return_mode="median")
        size = gate_bytes(tokens, hc, hidden)
        results.append({
            "T": tokens, "hc": hc, "hidden": hidden, "bytes": size, "input_sets": len(sets),
            "masked_fraction": masked_fraction,
            "config": dataclasses.asdict(gate_launch_config(tokens, hc, hidden)),
            **timings,
            "triton_gbps": size / (timings["triton_us"] * 1e3),
            "triton_graph_gbps": size / (timings["triton_graph_us"] * 1e3),
            "speedup": timings["torch_us"] / timings["triton_us"],
            "graph_speedup": timings["torch_graph_us"] / timings["triton_graph_us"],
        })
        del sets
        torch.cuda.empty_cache()
    return results


def sweep_gate_configs(T_values, configs, *, hc: int = 4, hidden: int = 5120,
                       masked_fraction: float = 0.05) -> list[dict]:
    """Median us, GB/s, registers and spills of each launch config at each ``T``."""
    import triton.testing

    from engram.layer.gate import _launch_gate_kernel

    generator = torch.Generator(device="cuda")
    generator.seed()
    rows = []
    for tokens in T_values:
        sets = _input_sets(tokens, hc, hidden, masked_fraction, generator)
        size = gate_bytes(tokens, hc, hidden)
        for config in configs:
            compiled = []

            def call(inputs, config=config, compiled=compiled):
                kv = inputs.kv
                _launch_gate_kernel(inputs.hidden_states, kv, kv.stride(0), hidden, kv, hc * hidden, kv.stride(0),
                                    inputs.q_weight, inputs.k_weight, EPS, inputs.token_mask, inputs.out, config,
                                    compiled=compiled)

            for inputs in sets:
                inputs.out.fill_(float("nan"))
                call(inputs)
            torch.cuda.synchronize()
            _check_written(sets)
            ms = triton.testing.do_bench(_rotating(sets, call), return_mode="median")
            graph_ms = triton.testing.do_bench_cudagraph(_rotating(sets, call), return_mode="median")
            kernel = compiled[-1]
            rows.append({"T": tokens, "config": dataclasses.asdict(config), "us": ms * 1e3,
                         "gbps": size / (ms * 1e6), "graph_us": graph_ms * 1e3,
                         "registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None)})
        del sets
        torch.cuda.empty_cache()
    return rows


def _sweep_configs(full: bool):
    """full: 20 configs (one copy per program with every option; 2 and 4 copies without
    hints); else the 7 fastest or most telling of the first sweep (H200, T = 8192)."""
    from engram.layer.gate import GateLaunchConfig

    if not full:
        return [GateLaunchConfig(1, 8, False), GateLaunchConfig(1, 8, True), GateLaunchConfig(1, 8, False, True),
                GateLaunchConfig(1, 4, True), GateLaunchConfig(1, 16, False), GateLaunchConfig(2, 8, False),
                GateLaunchConfig(4, 8, True)]
    configs = [GateLaunchConfig(1, warps, early, hints)
               for warps in (4, 8, 16) for early in (True, False) for hints in (False, True)]
    configs += [GateLaunchConfig(copies, warps, early)
                for copies in (2, 4) for warps in (8, 16) for early in (True, False)]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", choices=["full", "short"], help="time launch configs first (20 or 7)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 7, 63, 1024, 8192])
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[8192, 1024, 1])
    parser.add_argument("--json", help="write all numbers here")
    args = parser.parse_args()
    import triton

    device = torch.cuda.get_device_name()
    report = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbps": copy_ceiling_gbps()}
    print(f"{device}  torch {torch.__version__}  triton {triton.__version__}  copy {report['copy_gbps']:.0f} GB/s")
    if args.sweep:
        report["sweep"] = sweep_gate_configs(args.sweep_tokens, _sweep_configs(args.sweep == "full"))
        print(f"{'T':>6} {'copies':>6} {'warps':>5} {'early':>5} {'hints':>5} {'us':>9} {'GB/s':>7} {'graph us':>9} "
              f"{'regs':>5} {'spill':>5}")
        for row in sorted(report["sweep"], key=lambda r: (-r["T"], r["us"])):
            c = row["config"]
            print(f"{row['T']:>6} {c['copies_per_program']:>6} {c['num_warps']:>5} {c['early_value']!s:>5} "
                  f"{c['cache_hints']!s:>5} {row['us']:>9.1f} {row['gbps']:>7.0f} {row['graph_us']:>9.1f} "
                  f"{row['registers']!s:>5} {row['spills']!s:>5}")
    report["bench"] = bench_gate(args.tokens)
    print(f"{'T':>6} {'triton us':>10} {'GB/s':>7} {'% copy':>7} {'graph us':>9} {'GB/s':>7} "
          f"{'torch us':>9} {'graph us':>9} {'speedup':>8}")
    for row in report["bench"]:
        print(f"{row['T']:>6} {row['triton_us']:>10.1f} {row['triton_gbps']:>7.0f} "
              f"{100 * row['triton_gbps'] / report['copy_gbps']:>6.0f}% {row['triton_graph_us']:>9.1f} "
              f"{row['triton_graph_gbps']:>7.0f} {row['torch_us']:>9.1f} {row['torch_graph_us']:>9.1f} "
              f"{row['speedup']:>7.1f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
