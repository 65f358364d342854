"""The README and the pages under docs/ as a reader meets them: every python block runs as written on
the CPU (those marked ``<!-- readme-test: skip (reason) -->`` need a GPU or an engine and say why),
every ``engram ...`` line of a shell block is one the command's own parser takes (and every
``bash scripts/dev.sh ...`` one the script knows), every relative link names a file of the repository
(and a heading there, for ``#anchors``), the README stays short, and every page is linked from it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARK = re.compile(r"<!-- readme-test: skip \((?P<reason>[^)]+)\) -->\s*$")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
MAX_README_LINES = 250


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fenced_blocks(path: Path) -> list[tuple[str, int, str, str | None]]:
    """(language, first line number, code, skip reason or None) of every fenced block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].startswith("```"):
            language = lines[index][3:].strip()
            previous = lines[index - 1] if index else ""
            mark = SKIP_MARK.search(previous)
            end = next(k for k in range(index + 1, len(lines)) if lines[k].startswith("```"))
            blocks.append((language, index + 2, "\n".join(lines[index + 1:end]) + "\n", mark["reason"] if mark else None))
            index = end
        index += 1
    return blocks


def code_blocks(path: Path, language: str) -> list[tuple[int, str, str | None]]:
    """(first line number, code, skip reason or None) of every ```<language> block of ``path``."""
    return [(line, code, reason) for kind, line, code, reason in fenced_blocks(path) if kind == language]


def prose(path: Path) -> str:
    """The text of ``path`` outside fenced code blocks and inline code."""
    kept, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids of a Markdown file: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"^#{1,6} (.+?)\s*$", line)
        if fenced or heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        unique, count = slug, 1
        while unique in found:
            unique, count = f"{slug}-{count}", count + 1
        found.add(unique)
    return found


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_python_blocks_run_as_written(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = code_blocks(path, "python")
    namespace: dict = {"__name__": "docs"}
    ran = 0
    for line, code, reason in blocks:
        if reason is not None:
            assert len(reason) > 10, f"{_id(path)}:{line}: a skipped block gives no reason"
            compile(code, f"{_id(path)}:{line}", "exec")   # skipped, but still Python
            continue
        try:
            exec(compile(code, f"{_id(path)}:{line}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"the python block at {_id(path)}:{line} fails: {type(error).__name__}: {error}")
        ran += 1
    if path == README:
        assert ran, "the README has no python block that runs on the CPU"


def _commands(path: Path):
    for language, line, code, _ in fenced_blocks(path):
        if language in ("bash", "sh", "console", ""):
            for offset, text in enumerate(code.splitlines()):
                command = text.split(" #", 1)[0].strip().removeprefix("$ ")
                if command.startswith(("engram ", "bash scripts/dev.sh")):
                    yield f"{_id(path)}:{line + offset}", command


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_shell_lines_are_commands_that_exist(path, capsys):
    from engram.tools.cli import build_parser

    cases = re.search(r'case "\$command" in(?P<body>.*?)esac', (ROOT / "scripts" / "dev.sh").read_text(), re.S)
    known = set(re.findall(r"^\s*(\w+)\)", cases["body"], re.M))
    for where, command in _commands(path):
        words = shlex.split(command)
        if words[0] == "bash":
            assert len(words) >= 3 and words[2] in known, f"{where}: dev.sh has no command {words[2:3]}"
            continue
        try:
            build_parser().parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"{where}: the engram command refuses {command!r}: {capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_relative_links_resolve(path):
    for match in LINK.finditer(prose(path)):
        target = match["target"]
        if re.match(r"^[a-z]+:", target):
            continue   # a URL
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.is_relative_to(ROOT), f"{_id(path)}: link {target!r} leaves the repository"
        assert resolved.exists(), f"{_id(path)}: link {target!r} names nothing ({resolved})"
        if anchor:
            assert resolved.suffix == ".md", f"{_id(path)}: link {target!r}: an anchor into a file that is no page"
            assert anchor in anchors(resolved), (f"{_id(path)}: link {target!r}: no heading {anchor!r} in "
                                                 f"{_id(resolved)} (headings: {sorted(anchors(resolved))})")


def test_readme_is_short_and_links_every_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < MAX_README_LINES, f"the README has {len(lines)} lines; keep it under {MAX_README_LINES}"
    linked = {(README.parent / m["target"].partition("#")[0]).resolve() for m in LINK.finditer(prose(README))}
    missing = [_id(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert missing == [], f"pages the README does not link: {missing}"
    for needed in ("bash scripts/dev.sh demo", "bash scripts/dev.sh test"):
        assert needed in README.read_text(encoding="utf-8")


def test_ci_runs_the_documented_test_command():
    assert "bash scripts/dev.sh test" in (ROOT / ".ci" / "run").read_text()


def test_the_checker_catches_a_dead_link_and_a_bad_command(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("See [nothing](missing.md) and [a heading](#no-such-heading).\n\n```bash\nengram info --bogus\n```\n")
    links = [m["target"] for m in LINK.finditer(prose(page))]
    assert links == ["missing.md", "#no-such-heading"]
    assert not (tmp_path / "missing.md").exists() and "no-such-heading" not in anchors(page)
    assert [command for _, command in _commands(page)] == ["engram info --bogus"]
    from engram.tools.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["info", "--bogus"])

