"""The layer's eager step (engram.layer.eager_step): calls after the first of a structure run
prepared launches only, and give the bytes of the checked path; a changed table, wkv or
validation setting, a module move and forward hooks on the wkv are all honoured.

Under the interpreter the table is a ``device``-style table on CPU tensors (the Triton gather);
on a GPU a real ``device`` table."""

from __future__ import annotations

import os

import pytest
import torch

import engram
from engram.layer.eager_step import EagerStep
from engram.layer.module import Engram
from engram.layer.wkv import WkvProjection
from engram.table.fp8 import quantize_rows
from engram.tools.testing import cpu_device_style_table

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HC, HIDDEN, COLUMNS, HEAD_DIM, ROWS = 2, 64, 3, 64, 500


def _device_table(values, scales, device):
    """A table taking the ``device`` placement's Triton lookup (on CPU tensors under the interpreter)."""
    if device == "cuda":
        return engram.EngramTable(values, scales, placement="device", device="cuda", validate=False)
    return cpu_device_style_table(values, scales, COLUMNS)


def _layer(fp8: bool, device: str, generator: torch.Generator) -> Engram:
    values, scales = quantize_rows(torch.randn(ROWS, HEAD_DIM, generator=generator))
    table = _device_table(values.to(device), scales.to(device), device)
    in_features, out_features = COLUMNS * HEAD_DIM, (HC + 1) * HIDDEN
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    if fp8:
        scale = torch.exp2(torch.randint(-6, -2, (2, 2), generator=generator).float())
        wkv = WkvProjection((weight * 16).to(torch.float8_e4m3fn).to(device), scale.to(device), (128, 128),
                            backend="triton")
    else:
        wkv = WkvProjection(weight.to(torch.bfloat16).to(device))
    q_weight, k_weight = torch.randn(2, HC, HIDDEN, generator=generator).to(torch.bfloat16).to(device)
    return Engram(table, wkv, q_weight, k_weight, eps=1e-6, num_columns=COLUMNS, gate_backend="triton")


def _inputs(tokens, device, generator):
    hash_ids = torch.randint(-3, ROWS + 3, (tokens, COLUMNS), generator=generator, dtype=torch.int32)
    hidden = torch.randn(tokens, HC, HIDDEN, generator=generator).to(torch.bfloat16)
    mask = torch.rand(tokens, generator=generator) > 0.3
    return hash_ids.to(device), hidden.to(device), mask.to(device)


def _device() -> str:
    if INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    return "cuda"


def _checked(layer, hidden, hash_ids, mask):
    return layer.forward_checked(hidden, hash_ids, mask, None)


@pytest.mark.interpreter
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_eager_step_equals_the_checked_path(fp8, tokens, seed):
    device = _device()
    generator = torch.Generator().manual_seed(seed)
    layer = _layer(fp8, device, generator)
    for step in range(4):  # new values of one structure every step
        hash_ids, hidden, mask = _inputs(tokens, device, generator)
        if step == 3:  # the same structure at an address off 16-byte alignment (another kernel variant)
            spare = torch.empty(tokens * COLUMNS + 1, dtype=hash_ids.dtype, device=device)
            spare[1:] = hash_ids.reshape(-1)
            hash_ids = spare[1:].view(tokens, COLUMNS)
        out = layer(hidden, hash_ids, mask)
        expected = _checked(layer, hidden, hash_ids, mask)
        assert torch.equal(out, expected), f"step {step}, seed {seed}"
    steps = [plan.step for plan in layer._checked_calls._entries.values() if isinstance(plan.step, EagerStep)]
    assert len(steps) == 1, "the eager step was not prepared"
    assert (steps[0].fp8_rows is not None) == fp8 and (steps[0].lookup is not None) != fp8


@pytest.mark.interpreter
@pytest.mark.gpu
def test_eager_step_follows_table_wkv_validation_and_hooks(seed):
    device = _device()
    generator = torch.Generator().manual_seed(seed)
    layer = _layer(False, device, generator)
    other = _layer(False, device, generator)
    hash_ids, hidden, mask = _inputs(5, device, generator)
    layer(hidden, hash_ids, mask)  # prepares the step

    layer.table = other.table  # a new table: the stale step must not serve it
    assert torch.equal(layer(hidden, hash_ids, mask), _checked(layer, hidden, hash_ids, mask))
    layer.wkv = other.wkv
    assert torch.equal(layer(hidden, hash_ids, mask), _checked(layer, hidden, hash_ids, mask))

    seen = []
    handle = layer.wkv.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    layer._checked_calls.clear()
    layer(hidden, hash_ids, mask)  # prepares
    layer(hidden, hash_ids, mask)  # the step: runs the wkv as a module while hooked
    handle.remove()
    assert len(seen) == 2, seen

    layer.table.validate = True  # ids checked on every call again: out-of-table ids now raise
    bad = hash_ids.clone()
    bad[0, 0] = 10**6
    with pytest.raises(ValueError):
        layer(hidden, bad, mask)
