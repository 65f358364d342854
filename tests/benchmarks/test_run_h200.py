"""benchmarks/run_h200.sh on the CPU, with --print (the commands, not run): each subcommand runs a script
that exists, with its log under $OUT (else benchmarks/results/); a bad command line prints the usage and
exits 2."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_h200.sh"
# subcommand -> (script, an argument its command must pass: "" for none)
BENCHMARKS = {"kernels": ("kernels/bench_kernels.py", ""), "layer": ("layer/bench_layer.py", ""),
              "host": ("host/bench_host.py", ""), "cache": ("cache/bench_cache.py", ""),
              "cache-update": ("cache/bench_cache_update.py", ""),
              "disk": ("disk/bench_disk.py", "--gib 20"),
              "disk-lookup": ("disk/bench_disk_lookup.py", "--gib 2"), "step": ("step/bench_step.py", ""),
              "step-keys": ("step/bench_step.py", "--variants"),
              "step-cache": ("step/bench_step.py", "--host-neighbors 7"),
              "parallel": ("parallel/bench_parallel.py", ""),
              "node": ("parallel/bench_parallel.py", "--mode node")}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("argv", [[], ["benches"], ["suite", "bogus"], ["--runs"], ["--runs", "0", "suite"],
                                  ["--runs", "x", "suite"]])
def test_bad_command_lines_print_the_usage_and_exit_2(argv):
    done = run(*argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Subcommands" in done.stderr and done.stdout == ""
    for name in ("suite", "memcheck", *BENCHMARKS, "step-disk", "all"):
        assert f"\n  {name} " in done.stderr, name


def test_each_subcommand_runs_its_script_with_its_log_under_out(tmp_path):
    for name, (expected, argument) in BENCHMARKS.items():
        done = run("--print", name, out=tmp_path)
        assert done.returncode == 0, done.stderr
        (line,) = done.stdout.splitlines()
        command, log = line.rsplit(" > ", 1)
        script = next(part for part in command.split() if part.endswith(".py"))
        assert (ROOT / script).is_file(), script
        assert Path(script) == Path("benchmarks", expected) and Path(log).parent == tmp_path, line
        assert argument in command and ("--mode node" in command) == (name == "node"), line


def test_suite_runs_the_gpu_tests_as_two_interrupted_processes(tmp_path):
    done = run("--print", "--runs", "3", "suite", out=tmp_path)
    assert done.returncode == 0, done.stderr
    (tests,) = done.stdout.splitlines()
    assert tests.startswith("3 x (") and tests.endswith(f"> {tmp_path}/gpu-tests-h200.log")
    first, second = tests[len("3 x ("):].split(" & ")
    for part in (first, second):  # SIGINT, so pytest still names the test it was in
        assert part.startswith("timeout -s INT ") and "-m gpu" in part, part
    assert "tests/hashing/test_hash_kernel.py" in first and "--ignore=tests/hashing/test_hash_kernel.py" in second


def test_memcheck_runs_the_kernels_under_compute_sanitizer(tmp_path):
    done = run("--print", "memcheck", out=tmp_path)
    assert done.returncode == 0, done.stderr
    (memcheck,) = done.stdout.splitlines()
    assert "compute-sanitizer --tool memcheck" in memcheck and "benchmarks/kernels/memcheck_kernels.py" in memcheck
    assert memcheck.endswith(f"> {tmp_path}/memcheck-h200.log")
    assert (ROOT / "benchmarks" / "kernels" / "memcheck_kernels.py").is_file()


def test_all_is_the_suite_then_every_benchmark_and_logs_default_to_results():
    done = run("--print", "all")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    in_all = {name: entry for name, entry in BENCHMARKS.items()  # focused re-runs of the step's keys
              if name not in ("step-keys", "step-cache")}
    assert len(lines) == 2 + len(in_all)
    assert all(line.rsplit(" > ", 1)[1].startswith("benchmarks/results/") for line in lines)
    assert "gpu-tests-h200.log" in lines[0] and "memcheck-h200.log" in lines[1]
    scripts = [next(p for p in line.split() if p.endswith(".py")) for line in lines[2:]]
    assert scripts == [f"benchmarks/{script}" for script, _ in in_all.values()]
    assert len({line.rsplit(" > ", 1)[1] for line in lines}) == len(lines)  # no two write one log


def test_step_disk_writes_the_row_files_then_measures_them(tmp_path):
    done = run("--print", "step-disk", out=tmp_path)
    assert done.returncode == 0, done.stderr
    write, measure = done.stdout.splitlines()
    for line in (write, measure):
        assert "benchmarks/step/bench_step.py" in line and "--disk-directory .bench-disk/step" in line
        assert "--table-gib 20" in line and Path(line.rsplit(" > ", 1)[1]).parent == tmp_path
    assert "--write-disk-tables" in write and "--write-disk-tables" not in measure
    assert "--disk-hbm-fraction 0.02" in measure and "disk_prefetch_realtext_ram30" in measure
