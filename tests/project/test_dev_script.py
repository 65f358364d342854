"""scripts/dev.sh says before it installs system packages, and can be told not to."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "dev.sh"


def run_english_text_packages(tmp_path: Path, **environment: str) -> tuple[str, Path]:
    """Run the script's english_text_packages() as a fake root with a fake apt-get that only
    records its calls; returns (output, the record file)."""
    if Path("/usr/share/games/fortunes").is_dir():
        pytest.skip("fortunes-min is installed here: the function has nothing to do")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "apt-calls"
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    for tool in ("id", "apt-get"):
        (bin_dir / tool).chmod(0o755)
    source = SCRIPT.read_text(encoding="utf-8")
    function = source[source.index("english_text_packages() {"):]
    function = function[: function.index("\n}\n") + 3]
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **environment}
    result = subprocess.run(["bash", "-c", function + "english_text_packages"], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout, record


def test_says_so_before_installing_system_packages(tmp_path):
    out, record = run_english_text_packages(tmp_path)
    assert "installing the Debian packages fortunes-min and python3-doc system-wide" in out
    assert "ENGRAM_NO_SYSTEM_PACKAGES=1" in out
    assert "install -y -qq fortunes-min python3-doc" in record.read_text()


def test_system_packages_can_be_skipped(tmp_path):
    out, record = run_english_text_packages(tmp_path, ENGRAM_NO_SYSTEM_PACKAGES="1")
    assert "not installing fortunes-min/python3-doc" in out
    assert not record.exists()


def run_setup(tmp_path: Path, cpu_index_works: bool) -> tuple[str, list[str]]:
    """Run the script's setup() in a scratch directory with a fake venv whose python has no torch
    and whose pip records its arguments (and fails for the CPU index when told to)."""
    source = SCRIPT.read_text(encoding="utf-8")
    header = source[source.index("venv=.venv"):source.index("setup() {")]
    function = source[source.index("setup() {"):]
    function = function[: function.index("\n}\n") + 3]
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    record = tmp_path / "pip-calls"
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")   # nothing importable: every install runs
    fail = 'case "$*" in *download.pytorch.org*) exit 1;; esac\n' if not cpu_index_works else ""
    (bin_dir / "pip").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n{fail}exit 0\n")
    for tool in ("python", "pip"):
        (bin_dir / tool).chmod(0o755)
    result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + header + function + "setup"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout, record.read_text().splitlines()


def test_torch_comes_from_the_cpu_index(tmp_path):
    out, calls = run_setup(tmp_path, cpu_index_works=True)
    assert calls[0] == "install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert not any(call == "install -q torch==2.13.0" for call in calls)
    assert "unreachable" not in out


def test_torch_falls_back_to_pypi_when_the_cpu_index_is_unreachable(tmp_path):
    out, calls = run_setup(tmp_path, cpu_index_works=False)
    assert calls[:2] == ["install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                         "install -q torch==2.13.0"]
    assert "unreachable; installing torch==2.13.0 from PyPI" in out
