"""Hot sets are checked where they come in: a HOT.npz for engram profile (exit 2 naming the array,
the index and the value) and the ids given to EngramTable.load_hot_rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engram
from engram.tools.cli import main

from conftest import PACKAGED_CONFIG

LAYOUT = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))


def _hot_file(path, rows_0, counts_0=None):
    rows_1 = np.arange(5, dtype=np.int64)
    np.savez(path, layer_ids=np.array(LAYOUT.spec.layer_ids), num_rows=np.array(LAYOUT.num_embeddings),
             fraction=np.array(0.01), tokens=np.array(100), step_tokens=np.array(4096),
             rows_0=rows_0, counts_0=np.ones(len(rows_0), dtype=np.int64) if counts_0 is None else counts_0,
             rows_1=rows_1, counts_1=np.ones(5, dtype=np.int64))
    return path


CASES = {
    "row past the table": (np.array([3, 10**12], dtype=np.int64), None,
                           r"rows_0\[1\] = 1000000000000 is outside the layer's table rows \[0, 384006168\)"),
    "negative row": (np.array([-5, 3]), None, r"rows_0\[0\] = -5 is outside"),
    "float rows": (np.array([1.0, 2.5]), None, r"rows_0 must be a 1-D array of integers, found dtype float64"),
    "float 1e12": (np.array([1e12]), None, r"rows_0 must be a 1-D array of integers, found dtype float64"),
    "repeated row": (np.array([7, 8, 7]), None, r"rows_0\[2\] = 7 appears twice"),
    "counts of another length": (np.array([1, 2]), np.array([4]), r"rows_0 has 2 rows but counts_0 1 counts"),
    "negative count": (np.array([1, 2]), np.array([4, -1]), r"counts_0\[1\] = -1 is negative"),
    "2-D rows": (np.array([[1, 2]]), np.array([4, 1]), r"rows_0 must be a 1-D array of integers"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_hot_file_is_refused_before_the_tokenizer(case, tmp_path, monkeypatch, capsys):
    import engram.vocab

    rows, counts, message = CASES[case]
    path = _hot_file(tmp_path / "hot.npz", rows, counts)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox\n")

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer loaded before the hot set was checked")

    monkeypatch.setattr(engram.vocab.TokenCompressor, "from_tokenizer", no_tokenizer)
    for command in (["eval", "--fraction", "0.01", "--policy", "static"], ["plot", "--out", str(tmp_path / "f.png")]):
        assert main(["profile", *command, "--corpus", str(text), "--hot", str(path)]) == 2
        captured = capsys.readouterr()
        err = captured.err
        assert captured.out == "" and "--hot" in err and err.count("\n") == 1, err
        assert __import__("re").search(message, err), err


def test_a_sound_hot_file_loads(tmp_path):
    from engram.tools.profile import HotSet

    hot = HotSet.load(_hot_file(tmp_path / "hot.npz", np.array([9, 3, 384006167])), LAYOUT)
    assert hot.rows[0].tolist() == [9, 3, 384006167]


class _RecordingPlacement:
    """Stands in for a row cache: records the local ids load_hot_rows hands it."""

    def __init__(self):
        self.loaded = None

    def load_hot(self, local_ids):
        self.loaded = local_ids
        return len(local_ids)


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([500, -5]), r"global_row_ids\[1\] = -5 is outside the layer's table rows \[0, 800\)"),
    (torch.tensor([10**12]), r"global_row_ids\[0\] = 1000000000000 is outside the layer's table rows \[0, 800\)"),
    (torch.tensor([800]), r"global_row_ids\[0\] = 800 is outside"),
    (torch.tensor([1.0, 2.0]), r"global_row_ids: expected an int32/int64 tensor, found torch.float32"),
    (torch.tensor([[500]]), r"global_row_ids: expected a 1-D tensor \[K\], found shape \[1, 1\]"),
])
def test_load_hot_rows_refuses_rows_of_no_rank(ids, message, monkeypatch):
    values = torch.zeros(80, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.full((80, 2), 127, dtype=torch.uint8)
    table = engram.EngramTable(values, scales, column_start=1, column_end=4, row_start=500, num_columns_total=8,
                               num_rows_total=800, validate=False)
    recorder = _RecordingPlacement()
    monkeypatch.setattr(table, "_storage", type("Storage", (), {"load_hot": recorder.load_hot,
                                                                "__getattr__": lambda s, n: None})())
    with pytest.raises(ValueError, match=message):
        table.load_hot_rows(ids)
    assert recorder.loaded is None
    # Rows of the whole layer are accepted; those of other ranks are the placement's to ignore.
    assert table.load_hot_rows(torch.tensor([0, 510, 799])) == 3
    assert recorder.loaded.tolist() == [-500, 10, 299]


@pytest.mark.interpreter
def test_a_cached_table_refuses_rows_of_no_rank():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    values = torch.zeros(80, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.full((80, 2), 127, dtype=torch.uint8)
    cached = engram.EngramTable(values, scales, placement="cached", device="cpu", column_start=1, column_end=4,
                                row_start=500, num_columns_total=8, num_rows_total=800, validate=False,
                                placement_options={"cache_fraction": 0.25, "ways": 4})
    for bad in (torch.tensor([510, -5]), torch.tensor([10**12])):
        with pytest.raises(ValueError, match=r"global_row_ids\[\d\] = -?\d+ is outside the layer's table rows"):
            cached.load_hot_rows(bad)
    assert cached.load_hot_rows(torch.arange(500, 520)) == 20
