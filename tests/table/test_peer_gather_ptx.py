"""The peer gather kernels compiled offline for an H100/H200 (sm_90, no GPU needed): their global memory
instructions are the device gather's, plus the per-row load of the shard's base address.

Reading rows through a pointer table loses what Triton knows of a tensor argument's alignment; without
the kernel's 16-byte hint its row loads become single bytes (``ld.global.b8``), four to sixteen times
the instructions of the device gather. This checks the hint holds, on the CPU, in CI.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _compile_ptx(kernel, signature: dict, constexprs: dict, aligned: tuple[int, ...], num_warps: int) -> str:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(index,): [["tt.divisibility", 16]] for index in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": 1})
    except Exception as error:  # no NVIDIA backend or ptxas in this Triton build
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(error).__name__}: {error}")
    return compiled.asm["ptx"]


def _memory_instructions(ptx: str) -> Counter:
    return Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))


_IDS = {"hash_ids_ptr": "*i32"}
_SCALARS = {name: "i32" for name in ("total_rows", "local_columns", "stride_token", "stride_column", "row_start",
                                      "num_rows")}


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
def test_peer_kernels_load_rows_as_the_device_kernels_do(packed):
    if INTERPRET:
        pytest.skip("compiles for a GPU: run without TRITON_INTERPRET")
    pytest.importorskip("triton")
    from engram.table.kernels import gather_kernels, peer_gather_kernels

    shape = {"HEAD_DIM": 256, "GROUPS_PADDED": 8, "BLOCK_ROWS": 16 if packed else 8}
    warps = 4 if packed else 2
    outputs = {"out_value_ptr": "*u8", "out_scale_ptr": "*u8"} if packed else {"out_ptr": "*bf16"}
    extra = {} if packed else {"VECTOR": 16, "DECODE": 0}
    device_kernel = gather_kernels.gather_rows_packed_kernel if packed else gather_kernels.gather_rows_bf16_kernel
    peer_kernel = (peer_gather_kernels.peer_gather_rows_packed_kernel if packed
                   else peer_gather_kernels.peer_gather_rows_bf16_kernel)

    device_signature = {**_IDS, "value_ptr": "*u8", "scale_ptr": "*u8", **outputs, **_SCALARS,
                        "value_row_stride": "i32", "scale_row_stride": "i32"}
    device_constexprs = dict(shape, **({} if packed else {"VECTOR": 16, "CHUNK_OUTER": False, "DECODE": 0}),
                             VALUE_EVICTION="", OUT_CACHE="")
    device_signature.update({name: "constexpr" for name in device_constexprs})
    pointers = [i for i, kind in enumerate(device_signature.values()) if kind.startswith("*")]
    device = _memory_instructions(_compile_ptx(device_kernel, device_signature, device_constexprs,
                                               (*pointers, len(device_signature) - len(device_constexprs) - 2),
                                               warps))

    peer_signature = {**_IDS, "shard_bases_ptr": "*i64", **outputs, **_SCALARS, "rows_per_shard": "i32"}
    peer_constexprs = dict(shape, ROW_BYTES=272, **extra)
    peer_signature.update({name: "constexpr" for name in peer_constexprs})
    pointers = [i for i, kind in enumerate(peer_signature.values()) if kind.startswith("*")]
    peer = _memory_instructions(_compile_ptx(peer_kernel, peer_signature, peer_constexprs, tuple(pointers), warps))

    assert peer["ld.global.v4.b32"] == device["ld.global.v4.b32"] > 0, (peer, device)
    assert peer["ld.global.b8"] == device["ld.global.b8"], (peer, device)  # the scale bytes only
    bases = peer.pop("ld.global.b64", 0)
    assert bases > 0 and peer == device, (peer, device)  # everything else the same
