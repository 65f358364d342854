"""docs/design.md has its five numbered sections, and every citation of it in the sources
("docs/design.md §N", optionally followed by a quoted subsection title) names a section
(and subsection) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DESIGN = ROOT / "docs" / "design.md"
SCANNED = ("src", "tests", "benchmarks")
SECTIONS = (
    "1. What an Engram layer does",
    "2. Exact semantics",
    "3. Architecture",
    "4. Performance",
    "5. Serving tables larger than a GPU",
)
# Built from pieces so that this file holds no citation of its own.
CITE = "docs/design.md " + "\u00a7"
CITATION = re.compile(re.escape(CITE) + r'(?P<section>\d+)(?: "(?P<title>[^"\n]+)")?')
NUMBERED = re.compile(r"^## (?P<number>\d+)\. (?P<title>.+?)\s*$")


def outline(text: str) -> dict[int, set[str]]:
    """Numbered top-level section -> titles of its ``###`` subsections, from Markdown ``text``
    (lines inside fenced code blocks are not headings)."""
    sections: dict[int, set[str]] = {}
    current, fenced = None, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        numbered = NUMBERED.match(line)
        if numbered:
            current = int(numbered["number"])
            sections[current] = set()
        elif line.startswith("## "):
            current = None
        elif line.startswith("### ") and current is not None:
            sections[current].add(line[4:].strip())
    return sections


def bad_citations(text: str, sections: dict[int, set[str]]) -> list[str]:
    """Each citation in ``text`` whose section (or quoted subsection) ``sections`` lacks."""
    bad = []
    for match in CITATION.finditer(text):
        number, title = int(match["section"]), match["title"]
        if number not in sections or (title is not None and title not in sections[number]):
            bad.append(match[0])
    return bad


def scanned_files() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*") if path.is_file())


def test_design_has_the_five_numbered_sections_in_order():
    text = DESIGN.read_text(encoding="utf-8")
    headings = [line[3:].strip() for line in text.splitlines() if NUMBERED.match(line)]
    assert tuple(headings) == SECTIONS


def test_every_citation_in_the_sources_names_an_existing_section():
    sections = outline(DESIGN.read_text(encoding="utf-8"))
    problems = []
    for path in scanned_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # figures and other binary results
        problems += [f"{path.relative_to(ROOT)}: {cite}" for cite in bad_citations(text, sections)]
    assert not problems, "citations of sections that docs/design.md lacks:\n" + "\n".join(problems)


MADE_UP_OUTLINE = (
    "# title\n\n## 1. One\n\n### Alpha\n\n```\n## 7. not a heading (code)\n### Nor this\n```\n\n"
    "## Unnumbered\n\n### Outside\n\n## 2. Two\n\n### Beta\n"
)


def test_outline_reads_numbered_sections_and_their_subsections_only():
    assert outline(MADE_UP_OUTLINE) == {1: {"Alpha"}, 2: {"Beta"}}


@pytest.mark.parametrize("text, expected", [
    ("no citation at all, only DESIGN \u00a72 of the old brief", []),
    (f"see {CITE}1 and {CITE}2 \"Beta\"; rows as in {CITE}2, step 3", []),
    (f"{CITE}3 is missing", [f"{CITE}3"]),
    (f"{CITE}1 \"Beta\" is in another section", [f"{CITE}1 \"Beta\""]),
    (f"{CITE}12 and {CITE}2 \"Gamma\" and {CITE}1 \"Alpha\"", [f"{CITE}12", f"{CITE}2 \"Gamma\""]),
])
def test_bad_citations_of_a_made_up_text(text, expected):
    assert bad_citations(text, outline(MADE_UP_OUTLINE)) == expected
