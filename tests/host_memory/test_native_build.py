"""The native worker's builds: at install time (setup.py) into the package, at first use only as a fallback,
both by gather_protocol.build_command; a library of another protocol or source is refused."""

from __future__ import annotations

import importlib.util
import subprocess
import warnings
from pathlib import Path

import pytest

from conftest import missing_dependency
from engram.environment import c_compiler
from engram.table.host_memory import gather_protocol, native_worker

pytestmark = pytest.mark.skipif(c_compiler() is None, reason="no C compiler")

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def _setup_module():
    spec = importlib.util.spec_from_file_location("engram_setup", SETUP)  # not __main__: setup() is not called
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_install_built_the_library_and_it_is_the_one_loaded():
    built = native_worker.BUILT_LIBRARY
    if not built.exists():
        missing_dependency(f"no built native worker at {built} (pip install -e . builds it)")
    import ctypes

    refused = native_worker._mismatch(ctypes.CDLL(str(built)))
    if refused is not None:
        missing_dependency(f"the built native worker is stale ({refused}): pip install -e . rebuilds it")
    lib, reason = native_worker._library()
    assert reason == "" and lib._name == str(built)


def test_the_install_time_build_runs_the_first_use_builds_command(tmp_path):
    target = tmp_path / native_worker.BUILT_LIBRARY.name
    command = _setup_module().worker_command(target)
    assert command == gather_protocol.build_command(c_compiler(), target)
    assert "-O3" in command and gather_protocol.compile_definitions()[0] in command
    _build(command)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        lib, reason = native_worker.load_library(target)
    assert reason == "" and lib._name == str(target)


def test_without_a_built_library_the_fallback_builds_from_source_and_says_so(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(native_worker, "build_command",
                        lambda *args: commands.append(gather_protocol.build_command(*args)) or commands[-1])
    absent = tmp_path / "absent.so"
    with pytest.warns(RuntimeWarning, match=r"no built library at .*absent\.so.*building it from source"):
        lib, reason = native_worker.load_library(absent)
    assert reason == "" and lib is not None and len(commands) == 1  # by the one command


@pytest.mark.parametrize("name, value, says", [("CHUNK_ROWS", 64, "CHUNK_ROWS 64 (expected 128)"),
                                               ("SOURCE_DIGEST", 7, "source digest 7 (expected ")])
def test_a_library_of_another_protocol_is_refused_and_the_fallback_used(tmp_path, name, value, says):
    stale = tmp_path / "stale.so"
    command = [f"-DENGRAM_{name}={value}" if flag.startswith(f"-DENGRAM_{name}=") else flag
               for flag in gather_protocol.build_command(c_compiler(), stale)]
    _build(["-O0" if flag == "-O3" else flag for flag in command])
    with pytest.warns(RuntimeWarning, match="building it from source") as caught:
        lib, reason = native_worker.load_library(stale)
    assert f"{stale} is refused: it was built with {says}" in str(caught[0].message)
    assert reason == "" and lib._name != str(stale) and native_worker._mismatch(lib) is None


def test_a_library_from_before_the_protocol_check_is_refused(tmp_path):
    source = tmp_path / "old.c"
    source.write_text("int engram_gather_record_layout(long *out, int words) { return 0; }\n")
    old = tmp_path / "old.so"
    _build([c_compiler(), "-shared", "-fPIC", str(source), "-o", str(old)])
    with pytest.warns(RuntimeWarning, match=r"refused: it reports no protocol.*building it from source"):
        lib, _ = native_worker.load_library(old)
    assert lib is not None and lib._name != str(old)


def test_neither_a_built_library_nor_a_compiler_says_both(tmp_path, monkeypatch):
    monkeypatch.setattr(native_worker, "c_compiler", lambda: None)
    lib, reason = native_worker.load_library(tmp_path / "absent.so")
    assert lib is None and "no built library" in reason and "no C compiler" in reason
