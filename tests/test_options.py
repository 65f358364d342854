"""ServingOptions: one frozen object for every knob, checked when made, environment only as defaults."""

from __future__ import annotations

import dataclasses

import pytest

from engram.options import ServingOptions


def test_defaults_and_placement_options():
    options = ServingOptions()
    assert options.placement_options("device") == {}
    assert options.placement_options("host") == {"direct_max_rows": 4096 * 24, "gather_threads": None,
                                                 "host_gather_worker": "auto", "host_gather_dedup": "auto",
                                                 "prefetch_direct_max_rows": 1024 * 24}
    cached = ServingOptions(cache_fraction=0.05, cache_policy="static", cache_ways=4, direct_max_rows=0,
                            extra_placement_options={"aging_interval": 32}).placement_options("cached")
    assert cached == {"direct_max_rows": 0, "gather_threads": None, "host_gather_worker": "auto",
                      "host_gather_dedup": "auto", "cache_fraction": 0.05, "policy": "static", "ways": 4,
                      "aging_interval": 32}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.backend = "torch"


@pytest.mark.parametrize("field,value,message", [
    ("backend", "cuda", "backend: expected one of 'auto', 'triton', 'torch', found 'cuda'"),
    ("wkv_backend", "fp4", "wkv_backend: expected one of"),
    ("validate", "yes", "validate: expected True, False or None, found 'yes'"),
    ("direct_max_rows", -1, "direct_max_rows: expected an integer >= 0, found -1"),
    ("prefetch_direct_max_rows", -2, "prefetch_direct_max_rows: expected an integer >= 0, found -2"),
    ("gather_threads", 0, "gather_threads: expected an integer >= 1 or None, found 0"),
    ("host_gather_worker", "c", "host_gather_worker: expected one of 'auto', 'native', 'python', found 'c'"),
    ("host_gather_dedup", "sometimes",
     "host_gather_dedup: expected one of 'auto', 'always', 'never', found 'sometimes'"),
    ("cache_fraction", 1.5, r"cache_fraction: expected a number in \(0, 1\], found 1.5"),
    ("cache_policy", "lfu", "cache_policy: expected one of"),
    ("cache_ways", 6, "cache_ways: expected a power of two up to 64, found 6"),
    ("share_host_tables", 1, "share_host_tables: expected True or False, found 1"),
    ("chunk_bytes", 0, "chunk_bytes: expected an integer >= 1, found 0"),
])
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServingOptions(**{field: value})


def test_environment_gives_defaults_only(monkeypatch):
    monkeypatch.setenv("ENGRAM_WKV_BACKEND", "bf16")
    monkeypatch.setenv("ENGRAM_WKV_SMALL_M", "1")
    assert ServingOptions.from_environment().wkv_backend == "bf16"
    assert ServingOptions.from_environment().wkv_small_m is True
    assert ServingOptions.from_environment(wkv_backend="fused").wkv_backend == "fused"  # an argument wins
    assert ServingOptions().wkv_backend is None  # the plain constructor reads nothing
    monkeypatch.setenv("ENGRAM_WKV_BACKEND", "nope")
    with pytest.raises(ValueError, match="ENGRAM_WKV_BACKEND: expected one of"):
        ServingOptions.from_environment()
    monkeypatch.setenv("ENGRAM_WKV_BACKEND", "")
    monkeypatch.setenv("ENGRAM_WKV_SMALL_M", "maybe")
    with pytest.raises(ValueError, match="ENGRAM_WKV_SMALL_M: expected '0' or '1', found 'maybe'"):
        ServingOptions.from_environment()


def test_replace_checks_again_and_ignores_none():
    options = ServingOptions(backend="torch")
    assert options.replace(backend=None, validate=None) is options
    assert options.replace(validate=True).validate is True
    with pytest.raises(ValueError, match="options: ServingOptions has no field 'placement'"):
        options.replace(placement="host")
    with pytest.raises(ValueError, match="direct_max_rows: expected an integer >= 0"):
        options.replace(direct_max_rows=-5)


def test_from_pretrained_takes_the_options_and_keyword_arguments_win(synthetic_model_dir):
    import engram

    options = ServingOptions(backend="torch", validate=False, progress=False)
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", options=options)
    assert memory.options == options
    assert all(not memory.table(i).validate and memory.table(i).backend == "torch" for i in memory.layer_ids)
    checked = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", options=options, validate=True)
    assert checked.options.validate is True and all(checked.table(i).validate for i in checked.layer_ids)
    with pytest.raises(ValueError, match="options: expected a ServingOptions or None, found dict"):
        engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", options={"backend": "torch"})
    with pytest.raises(ValueError, match="backend: expected one of"):
        engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", backend="gpu")


def test_table_takes_the_options():
    import torch

    import engram

    values = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.full((4, 1), 127, dtype=torch.uint8)
    table = engram.EngramTable(values, scales, options=ServingOptions(backend="torch", validate=False))
    assert table.backend == "torch" and table.validate is False
    with pytest.raises(ValueError, match="direct_max_rows: expected an integer >= 0"):
        engram.EngramTable(values, scales, placement="host", options=ServingOptions(),
                           placement_options={"direct_max_rows": -1})
