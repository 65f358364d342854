"""engram.checks: each check refuses what it should with one error naming the field and the value, and
the checks and choice tuples are written once in src/ (no module spells them again)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from engram import checks
from engram.checks import (check_bool, check_choice, check_fraction, check_hash_ids, check_int, check_launch_ids,
                           check_positive_int, check_power_of_two)

SRC = Path(__file__).resolve().parents[2] / "src" / "engram"
MODULES = sorted(SRC.rglob("*.py"))
CHOICE_NAMES = ("BACKEND_CHOICES", "WKV_BACKEND_CHOICES", "CACHE_POLICIES", "HOST_GATHER_WORKERS", "HOST_GATHER_DEDUP")


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, -1])
def test_check_int_refuses_bools_other_types_and_values_below_the_minimum(value):
    with pytest.raises(ValueError, match=rf"^threads: expected an integer >= 0, found {re.escape(repr(value))}$"):
        check_int("threads", value, 0)


def test_check_int_bounds_optional_and_notes():
    assert check_int("rank", 0, 0, below=2) == 0 and check_int("n", 5, 1, maximum=5) == 5
    assert check_int("gather_threads", None, 1, optional=True) is None
    with pytest.raises(ValueError, match=r"^rank: expected an integer in \[0, 2\), found 2$"):
        check_int("rank", 2, 0, below=2)
    with pytest.raises(ValueError, match=r"^threads: expected an integer in \[1, 256\], found 0$"):
        check_int("threads", 0, 1, maximum=256)
    with pytest.raises(ValueError, match=r"^gather_threads: expected an integer >= 1 or None, found 0$"):
        check_int("gather_threads", 0, 1, optional=True)
    with pytest.raises(ValueError, match=r"^direct_max_rows: expected an integer >= 0 \(0: all\), found -1$"):
        check_int("direct_max_rows", -1, 0, note=" (0: all)")
    with pytest.raises(ValueError, match=r"^--seed: expected an integer in \[0, 2\*\*63\), found 2\.0$"):
        check_int("--seed", 2.0, 0, below=2**63, shown="[0, 2**63)")
    import numpy as np

    assert check_int("capacity", np.int64(3), 1, numpy_ints=True) == 3
    with pytest.raises(ValueError, match="capacity: expected an integer >= 1"):
        check_int("capacity", np.int64(3), 1)  # numpy integers only where asked for


@pytest.mark.parametrize("value", [0, -3, True, 1.5, "2"])
def test_check_positive_int(value):
    with pytest.raises(ValueError, match=rf"^nbytes: expected a positive integer, found {re.escape(repr(value))}$"):
        check_positive_int("nbytes", value)
    assert check_positive_int("nbytes", 7) == 7


def test_check_power_of_two():
    assert check_power_of_two("ways", 8, 64) == 8
    for value in (0, 6, 128, True, 4.0):
        with pytest.raises(ValueError, match=rf"^ways: expected a power of two up to 64, found {re.escape(repr(value))}$"):
            check_power_of_two("ways", value, 64)
    with pytest.raises(ValueError, match=r"^GatherConfig.vector: expected a power of two, found 3$"):
        check_power_of_two("GatherConfig.vector", 3)


def test_check_bool_choice_and_fraction():
    assert check_bool("progress", False) is False and check_bool("validate", None, optional=True) is None
    with pytest.raises(ValueError, match=r"^progress: expected True or False, found 1$"):
        check_bool("progress", 1)
    with pytest.raises(ValueError, match=r"^validate: expected True, False or None, found 'yes'$"):
        check_bool("validate", "yes", optional=True)
    assert check_choice("backend", "torch", checks.BACKEND_CHOICES) == "torch"
    with pytest.raises(ValueError, match=r"^backend: expected one of 'auto', 'triton', 'torch', found 'cuda'$"):
        check_choice("backend", "cuda", checks.BACKEND_CHOICES)
    with pytest.raises(ValueError, match=r"^policy: expected one of 'set-lru', 'dynamic', 'static', found \['lru'\]$"):
        check_choice("policy", ["lru"], checks.CACHE_POLICIES)
    assert check_fraction("cache_fraction", 1) == 1
    for value in (0, 1.5, True, "0.5", -0.1):
        with pytest.raises(ValueError, match=rf"^cache_fraction: expected a number in \(0, 1\], found "
                                             rf"{re.escape(repr(value))}$"):
            check_fraction("cache_fraction", value)


def test_check_hash_ids_names_the_type_dtype_shape_and_device():
    ids = torch.zeros(3, 4, dtype=torch.int32)
    assert check_hash_ids(ids, columns=4, device=torch.device("cpu")) is ids
    assert check_hash_ids(ids.long()) is not None and check_hash_ids(ids.view(3, 1, 4), layers=1, columns=4) is not None
    with pytest.raises(ValueError, match=r"^hash_ids: expected a torch.Tensor, found list$"):
        check_hash_ids([[1, 2]])
    for dtype in (torch.float32, torch.int16, torch.bool, torch.uint8):
        with pytest.raises(ValueError, match=rf"^hash_ids: expected dtype torch.int32 or torch.int64, found {dtype}$"):
            check_hash_ids(ids.to(dtype), columns=4)
    with pytest.raises(ValueError, match=r"^hash_ids: expected shape \[T, C\], found \[12\]$"):
        check_hash_ids(ids.reshape(-1))
    with pytest.raises(ValueError, match=r"^hash_ids: expected shape \[T, 5\], found \[3, 4\]$"):
        check_hash_ids(ids, columns=5)
    with pytest.raises(ValueError, match=r"^hash_ids: expected shape \[T, 2, 4\] \(tokens, Engram layers, hash "
                                         r"columns\), found \[3, 4\]$"):
        check_hash_ids(ids, layers=2, columns=4)
    on_meta = torch.zeros(3, 4, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"^hash_ids: expected device cpu \(the table's\), found meta$"):
        check_hash_ids(on_meta, columns=4, device=torch.device("cpu"), device_note=" (the table's)")
    with pytest.raises(ValueError, match=r"^ids: expected a torch.Tensor, found int$"):
        check_hash_ids(3, name="ids")


def test_check_launch_ids():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    assert check_launch_ids(ids) is ids
    with pytest.raises(ValueError, match=r"^hash_ids: expected an int32 or int64 tensor \[T, C\], found "
                                         r"torch.float32 \[2, 3\]$"):
        check_launch_ids(ids.float())
    with pytest.raises(ValueError, match=r"^hash_ids: expected an int32 or int64 tensor \[T, C\], found "
                                         r"torch.int64 \[6\]$"):
        check_launch_ids(ids.reshape(-1))
    with pytest.raises(ValueError, match=r"found NoneType$"):
        check_launch_ids(None)


def test_the_layers_and_the_memory_refuse_bad_ids_through_the_checks(synthetic_model_dir):
    import engram

    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    layers, columns = memory.spec.num_layers, memory.spec.num_columns
    float_ids = torch.zeros(2, layers, columns)
    with pytest.raises(ValueError, match="^hash_ids: expected dtype torch.int32 or torch.int64, found torch.float32$"):
        memory.prefetch(float_ids)
    with pytest.raises(ValueError, match=rf"^hash_ids: expected shape \[T, {layers}, {columns}\]"):
        memory.prefetch(torch.zeros(2, columns, dtype=torch.int32))
    layer = memory.layer(memory.layer_ids[0])
    for call in (layer.prefetch, layer.kv_ahead):
        with pytest.raises(ValueError, match="^hash_ids: expected dtype torch.int32 or torch.int64"):
            call(float_ids[:, 0])
        with pytest.raises(ValueError, match=rf"^hash_ids: expected shape \[T, {columns}\], found \[2, 1\]$"):
            call(torch.zeros(2, 1, dtype=torch.int64))
        with pytest.raises(ValueError, match="^hash_ids: expected a torch.Tensor, found list$"):
            call([[0] * columns])


# ---- written once ---------------------------------------------------------------------------------
def _module_assignments(path: Path) -> list[tuple[str, object]]:
    """``(name, literal value or None)`` of every module-level assignment of ``path``."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value) if node.value is not None else None
            except ValueError:
                value = None
            found += [(target.id, value) for target in targets if isinstance(target, ast.Name)]
    return found


def test_each_choice_tuple_is_defined_once_in_the_checks_module():
    tuples = {name: getattr(checks, name) for name in CHOICE_NAMES}
    assert all(isinstance(value, tuple) and value for value in tuples.values())
    elsewhere = []
    for path in MODULES:
        if path == SRC / "checks.py":
            continue
        for name, value in _module_assignments(path):
            if name in tuples or (isinstance(value, tuple) and value in tuples.values()):
                elsewhere.append(f"{path.relative_to(SRC)}: {name} = {value!r}")
    assert elsewhere == [], "choice tuples defined outside engram/checks.py (import them instead)"
    checks_names = [name for name, _ in _module_assignments(SRC / "checks.py")]
    assert all(checks_names.count(name) == 1 for name in CHOICE_NAMES)


# The integer check spelled out by hand: ``isinstance(v, bool) or not isinstance(v, int) or <a bound on v>``.
_HAND_WRITTEN_INT_CHECK = re.compile(r"isinstance\((\w[\w.]*), bool\) or not isinstance\(\1, (?:int|\(int, np\.integer\))\)"
                                     r" or (?:not )?(?:\d+ <=? )?\1 *[<>]")


def test_integer_and_bool_checks_are_calls_of_the_checks_module():
    hand_written = [f"{path.relative_to(SRC)}:{number}" for path in MODULES if path != SRC / "checks.py"
                    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                    if _HAND_WRITTEN_INT_CHECK.search(line)
                    or re.search(r"""raise ValueError\(f"\{?\w*\}?\w*: expected True or False, found""", line)]
    assert hand_written == [], "use engram.checks.check_int / check_positive_int / check_bool"
    hash_id_checks = [f"{path.relative_to(SRC)}:{number}" for path in MODULES if path != SRC / "checks.py"
                      for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                      if re.search(r"hash_ids: expected (dtype torch.int32|an int32 or int64 tensor|a torch.Tensor)", line)]
    assert hash_id_checks == [], "use engram.checks.check_hash_ids / check_launch_ids"


def test_the_checks_module_imports_nothing_above_it():
    tree = ast.parse((SRC / "checks.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in imported if name.startswith("engram")} <= {"engram.common"}
    common = ast.parse((SRC / "common.py").read_text(encoding="utf-8"))
    assert not [node for node in ast.walk(common) if isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("engram")]
