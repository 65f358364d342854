"""The command line on a user's mistakes: one line and exit 2, before any slow work, never a
traceback; a closed stdout ends the command quietly; --out writes exactly the path given."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import engram
from engram.tools.cli import main

SRC = Path(engram.__file__).parent.parent

TEXT = "The quick brown fox jumps over the lazy dog. A lazy dog sleeps while the quick fox runs.\n" * 4


def _require_matplotlib():
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from conftest import missing_dependency

        missing_dependency("matplotlib is not installed (pip install -e '.[profile]')")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def _error(capsys) -> str:
    """The one error line on stderr (stdout holds none of it)."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "error:" not in captured.out, captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("action", ["build", "plot"])
def test_out_in_a_missing_directory(action, corpus, tmp_path, capsys):
    out = tmp_path / "nonexistent" / "dir" / "x"
    extra = ["--fraction", "0.01"] if action == "build" else []
    assert main(["profile", action, "--corpus", str(corpus), "--out", str(out), *extra]) == 2
    line = _error(capsys)
    assert "--out" in line and "does not exist" in line and str(out.parent) in line


@pytest.mark.parametrize("action", ["build", "plot"])
def test_out_that_is_a_directory_is_refused(action, corpus, tmp_path, capsys):
    extra = ["--fraction", "0.01"] if action == "build" else []
    assert main(["profile", action, "--corpus", str(corpus), "--out", str(tmp_path), *extra]) == 2
    assert "is a directory" in _error(capsys)
    assert not Path(f"{tmp_path}.npz").exists() and not Path(f"{tmp_path}.png").exists()


def test_build_writes_exactly_the_path_given(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    from engram.tools.profile import HotSet

    out = tmp_path / "h.txt"
    assert main(["profile", "build", "--corpus", str(corpus), "--fraction", "0.001", "--out", str(out),
                 "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    assert out.is_file() and not (tmp_path / "h.txt.npz").exists()
    assert capsys.readouterr().out.rstrip().endswith(f"-> {out}")
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(engram.tools.defaults.packaged_config()))
    assert HotSet.load(out, layout).tokens > 0


def test_plot_writes_exactly_the_path_given(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    _require_matplotlib()
    for name, magic in (("figure", b"\x89PNG"), ("figure.svg", b"<?xml")):
        out = tmp_path / name
        assert main(["profile", "plot", "--corpus", str(corpus), "--out", str(out), "--fractions", "0.001",
                     "--step-tokens", "16", "--tokenizer", str(deepseek_tokenizer_path)]) == 0
        assert out.read_bytes()[:len(magic)] == magic and not (tmp_path / f"{name}.png").exists()
        assert capsys.readouterr().out.rstrip().endswith(f"-> {out}")
    assert main(["profile", "plot", "--corpus", str(corpus), "--out", str(tmp_path / "h.txt")]) == 2
    line = _error(capsys)
    assert "'.txt'" in line and ".png" in line


def test_plot_static_without_hot(corpus, tmp_path, capsys):
    started = time.perf_counter()
    assert main(["profile", "plot", "--corpus", str(corpus), "--out", str(tmp_path / "f.png"),
                 "--policies", "static"]) == 2
    assert "--policies static: needs --hot" in _error(capsys)
    assert time.perf_counter() - started < 5  # before the tokenizer


def test_eval_hot_that_is_empty_or_not_a_hot_set(corpus, tmp_path, deepseek_tokenizer_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    array = tmp_path / "array.npy"
    np.save(array, np.arange(3))
    for path, reason in ((empty, "is empty; expected a hot set"), (array, "is not a hot set")):
        assert main(["profile", "eval", "--corpus", str(corpus), "--fraction", "0.01", "--hot", str(path),
                     "--policy", "static", "--tokenizer", str(deepseek_tokenizer_path)]) == 2
        line = _error(capsys)
        assert "--hot" in line and reason in line


def test_demo_checkpoint_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "regular"
    path.write_text("x")
    assert main(["demo", "--checkpoint", str(path), "--texts", "1", "--max-chars", "100"]) == 2
    line = _error(capsys)
    assert "--checkpoint" in line and "found a file" in line


def _run_with_closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """Run the command line with its stdout a pipe whose reader is gone before it writes."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "engram.tools.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, b"", err)


@pytest.mark.parametrize("args", [["info"], ["hash", "--json", "--tokenizer", "TOKENIZER", "In the beginning"]])
def test_a_closed_stdout_ends_quietly(args, deepseek_tokenizer_path):
    args = [str(deepseek_tokenizer_path) if a == "TOKENIZER" else a for a in args]
    result = _run_with_closed_stdout(*args)
    assert result.returncode == 141  # 128 + SIGPIPE, as a shell reports cat or grep there
    assert result.stderr == b"", result.stderr.decode()


def _refuse_slow_work(monkeypatch, *targets):
    """Make each (module, attribute) fail the test when called: the error must come before it."""
    for module, name in targets:
        def slow(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran before the argument error")
        monkeypatch.setattr(module, name, slow)


def test_demo_seed_is_checked_first(monkeypatch, capsys):
    import engram.tools.demo

    _refuse_slow_work(monkeypatch, (engram.tools.demo.TokenCompressor, "from_tokenizer"), (engram.tools.demo, "english_texts"))
    assert main(["demo", "--seed", "-1"]) == 2
    line = _error(capsys)
    assert "--seed" in line and "-1" in line


def test_transformers_demo_arguments_are_checked_before_the_model_is_written(monkeypatch, capsys):
    import engram.tools.testing

    _refuse_slow_work(monkeypatch, (engram.tools.testing, "write_transformers_checkpoint"))
    assert main(["demo", "--transformers", "--texts", "0"]) == 2
    assert "--texts: expected an integer >= 1, found 0" in _error(capsys)
    assert main(["demo", "--transformers", "--seed", "-3"]) == 2
    assert "--seed" in _error(capsys)


@pytest.mark.parametrize("flags", [["--checkpoint", "x"], ["--skip-layers"], ["--placement", "device"],
                                   ["--max-chars", "100"], ["--config", "x"]])
def test_transformers_demo_refuses_the_flags_it_would_ignore(flags, monkeypatch, capsys):
    import engram.tools.testing

    _refuse_slow_work(monkeypatch, (engram.tools.testing, "write_transformers_checkpoint"))
    assert main(["demo", "--transformers", *flags]) == 2
    line = _error(capsys)
    assert "--transformers" in line and flags[0] in line


def test_transformers_demo_on_cuda_without_a_gpu(monkeypatch, capsys):
    import torch
    import engram.tools.testing

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    _refuse_slow_work(monkeypatch, (engram.tools.testing, "write_transformers_checkpoint"))
    assert main(["demo", "--transformers", "--device", "cuda"]) == 2
    line = _error(capsys)
    assert "needs a CUDA device" in line and "accelerate" not in line


def test_demo_host_placement_on_the_cpu_is_refused_before_hashing(monkeypatch, capsys):
    import engram.tools.demo

    _refuse_slow_work(monkeypatch, (engram.tools.demo.TokenCompressor, "from_tokenizer"), (engram.tools.demo, "english_texts"))
    for placement in ("host", "cached"):
        assert main(["demo", "--placement", placement]) == 2
        assert f"--placement {placement}" in _error(capsys)


def test_info_config_that_is_not_a_regular_file(capsys):
    assert main(["info", "--config", os.devnull]) == 2
    line = _error(capsys)
    assert "is not a regular file" in line and "does not exist" not in line
