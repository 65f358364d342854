"""Placement ``"node"`` over gloo groups of CPU processes: what its setup and ``close()`` leave behind.

* ``close()`` refuses later lookups and plans (prepared ones too, under ``TRITON_INTERPRET=1``), by
  name; a view of the rows taken before it still reads them (the mapping is never unmapped under a
  tensor) and the mapping goes once the last view does;
* a setup failure on one rank (an option, its shard's allocation, its checkpoint read, opening a peer's
  shard) makes every rank raise, the others naming it, well before the group's timeout; the group then
  builds the table again;
* ``engram shm remove --all-stale`` run while the group sets up leaves the live shards alone;
* a tmpfs too small for the shards is one clear error on the ranks, never a SIGBUS.

Every wait on the ranks is bounded (``WAIT_S``); the seed is reported on failure.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_group import end_group
from engram.table import EngramTable
from test_node_layer import fp8_table, layer_weights, step_inputs
from test_node_placement import random_fp8, request

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TIMEOUT = datetime.timedelta(seconds=40)   # the group's timeout: a rank left waiting fails after it
WAIT_S = 180.0                             # bound of the wait for all ranks
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _init(rank: int, world_size: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)


def _save(out_dir: str, rank: int, results: dict) -> None:
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def run_group(worker, world_size: int, tmp_path: Path, *args) -> list[dict]:
    """Start ``worker(rank, world_size, init_file, out_dir, *args)`` on every rank, wait (bounded) and
    return each rank's saved results."""
    context = mp.start_processes(worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), *args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + WAIT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"the ranks did not finish within {WAIT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _error(call) -> str | None:
    """``"<type>: <message>"`` of what ``call()`` raised, None if nothing."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _mapped_lines(directory: str) -> int:
    """Lines of /proc/self/maps naming a file in ``directory``."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"{directory}/" in line)


def _peer_table(values, scales, directory: str, **kwargs) -> EngramTable:
    options = {"group": dist.group.WORLD, "lookup": "peer", "shm_directory": directory}
    return EngramTable(values, scales, placement="node", placement_options=options, **kwargs)


# ---------------------------------------------------------------------------
# close()
# ---------------------------------------------------------------------------
def _close_worker(rank, world_size, init_file, out_dir, seed, directory, backend):
    _init(rank, world_size, init_file)
    results: dict = {}
    try:
        from engram.layer import Engram, WkvProjection

        shared = torch.Generator().manual_seed(seed)
        values, scales = fp8_table(shared)
        weights = layer_weights(shared)
        table = _peer_table(values, scales, directory, backend=backend, validate=False)
        plain = EngramTable(values, scales, placement="cpu")
        layer = Engram(table, WkvProjection(weights["wkv"]), weights["q"], weights["k"], eps=1e-6, num_columns=4,
                       gate_backend=backend)
        hidden, ids, mask = step_inputs(5 + rank, torch.Generator().manual_seed(seed + 1 + rank))
        with torch.inference_mode():
            plan = layer.plan(hidden, ids, mask)
            results["path"] = plan.path
            results["before"] = torch.equal(table.lookup(ids).view(torch.int16), plain.lookup(ids).view(torch.int16))
            plan.run(hidden, ids, mask)
            prepared = table.prepare_lookup(ids)
            results["prepared"] = prepared is not None
            view = table.storage.value_bytes
            expected = view.clone()
            start, end = table.storage.owned
            results["view is own rows"] = torch.equal(expected, values[start:end])
            dist.barrier()
            table.close()
            results["files after close"] = sorted(os.listdir(directory))
            results["plan after close"] = _error(lambda: plan.run(hidden, ids, mask))
            results["lookup after close"] = _error(lambda: table.lookup(ids))
            results["prepared after close"] = _error(lambda: prepared(ids)) if prepared is not None else None
            results["view after close"] = torch.equal(view, expected)   # reads the mapped rows: no fault
            results["mapped with a view"] = _mapped_lines(directory)
            del view
            results["mapped without views"] = _mapped_lines(directory)
            table.close()   # twice: a no-op
    finally:
        _save(out_dir, rank, results)
        end_group()


def _check_closed(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert got["before"] and got["view is own rows"], rank
        assert got["files after close"] == [], rank
        for key in ("plan after close", "lookup after close"):
            assert got[key] is not None and got[key].startswith("RuntimeError") and "closed" in got[key], (rank, key)
            assert "NodePlacement(lookup='peer'" in got[key], (rank, key)
        assert got["view after close"], rank
        assert got["mapped with a view"] >= 1 and got["mapped without views"] == 0, rank


def test_close_refuses_plans_and_never_unmaps_under_a_view(seed, tmp_path):
    directory = tempfile.mkdtemp(prefix="engram-node-test-", dir=SHM)
    try:
        results = run_group(_close_worker, 2, tmp_path, seed, directory, "torch")
    finally:
        os.rmdir(directory)
    _check_closed(results)
    assert all(got["path"] == "unchecked" and not got["prepared"] for got in results)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_close_refuses_prepared_lookups(seed, tmp_path):
    if not INTERPRET:
        pytest.skip("the CPU peer kernel runs under TRITON_INTERPRET=1")
    directory = tempfile.mkdtemp(prefix="engram-node-test-", dir=SHM)
    try:
        results = run_group(_close_worker, 2, tmp_path, seed, directory, "triton")
    finally:
        os.rmdir(directory)
    _check_closed(results)
    for rank, got in enumerate(results):
        assert got["path"] == "prepared" and got["prepared"], rank
        refused = got["prepared after close"]
        assert refused is not None and refused.startswith("RuntimeError") and "was closed" in refused, rank
        assert "this prepared lookup" in refused, rank


# ---------------------------------------------------------------------------
# setup failures are told
# ---------------------------------------------------------------------------
FAILING_RANK = 1
SIMULATED = "simulated failure of this rank's setup"


def _fail(*args, **kwargs):
    raise ValueError(SIMULATED)


def _told_worker(rank, world_size, init_file, out_dir, seed, directory, where, checkpoint_dir, spec):
    _init(rank, world_size, init_file)
    results: dict = {}
    try:
        import engram.table.peer_memory as peer_memory
        import engram.table.placements.node as node
        from engram.checkpoint import SafetensorsCheckpoint, load_engram_table
        from engram.checkpoint.loading import TableSource
        from engram.layout import EngramLayout

        values, scales = random_fp8(97, torch.Generator().manual_seed(seed))
        lookup = "exchange" if where == "exchange" else "peer"
        options = {"group": dist.group.WORLD, "lookup": lookup, "shm_directory": directory}
        real = {}
        if rank == FAILING_RANK:
            if where == "option":
                options["shm_directory"] = os.path.join(directory, "missing")
            elif where in ("allocation", "exchange"):
                real["_allocate_owned"] = node._allocate_owned
                node._allocate_owned = _fail
            elif where == "checkpoint":
                real["read_into"] = TableSource.read_into
                TableSource.read_into = _fail
        if rank == world_size - 1 and where == "mapping":
            real["_open_peer_file"] = peer_memory._open_peer_file
            peer_memory._open_peer_file = _fail

        def build():
            if where == "checkpoint":
                return load_engram_table(SafetensorsCheckpoint(checkpoint_dir), EngramLayout(spec), 0, None,
                                         placement="node", placement_options=options)
            return EngramTable(values, scales, placement="node", placement_options=options)

        started = time.monotonic()
        results["error"] = _error(build)
        results["seconds"] = time.monotonic() - started
        dist.barrier()   # every rank has raised, having released its part
        results["files after failure"] = sorted(os.listdir(directory))
        dist.barrier()   # no rank starts the retry (which makes files) before every rank has looked
        # Undo the failure: the group is still in step and builds the table.
        for name, function in real.items():
            if name == "_allocate_owned":
                node._allocate_owned = function
            elif name == "read_into":
                TableSource.read_into = function
            else:
                peer_memory._open_peer_file = function
        options["shm_directory"] = directory
        table = build()
        if where == "checkpoint":
            plain = load_engram_table(SafetensorsCheckpoint(checkpoint_dir), EngramLayout(spec), 0, None)
        else:
            plain = EngramTable(values, scales, placement="cpu")
        columns = EngramLayout(spec).num_columns if where == "checkpoint" else 3
        ids = request(plain.num_rows, 0, plain.num_rows, 7 + rank, torch.Generator().manual_seed(seed + rank), None,
                      columns)
        results["same after retry"] = torch.equal(table.lookup_packed(ids)[0].view(torch.uint8),
                                                  plain.lookup_packed(ids)[0].view(torch.uint8))
        table.close()
        results["files at end"] = sorted(os.listdir(directory))
    finally:
        _save(out_dir, rank, results)
        end_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engram.tools.testing import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("told_checkpoint"), scale="small", tokenizer="word",
                                      num_shards=1, seed=5)


@pytest.mark.parametrize("where", ["option", "allocation", "exchange", "checkpoint", "mapping"])
def test_a_setup_failure_is_told_to_every_rank(where, seed, tmp_path, checkpoint):
    world_size = 3
    directory = tempfile.mkdtemp(prefix="engram-node-test-", dir=SHM)
    try:
        results = run_group(_told_worker, world_size, tmp_path, seed, directory, where, str(checkpoint.directory),
                            checkpoint.spec)
    finally:
        os.rmdir(directory)
    failing = world_size - 1 if where == "mapping" else FAILING_RANK
    own = "does not exist or is not a directory" if where == "option" else SIMULATED
    for rank, got in enumerate(results):
        error = got["error"]
        assert error is not None, rank
        if rank == failing:
            assert error.startswith("ValueError") and own in error, (rank, error)
        else:
            assert error.startswith("RuntimeError") and f"failed on rank {failing} of the group" in error, (rank, error)
            assert own in error, (rank, error)
        assert got["seconds"] < TIMEOUT.total_seconds(), (rank, got["seconds"])   # told, not timed out
        assert got["same after retry"], rank
        assert got["files after failure"] == [] and got["files at end"] == [], (rank, got["files after failure"])


# ---------------------------------------------------------------------------
# the admin during setup; a small tmpfs
# ---------------------------------------------------------------------------
def _admin_worker(rank, world_size, init_file, out_dir, seed, directory):
    _init(rank, world_size, init_file)
    results: dict = {}
    try:
        import engram.table.placements.node as node
        from engram.table.host_memory.shm_admin import remove_shared_table

        real_map = node.map_peer_shards

        def map_after_admin(*args, **kwargs):
            dist.barrier()   # every rank's shard is allocated and filled, none sent yet
            if rank == 0:
                removal = remove_shared_table(directory=directory, all_stale=True)
                results["removed"], results["refused"] = removal.removed, removal.refused
            dist.barrier()
            return real_map(*args, **kwargs)

        node.map_peer_shards = map_after_admin
        values, scales = random_fp8(97, torch.Generator().manual_seed(seed))
        results["error"] = _error(lambda: results.setdefault("table", None) or
                                  results.__setitem__("table", _peer_table(values, scales, directory)))
        table = results.pop("table")
        if table is not None:
            plain = EngramTable(values, scales, placement="cpu")
            ids = torch.randint(0, 97, (9, 3), generator=torch.Generator().manual_seed(seed + rank))
            results["same"] = torch.equal(table.lookup_packed(ids)[0].view(torch.uint8),
                                          plain.lookup_packed(ids)[0].view(torch.uint8))
            table.close()
    finally:
        _save(out_dir, rank, results)
        end_group()


def test_remove_all_stale_during_setup_keeps_live_shards(seed, tmp_path):
    directory = tempfile.mkdtemp(prefix="engram-node-test-", dir=SHM)
    try:
        results = run_group(_admin_worker, 2, tmp_path, seed, directory)
        assert os.listdir(directory) == []
    finally:
        os.rmdir(directory)
    assert results[0]["removed"] == [] and results[0]["refused"] == []
    for rank, got in enumerate(results):
        assert got["error"] is None and got["same"], (rank, got["error"])


def _small_worker(rank, world_size, init_file, out_dir, rows, directory):
    _init(rank, world_size, init_file)
    results: dict = {}
    try:
        values = torch.full((rows, 64), 0x38, dtype=torch.uint8)
        scales = torch.full((rows, 2), 127, dtype=torch.uint8)
        results["error"] = _error(lambda: _peer_table(values, scales, directory))
        results["files"] = sorted(os.listdir(directory))
    finally:
        _save(out_dir, rank, results)
        end_group()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs of its own (needs root), unmounted after the test."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield str(mount_point)
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_shards_larger_than_the_tmpfs_are_a_clear_error(small_tmpfs, tmp_path, seed):
    """Two ranks whose 3 MiB shards cannot both fit a 4 MiB tmpfs: reserved up front, so a rank raises the
    no-room error (naming the directory and how to grow it) and the other names that rank; no SIGBUS."""
    width = 80   # a packed row of head_dim 64 (values, scales, tag, padding)
    rows = 2 * (3 * 2**20 // width) + seed % 7 * 2
    out = tmp_path / "out"
    out.mkdir()
    results = run_group(_small_worker, 2, out, rows, small_tmpfs)   # a rank killed by SIGBUS fails the join
    errors = [got["error"] for got in results]
    assert all(error is not None for error in errors), errors
    no_room = [error for error in errors if error.startswith("ValueError") and "the peer shard needs" in error]
    assert no_room and all(f"directory: '{small_tmpfs}' has " in error and "mount -o remount,size=" in error
                           for error in no_room), errors
    assert all(error in no_room or ("RuntimeError" in error and "the peer shard needs" in error) for error in errors)
    assert all(got["files"] == [] for got in results) or os.listdir(small_tmpfs) == []
