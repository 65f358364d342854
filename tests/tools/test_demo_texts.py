"""engram demo over the whole range of --texts and --max-chars: text sources whose files share
names (Debian's python3-doc beside python3.11-doc, index.rst.txt in several folders) give
distinct requests, and every run checks every token."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import engram.tools.corpus as corpus
from engram.tools.cli import main
from engram.tools.simulation import StreamingEngine

_DOC_NAMES = ("index.rst.txt", "intro.rst.txt", "os.rst.txt")


@pytest.fixture
def duplicate_named_sources(tmp_path, monkeypatch):
    """Text sources laid out as on a Debian machine with python3-doc and python3.11-doc: the same
    file names under library/, tutorial/ and faq/, python3-doc's html a link to python3.11-doc's,
    and a second doc package whose files have the same names again (text: the standard library's
    sources, which are on every machine)."""
    stdlib = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 4000)
    files = iter(stdlib)
    doc = tmp_path / "doc"
    for package in ("python3.11-doc", "python3.12-doc"):
        for folder in ("library", "tutorial", "faq"):
            target = doc / package / "html" / "_sources" / folder
            target.mkdir(parents=True)
            for name in _DOC_NAMES:
                shutil.copy(next(files), target / name)
    (doc / "python3-doc").mkdir()
    (doc / "python3-doc" / "html").symlink_to("../python3.11-doc/html")
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    for name in ("art", "computers", "science"):
        shutil.copy(next(files), fortunes / name)
    sources = {"fortunes": [fortunes], "python-docs": sorted(doc.glob("python3*-doc/html/_sources")),
               "python-stdlib": [Path(sysconfig.get_paths()["stdlib"])]}
    monkeypatch.setattr(corpus, "TEXT_SOURCES", sources)
    return sources


def test_text_names_are_distinct_and_each_file_is_read_once(duplicate_named_sources):
    texts = corpus.english_texts(max_texts=10_000, max_chars=50)
    names = [name for name, _ in texts]
    assert len(names) == len(set(names))
    docs = [name for name in names if name.startswith("python-docs:")]
    # 2 packages x 3 folders x 3 names; python3-doc's linked copy is the same files, listed once.
    assert len(docs) == 18
    assert "python-docs:python3.11-doc/library/index.rst.txt" in docs
    assert "python-docs:python3.12-doc/faq/index.rst.txt" in docs
    assert not any("python3-doc/" in name for name in docs)


@pytest.mark.parametrize("texts, max_chars", [(20, 10), (60, 500), (1, 10), (100, 10), (7, 1000), (33, 64)])
def test_demo_passes_on_duplicate_file_names(duplicate_named_sources, deepseek_tokenizer_path, texts, max_chars,
                                             capsys):
    assert main(["demo", "--texts", str(texts), "--max-chars", str(max_chars), "--skip-layers",
                 "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("│ match") == 3 and "tokens checked" not in out


@pytest.mark.parametrize("texts, max_chars", [(1, 1000), (100, 10), (60, 500)])
def test_demo_passes_on_this_machines_text(deepseek_tokenizer_path, texts, max_chars, capsys):
    assert main(["demo", "--texts", str(texts), "--max-chars", str(max_chars), "--skip-layers",
                 "--tokenizer", str(deepseek_tokenizer_path)]) == 0


@pytest.mark.parametrize("texts, max_chars", [(20, 10), (2, 300)])
def test_demo_layers_on_duplicate_file_names(duplicate_named_sources, deepseek_tokenizer_path, texts, max_chars,
                                             capsys):
    assert main(["demo", "--texts", str(texts), "--max-chars", str(max_chars),
                 "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("│ match") == 3 + 2  # three history sources, two layers


def test_streaming_engine_refuses_a_second_request_of_the_same_name(small_layout, small_vocab):
    from engram import NgramHasher

    engine = StreamingEngine(NgramHasher(small_layout, small_vocab), "lookback", np.random.default_rng(0))
    engine.add("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add("a", [4, 5])
