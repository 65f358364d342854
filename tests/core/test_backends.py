"""One way to choose a backend (engram.backends): an argument with default "auto", decided
once; a missing Triton is said once, never a silent fallback."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import engram.backends as backends
from engram.backends import resolve_backend
from engram.table import EngramTable

SOURCES = Path(backends.__file__).parent
CUDA = torch.device("cuda", 0)  # only its type is looked at: no GPU needed
CPU = torch.device("cpu")


@pytest.fixture
def no_triton(monkeypatch):
    """As on a machine where ``import triton`` fails."""
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    monkeypatch.setattr(backends, "_warned_missing_triton", False)


def test_choices_with_triton_installed(monkeypatch):
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.setattr(backends, "interpreting", lambda: False)
    assert resolve_backend("auto", CUDA, "x") == resolve_backend(None, CUDA, "x") == "triton"
    assert resolve_backend("auto", CPU, "x") == "torch"
    assert resolve_backend("torch", CUDA, "x") == "torch"
    assert resolve_backend("triton", CUDA, "x") == "triton"
    with pytest.raises(ValueError, match=r"backend: 'triton' for x on cpu tensors needs CUDA tensors, or "
                                         r"TRITON_INTERPRET=1 set before triton is imported"):
        resolve_backend("triton", CPU, "x")
    monkeypatch.setattr(backends, "interpreting", lambda: True)
    assert resolve_backend("triton", CPU, "x") == "triton"
    with pytest.raises(ValueError, match=r"backend: expected one of 'auto', 'triton', 'torch', found 'cuda'"):
        resolve_backend("cuda", CUDA, "x")


def test_missing_triton_is_said_once(no_triton):
    with pytest.warns(RuntimeWarning, match=r"table lookups run the torch path on CUDA tensors because the 'triton' "
                                            r"package is not installed.*pip install 'engram\[triton\]'"):
        assert resolve_backend("auto", CUDA, "table lookups") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", CUDA, "the Engram gate") == "torch"   # said once per process
        assert resolve_backend("auto", CPU, "x") == "torch"                  # the CPU path is no fallback
    with pytest.raises(ValueError, match=r"backend: 'triton' for x needs the 'triton' package \(pip install "
                                         r"'engram\[triton\]'\), which is not installed"):
        resolve_backend("triton", CUDA, "x")


def test_table_backend_is_decided_once(rng):
    values = torch.from_numpy(rng.integers(0, 0x7F, (10, 64), dtype=np.uint8))
    scales = torch.full((10, 2), 127, dtype=torch.uint8)
    table = EngramTable(values, scales)
    assert table.backend == "torch"
    with pytest.raises(ValueError, match=r"backend: placement 'cpu' has no Triton lookup; expected 'auto' or 'torch'"):
        EngramTable(values, scales, backend="triton")
    with pytest.raises(ValueError, match=r"backend: expected one of 'auto', 'triton', 'torch', found 'fast'"):
        EngramTable(values, scales, backend="fast")


@pytest.mark.parametrize("path", ["table/kernels/gather.py", "table/table.py", "layer/gate.py"])
def test_no_catch_all_fallback(path):
    """A broken kernel module must fail loudly, not run the slow torch path."""
    tree = ast.parse((SOURCES / path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            caught = ast.unparse(node.type) if node.type is not None else "everything"
            assert caught not in ("Exception", "BaseException", "everything"), f"{path}:{node.lineno} catches {caught}"
