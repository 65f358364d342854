"""The README's python blocks run as written on the CPU (those marked
``<!-- readme-test: skip (reason) -->`` need a GPU or an engine and say why), and it links
nothing outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
SKIP_MARK = re.compile(r"<!-- readme-test: skip \((?P<reason>[^)]+)\) -->\s*$")


def python_blocks() -> list[tuple[int, str, str | None]]:
    """(first line number, code, skip reason or None) of every ```python block."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            previous = lines[index - 1] if index else ""
            mark = SKIP_MARK.search(previous)
            end = next(k for k in range(index + 1, len(lines)) if lines[k].strip() == "```")
            blocks.append((index + 2, "\n".join(lines[index + 1:end]) + "\n", mark["reason"] if mark else None))
            index = end
        index += 1
    return blocks


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks()
    runnable = [(line, code) for line, code, reason in blocks if reason is None]
    assert runnable, "the README has no python block that runs on the CPU"
    namespace: dict = {"__name__": "readme"}
    for line, code in runnable:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"the README's python block at line {line} fails: {type(error).__name__}: {error}")


def test_readme_skips_say_why_and_links_stay_inside():
    for line, _, reason in python_blocks():
        assert reason is None or len(reason) > 10, f"README.md:{line}: a skipped block gives no reason"
    text = README.read_text(encoding="utf-8")
    assert "../" not in text, "the README links a path outside the repository"
