"""cProfile of the eager calls that host_cost_bench times (GPU): where an eager layer call's host
time goes, per Python function and torch operator (issue 9's open question: the FP8 layer's
host time beyond its bare launches).

    PYTHONPATH=src python benchmarks/profile_host_cost.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from host_cost_bench import _fp8_layer, _layer, host_us  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=22)
    options = parser.parse_args()
    spec, layer = _layer()
    tokens = 64
    generator = torch.Generator(device="cuda").manual_seed(5)
    hash_ids = torch.randint(0, 1 << 20, (tokens, spec.num_columns), device="cuda", dtype=torch.int32,
                             generator=generator)
    hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device="cuda", generator=generator).to(torch.bfloat16)
    mask = torch.rand(tokens, device="cuda", generator=generator) > 0.05
    fp8_layer = _fp8_layer(spec, layer.table)
    print(f"fp8 wkv backend: {fp8_layer.wkv.backend}, small_m_max_tokens {fp8_layer.wkv.small_m_max_tokens}")
    print(f"torch.cuda.current_device: {host_us(torch.cuda.current_device):.1f} us; "
          f"torch.empty [64, 6144] fp8: "
          f"{host_us(lambda: torch.empty(64, 6144, dtype=torch.float8_e4m3fn, device='cuda')):.1f} us")
    for name, model in (("layer bf16", layer), ("layer fp8", fp8_layer)):
        call = lambda: model(hidden, hash_ids, mask)  # noqa: E731
        print(f"== {name}: {host_us(call):.1f} us per call (median, alone)")
        steps = [type(value).__name__ for value in model._checked_calls._entries.values()]
        print(f"   kept per structure: {steps}")
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(options.calls):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(options.top)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-4000:])


if __name__ == "__main__":
    main()
