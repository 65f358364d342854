"""The shared helpers (engram.common) and the one-line errors of a machine without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from engram.tools.cli import main
from engram.common import ceil_div, next_power_of_2, resolve_cuda_device, resolve_device
from engram.memory import EngramMemory, resolve_placement
from engram.tools.testing import write_synthetic_checkpoint

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the errors of a machine without CUDA")


@given(st.integers(0, 2**70), st.integers(1, 2**40))
def test_ceil_div(numerator, denominator):
    assert ceil_div(numerator, denominator) == -(-numerator // denominator) == (numerator + denominator - 1) // denominator


@given(st.integers(-3, 2**40))
def test_next_power_of_2(n):
    found = next_power_of_2(n)
    assert found >= max(n, 1) and (found & (found - 1)) == 0 and (found == 1 or found // 2 < n)
    if n >= 1:
        assert found == 2 ** math.ceil(math.log2(n)) or n > 2**39


def test_device_values_are_checked():
    assert resolve_device(None, "x") == torch.device("cpu") == resolve_device("cpu", "x")
    with pytest.raises(ValueError, match=r"device: expected a torch.device, a device string or a CUDA index, found 'gpu'"):
        resolve_device("gpu", "x")
    with pytest.raises(ValueError, match=r"device: the thing needs a CUDA device, found 'cpu'"):
        resolve_cuda_device("cpu", "the thing")
    with pytest.raises(ValueError, match=r"device: the thing runs on the CPU or a CUDA device, found 'meta'"):
        resolve_device("meta", "the thing")


@NO_CUDA
@pytest.mark.parametrize("device", [None, "cuda", 0, "cuda:1"])
def test_no_cuda_is_one_clear_error(device):
    with pytest.raises(ValueError, match=r"device: placement 'device' needs a CUDA device.*, and this machine has none: "
                                         r".*; use device='cpu'"):
        resolve_cuda_device(device, "placement 'device'")


@NO_CUDA
def test_auto_placement_with_a_cuda_device_names_what_was_asked(tmp_path):
    """placement='auto', device='cuda' on a machine without CUDA: the error names 'auto' and the
    device, never a 'cpu' placement the caller did not ask for."""
    with pytest.raises(ValueError, match=r"device: placement 'auto' needs a CUDA device \('cuda'\), and this machine "
                                         r"has none") as raised:
        resolve_placement("auto", "cuda")
    assert "'cpu'" not in str(raised.value).split("use device=")[0]
    assert resolve_placement("auto", "cpu") == ("cpu", torch.device("cpu"))
    synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word")
    with pytest.raises(ValueError, match=r"placement 'auto' needs a CUDA device \('cuda'\)"):
        EngramMemory.from_pretrained(synthetic.directory, placement="auto", device="cuda", progress=False)


@NO_CUDA
def test_demo_on_cuda_without_cuda_exits_2_with_one_line(capsys):
    assert main(["demo", "--device", "cuda", "--skip-layers", "--texts", "1", "--max-chars", "100"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert captured.out == "" and "engram demo --device needs a CUDA device ('cuda')" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@NO_CUDA
def test_hasher_and_memory_name_the_missing_cuda_in_one_line(small_layout, small_vocab):
    """The serving guide's NgramHasher(..., device="cuda") and the hasher's backend="triton" on a
    machine without CUDA: one ValueError each, not torch's assertion."""
    import engram

    with pytest.raises(ValueError, match=r"device: NgramHasher needs a CUDA device \('cuda'\), and this machine has none"):
        engram.NgramHasher(small_layout, small_vocab, device="cuda")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1|needs the 'triton' package"):
        engram.NgramHasher(small_layout, small_vocab, device="cpu", backend="triton")
