"""Does warming part of the FP8 wkv weight into L2 while the activations are quantized speed up the
decode-size GEMM? (issue 13: the layer at T = 64 is ~1 us over its 65 us target)

At T = 64 the layer is three launches in a row: gather-quantize (~3 us of kernel time, latency-bound,
few SMs busy), ``torch._scaled_mm`` (~53 us, streaming 157 MB of weight at ~2.9 TB/s) and the gate.
While the quantize runs, HBM is nearly idle. A side-stream branch that asks L2 to fetch the part of
the weight the GEMM reads first could turn that idle time into L2 hits for the GEMM. Which part the
GEMM reads first is cuBLAS's business, so both guesses are timed: every weight row's first k bytes
(``k_prefix``: tiles sweep K) and the first weight rows whole (``n_prefix``).

Forms, each CUDA-graph replayed (H200 V4.1-Flash shapes K = 6144, N = 25600, T = 64 padded to 128 rows):

* ``gemm``: ``scaled_mm_gemm`` alone; ``gemm_rows_M``: the activations padded to M rows instead;
* ``quantize_gemm``: gather-quantize then the GEMM (the layer's middle, as the library runs it);
* ``prefetch_then_gemm`` / ``prefetch``: the warm-up then the GEMM on one stream / the warm-up alone
  (the most an L2 warm-up can give, with nothing to hide it behind);
* ``quantize_with_prefetch_gemm``: the warm-up forked onto a side stream beside the quantize, joined
  before the GEMM (what the library would do).

Warm-ups: ``bulk`` (``cp.async.bulk.prefetch.L2``, one instruction per contiguous range, no SM
registers held) and ``load`` (plain loads whose values are dropped).

    PYTHONPATH=src python benchmarks/probe_wkv_l2_prefetch.py [--gemm-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layer import COLUMNS, HEAD_DIM, IN_FEATURES, scaled_mm_weight, time_us  # noqa: E402
from probe_scaled_mm_split import two_streams  # noqa: E402


@triton.jit
def bulk_prefetch_kernel(base_address, row_stride, rows, chunk_bytes, chunks_per_row, BLOCK: tl.constexpr):
    """L2 prefetch of ``rows`` ranges: range ``r`` chunk ``c`` = bytes ``[c * chunk_bytes, (c + 1) *
    chunk_bytes)`` of ``base_address + r * row_stride``; one ``cp.async.bulk.prefetch.L2`` each."""
    item = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = item // chunks_per_row
    chunk = item - row * chunks_per_row
    valid = (row < rows).to(tl.int32)
    address = base_address + row * row_stride + chunk * chunk_bytes
    size = tl.full([BLOCK], 0, tl.int32) + chunk_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [address, valid, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_prefetch_kernel(weight_ptr, row_stride, rows, row_bytes, sink_ptr, BLOCK_ROWS: tl.constexpr,
                         BLOCK_BYTES: tl.constexpr):
    """Reads ``weight[r, :row_bytes]`` for ``rows`` rows (u8) and drops the values (``sink`` is
    written only if a byte sum is negative, which an unsigned sum never is)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    total = tl.zeros([BLOCK_ROWS], tl.int32)
    for start in range(0, row_bytes, BLOCK_BYTES):
        column = start + tl.arange(0, BLOCK_BYTES)
        mask = (row < rows)[:, None] & (column < row_bytes)[None, :]
        total += tl.sum(tl.load(weight_ptr + row[:, None] * row_stride + column[None, :], mask=mask,
                                other=0).to(tl.int32), axis=1)
    tl.store(sink_ptr + tl.arange(0, BLOCK_ROWS), total, mask=total < 0)


def warm_up_call(kind: str, region: str, weight: torch.Tensor, megabytes: int, sink: torch.Tensor):
    """A call that warms ``megabytes`` of ``weight [N, K]`` (u8 view) into L2."""
    n, k = weight.shape
    bytes_wanted = megabytes << 20
    if region == "k_prefix":
        rows, row_bytes = n, max(128, (bytes_wanted // n) // 128 * 128)
    else:
        rows, row_bytes = max(1, bytes_wanted // k), k
    if kind == "bulk":
        chunk = 4096 if row_bytes % 4096 == 0 else row_bytes
        chunks_per_row = row_bytes // chunk
        items = rows * chunks_per_row
        grid = (triton.cdiv(items, 128),)
        return lambda: bulk_prefetch_kernel[grid](weight.data_ptr(), weight.stride(0), rows, chunk, chunks_per_row,
                                                  BLOCK=128, num_warps=4)
    grid = (triton.cdiv(rows, 16),)
    return lambda: load_prefetch_kernel[grid](weight, weight.stride(0), rows, row_bytes, sink, BLOCK_ROWS=16,
                                              BLOCK_BYTES=128, num_warps=4)


def main() -> None:
    from engram.layer import wkv_gemm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gemm-only", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(41)
    weight, weight_scale, layout, note = scaled_mm_weight(generator)  # weight_scale fp32 [N / 128, K / 128]
    workspace = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "default")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"CUBLASLT_WORKSPACE_SIZE={workspace}: {note}", flush=True)
    if layout is None:
        return
    weight_scale_t = wkv_gemm.scaled_mm_weight_scale(weight_scale, layout)
    tokens = args.tokens
    rows = {}

    def record(name, calls):
        rows[name] = time_us(calls, graph=True)
        print(f"{name:55s} {rows[name]:8.2f} us", flush=True)

    def activations(padded):
        a = (torch.randn(padded, IN_FEATURES, device=device, generator=generator) * 8).to(torch.float8_e4m3fn)
        scale = torch.exp2(torch.randint(-6, 2, (IN_FEATURES // 128, padded), device=device,
                                         generator=generator).float()).t()
        return a, scale

    a, a_scale = activations(wkv_gemm.padded_tokens(tokens))
    gemm = lambda: wkv_gemm.scaled_mm_gemm(a, a_scale, tokens, weight, weight_scale_t)  # noqa: E731
    record("gemm", [gemm])
    for padded in (192, 256, 512):
        a_m, scale_m = activations(padded)
        record(f"gemm_rows_{padded}", [lambda a_m=a_m, scale_m=scale_m:
                                       wkv_gemm.scaled_mm_gemm(a_m, scale_m, tokens, weight, weight_scale_t)])
    if args.gemm_only:
        return _write(args, rows, workspace)

    table_rows = 20_000_000
    values = torch.randint(0, 0x7E, (table_rows, HEAD_DIM), dtype=torch.uint8, device=device, generator=generator)
    scales = torch.randint(120, 130, (table_rows, HEAD_DIM // 32), dtype=torch.uint8, device=device,
                           generator=generator)
    ids = torch.randint(0, table_rows, (tokens, COLUMNS), dtype=torch.int32, device=device, generator=generator)
    quantize = wkv_gemm.PreparedQuantize(values, scales, ids)

    def quantize_gemm():
        a_q, scale_q = quantize(ids)
        return wkv_gemm.scaled_mm_gemm(a_q, scale_q, tokens, weight, weight_scale_t)

    record("quantize", [lambda: quantize(ids)])
    record("quantize_gemm", [quantize_gemm])
    weight_bytes = weight.view(torch.uint8)
    sink = torch.empty(16, dtype=torch.int32, device=device)
    for kind in ("bulk", "load"):
        for region in ("k_prefix", "n_prefix"):
            for megabytes in (4, 8, 16, 32):
                warm = warm_up_call(kind, region, weight_bytes, megabytes, sink)
                name = f"{kind}_{region}_{megabytes}MB"
                try:
                    warm()
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - a probe: record and go on
                    rows[name + "_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    print(name, rows[name + "_error"], flush=True)
                    break
                record(f"prefetch {name}", [warm])
                record(f"prefetch_then_gemm {name}", [lambda warm=warm: (warm(), gemm())])
                quantize_beside_warm = two_streams(lambda: quantize(ids), warm)

                def quantize_with_prefetch_gemm(quantize_beside_warm=quantize_beside_warm):
                    (a_q, scale_q), _ = quantize_beside_warm()
                    return wkv_gemm.scaled_mm_gemm(a_q, scale_q, tokens, weight, weight_scale_t)

                record(f"quantize_with_prefetch_gemm {name}", [quantize_with_prefetch_gemm])
    return _write(args, rows, workspace)


def _write(args, rows, workspace):
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "triton": triton.__version__, "cublaslt_workspace": workspace,
                                         "tokens": args.tokens, "us": rows}, indent=1))


if __name__ == "__main__":
    main()
