"""Placement ``"node"`` with ``lookup="peer"`` over gloo groups of 2 and 3 CPU processes: each rank maps
the others' shards (shared-memory files here, CUDA IPC on GPUs) and reads every row from its owner.

* lookups and packed lookups equal a ``"cpu"`` table of the whole rows on every rank (edges of every
  rank's rows, a rank with no tokens, uneven token counts, rows that do not divide by the group's
  size, fewer rows than ranks, a tensor-parallel shard with ids outside its rows, a checkpoint load
  reading only the owned rows), through the torch path and, under ``TRITON_INTERPRET=1``, the peer
  gather kernel; no lookup is a collective (ranks look up different numbers of times);
* setup leaves no file in the shared-memory directory; a peer refuses a file that is not the one its
  owner created; :meth:`close` releases in order and later lookups are refused;
* the setup checks as pure functions: a group spanning hosts, GPUs seen in another order, two ranks
  on one GPU, a pair without peer access.
"""

from __future__ import annotations

import glob
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_group import end_group
from engram.checkpoint import SafetensorsCheckpoint, load_engram_table
from engram.layout import EngramLayout
from engram.table import EngramTable
from engram.table.peer_memory import RankInfo, check_node_local, check_peer_access
from engram.tools.testing import write_synthetic_checkpoint
from test_node_placement import COLUMNS, TABLES, edge_ids, random_fp8, request, tokens_per_step

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _peer_files() -> set[str]:
    return set(glob.glob(os.path.join(SHM, "engram-peer-*")))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, seed: int, checkpoint_dir: str,
            spec, backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results: dict = {"files_before": _peer_files()}
        options = {"group": dist.group.WORLD, "lookup": "peer"}
        tables = []
        for table_name, (rows, row_start, total) in TABLES.items():
            generator = torch.Generator().manual_seed(seed + rows)  # the same table on every rank
            values, scales = random_fp8(rows, generator)
            kwargs = dict(row_start=row_start, num_rows_total=total)
            node = EngramTable(values, scales, placement="node", placement_options=options, backend=backend, **kwargs)
            plain = EngramTable(values, scales, placement="cpu", **kwargs)
            assert not node.collective and node.storage.lookup == "peer"
            start, end = node.storage.owned
            assert node.storage.value_bytes.shape[0] == end - start
            tables.append(node)
            own = torch.Generator().manual_seed(seed + 1000 * rank + rows)  # each rank's own ids
            total = rows if total is None else total
            edges = edge_ids(rows, row_start, total, world_size)
            # No collective in a lookup: rank r looks up r + 1 extra times, the others never wait for it.
            steps = tokens_per_step(world_size, rank) + [5] * (rank + 1)
            for step, tokens in enumerate(steps):
                ids = request(rows, row_start, total, tokens, own, edges if step == 2 else None)
                node_values, node_scales = node.lookup_packed(ids)
                results[(table_name, step)] = {
                    "node": (node.lookup(ids).view(torch.int16), node_values.view(torch.uint8), node_scales),
                    "cpu": (plain.lookup(ids).view(torch.int16), plain.lookup_packed(ids)[0].view(torch.uint8),
                            plain.lookup_packed(ids)[1]),
                }
        dist.barrier()  # no rank has started the next table's setup (which creates its file)
        results["files_after_setup"] = _peer_files()
        dist.barrier()
        checkpoint = SafetensorsCheckpoint(checkpoint_dir)
        layout = EngramLayout(spec)
        for shard_name, shard in (("whole", None), ("shard", layout.shard(1, 2))):
            node = load_engram_table(checkpoint, layout, 0, shard, placement="node", placement_options=options,
                                     backend=backend)
            plain = load_engram_table(checkpoint, layout, 0, shard)
            tables.append(node)
            own = torch.Generator().manual_seed(seed + 7 + rank)
            rows, row_start, total = node.num_rows, node.row_start, layout.num_embeddings[0]
            ids = request(rows, row_start, total, 40 + 9 * rank, own, edge_ids(rows, row_start, total, world_size),
                          layout.num_columns)
            start, end = node.storage.owned
            assert torch.equal(node.storage.value_bytes, plain.storage.value_bytes[start:end])
            results[("checkpoint", shard_name)] = {
                "node": (node.lookup(ids).view(torch.int16), node.lookup_packed(ids)[0].view(torch.uint8)),
                "cpu": (plain.lookup(ids).view(torch.int16), plain.lookup_packed(ids)[0].view(torch.uint8)),
            }
        results["kernel"] = tables[0].storage._peer is not None
        for table in tables:
            table.close()  # a collective: every rank closes its tables in the same order
        try:
            tables[0].lookup(torch.zeros(1, COLUMNS, dtype=torch.int64))
            results["after_close"] = None
        except RuntimeError as error:
            results["after_close"] = str(error)
        dist.barrier()
        results["files_at_end"] = _peer_files()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("peer_checkpoint"), scale="small", tokenizer="word",
                                      num_shards=2, seed=13)


def _run(world_size, seed, small_checkpoint, tmp_path, backend) -> list[dict]:
    mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), seed,
                            str(small_checkpoint.directory), small_checkpoint.spec, backend),
             nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    compared = 0
    for rank, mine in enumerate(results):
        for key, got in mine.items():
            if not isinstance(key, tuple):
                continue
            for node_part, cpu_part in zip(got["node"], got["cpu"]):
                assert torch.equal(node_part, cpu_part), (rank, key)
                compared += 1
        # the shared files' names are gone once every rank mapped them
        assert mine["files_after_setup"] <= mine["files_before"], rank
        assert mine["files_at_end"] <= mine["files_before"], rank
        assert mine["after_close"] is not None and "closed" in mine["after_close"], rank
    assert compared >= world_size * (3 * len(TABLES) * 3 + 4)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_peer_lookups_equal_cpu_table(world_size, seed, small_checkpoint, tmp_path):
    results = _run(world_size, seed, small_checkpoint, tmp_path, "torch")
    assert not any(mine["kernel"] for mine in results)  # the torch path read the mapped shards


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_peer_kernel_lookups_equal_cpu_table(seed, small_checkpoint, tmp_path):
    if not INTERPRET:
        pytest.skip("the CPU peer kernel runs under TRITON_INTERPRET=1")
    results = _run(2, seed, small_checkpoint, tmp_path, "triton")
    assert all(mine["kernel"] for mine in results)  # the peer gather kernel served the lookups


def test_a_peer_refuses_a_file_its_owner_did_not_create(tmp_path, seed):
    from engram.table.peer_memory import _open_peer_file, allocate_shard

    shard, shared = allocate_shard(2, 80, torch.device("cpu"), tmp_path)
    content = torch.randint(0, 256, (2, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    shard.copy_(content)
    path, identity = str(shared.path), shared.identity
    assert sorted(os.listdir(tmp_path)) == sorted([shared.path.name, shared.path.name + ".lock"])
    with pytest.raises(ValueError, match=r"is not the one that rank sent: .* = \(.*'peer', False, 2, 80\)"):
        _open_peer_file(path, identity, 2, 80, 1)   # not published yet (filled flag 0)
    shared.publish()
    with pytest.raises(ValueError, match="is not the file that rank created"):
        _open_peer_file(path, (identity[0], identity[1] + 1, identity[2]), 2, 80, 1)
    with pytest.raises(ValueError, match="is not the file that rank created"):
        _open_peer_file(path, (identity[0], identity[1], identity[2] + 80), 2, 80, 1)
    with pytest.raises(ValueError, match=r"expected \('engram-peer-.*', 'peer', True, 4, 40\)"):
        _open_peer_file(path, identity, 4, 40, 1)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(OSError):
        _open_peer_file(str(link), identity, 2, 80, 1)
    planted = tmp_path / "planted"
    planted.write_bytes(bytes(identity[2]))
    info = os.stat(planted)
    with pytest.raises(ValueError, match="is refused: it does not start with the magic"):
        _open_peer_file(str(planted), (info.st_dev, info.st_ino, info.st_size), 2, 80, 1)
    mapped = _open_peer_file(path, identity, 2, 80, 1)
    assert bytes(mapped.mapping) == content.numpy().tobytes()
    shared.release()
    assert sorted(os.listdir(tmp_path)) == ["link", "planted"]   # the shard's name and lock went
    assert bytes(mapped.mapping) == content.numpy().tobytes()   # a mapping keeps its bytes


def _info(host="node-a", device="GPU-0", visible=("GPU-0", "GPU-1"), access=(True, True)) -> RankInfo:
    return RankInfo(host, device, tuple(visible), tuple(access))


def test_setup_checks_name_what_is_missing():
    check_node_local([_info(), _info(device="GPU-1")])
    with pytest.raises(ValueError, match=r"spans 2 hosts \(ranks 0, 2 on host 'node-a'; ranks 1 on host 'node-b'\)"):
        check_node_local([_info(), _info(host="node-b"), _info()])
    check_peer_access([_info(), _info(device="GPU-1")])
    with pytest.raises(ValueError, match="same GPUs in the same order; rank 1 sees 1 \\(GPU-1\\), rank 0 sees 2"):
        check_peer_access([_info(), _info(device="GPU-1", visible=("GPU-1",), access=(True,))])
    with pytest.raises(ValueError, match=r"device: ranks 0 and 1 of the group use the same GPU \(GPU-0\)"):
        check_peer_access([_info(), _info()])
    with pytest.raises(ValueError, match=r"these pairs lack: rank 1 \(GPU-1\) -> rank 0 \(GPU-0\)\. Use lookup='exchange'"):
        check_peer_access([_info(), _info(device="GPU-1", access=(False, True))])
