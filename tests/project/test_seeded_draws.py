"""Every random draw in the tests comes from a seed a failure reports (conftest's ``seed``/``rng``
fixtures, a Hypothesis-drawn seed, or a fixed one): this scans the test sources for draws that
take their randomness from nowhere."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]
# Rewritten on another branch together with the hash kernel; it joins the scan when that lands.
NOT_YET_SCANNED: set[str] = set()
TORCH_DRAWS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
               "multinomial", "normal"}
NUMPY_LEGACY_DRAWS = {"rand", "randn", "randint", "random", "choice", "permutation", "shuffle", "uniform", "normal",
                      "integers", "seed"}
PYTHON_RANDOM_DRAWS = {"random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform",
                       "getrandbits", "gauss"}


def _dotted(node: ast.AST) -> str:
    """``np.random.default_rng`` for the attribute chain of a call's function, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def unseeded_draws(source: str) -> list[tuple[int, str]]:
    """(line, call) of every draw without a seed or generator in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        keywords = {k.arg for k in node.keywords}
        if name in ("np.random.default_rng", "numpy.random.default_rng") and not node.args and not keywords:
            found.append((node.lineno, name + "()"))
        elif name in ("np.random.SeedSequence", "numpy.random.SeedSequence") and not node.args and not keywords:
            found.append((node.lineno, name + "()"))
        elif name == "os.urandom":
            found.append((node.lineno, name))
        elif name.startswith("torch.") and name.split(".", 1)[1] in TORCH_DRAWS and "generator" not in keywords:
            found.append((node.lineno, name + " without generator="))
        elif name.startswith(("np.random.", "numpy.random.")) and name.rsplit(".", 1)[1] in NUMPY_LEGACY_DRAWS:
            found.append((node.lineno, name + " (numpy's global state)"))
        elif name.startswith("random.") and name.split(".", 1)[1] in PYTHON_RANDOM_DRAWS:
            found.append((node.lineno, name + " (Python's global state)"))
    return found


def test_the_scan_finds_unseeded_draws():
    source = ("import numpy as np, torch, random, os\n"
              "a = np.random.default_rng()\nb = torch.randn(3)\nc = np.random.randint(5)\nd = random.random()\n"
              "e = os.urandom(4)\n"
              "ok = np.random.default_rng(7), torch.randn(3, generator=g), np.random.default_rng(seed)\n")
    assert [line for line, _ in unseeded_draws(source)] == [2, 3, 4, 5, 6]


def test_no_test_draws_without_a_seed():
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in NOT_YET_SCANNED or path.name in ("conftest.py", Path(__file__).name):  # conftest draws the seeds
            continue
        problems += [f"{path.name}:{line}: {call}" for line, call in unseeded_draws(path.read_text(encoding="utf-8"))]
    assert not problems, ("draws with no seed a failure could report; use the `seed` or `rng` fixture "
                          "(tests/conftest.py):\n" + "\n".join(problems))
