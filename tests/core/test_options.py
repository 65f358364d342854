"""ServingOptions: one frozen object for every knob, checked when made, environment only as defaults."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from engram.options import ServingOptions


def test_defaults_and_placement_options():
    options = ServingOptions()
    assert options.placement_options("device") == {}
    assert options.placement_options("host") == {"direct_max_rows": 4096 * 24, "gather_threads": None,
                                                 "host_gather_worker": "auto", "host_gather_dedup": "auto",
                                                 "prefetch_direct_max_rows": 1024 * 24,
                                                 "graph_direct_max_rows": 64 * 24}
    cached = ServingOptions(cache_fraction=0.05, cache_policy="static", cache_ways=4, direct_max_rows=0,
                            extra_placement_options={"aging_interval": 32}).placement_options("cached")
    assert cached == {"direct_max_rows": 0, "gather_threads": None, "host_gather_worker": "auto",
                      "host_gather_dedup": "auto", "cache_fraction": 0.05, "policy": "static", "ways": 4,
                      "update_beside": True, "aging_interval": 32}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.backend = "torch"


@pytest.mark.parametrize("field,value,message", [
    ("backend", "cuda", "backend: expected one of 'auto', 'triton', 'torch', found 'cuda'"),
    ("wkv_backend", "fp4", "wkv_backend: expected one of"),
    ("validate", "yes", "validate: expected True, False or None, found 'yes'"),
    ("direct_max_rows", -1, "direct_max_rows: expected an integer >= 0, found -1"),
    ("prefetch_direct_max_rows", -2, "prefetch_direct_max_rows: expected an integer >= 0, found -2"),
    ("graph_direct_max_rows", -3, "graph_direct_max_rows: expected an integer >= 0, found -3"),
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


# ---- options owned by the placements --------------------------------------------------------------
def test_built_in_placements_receive_their_options_objects():
    from engram.table.placements.cached import CachedOptions
    from engram.table.placements.host import HostOptions
    from engram.table.placements.node import NodeOptions

    options = ServingOptions(direct_max_rows=0, placements={"cached": CachedOptions(ways=4, aging_interval=2),
                                                            "node": {"lookup": "peer"}})
    assert options.options_for("host") == HostOptions(direct_max_rows=0)   # the shared field, mapped by the placement
    assert options.options_for("cached") == CachedOptions(ways=4, aging_interval=2, direct_max_rows=0)
    assert options.placement_options("cached")["ways"] == 4 and options.placement_options("node")["lookup"] == "peer"
    assert options.options_for("device") is None and options.placement_options("cpu") == {}
    # The shared fields fill a dict entry's other fields; a field given twice with two values is refused.
    partial = ServingOptions(cache_ways=16, placements={"cached": {"aging_interval": 8}}).options_for("cached")
    assert (partial.ways, partial.aging_interval) == (16, 8)
    with pytest.raises(ValueError, match=r"^cache_ways: 16 as a ServingOptions field and ways=4 in "
                                         r"placements\['cached'\] \(CachedOptions\); give it once$"):
        ServingOptions(cache_ways=16, placements={"cached": CachedOptions(ways=4)})
    with pytest.raises(ValueError, match=r"^placements\['cached'\]: ways: expected a power of two at most 64, found 3$"):
        ServingOptions(placements={"cached": {"ways": 3}})
    with pytest.raises(ValueError, match=r"^placements\['host'\]: expected a HostOptions or a dict of its fields, "
                                         r"found CachedOptions\("):
        ServingOptions(placements={"host": CachedOptions()})
    with pytest.raises(ValueError, match=r"^placements\['device'\]: placement 'device' takes no options$"):
        ServingOptions(placements={"device": {}})
    with pytest.raises(ValueError, match=r"^placements: unknown placement 'disc'; available placements: 'cpu'"):
        ServingOptions(placements={"disc": {}})
    with pytest.raises(ValueError, match=r"^direct_max_rows: expected an integer >= 0 \(0: every lookup"):
        HostOptions(direct_max_rows=-1)
    with pytest.raises(ValueError, match="lookup: expected 'peer' or 'exchange', found 'all'"):
        NodeOptions(lookup="all")


def test_a_placement_registered_from_outside_gets_its_options_the_same_way(monkeypatch):
    import pickle

    import torch

    import engram
    from engram.table import placement as registry

    @dataclasses.dataclass(frozen=True)
    class ToyOptions:
        tint: int = 0
        threads: int | None = None
        serving_fields: ClassVar[dict] = {"gather_threads": "threads"}   # a shared field, under its own name

        def __post_init__(self):
            if not isinstance(self.tint, int) or self.tint < 0:
                raise ValueError(f"tint: expected an integer >= 0, found {self.tint!r}")

    class ToyPlacement(registry.TablePlacement):
        name = "toy"
        options_type = ToyOptions

        def __init__(self, value_bytes, scale_bytes, device=None, *, tint: int = 0, threads: int | None = None):
            ToyOptions(tint, threads)
            super().__init__(value_bytes, scale_bytes, torch.device("cpu"))
            self.received = (tint, threads)

        def gather(self, local_row_ids):
            return self.value_bytes[local_row_ids], self.scale_bytes[local_row_ids]

        @classmethod
        def storage_device(cls, device):
            return None

    monkeypatch.setitem(registry._PLACEMENTS, "toy", ToyPlacement)  # the registry as it was, after the test
    registry.register_placement(ToyPlacement)
    options = ServingOptions(backend="torch", gather_threads=3, placements={"toy": ToyOptions(tint=7)})
    assert options.options_for("toy") == ToyOptions(tint=7, threads=3)
    assert options.placement_options("toy") == {"tint": 7, "threads": 3}
    assert pickle.loads(pickle.dumps(ServingOptions(placements={"toy": {"tint": 1}}))).placements == {"toy": {"tint": 1}}
    values = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.full((4, 1), 127, dtype=torch.uint8)
    table = engram.EngramTable(values, scales, placement="toy", options=options)
    assert table._storage.received == (7, 3)
    with pytest.raises(ValueError, match=r"^placements\['toy'\]: placement 'toy' has no option 'colour' \(its options, "
                                         r"ToyOptions: tint, threads\)$"):
        ServingOptions(placements={"toy": {"colour": "red"}})
    with pytest.raises(ValueError, match=r"^placements\['toy'\]: tint: expected an integer >= 0, found -1$"):
        ServingOptions(placements={"toy": {"tint": -1}})
    with pytest.raises(ValueError, match="share_host_tables: .* placement 'toy' keeps none$"):
        ServingOptions(share_host_tables=True).placement_options("toy")

    class Loose(ToyPlacement):
        name = "loose"
        options_type = dict
    with pytest.raises(ValueError, match="placement_class Loose: options_type: expected a frozen dataclass"):
        registry.register_placement(Loose)

    @dataclasses.dataclass(frozen=True)
    class Misnamed:
        tint: int = 0
        serving_fields: ClassVar[dict] = {"gather_thread": "tint"}

    class Bad(ToyPlacement):
        name = "bad"
        options_type = Misnamed
    with pytest.raises(ValueError, match="placement_class Bad: options_type: serving_fields maps 'gather_thread' onto "
                                         "'tint'; expected a ServingOptions field"):
        registry.register_placement(Bad)
    assert "loose" not in registry.available_placements() and "bad" not in registry.available_placements()


def test_options_stay_frozen_with_placement_entries():
    given = {"cached": {"aging_interval": 32}}
    options = ServingOptions(placements=given)
    given["cached"]["aging_interval"] = 1
    given["host"] = {}
    assert options.options_for("cached").aging_interval == 32 and "host" not in options.placements
    with pytest.raises(TypeError, match="read-only"):
        options.placements["host"] = {}
    with pytest.raises(TypeError, match="read-only"):
        options.placements["cached"]["aging_interval"] = 2
    with pytest.raises(TypeError, match="read-only"):
        options.extra_placement_options["x"] = 1
    assert hash(options) == hash(ServingOptions())   # hashable; entries compare, not hash
    assert options != ServingOptions() and options == ServingOptions(placements={"cached": {"aging_interval": 32}})
    with pytest.raises(ValueError, match="placements: expected a dict of placement names, found"):
        ServingOptions(placements=[("cached", {})])
