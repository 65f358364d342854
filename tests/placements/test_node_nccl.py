"""Placement ``"node"`` over NCCL, one process per GPU (1, 2, 4 and 8 GPUs): ``lookup="peer"`` (every rank
maps the others' shards by CUDA IPC and reads them over NVLink) and ``lookup="exchange"`` (all-gather +
all-to-all) against a ``"device"`` table of the whole rows on each rank, bit for bit.

Each rank looks up its own ids (uneven counts, a step where rank 0 has none, the edges of every rank's
rows, ids outside a row-sharded table): ``lookup`` and ``lookup_packed`` of both lookups; the peer
lookup also captured in a CUDA graph and replayed on refilled ids, and prepared (``prepare_lookup``);
then ``close()`` in order while a lookup still runs on a side stream (its rows must be exact), and a
refused lookup and prepared lookup after it. The GPU tests skip without enough GPUs
(``tests/placements/test_node_peer.py`` runs the same logic over gloo on the CPU). ``NCCL_NVLS_ENABLE=0`` is set
before the ranks start. The seed is in every failure message (``ENGRAM_TEST_SEED`` replays it).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.parallel import NCCL_ENVIRONMENT, init_rank
from engram.table import EngramTable
from engram.table.placements.node import owned_rows

from conftest import fresh_seed
from test_node_placement import edge_ids, random_fp8, request

SEED = fresh_seed(__name__)
TIMEOUT = datetime.timedelta(seconds=240)
COLUMNS = 4
# name: (rows, row_start, num_rows_total): a whole table whose rows do not divide by 3 or 8, and a shard
TABLES = {"whole": (100_003, 0, None), "shard": (5_001, 700, 9_000)}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, seed: int) -> None:
    device, _ = init_rank(rank, world_size, "nccl", init_file, cpu_threads=1, timeout=TIMEOUT)
    try:
        failures: list[str] = []
        checked = 0
        for table_name, (rows, row_start, total) in TABLES.items():
            values, scales = random_fp8(rows, torch.Generator().manual_seed(seed + rows))  # same on every rank
            kwargs = dict(row_start=row_start, num_rows_total=total)
            reference = EngramTable(values, scales, placement="device", device=device, **kwargs)
            total = rows if total is None else total
            for lookup in ("peer", "exchange"):
                table = EngramTable(values, scales, placement="node", device=device, **kwargs,
                                    placement_options={"group": dist.group.WORLD, "lookup": lookup})
                start, end = table.storage.owned
                if (start, end) != owned_rows(rows, world_size, rank):
                    failures.append(f"{table_name}/{lookup}: owns {start, end}")
                own = torch.Generator().manual_seed(seed + 1000 * rank + rows)
                edges = edge_ids(rows, row_start, total, world_size)
                counts = [(1, 63, 100, 7, 30, 2, 9, 64)[rank % 8], 0 if rank == 0 else 5, 200]
                for step, tokens in enumerate(counts):
                    ids = request(rows, row_start, total, tokens, own, edges if step == 2 else None, COLUMNS).to(device)
                    where = f"{table_name}/{lookup} step {step} (T = {tokens}) rank {rank}, seed {seed}"
                    pairs = [(table.lookup(ids), reference.lookup(ids)),
                             *zip(table.lookup_packed(ids), reference.lookup_packed(ids))]
                    for found, expected in pairs:
                        checked += 1
                        if not _same(found, expected):
                            failures.append(f"{where}: differs from device")
                if lookup == "peer":
                    ids = request(rows, row_start, total, 128, own, edges, COLUMNS).to(device)
                    out = table.lookup(ids)  # compiled before capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = table.lookup(ids)
                    ids.copy_(request(rows, row_start, total, 128, own, None, COLUMNS).to(device))
                    graph.replay()
                    torch.cuda.synchronize()
                    checked += 1
                    if not _same(out, reference.lookup(ids)):
                        failures.append(f"{table_name}/peer graph replay rank {rank}: differs, seed {seed}")
                    prepared = table.prepare_lookup(ids)
                    if prepared is not None:
                        checked += 1
                        if not _same(prepared(ids), reference.lookup(ids)):
                            failures.append(f"{table_name}/peer prepared rank {rank}: differs, seed {seed}")
                    del graph, out
                    # A lookup still running on another stream when close() is called: close() waits for
                    # every stream of the devices holding shards before the IPC handles close.
                    many = request(rows, row_start, total, 8192, own, edges, COLUMNS).to(device)
                    side = torch.cuda.Stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):
                        in_flight = table.lookup(many)
                    table.close()
                    torch.cuda.synchronize()
                    checked += 1
                    if not _same(in_flight, reference.lookup(many)):
                        failures.append(f"{table_name}/peer lookup in flight at close() rank {rank}: differs, seed {seed}")
                    try:
                        table.lookup(ids)
                        failures.append(f"{table_name}/peer: a lookup after close() was served")
                    except RuntimeError:
                        pass
                    if prepared is not None:
                        try:
                            prepared(ids)
                            failures.append(f"{table_name}/peer: a prepared lookup after close() was served")
                        except RuntimeError as error:
                            if "was closed" not in str(error):
                                failures.append(f"{table_name}/peer: prepared lookup refused with {error}")
                del table
            torch.cuda.empty_cache()
        torch.save({"failures": failures, "checked": checked}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _skip_reason(world_size: int) -> str | None:
    if not torch.cuda.is_available():
        return f"needs {world_size} CUDA device(s)"
    if torch.cuda.device_count() < world_size:
        return f"needs {world_size} CUDA devices (one NCCL rank per GPU), found {torch.cuda.device_count()}"
    if not dist.is_nccl_available():
        return "needs torch.distributed with NCCL"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_nccl_node_tables_equal_device_tables(world_size, tmp_path):
    reason = _skip_reason(world_size)
    if reason:
        pytest.skip(reason)
    os.environ.update(NCCL_ENVIRONMENT)  # before spawning: the children inherit it
    mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), SEED), nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    failures = [failure for result in results for failure in result["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert all(result["checked"] >= 2 * 2 * 3 * 3 for result in results)
