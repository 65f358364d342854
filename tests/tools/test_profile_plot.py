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


def test_policies_differ_by_colour_and_one_legend_sits_below_the_panels(figure):
    """Curves that coincide stay told apart by colour; the legend takes no width from the panels."""
    colours = {}
    for axes in figure.axes:
        for line in axes.get_lines():
            label = line.get_label()
            if label.split(": ", 1)[-1] in POLICIES:
                colours.setdefault(label.split(": ", 1)[1], set()).add(line.get_color())
    assert all(len(c) == 1 for c in colours.values()) and len({c.pop() for c in colours.values()}) == len(POLICIES)
    assert [axes.get_title() for axes in figure.axes] == ["a.txt", "b.txt"]
    (legend,) = figure.legends
    figure.canvas.draw()
    box = legend.get_window_extent().transformed(figure.transFigure.inverted())
    lowest_panel = min(axes.get_position().y0 for axes in figure.axes)
    assert box.y1 <= lowest_panel and box.x0 >= 0 and box.x1 <= 1
    assert min(axes.get_position().x0 for axes in figure.axes) < 0.15 and max(
        axes.get_position().x1 for axes in figure.axes) > 0.85   # the panels take the width


def test_the_small_corpus_warning_says_what_is_true(rng):
    """When the cache holds every distinct row, LRU serves exactly the reads of rows read in an earlier
    step: less than the ceiling whenever a row repeats within its first step (what the warning says)."""
    from engram.tools.profile import evaluate
    from engram.layout import EngramLayout
    from engram.spec import EngramSpec
    from engram.tools.defaults import packaged_config

    layout = EngramLayout(EngramSpec.from_hf_config(packaged_config()))
    columns = layout.spec.num_columns
    tokens = 64
    reads = [np.asarray(layout.column_offsets[l])[None, :] + rng.integers(0, 20, size=(tokens, columns))
             for l in range(layout.spec.num_layers)]
    trace = Trace([r.reshape(-1) for r in reads], tokens=tokens, files=1, skipped=0, seconds=0.0)
    (result,) = evaluate(trace, layout, [0.01], ["lru"], step_tokens=16)
    warnings = corpus_warnings(trace, [result], 16)
    assert any("serves every read of a row read in an earlier step" in w and "less than the ceiling" in w
               for w in warnings), warnings
    assert not any("meets the ceiling" in w for w in warnings)
    for l, stream in enumerate(trace.reads):
        steps = stream.reshape(-1, 16 * columns)
        seen, earlier = set(), 0
        for step in steps:
            earlier += sum(int(row) in seen for row in step)
            seen.update(int(row) for row in step)
        figures = result["layers"][str(layout.spec.layer_ids[l])]
        assert figures["hits"] == earlier and figures["hit_rate"] < figures["ceiling"]
