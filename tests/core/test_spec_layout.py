"""EngramSpec parsing and validation; EngramLayout primes, offsets, multipliers, shards."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import sympy
from hypothesis import given, settings, strategies as st

import engram
from engram.layout import is_prime, layer_multipliers

from conftest import PACKAGED_CONFIG, small_config


def test_v41_flash_row_counts():
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    assert layout.num_embeddings == [384006168, 384016682]
    assert layout.column_primes.shape == (2, 24)
    assert layout.spec.kv_dim == 25600 and layout.spec.num_columns * layout.spec.head_dim == 6144


def test_model_directory_and_text_config(tmp_path):
    config = json.loads(PACKAGED_CONFIG.read_text())
    nested = {"model_type": "x", "text_config": config}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert engram.EngramSpec.from_hf_config(tmp_path) == engram.EngramSpec.from_hf_config(config)


def test_pad_key_alias():
    config = small_config()
    config["engram_pad_id"] = config.pop("engram_pad_token_id")
    assert engram.EngramSpec.from_hf_config(config).pad_token_id == 2
    config["engram_pad_token_id"] = 5
    with pytest.raises(ValueError, match="engram_pad_token_id.*engram_pad_id.*disagree"):
        engram.EngramSpec.from_hf_config(config)


@pytest.mark.parametrize("key", [
    "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
    "engram_vocab_size", "engram_compressed_vocab_size", "engram_pad_token_id", "hidden_size", "hc_mult",
    "rms_norm_eps",
])
def test_missing_key_is_named(key):
    config = small_config()
    del config[key]
    with pytest.raises(ValueError, match=key):
        engram.EngramSpec.from_hf_config(config)


@pytest.mark.parametrize("key,value", [
    ("engram_n_heads", "8"), ("engram_n_heads", 2.0), ("engram_max_ngram_size", 1), ("engram_head_dim", 48),
    ("hc_mult", True), ("rms_norm_eps", -1.0), ("engram_layer_ids", [1, 1]), ("engram_layer_ids", 3),
])
def test_wrong_type_or_value_is_named(key, value):
    config = small_config()
    config[key] = value
    with pytest.raises(ValueError, match=key) as error:
        engram.EngramSpec.from_hf_config(config)
    assert repr(value) in str(error.value) or str(value) in str(error.value)


def test_layer_count_disagreement():
    config = small_config()
    config["engram_num_embeddings"] = config["engram_num_embeddings"][:1]
    with pytest.raises(ValueError, match=r"engram_num_embeddings.*expected 2 entries.*found 1"):
        engram.EngramSpec.from_hf_config(config)


def test_row_count_disagreement_names_both_values():
    config = small_config()
    good = config["engram_num_embeddings"][1]
    config["engram_num_embeddings"][1] = good + 2
    with pytest.raises(ValueError, match=rf"engram_num_embeddings\[1\].*gives {good} rows.*says {good + 2}"):
        engram.EngramSpec.from_hf_config(config)


def test_top_level_and_text_config_disagree():
    config = small_config()
    nested = {"hidden_size": 128, "text_config": copy.deepcopy(config)}
    with pytest.raises(ValueError, match="hidden_size.*128.*64"):
        engram.EngramSpec.from_hf_config(nested)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        engram.EngramSpec.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        engram.EngramSpec.from_hf_config(tmp_path)


@given(st.integers(0, 10**6))
def test_is_prime_matches_sympy(n):
    assert is_prime(n) == sympy.isprime(n)


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(1, 3), order=st.integers(2, 5), heads=st.integers(1, 5), start=st.integers(2, 5000))
def test_prime_rule(layers, order, heads, start):
    config = small_config(layer_ids=tuple(range(1, layers + 1)), max_ngram_size=order, n_heads=heads, vocab_size=start)
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(config))
    flat = [p for layer in layout.primes for order_primes in layer for p in order_primes]
    assert len(set(flat)) == len(flat) and all(sympy.isprime(p) for p in flat)
    used = set()
    for layer in layout.primes:
        for order_primes in layer:
            # Each pick is the smallest prime >= its search start not used before.
            search_from = start
            for prime in order_primes:
                assert prime >= search_from
                assert all(q in used for q in sympy.primerange(search_from, prime))
                used.add(prime)
                search_from = prime + 1
    offsets = np.asarray(layout.offsets)
    assert (offsets[:, 0] == 0).all()
    assert (np.diff(offsets, axis=1) == layout.column_primes[:, :-1]).all()
    assert layout.num_embeddings == [int(x) for x in layout.column_primes.sum(axis=1)]


@given(layer_id=st.integers(0, 100), vocab=st.integers(1, 10**7), order=st.integers(2, 6))
def test_multipliers_are_odd_and_never_overflow(layer_id, vocab, order):
    multipliers = layer_multipliers(layer_id, order, vocab)
    assert multipliers.dtype == np.int64 and (multipliers % 2 == 1).all()
    assert all(int(m) * (vocab - 1) <= np.iinfo(np.int64).max for m in multipliers)
    again = layer_multipliers(layer_id, order, vocab)
    assert (again == multipliers).all()


def test_multipliers_follow_the_seed_rule():
    bound = (np.iinfo(np.int64).max // 99092) // 2
    expected = np.random.default_rng(10007 * 14).integers(0, bound, size=4, dtype=np.int64) * 2 + 1
    assert (layer_multipliers(14, 4, 99092) == expected).all()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 8, 12, 24])
def test_shards_cover_every_column_once(world_size):
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    shards = [layout.shard(rank, world_size) for rank in range(world_size)]
    columns = [c for s in shards for c in range(s.column_start, s.column_end)]
    assert columns == list(range(24))
    per_rank = -(-24 // world_size)
    for s in shards:
        assert s.column_start == s.rank * per_rank
        for layer in range(2):
            row_start, row_end = s.row_ranges[layer]
            assert row_start == layout.offsets[layer][s.column_start]
            assert row_end - row_start == int(layout.column_primes[layer, s.column_start:s.column_end].sum())
    assert sum(s.num_rows(0) for s in shards) == layout.num_embeddings[0]


@pytest.mark.parametrize("world_size,rank", [(7, 6), (16, 12), (10, 9)])
def test_rank_without_columns_is_an_error(world_size, rank):
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    with pytest.raises(ValueError, match=rf"world_size {world_size}: rank {rank} gets no hash column"):
        layout.shard(rank, world_size)


def test_bad_rank_arguments():
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    with pytest.raises(ValueError, match="rank"):
        layout.shard(4, 4)
    with pytest.raises(ValueError, match="world_size"):
        layout.shard(0, 0)


def test_quantization_config_must_be_an_object():
    config = small_config() | {"quantization_config": "fp8"}
    with pytest.raises(ValueError, match=r"config field 'quantization_config': expected an object such as .*, "
                                         r"found 'fp8'"):
        engram.EngramSpec.from_hf_config(config)
