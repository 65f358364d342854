"""Library calls a new user gets wrong: one ValueError naming the argument and the value, before any
work (``fused_write``, request ids, ``EngramLayout``'s spec, ``share_host_tables`` where no host table
is kept, the frozen options' placement options), a plan's structure mismatch named argument by
argument, and the package's lazy names (``import engram.spec`` or the command's ``info`` load no torch)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

import engram
from engram.call_cache import structure, structure_mismatch
from engram.options import ServingOptions


@pytest.fixture
def hasher(small_layout, small_vocab):
    return engram.NgramHasher(small_layout, small_vocab)


@pytest.mark.parametrize("given", ["yes", 1, None, "False"])
def test_fused_write_must_be_a_bool(hasher, given):
    with pytest.raises(ValueError, match=rf"fused_write: expected True or False, found {re_escape(repr(given))}"):
        hasher.bind_slot_cache(64, 16, fused_write=given)
    assert hasher.bind_slot_cache(64, 16, fused_write=True).fused_write is True


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("given", ["abc", b"ab", 7])
def test_request_ids_must_be_a_list_of_ids(hasher, given):
    hasher.bind_request_history(4)
    for call in (hasher.request_rows, hasher.release_requests):
        with pytest.raises(ValueError, match=r"request_ids: expected an iterable of request ids .* a single id goes "
                                             r"in a list"):
            call(given)
    assert hasher.request_history._row_of == {}   # nothing was taken
    assert hasher.request_rows(["abc"]).tolist() == [0]
    assert hasher.request_rows(iter(["abc", "d"])).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"request_ids\[1\]: expected a hashable request id, found list"):
        hasher.request_rows(["e", ["f"]])


@pytest.mark.parametrize("given", ["spec", {"engram_layer_ids": [1]}, None, 3])
def test_layout_needs_a_spec(given):
    with pytest.raises(ValueError, match=r"spec: expected an EngramSpec, found") as error:
        engram.EngramLayout(given)
    if isinstance(given, (str, dict)):
        assert "EngramSpec.from_hf_config" in str(error.value)


def test_share_host_tables_where_no_host_table_is_kept(synthetic_model_dir, monkeypatch):
    import engram.checkpoint.reading as reading

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the option was refused")

    monkeypatch.setattr(reading.SafetensorsCheckpoint, "read_tensor", no_reads)
    with pytest.raises(ValueError, match=r"share_host_tables: True keeps one copy of each host table per node, which "
                                         r"placements 'host' and 'cached' have; placement 'cpu' keeps none"):
        engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", share_host_tables=True,
                                            progress=False)
    monkeypatch.undo()
    from engram.checkpoint import SafetensorsCheckpoint, load_engram_table

    spec = engram.EngramSpec.from_hf_config(synthetic_model_dir)
    with pytest.raises(ValueError, match=r"share_host_table: .* placement 'device' keeps none"):
        load_engram_table(SafetensorsCheckpoint(synthetic_model_dir), engram.EngramLayout(spec), 0,
                          placement="device", share_host_table=True)
    for placement in ("host", "cached"):   # where it applies, it is taken
        assert ServingOptions(share_host_tables=True).placement_options(placement)["direct_max_rows"] > 0


def test_frozen_options_keep_their_own_placement_options():
    given = {"aging_interval": 32}
    options = ServingOptions(extra_placement_options=given)
    given["aging_interval"] = 1                       # the caller's dict is not the options'
    assert options.placement_options("cached")["aging_interval"] == 32
    with pytest.raises(TypeError, match="read-only"):
        options.extra_placement_options["aging_interval"] = 2
    with pytest.raises(TypeError, match="read-only"):
        options.extra_placement_options.update(x=1)
    assert options.extra_placement_options == {"aging_interval": 32}
    copy = pickle.loads(pickle.dumps(options))
    assert copy == options and copy.extra_placement_options == {"aging_interval": 32}
    changed = options.replace(extra_placement_options={"aging_interval": 8})
    assert changed.placement_options("cached")["aging_interval"] == 8 and options.extra_placement_options["aging_interval"] == 32


def test_structure_mismatch_names_the_argument_and_what_differs():
    hidden = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    ids = torch.zeros(4, 24, dtype=torch.int32)
    names = ("hidden_states", "hash_ids", "token_mask")
    planned = (structure(hidden), structure(ids), None)
    assert structure_mismatch(names, planned, planned) == ""
    message = structure_mismatch(names, planned, (structure(hidden), structure(torch.zeros(8, 24, dtype=torch.int64)),
                                                  None))
    assert message == "hash_ids: shape [8, 24] (the plan's [4, 24]), dtype torch.int64 (the plan's torch.int32)"
    assert structure_mismatch(names, planned, (structure(hidden), structure(ids),
                                               structure(torch.ones(4, dtype=torch.bool)))) == (
        "token_mask: a tensor (the plan's: None)")
    strided = torch.zeros(2, 4, 64, dtype=torch.bfloat16).transpose(0, 1)
    assert structure_mismatch(names, planned, (structure(strided), structure(ids), None)).startswith(
        "hidden_states: strides [64, 256, 1] (the plan's [128, 64, 1])")


def _imports_torch(code: str) -> bool:
    result = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint('torch' in sys.modules)"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1] == "True"


def test_the_light_parts_import_no_torch():
    """``engram --help``, ``info`` and the numpy reference answer without loading torch (seconds each)."""
    assert not _imports_torch("import engram.spec, engram.layout, engram.hashing.reference")
    assert not _imports_torch("from engram.tools.cli import build_parser, main\nbuild_parser()\n"
                              "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n"
                              "    assert main(['info']) == 0")
    help_text = ("from engram.tools.cli import main\nimport contextlib, io\nout = io.StringIO()\n"
                 "with contextlib.redirect_stdout(out):\n    try:\n        main(['--help'])\n"
                 "    except SystemExit as done:\n        assert done.code == 0, done.code\n"
                 "assert 'usage: engram' in out.getvalue(), out.getvalue()")
    assert not _imports_torch(help_text)
    assert _imports_torch("import engram\nengram.EngramMemory")   # the serving core loads on first use
