"""The disk reads' library: built at install time (setup.py) by the first-use build's command, loaded when it
reports this disk_reads.c's digest, refused (and rebuilt at first use, saying so) when it does not."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import warnings
from pathlib import Path

import pytest

from conftest import missing_dependency
from engram.environment import c_compiler
from engram.table.disk import reads, reads_build

pytestmark = pytest.mark.skipif(c_compiler() is None, reason="no C compiler")

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def _setup_module():
    spec = importlib.util.spec_from_file_location("engram_setup_disk", SETUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_install_built_the_library_and_it_is_the_one_loaded():
    built = reads.BUILT_LIBRARY
    if not built.exists():
        missing_dependency(f"no built disk reads library at {built} (pip install -e . builds it)")
    if reads._mismatch(ctypes.CDLL(str(built))) is not None:
        missing_dependency("the built disk reads library is stale: pip install -e . rebuilds it")
    lib, reason = reads._library()
    assert reason == "" and lib._name == str(built)


def test_the_install_time_build_runs_the_first_use_command(tmp_path):
    target = tmp_path / reads.BUILT_LIBRARY.name
    command = _setup_module().disk_reads_command(target)
    assert command == reads_build.build_command(c_compiler(), target)
    assert subprocess.run(command, capture_output=True, text=True, timeout=120).returncode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback, no warning
        lib, reason = reads.load_library(target)
    assert reason == "" and lib._name == str(target)


def test_a_library_of_another_source_is_refused_and_rebuilt(tmp_path):
    stale = tmp_path / "stale.so"
    command = ["-DENGRAM_DISK_SOURCE_DIGEST=7" if flag.startswith("-DENGRAM_DISK_SOURCE_DIGEST=") else flag
               for flag in reads_build.build_command(c_compiler(), stale)]
    assert subprocess.run(command, capture_output=True, text=True, timeout=120).returncode == 0
    with pytest.warns(RuntimeWarning, match=r"stale\.so is refused: it was built from another disk_reads.c \(source "
                                            r"digest 7, expected \d+\); built it from source"):
        lib, reason = reads.load_library(stale)
    assert reason == "" and lib._name != str(stale) and reads._mismatch(lib) is None


def test_neither_a_library_nor_a_compiler_says_both(tmp_path, monkeypatch):
    from engram import environment

    monkeypatch.setattr(environment, "c_compiler", lambda: None)
    lib, reason = reads.load_library(tmp_path / "absent.so")
    assert lib is None and "no built library" in reason and "no C compiler" in reason
