"""Real English text found on the machine, for demos, access traces and tests.

Looked for, in order: Debian's ``fortunes-min`` (``/usr/share/games/fortunes``),
``python3-doc`` (the reStructuredText sources of the Python documentation) and
the Python standard library's own sources, which are always there.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["english_texts", "TEXT_SOURCES"]

TEXT_SOURCES = {
    "fortunes": [Path("/usr/share/games/fortunes")],
    "python-docs": sorted(Path("/usr/share/doc").glob("python3*-doc/html/_sources")),
    "python-stdlib": [Path(sysconfig.get_paths()["stdlib"])],
}
_PATTERNS = {"fortunes": ["*"], "python-docs": ["library/*.rst.txt", "tutorial/*.rst.txt", "faq/*.rst.txt"],
             "python-stdlib": ["*.py"]}


def _candidates(source: str) -> list[Path]:
    files: list[Path] = []
    for root in TEXT_SOURCES[source]:
        if root.is_dir():
            for pattern in _PATTERNS[source]:
                files += [p for p in sorted(root.glob(pattern))
                          if p.is_file() and p.suffix not in (".dat", ".u8") and p.stat().st_size > 2000]
    return files


def english_texts(max_texts: int = 6, max_chars: int = 20_000, seed: int = 0) -> list[tuple[str, str]]:
    """Up to ``max_texts`` (name, text) pairs, at most ``max_chars`` characters each,
    taken round-robin from every source present; deterministic for a ``seed``. Texts that
    are empty or only white space are skipped."""
    import random

    for name, value in (("max_texts", max_texts), ("max_chars", max_chars)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, found {value!r}")

    chooser = random.Random(seed)
    pools = {source: _candidates(source) for source in TEXT_SOURCES}
    pools = {source: files for source, files in pools.items() if files}
    texts: list[tuple[str, str]] = []
    while len(texts) < max_texts and any(pools.values()):
        for source, files in pools.items():
            if not files or len(texts) >= max_texts:
                continue
            path = files.pop(chooser.randrange(len(files)))
            text = path.read_text(encoding="utf-8", errors="replace")
            if len(text) > max_chars:
                start = chooser.randrange(len(text) - max_chars)
                text = text[start:start + max_chars]
            if text.strip():
                texts.append((f"{source}:{path.name}", text))
    return texts
