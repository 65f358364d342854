"""Every config field is bounded and checked before any work that grows with it: an error naming
the field and the value, at once; DeepSeek-V4.1's own values pass."""

from __future__ import annotations

import json
import time

import pytest

import engram
from engram.tools.cli import main

from conftest import PACKAGED_CONFIG, small_config

V41 = json.loads(PACKAGED_CONFIG.read_text())

CASES = [
    ({"engram_max_ngram_size": 1000}, r"'engram_max_ngram_size': expected an integer in \[2, 8\], found 1000"),
    ({"engram_n_heads": 100000}, r"'engram_n_heads': expected an integer in \[1, 64\], found 100000"),
    ({"engram_layer_ids": [1, 14], "num_hidden_layers": 10},
     r"'engram_layer_ids': layer ids \[14\] are beyond the model's decoder layers 0..9 \(num_hidden_layers = 10\)"),
    ({"text_config": {"num_hidden_layers": 14}}, r"layer ids \[14\] are beyond .*num_hidden_layers = 14"),
    ({"engram_layer_ids": [1, 5000]}, r"'engram_layer_ids\[1\]': expected an integer in \[0, 4095\], found 5000"),
    ({"engram_layer_ids": list(range(65))}, r"'engram_layer_ids': expected at most 64 entries, found 65"),
    ({"engram_layer_ids": list(range(8)), "engram_num_embeddings": [5] * 8, "engram_max_ngram_size": 8,
      "engram_n_heads": 64},
     r"8 layers x 7 orders x 64 heads = 3584 hash columns, expected at most 1024"),
    ({"engram_head_dim": 8192}, r"'engram_head_dim': expected an integer in \[32, 4096\], found 8192"),
    ({"engram_vocab_size": 2**40}, r"'engram_vocab_size': expected an integer in \[2, 2147483647\], found 1099511627776"),
    ({"engram_compressed_vocab_size": 2**30}, r"'engram_compressed_vocab_size': expected an integer in \[1, 16777216\]"),
    ({"engram_pad_token_id": 2**40}, r"'engram_pad_token_id': expected an integer in \[0, 2147483647\]"),
    ({"hidden_size": 10**6}, r"'hidden_size': expected an integer in \[1, 65536\], found 1000000"),
    ({"hc_mult": 1000}, r"'hc_mult': expected an integer in \[1, 64\], found 1000"),
    ({"rms_norm_eps": float("inf")}, r"'rms_norm_eps': expected a number in \(0, 1\), found inf"),
    ({"rms_norm_eps": float("nan")}, r"'rms_norm_eps': expected a number in \(0, 1\), found nan"),
    ({"rms_norm_eps": 2}, r"'rms_norm_eps': expected a number in \(0, 1\), found 2"),
    ({"num_hidden_layers": 0}, r"'num_hidden_layers': expected an integer in \[1, 4096\], found 0"),
    ({"engram_num_embeddings": [2**41, 5]}, r"'engram_num_embeddings\[0\]': expected an integer in \[1, 1099511627776\]"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     r"'quantization_config.fmt': expected 'e4m3' .*found 'e5m2'"),
    ({"quantization_config": {"quant_method": "int4"}}, r"'quantization_config.quant_method': expected 'fp8'"),
    ({"quantization_config": {"scale_fmt": "e4m3", "weight_block_size": [128, 128]}},
     r"'quantization_config.scale_fmt': expected 'ue8m0'"),
    ({"quantization_config": {"weight_block_size": [128, 100000]}},
     r"'quantization_config.weight_block_size': expected two integers in \[1, 4096\], found \[128, 100000\]"),
]


@pytest.mark.parametrize("change, message", CASES, ids=[next(iter(c)) + f"-{i}" for i, (c, _) in enumerate(CASES)])
def test_a_field_out_of_bounds_is_named_at_once(change, message):
    config = {**V41, **change}
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        engram.EngramSpec.from_hf_config(config)
    assert time.perf_counter() - started < 0.5


def test_the_cli_refuses_them_quickly(tmp_path, capsys):
    for change in ({"engram_max_ngram_size": 1000}, {"engram_n_heads": 100000}):
        (tmp_path / "config.json").write_text(json.dumps({**V41, **change}))
        started = time.perf_counter()
        assert main(["info", "--config", str(tmp_path)]) == 2
        assert time.perf_counter() - started < 5
        assert next(iter(change)) in capsys.readouterr().err


def test_v41_values_and_the_largest_accepted_geometry_pass():
    spec = engram.EngramSpec.from_hf_config({**V41, "num_hidden_layers": 43})
    assert spec.layer_ids == (1, 14) and spec.weight_block_size == (128, 128)
    # The bounds themselves are accepted (the row check off: its prime search is the slow part).
    config = small_config() | {"engram_layer_ids": [0, 4095], "engram_max_ngram_size": 8, "engram_n_heads": 64,
                               "engram_head_dim": 4096, "hidden_size": 65536, "hc_mult": 64, "rms_norm_eps": 0.5}
    config["engram_num_embeddings"] = [2**40, 1]
    spec = engram.EngramSpec.from_hf_config(config, check_rows=False)
    assert spec.num_columns == 7 * 64
