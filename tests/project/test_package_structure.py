"""The package's structure: every import of an engram module in src/, tests/ and benchmarks/ resolves (lazy ones inside functions too,
which only a GPU path may run), the serving core never imports the tools, no module exceeds
600 lines, and environment variables are read in two modules only."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
SRC = REPOSITORY / "src"
MODULES = sorted(SRC.joinpath("engram").rglob("*.py"))
USERS = (MODULES + sorted(REPOSITORY.joinpath("tests").rglob("*.py"))
         + sorted(REPOSITORY.joinpath("benchmarks").rglob("*.py")))
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _engram_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name or None)`` of every import of an engram module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.startswith("engram")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engram") and not node.level:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", USERS, ids=lambda p: str(p.relative_to(REPOSITORY)))
def test_every_import_resolves(path):
    for line, module, name in _engram_imports(path):
        assert importlib.util.find_spec(module) is not None, f"{path.name}:{line}: no module {module}"
        if name is None or name == "*":
            continue
        if importlib.util.find_spec(f"{module}.{name}") if _is_package(module) else False:
            continue
        text = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
        tree = ast.parse(text)
        defined = {target.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                   if isinstance(target, ast.Name)}
        defined |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                                               ast.AsyncFunctionDef))}
        defined |= {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        assert name in defined, f"{path.name}:{line}: {module} defines no {name!r}"


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def test_the_serving_core_never_imports_the_tools():
    offenders = []
    for path in MODULES:
        if _module_name(path).startswith("engram.tools"):
            continue
        offenders += [f"{path.relative_to(SRC)}:{line} imports {module}"
                      for line, module, name in _engram_imports(path)
                      if module.startswith("engram.tools") or (module == "engram" and name == "tools")]
    assert offenders == []


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in MODULES if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read the environment: ``os.environ[...]`` / ``.get`` / ``in``, ``os.getenv``
    (``os.environ.update``, which sets variables for child processes, is not a read)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    setters = {id(node.value) for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr == "update"}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and (node.attr == "getenv" or (node.attr == "environ" and id(node) not in setters))]


def test_environment_variables_are_read_in_two_modules_only():
    """``engram.environment`` (every serving default) and the CLI (the terminal's width); ``engram.parallel``
    only sets NCCL's variables for the processes it starts."""
    reading = {str(path.relative_to(SRC)) for path in MODULES if _environment_reads(path)}
    assert reading <= {"engram/environment.py", "engram/tools/cli.py"}, sorted(reading)


def test_the_checker_catches_a_broken_import(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f():\n    from engram.table.host import HostPlacement\n")
    ((line, module, name),) = _engram_imports(broken)
    assert (line, module, name) == (2, "engram.table.host", "HostPlacement")
    assert importlib.util.find_spec(module) is None
