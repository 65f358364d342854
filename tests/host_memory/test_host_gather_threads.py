"""The host gather leaves the engine's threads alone: no process-wide torch thread setting is
changed, its thread count is an option (default: the node's cores shared by its processes), and
bad option values are refused before anything is allocated."""

from __future__ import annotations

import threading

import pytest
import torch

import engram
from engram.table.host_memory import gather as host_gather
from engram.options import ServingOptions
from engram.table.host_memory.gather import default_gather_threads


def test_worker_changes_no_thread_setting_of_the_process():
    before = torch.get_num_threads()
    worker = host_gather._shared_worker()
    table = torch.arange(4000 * 16, dtype=torch.int64).view(torch.uint8).view(4000, 128)
    ids = torch.randperm(4000, generator=torch.Generator().manual_seed(3))
    out = torch.empty(4000, 128, dtype=torch.uint8)
    threads = 1 if before > 1 else 2  # a count unlike the process's, so a leak would show
    worker.submit(host_gather.gather_rows, table, ids, out, threads).result()  # rows copied on the worker
    assert torch.equal(out, table[ids])
    seen = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [before] and torch.get_num_threads() == before


def test_default_gather_threads_splits_the_cores_between_local_processes(monkeypatch):
    monkeypatch.setattr(host_gather, "_usable_cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_gather_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_gather_threads() == 2
    assert default_gather_threads(processes_per_node=32) == 1   # at least one
    for given in ("garbage", "0", "-2", "2.5"):   # a typo is an error naming the variable, never a silent 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", given)
        with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE: expected a positive integer .* found '{given}'"):
            default_gather_threads()
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):   # ServingOptions reads it before any byte
            ServingOptions.from_environment()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert default_gather_threads() == 16


@pytest.mark.parametrize("placement", ["host", "cached"])
@pytest.mark.parametrize("option,value", [("gather_threads", 0), ("gather_threads", 2.5), ("gather_threads", True),
                                          ("direct_max_rows", -1), ("direct_max_rows", "all")])
def test_bad_placement_options_name_the_option(placement, option, value):
    values = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.full((4, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{option}: expected an integer >= "):
        engram.EngramTable(values, scales, placement=placement, placement_options={option: value})


def test_copy_threads_keep_their_team_after_the_engine_sets_torch_threads(tmp_path):
    """An engine that calls torch.set_num_threads (before or after the library's threads exist) keeps
    its count on its threads and on threads it starts later; the library's copy thread keeps its own."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(
        "import threading, torch\n"
        "from engram.table.host_memory import openmp_team, row_copy\n"
        "if not openmp_team.available():\n"
        "    print('unavailable'); raise SystemExit(0)\n"
        "torch.set_num_threads(1)\n"
        "table = torch.arange(3000 * 8, dtype=torch.int64).view(torch.uint8).view(3000, 64)\n"
        "ids = torch.randperm(3000, generator=torch.Generator().manual_seed(5))\n"
        "out = torch.empty(3000, 64, dtype=torch.uint8)\n"
        "row_copy.gather_rows(table, ids, out, 3)\n"
        "assert torch.equal(out, table[ids])\n"
        "copy_thread = openmp_team.run_owned(torch.get_num_threads)\n"
        "torch.set_num_threads(2)\n"
        "row_copy.gather_rows(table, ids, out, 3)\n"
        "again = openmp_team.run_owned(torch.get_num_threads)\n"
        "later = []\n"
        "thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))\n"
        "thread.start(); thread.join()\n"
        "print(copy_thread, again, torch.get_num_threads(), later[0])\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "unavailable":
        pytest.skip("torch's parallel backend here is not a per-thread OpenMP runtime")
    assert result.stdout.split() == ["3", "3", "2", "2"], result.stdout
