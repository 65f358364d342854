"""engram profile build|eval|plot|size|tiers on tiny text files: outputs, JSON and the errors for bad arguments."""

from __future__ import annotations

import json

import numpy as np
import pytest

import engram
from engram.tools.cli import main
from engram.tools.profile import HotSet

from conftest import PACKAGED_CONFIG

TEXT_A = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.\n" * 3
TEXT_B = "A lazy dog and a quick fox.\nThe lazy dog sleeps while the fox jumps.\n"


def _require_matplotlib():
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from conftest import missing_dependency

        missing_dependency("matplotlib is not installed (pip install -e '.[profile]')")


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text(TEXT_A)
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "two.txt").write_text(TEXT_B)
    (tmp_path / "a" / "binary.dat").write_bytes(b"\x00\x01\xff")
    (tmp_path / "b.txt").write_text(TEXT_B)
    return tmp_path


def _tok(path):
    return ["--tokenizer", str(path)]


def test_build_writes_the_most_read_rows(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    out = tmp_path / "hot.npz"
    assert main(["profile", "build", "--corpus", str(corpus / "a"), "--fraction", "0.001", "--out", str(out),
                 *_tok(deepseek_tokenizer_path)]) == 0
    assert "1 not plain UTF-8" in capsys.readouterr().out
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    hot = HotSet.load(out, layout)
    vocab = engram.TokenCompressor.from_tokenizer(deepseek_tokenizer_path, spec=layout.spec)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(deepseek_tokenizer_path))
    ids = [engram.hash_ngrams(tokenizer.encode(t, add_special_tokens=False).ids, layout, vocab) for t in (TEXT_A, TEXT_B)]
    for l in range(layout.spec.num_layers):
        reads = np.concatenate([i[:, l, :].reshape(-1) for i in ids])
        rows, counts = np.unique(reads, return_counts=True)
        assert sorted(zip(hot.rows[l].tolist(), hot.counts[l].tolist())) == sorted(zip(rows.tolist(), counts.tolist()))
        assert np.all(np.diff(hot.counts[l]) <= 0)  # hottest first


def test_eval_json_and_table(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    hot = tmp_path / "hot.npz"
    assert main(["profile", "build", "--corpus", str(corpus / "a"), "--fraction", "0.01", "--out", str(hot),
                 *_tok(deepseek_tokenizer_path)]) == 0
    capsys.readouterr()
    for policy in ("static", "dynamic", "lru"):
        assert main(["profile", "eval", "--corpus", str(corpus / "b.txt"), "--fraction", "0.01", "--hot", str(hot),
                     "--policy", policy, "--json", *_tok(deepseek_tokenizer_path)]) == 0
        result = json.loads(capsys.readouterr().out)
        # b.txt is also in the profile: every row it reads is in the hot set, so every read hits.
        assert result["hit_rate"] == 1.0 and result["policy"] == policy
        assert set(result["layers"]) == {"1", "14"}
        assert sum(layer["reads"] for layer in result["layers"].values()) == result["reads"] > 0
    assert main(["profile", "eval", "--corpus", str(corpus / "a" / "one.txt"), "--fraction", "0.5",
                 "--policy", "lru", "--json", *_tok(deepseek_tokenizer_path)]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["hit_rate"] == 0.0  # one step, empty cache: nothing is cached before the step
    assert 0 < cold["ceiling"] < 1 and cold["best_static_hit_rate"] == 1.0
    assert main(["profile", "eval", "--corpus", str(corpus / "b.txt"), "--fraction", "0.01", "--step-tokens", "4",
                 *_tok(deepseek_tokenizer_path)]) == 0
    assert "hit rate" in capsys.readouterr().out


def test_plot_writes_a_png(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from conftest import missing_dependency

        missing_dependency("matplotlib is not installed (pip install -e '.[profile]')")
    out = tmp_path / "fig.png"
    assert main(["profile", "plot", "--corpus", str(corpus / "a"), str(corpus / "b.txt"), "--out", str(out),
                 "--fractions", "0.001", "0.01", "--step-tokens", "8", *_tok(deepseek_tokenizer_path)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(corpus, tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["profile", "plot", "--corpus", str(corpus / "b.txt"), "--out", str(tmp_path / "f.png")]) == 2
    assert "engram[profile]" in capsys.readouterr().err


@pytest.mark.parametrize("fraction", ["0", "-0.5", "1.01", "nan", "half"])
def test_fraction_outside_range(corpus, fraction, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "eval", "--corpus", str(corpus / "b.txt"), "--fraction", fraction])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--fraction" in err and repr(fraction) in err


def test_missing_corpus_path(tmp_path, deepseek_tokenizer_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert main(["profile", "eval", "--corpus", missing, "--fraction", "0.01", *_tok(deepseek_tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert "--corpus" in err and "nowhere" in err


def test_no_text_files(tmp_path, deepseek_tokenizer_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"\x00\xfe")
    assert main(["profile", "build", "--corpus", str(tmp_path / "empty"), "--fraction", "0.01",
                 "--out", str(tmp_path / "h.npz"), *_tok(deepseek_tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert "--corpus" in err and "no text files" in err and "empty" in err
    assert not (tmp_path / "h.npz").exists() and not list(tmp_path.glob(".h.npz*"))   # nothing left behind


def test_static_needs_a_hot_set_and_a_matching_one(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    assert main(["profile", "eval", "--corpus", str(corpus / "b.txt"), "--fraction", "0.01", "--policy", "static",
                 *_tok(deepseek_tokenizer_path)]) == 2
    assert "--policy static" in capsys.readouterr().err
    bogus = tmp_path / "bogus.npz"
    np.savez(bogus, layer_ids=np.array([1, 14]), num_rows=np.array([5, 5]), fraction=np.array(0.1),
             tokens=np.array(1), step_tokens=np.array(1), rows_0=np.zeros(1), rows_1=np.zeros(1),
             counts_0=np.ones(1), counts_1=np.ones(1))
    assert main(["profile", "eval", "--corpus", str(corpus / "b.txt"), "--fraction", "0.01", "--hot", str(bogus),
                 *_tok(deepseek_tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert "--hot" in err and "[5, 5]" in err and "384,006,168".replace(",", "") in err


@pytest.mark.parametrize("action", ["build", "eval", "plot", "size", "tiers"])
@pytest.mark.parametrize("flag, value", [("--max-tokens", "0"), ("--step-tokens", "0"), ("--step-tokens", "99999999999"),
                                         ("--step-tokens", "many")])
def test_bad_max_tokens_and_step_tokens(action, flag, value, corpus, tmp_path, capsys):
    """Refused by the argument parser, before the tokenizer loads or any text is hashed."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    extra = {"build": ["--fraction", "0.01", "--out", str(outputs / "h.npz")], "eval": ["--fraction", "0.01"],
             "plot": ["--out", str(outputs / "f.png")], "size": ["--json", str(outputs / "s.json")],
             "tiers": ["--json", str(outputs / "t.json")]}[action]
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", action, "--corpus", str(corpus / "b.txt"), *extra, flag, value])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and flag in captured.err and repr(value) in captured.err
    assert list(outputs.iterdir()) == []


def test_eval_and_plot_show_progress(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    """Long profile runs are not silent: bars for the hashing and the replay, on stderr."""
    assert main(["profile", "eval", "--corpus", str(corpus / "a"), "--fraction", "1.0", "--step-tokens", "8",
                 *_tok(deepseek_tokenizer_path)]) == 0
    err = capsys.readouterr().err
    assert "hashing text" in err and "replaying steps" in err
    _require_matplotlib()
    assert main(["profile", "plot", "--corpus", str(corpus / "b.txt"), "--out", str(tmp_path / "f.png"),
                 "--fractions", "0.01", "--step-tokens", "8", *_tok(deepseek_tokenizer_path)]) == 0
    err = capsys.readouterr().err
    assert "hashing text" in err and "replaying steps" in err
