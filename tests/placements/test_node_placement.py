"""Placement ``"node"`` with ``lookup="exchange"``: a table spread over a gloo group of 2 and 3
processes serves the same bytes as a ``"cpu"`` table of the whole rows, for every rank's ids
(edges of every rank's rows, a rank with no tokens, uneven token counts, rows that do not divide
by the group's size, a tensor-parallel shard with ids outside its rows, a checkpoint load);
and its argument errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_group import end_group
from engram.checkpoint import SafetensorsCheckpoint, load_engram_table
from engram.layout import EngramLayout
from engram.table import EngramTable
from engram.table.placements.node import NodePlacement, owned_rows
from engram.tools.testing import write_synthetic_checkpoint

HEAD_DIM = 64
COLUMNS = 3
# name: (rows, row_start, num_rows_total): whole tables whose rows divide by 2 and 3 (96) or
# by neither (97), one with fewer rows than ranks, and a shard [10, 10 + 41) of a 70-row layer.
TABLES = {"even": (96, 0, None), "uneven": (97, 0, None), "tiny": (2, 0, None), "shard": (41, 10, 70)}


def random_fp8(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [rows, D]`` E4M3 bytes without NaN patterns and ``[rows, D // 32]`` UE8M0 bytes below 255."""
    values = torch.randint(0, 256, (rows, HEAD_DIM), dtype=torch.uint8, generator=generator)
    values[(values & 0x7F) == 0x7F] = 0x3F
    scales = torch.randint(100, 160, (rows, HEAD_DIM // 32), dtype=torch.uint8, generator=generator)
    return values, scales


def edge_ids(rows: int, row_start: int, total: int, world_size: int) -> torch.Tensor:
    """Global ids of the first and last row each rank owns, and of the layer's rows just outside the table."""
    ids = [row_start - 1] if row_start else []
    ids += [row_start + rows] if row_start + rows < total else []
    for rank in range(world_size):
        start, end = owned_rows(rows, world_size, rank)
        if end > start:
            ids += [row_start + start, row_start + end - 1]
    return torch.tensor(ids, dtype=torch.int64)


def request(rows: int, row_start: int, total: int, tokens: int, generator: torch.Generator,
            edges: torch.Tensor | None, columns: int = COLUMNS) -> torch.Tensor:
    """``int64 [tokens, columns]`` layer row ids in ``[row_start - 5, row_start + rows + 5)`` (within the layer's
    ``[0, total)``), the edges first when given."""
    low, high = max(0, row_start - 5), min(total, row_start + rows + 5)
    ids = torch.randint(low, high, (tokens, columns), dtype=torch.int64, generator=generator)
    if edges is not None:
        flat = ids.reshape(-1)
        flat[:edges.numel()] = edges[:flat.numel()]
    return ids


def tokens_per_step(world_size: int, rank: int) -> list[int]:
    """Token counts of this rank's lookups: uneven over ranks, then none on rank 0 while the others
    have tokens, then every rank the edges (12 tokens hold them all)."""
    return [(1, 63, 100)[rank], 0 if rank == 0 else 7, 12]


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, seed: int, checkpoint_dir: str,
            spec) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results: dict = {}
        pair = dist.new_group([0, 1])  # every rank creates every group, in the same order
        groups = {"world": dist.group.WORLD}
        if world_size > 2:
            groups["pair"] = pair
            try:
                NodePlacement(*random_fp8(4, torch.Generator().manual_seed(seed)), group=pair)
                results["outside"] = None
            except ValueError as error:
                results["outside"] = str(error)
        for group_name, group in groups.items():
            if group is dist.GroupMember.NON_GROUP_MEMBER:
                continue
            group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
            for table_name, (rows, row_start, total) in TABLES.items():
                generator = torch.Generator().manual_seed(seed + rows)  # the same table on every rank
                values, scales = random_fp8(rows, generator)
                kwargs = dict(row_start=row_start, num_rows_total=total)
                node = EngramTable(values, scales, placement="node", placement_options={"group": group}, **kwargs)
                plain = EngramTable(values, scales, placement="cpu", **kwargs)
                start, end = node.storage.owned
                assert node.num_rows == rows and node.storage.value_bytes.shape[0] == end - start
                assert node.rows_in_place(torch.zeros(1, COLUMNS, dtype=torch.int64)) is None
                own = torch.Generator().manual_seed(seed + 1000 * group_rank + rows)  # each rank's own ids
                total = rows if total is None else total
                edges = edge_ids(rows, row_start, total, group_size)
                for step, tokens in enumerate(tokens_per_step(group_size, group_rank)):
                    ids = request(rows, row_start, total, tokens, own, edges if step == 2 else None)
                    node_rows, node_values, node_scales = node.lookup(ids), *node.lookup_packed(ids)
                    results[(group_name, table_name, step)] = {
                        "ids": ids, "owned": (start, end),
                        "node": (node_rows.view(torch.int16), node_values.view(torch.uint8), node_scales),
                        "cpu": (plain.lookup(ids).view(torch.int16), plain.lookup_packed(ids)[0].view(torch.uint8),
                                plain.lookup_packed(ids)[1]),
                    }
        # a checkpoint's layer 0, whole and one tensor-parallel shard, each rank reading only its rows
        checkpoint = SafetensorsCheckpoint(checkpoint_dir)
        layout = EngramLayout(spec)
        for shard_name, shard in (("whole", None), ("shard", layout.shard(1, 2))):  # the same rows on every rank
            node = load_engram_table(checkpoint, layout, 0, shard, placement="node",
                                     placement_options={"group": dist.group.WORLD})
            plain = load_engram_table(checkpoint, layout, 0, shard)
            own = torch.Generator().manual_seed(seed + 7 + rank)
            rows, row_start, total = node.num_rows, node.row_start, layout.num_embeddings[0]
            ids = request(rows, row_start, total, 40 + 9 * rank, own, edge_ids(rows, row_start, total, world_size),
                          layout.num_columns)
            start, end = node.storage.owned
            results[("checkpoint", shard_name)] = {
                "ids": ids, "owned": (start, end),
                "stored": (node.storage.value_bytes, node.storage.scale_bytes),
                "expected_stored": (plain.storage.value_bytes[start:end], plain.storage.scale_bytes[start:end]),
                "node": (node.lookup(ids).view(torch.int16), node.lookup_packed(ids)[0].view(torch.uint8)),
                "cpu": (plain.lookup(ids).view(torch.int16), plain.lookup_packed(ids)[0].view(torch.uint8)),
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("node_checkpoint"), scale="small", tokenizer="word",
                                      num_shards=2, seed=11)


@pytest.mark.parametrize("world_size", [2, 3])
def test_exchange_lookups_equal_cpu_table(world_size, seed, small_checkpoint, tmp_path):
    mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), seed,
                            str(small_checkpoint.directory), small_checkpoint.spec),
             nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    compared = 0
    for rank, mine in enumerate(results):
        if world_size > 2:
            expected = None if rank < 2 else "not a member of the group"
            assert (mine["outside"] is None) == (expected is None)
            if expected is not None:
                assert expected in mine["outside"] and "group:" in mine["outside"]
        for key, got in mine.items():
            if key == "outside":
                continue
            for node_part, cpu_part in zip(got["node"], got["cpu"]):
                assert torch.equal(node_part, cpu_part), (rank, key)
                compared += 1
            if key[0] == "checkpoint":
                for stored, expected_bytes in zip(got["stored"], got["expected_stored"]):
                    assert torch.equal(stored, expected_bytes), rank
    # every rank owns its block; the blocks tile the rows
    for key in results[0]:
        if key == "outside" or (isinstance(key, tuple) and key[0] == "pair"):
            continue
        blocks = sorted(results[rank][key]["owned"] for rank in range(world_size))
        assert blocks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert compared >= world_size * 3 * len(TABLES) * 3
    # rank 0 looked up no token in step 1, and uneven counts in step 0
    assert results[0][("world", "even", 1)]["ids"].shape[0] == 0
    for rank in range(world_size):
        assert results[rank][("world", "even", 0)]["ids"].shape[0] == (1, 63, 100)[rank]


def _init_single(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)


def test_argument_errors(tmp_path, seed):
    values, scales = random_fp8(8, torch.Generator().manual_seed(seed))
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(ValueError, match="group: placement 'node' needs torch.distributed initialized"):
        NodePlacement(values, scales, group=None)
    _init_single(tmp_path)
    try:
        with pytest.raises(ValueError, match=r"group: placement 'node' needs placement_options\['group'\]"):
            EngramTable(values, scales, placement="node")
        with pytest.raises(ValueError, match="group: this process .* is not a member"):
            NodePlacement(values, scales, group=dist.GroupMember.NON_GROUP_MEMBER)
        with pytest.raises(ValueError, match="group: expected a torch.distributed ProcessGroup, found str"):
            NodePlacement(values, scales, group="world")
        with pytest.raises(ValueError, match="lookup: expected 'peer' or 'exchange', found 'all'"):
            NodePlacement(values, scales, group=dist.group.WORLD, lookup="all")
        # one process: the group is this rank alone, and it serves every row
        table = EngramTable(values, scales, placement="node", placement_options={"group": dist.group.WORLD})
        plain = EngramTable(values, scales)
        ids = torch.randint(0, 8, (5, 2), generator=torch.Generator().manual_seed(seed + 1))
        assert torch.equal(table.lookup(ids).view(torch.int16), plain.lookup(ids).view(torch.int16))
        assert table.storage.owned == (0, 8) and table.nbytes == plain.nbytes
    finally:
        end_group()

