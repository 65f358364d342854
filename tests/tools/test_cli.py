"""The engram command: info, hash (table and JSON), demo."""

from __future__ import annotations

import json

import numpy as np
import pytest

import engram
from engram.tools.cli import main
from engram.tools.testing import write_synthetic_checkpoint

from conftest import PACKAGED_CONFIG


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "384,006,168" in out and "384,016,682" in out
    assert "16,000,057" in out  # the smallest prime of layer 1
    assert "3/3/3/3/3/3/3/3" in out


def test_info_reports_bad_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"engram_layer_ids": [1]}))
    assert main(["info", "--config", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "engram_num_embeddings" in captured.err and str(tmp_path) in captured.err


def test_hash_json_matches_reference(deepseek_tokenizer_path, capsys):
    assert main(["hash", "--json", "--tokenizer", str(deepseek_tokenizer_path), "In the beginning God created"]) == 0
    rows = json.loads(capsys.readouterr().out)
    spec = engram.EngramSpec.from_hf_config(PACKAGED_CONFIG)
    vocab = engram.TokenCompressor.from_tokenizer(deepseek_tokenizer_path, spec=spec)
    ids = engram.hash_ngrams([r["token_id"] for r in rows], engram.EngramLayout(spec), vocab)
    assert len(rows) >= 4
    for t, row in enumerate(rows):
        assert row["compressed_id"] == int(vocab.token_map[row["token_id"]])
        assert np.array_equal(np.array([row["hash_ids"]["1"], row["hash_ids"]["14"]]), ids[t])


def test_demo_checks_every_id(deepseek_tokenizer_path, capsys):
    assert main(["demo", "--texts", "2", "--max-chars", "1500", "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("match") >= 3


def test_info_is_not_cut_when_stdout_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    for table_bytes in [*layout.table_bytes, sum(layout.table_bytes)]:
        assert f"{table_bytes:,}" in out
    assert "…" not in out


def test_hash_json_gives_the_raw_token_and_its_text(deepseek_tokenizer_path, capsys):
    assert main(["hash", "--json", "--tokenizer", str(deepseek_tokenizer_path), "In the beginning"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["text"] for row in rows] == ["In", " the", " beginning"]
    assert [row["token"] for row in rows] == ["In", "\u0120the", "\u0120beginning"]  # byte-level: U+0120 is a space


def test_hash_uses_the_tokenizer_beside_the_config(tmp_path, capsys):
    synthetic = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word")
    assert main(["hash", "--json", "--config", str(synthetic.directory), "the table and the memory"]) == 0
    rows = json.loads(capsys.readouterr().out)
    vocab = engram.TokenCompressor.from_tokenizer(synthetic.directory / "tokenizer.json", spec=synthetic.spec)
    ids = engram.hash_ngrams([r["token_id"] for r in rows], engram.EngramLayout(synthetic.spec), vocab)
    assert [r["text"] for r in rows] == ["the", "table", "and", "the", "memory"]
    for t, row in enumerate(rows):
        assert np.array_equal(np.array([row["hash_ids"]["1"], row["hash_ids"]["14"]]), ids[t])
    assert main(["hash", "--config", str(synthetic.directory / "config.json"), "the memory"]) == 0
    assert str(synthetic.directory / "tokenizer.json") in capsys.readouterr().out
    assert main(["hash", "--tokenizer", str(tmp_path / "nothing"), "x"]) == 2
    assert "--tokenizer: expected a tokenizer.json or a directory holding one" in capsys.readouterr().err


def test_demo_placement_host_without_cuda_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    from engram.tools.cli import main

    assert main(["demo", "--placement", "host", "--texts", "1", "--max-chars", "300"]) == 2
