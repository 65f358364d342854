"""Real English text found on the machine, for demos, access traces and tests.

Looked for, in order: Debian's ``fortunes-min`` (``/usr/share/games/fortunes``),
``python3-doc`` (the reStructuredText sources of the Python documentation) and
the Python standard library's own sources, which are always there.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from engram.checks import check_int

__all__ = ["english_texts", "count_english_texts", "TEXT_SOURCES"]

TEXT_SOURCES = {
    "fortunes": [Path("/usr/share/games/fortunes")],
    "python-docs": sorted(Path("/usr/share/doc").glob("python3*-doc/html/_sources")),
    "python-stdlib": [Path(sysconfig.get_paths()["stdlib"])],
}
_PATTERNS = {"fortunes": ["*"], "python-docs": ["library/*.rst.txt", "tutorial/*.rst.txt", "faq/*.rst.txt"],
             "python-stdlib": ["*.py"]}


def _candidates(source: str) -> list[tuple[Path, str]]:
    """(file, name) of each text file of ``source``: the name is the file's path under its root
    (``library/os.rst.txt``), led by the root's package directory when the source has several
    roots (``python3.11-doc/library/os.rst.txt``). A file reached twice (``python3-doc``'s html is
    a link to ``python3.11-doc``'s) is listed once."""
    roots = TEXT_SOURCES[source]
    files: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for pattern in _PATTERNS[source]:
            for path in sorted(root.glob(pattern)):
                if not path.is_file() or path.suffix in (".dat", ".u8") or path.stat().st_size <= 2000:
                    continue
                real = path.resolve()
                if real in seen:
                    continue
                seen.add(real)
                name = path.relative_to(root).as_posix()
                if len(roots) > 1:
                    name = f"{_root_label(root.resolve())}/{name}"
                files.append((path, name))
    return files


def _root_label(root: Path) -> str:
    """A short name telling roots of one source apart: the package directory of
    ``/usr/share/doc/<package>/html/_sources``, else the root's own name."""
    parts = root.parts
    return parts[parts.index("doc") + 1] if "doc" in parts[:-1] else root.name


def count_english_texts() -> dict[str, int]:
    """Per source present, how many texts :func:`english_texts` can take from it at most: its text
    files (a listing, no file read; a file that turns out to hold only white space is skipped there)."""
    counts = {source: len(_candidates(source)) for source in TEXT_SOURCES}
    return {source: count for source, count in counts.items() if count}


def english_texts(max_texts: int = 6, max_chars: int = 20_000, seed: int = 0) -> list[tuple[str, str]]:
    """Up to ``max_texts`` (name, text) pairs, at most ``max_chars`` characters each,
    taken round-robin from every source present; deterministic for a ``seed``. Texts that
    are empty or only white space are skipped. Names are distinct (``source:path``), so each
    can name a request."""
    import random

    for name, value in (("max_texts", max_texts), ("max_chars", max_chars)):
        check_int(name, value, 1)

    chooser = random.Random(seed)
    pools = {source: _candidates(source) for source in TEXT_SOURCES}
    pools = {source: files for source, files in pools.items() if files}
    texts: list[tuple[str, str]] = []
    names: set[str] = set()
    while len(texts) < max_texts and any(pools.values()):
        for source, files in pools.items():
            if not files or len(texts) >= max_texts:
                continue
            path, name = files.pop(chooser.randrange(len(files)))
            text = path.read_text(encoding="utf-8", errors="replace")
            if len(text) > max_chars:
                start = chooser.randrange(len(text) - max_chars)
                text = text[start:start + max_chars]
            if text.strip():
                name = f"{source}:{name}"
                # Sources are distinct and paths under one root are too; the counter only guards
                # roots that share a label.
                unique, copy = name, 2
                while unique in names:
                    unique, copy = f"{name} ({copy})", copy + 1
                names.add(unique)
                texts.append((unique, text))
    return texts
