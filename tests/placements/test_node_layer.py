"""The Engram layer and EngramMemory over placement ``"node"`` (lookups exchanged by collectives):
over gloo groups of 2, 3 and 4 processes every rank's output equals, bit for bit, the same layer
over a ``"cpu"`` table of the whole rows, with no tokens on some ranks, uneven token counts, a step
where one rank alone has tokens, sequence-parallel shards that are empty, tensor parallelism (the
node group per column shard), plans and prefetch handles. A hung collective fails through the
groups' timeout. Also, in one process: a collective table is looked up with no tokens too, never
prefetched, and refused for kv ahead."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_group import end_group
from engram.layer import Engram, WkvProjection, sequence_parallel_sizes
from engram.memory import EngramMemory, resolve_placement
from engram.table import EngramTable
from engram.tools.testing import write_synthetic_checkpoint
from test_node_placement import HEAD_DIM, random_fp8

TIMEOUT = datetime.timedelta(seconds=30)  # a collective one rank never joins fails the test after this
COLUMNS, BUCKET = 4, 23                   # column c owns the global rows [c * BUCKET, (c + 1) * BUCKET)
HC, HIDDEN, EPS = 2, 64, 1e-6


def fp8_table(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [C * BUCKET, D]`` E4M3 bytes and UE8M0 bytes near 1 (moderate bf16 rows)."""
    values, _ = random_fp8(COLUMNS * BUCKET, generator)
    scales = torch.randint(124, 130, (COLUMNS * BUCKET, HEAD_DIM // 32), dtype=torch.uint8, generator=generator)
    return values, scales


def layer_weights(generator: torch.Generator) -> dict:
    """bf16 ``wkv [(hc + 1) * D, C * hd]``, ``q_weight`` and ``k_weight [hc, D]``."""
    in_features = COLUMNS * HEAD_DIM
    return {"wkv": (torch.randn((HC + 1) * HIDDEN, in_features, generator=generator) / in_features ** 0.5
                    ).to(torch.bfloat16),
            "q": torch.randn(HC, HIDDEN, generator=generator).to(torch.bfloat16),
            "k": torch.randn(HC, HIDDEN, generator=generator).to(torch.bfloat16)}


def step_inputs(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden bf16 [T, hc, D]``, ``hash_ids int64 [T, C]`` in each column's rows, ``token_mask bool [T]``."""
    ids = torch.randint(0, BUCKET, (tokens, COLUMNS), dtype=torch.int64, generator=generator)
    ids += torch.arange(COLUMNS) * BUCKET
    hidden = torch.randn(tokens, HC, HIDDEN, generator=generator).to(torch.bfloat16)
    return hidden, ids, torch.rand(tokens, generator=generator) < 0.8


def make_table(values, scales, placement: str, group=None, columns: tuple[int, int] = (0, COLUMNS)) -> EngramTable:
    """The table of hash columns ``[start, end)`` (their rows only), placement ``"node"`` over ``group`` or ``"cpu"``."""
    start, end = columns
    options = {"group": group} if placement == "node" else None
    return EngramTable(values[start * BUCKET:end * BUCKET], scales[start * BUCKET:end * BUCKET],
                       column_start=start, column_end=end, row_start=start * BUCKET, num_columns_total=COLUMNS,
                       num_rows_total=COLUMNS * BUCKET, placement=placement, placement_options=options)


def layer_pair(weights: dict, values, scales, node_group, **parallel) -> tuple[Engram, Engram]:
    """The same layer over a ``"node"`` table (spread over ``node_group``) and over a ``"cpu"`` table."""
    tp_group = parallel.get("tp_group")
    tp_rank, tp_size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    per_rank = -(-COLUMNS // tp_size)
    columns = (tp_rank * per_rank, min(COLUMNS, (tp_rank + 1) * per_rank))
    wkv = WkvProjection(weights["wkv"])
    return tuple(Engram(make_table(values, scales, placement, node_group, columns), wkv, weights["q"], weights["k"],
                        eps=EPS, num_columns=COLUMNS, **parallel) for placement in ("node", "cpu"))


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def init(rank: int, world_size: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)


def memory_ids(memory: EngramMemory, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """``int32 [T, L, C]`` ids of every layer, each in its column's rows."""
    layout = memory.layout
    offsets = torch.from_numpy(layout.column_offsets).to(torch.int64)   # [L, C]
    primes = torch.from_numpy(layout.column_primes).to(torch.int64)
    draw = torch.rand(tokens, *offsets.shape, generator=generator, dtype=torch.float64)
    return (offsets + (draw * primes).long()).to(torch.int32)


def run_inputs(memory: EngramMemory, generator: torch.Generator, tokens: int = 3) -> tuple:
    """``(hidden bf16 [T, hc, D], hash_ids int32 [T, L, C])`` for one step of ``memory``."""
    hash_ids = memory_ids(memory, tokens, generator)
    hidden = torch.randn(tokens, memory.spec.hc_mult, memory.spec.hidden_size, generator=generator)
    return hidden.to(torch.bfloat16), hash_ids


def run_memories(node: EngramMemory, plain: EngramMemory, tokens: int, generator: torch.Generator,
                 sp_token_counts=None, own: tuple[int, int] | None = None) -> list[tuple]:
    """``(node output, cpu output)`` per layer and path: forward_layer with the step's prefetch handle, and
    (without sequence parallelism) the step's plan. ``own``: this rank's ``(start, count)`` of the tokens."""
    hash_ids = memory_ids(node, tokens, generator)
    start, count = own if own is not None else (0, tokens)
    hidden = torch.randn(count, node.spec.hc_mult, node.spec.hidden_size, generator=generator).to(torch.bfloat16)
    mask = torch.rand(count, generator=generator) < 0.8
    pairs = []
    handle = node.prefetch(hash_ids, sp_token_counts=sp_token_counts)
    assert not any(handle.started.values())
    for layer_id in node.layer_ids:
        got = node.forward_layer(layer_id, hidden, hash_ids, mask, sp_token_counts=sp_token_counts, prefetch=handle)
        pairs.append((got, plain.forward_layer(layer_id, hidden, hash_ids, mask, sp_token_counts=sp_token_counts)))
    if sp_token_counts is None and node.layer(node.layer_ids[0]).mode == "single":
        plan = node.plan(hidden, hash_ids, mask)
        handle = node.prefetch(hash_ids)
        for layer_id in node.layer_ids:
            pairs.append((plan.run(layer_id, hidden, hash_ids, mask, prefetch=handle),
                          plain.forward_layer(layer_id, hidden, hash_ids, mask)))
    return pairs


# ---------------------------------------------------------------------------
# 2 and 3 processes: one node group, no tensor parallelism
# ---------------------------------------------------------------------------
def tokens_per_step(world_size: int, rank: int) -> list[int]:
    """Uneven counts; none on rank 0; only the last rank; none anywhere."""
    return [(1, 6, 9)[rank], (0, 4, 2)[rank], 5 if rank == world_size - 1 else 0, 0]


def sp_steps(world_size: int) -> list[tuple[int, list[int] | None]]:
    """``(T, sp_token_counts)``: the ceil split of 1 token (empty shards), given counts with an empty shard,
    an even split."""
    return [(1, None), (7, [0, 7] if world_size == 2 else [4, 0, 3]), (6, None)]


def _group_worker(rank: int, world_size: int, init_file: str, out_dir: str, seed: int, checkpoint_dir: str) -> None:
    init(rank, world_size, init_file)
    try:
        results: dict = {}
        world = dist.group.WORLD
        shared = torch.Generator().manual_seed(seed)                   # the same tables and weights everywhere
        values, scales = fp8_table(shared)
        weights = layer_weights(shared)
        own = torch.Generator().manual_seed(seed + 1 + rank)           # each rank's own tokens
        node, plain = layer_pair(weights, values, scales, world)
        assert node.collective and not plain.collective
        for step, tokens in enumerate(tokens_per_step(world_size, rank)):
            hidden, ids, mask = step_inputs(tokens, own)
            handle = node.prefetch(ids)
            assert handle is None
            expected = plain(hidden, ids, mask)
            results[("eager", step)] = (node(hidden, ids, mask, prefetch=handle), expected, tokens)
            results[("plan", step)] = (node.plan(hidden, ids, mask).run(hidden, ids, mask), expected, tokens)
        with pytest.raises(ValueError, match="kv_ahead: the table .* serves lookups as collectives"):
            node.kv_ahead(ids)

        # other rows: a lookup paired with another table's on a peer (a skipped one) reads wrong rows
        values, scales = fp8_table(torch.Generator().manual_seed(seed + 1000))
        node, plain = layer_pair(weights, values, scales, world, sequence_parallel=True, sp_group=world)
        for step, (tokens, counts) in enumerate(sp_steps(world_size)):
            hidden, ids, mask = step_inputs(tokens, shared)            # all tokens, the same on every rank
            sizes = counts if counts is not None else sequence_parallel_sizes(tokens, world_size)
            start, count = sum(sizes[:rank]), sizes[rank]
            mine = hidden[start:start + count]
            assert node.prefetch(ids, sp_token_counts=counts) is None
            results[("sequence", step)] = (node(mine, ids, mask, sp_token_counts=counts),
                                           plain(mine, ids, mask, sp_token_counts=counts), count)

        # EngramMemory: the checkpoint's tables spread over the group, against placement "cpu"
        memories = [EngramMemory.from_pretrained(checkpoint_dir, placement=placement, device="cpu", progress=False,
                                                 placement_options={"group": world} if placement == "node" else None)
                    for placement in ("node", "cpu")]
        assert memories[0].placement == "node" and memories[0].table(memories[0].layer_ids[0]).collective
        with pytest.raises(ValueError, match="kv_ahead: placement 'node' serves lookups as collectives"):
            memories[0].prefetch(memory_ids(memories[0], 2, own), kv_ahead=True)
        for step, tokens in enumerate(tokens_per_step(world_size, rank)):
            for index, pair in enumerate(run_memories(*memories, tokens, own)):
                results[("memory", step, index)] = (*pair, tokens)
        memories = [EngramMemory.from_pretrained(checkpoint_dir, placement=placement, device="cpu", progress=False,
                                                 sequence_parallel=True, sp_group=world,
                                                 placement_options={"group": world} if placement == "node" else None)
                    for placement in ("node", "cpu")]
        for step, (tokens, counts) in enumerate(sp_steps(world_size)):
            sizes = counts if counts is not None else sequence_parallel_sizes(tokens, world_size)
            own_range = (sum(sizes[:rank]), sizes[rank])
            same = torch.Generator().manual_seed(seed + 99 + step)     # all tokens: the same ids on every rank
            for index, pair in enumerate(run_memories(*memories, tokens, same, counts, own_range)):
                results[("memory sequence", step, index)] = (*pair, own_range[1])
        # lookup "peer": no collective in a lookup; EngramMemory.close() releases every layer's mappings
        peer_options = {"group": world, "lookup": "peer"}
        memories = [EngramMemory.from_pretrained(checkpoint_dir, placement=placement, device="cpu", progress=False,
                                                 placement_options=peer_options if placement == "node" else None)
                    for placement in ("node", "cpu")]
        assert not memories[0].table(memories[0].layer_ids[0]).collective
        for step, tokens in enumerate(tokens_per_step(world_size, rank)):
            for index, pair in enumerate(run_memories(*memories, tokens, own)):
                results[("memory peer", step, index)] = (*pair, tokens)
        memories[0].close()
        with pytest.raises(RuntimeError, match="closed"):
            memories[0].forward_layer(memories[0].layer_ids[0], *run_inputs(memories[0], own))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("node_layer_checkpoint"), scale="tiny",
                                      tokenizer="word", seed=5)


def check_results(results: list[dict], expected_keys: set) -> None:
    """Every rank's node output equals its cpu output bit for bit, for every key the run was meant to have."""
    for rank, mine in enumerate(results):
        assert set(mine) == expected_keys, rank
        for key, (got, expected, tokens) in mine.items():
            assert got.shape[0] == tokens and got.dtype == torch.bfloat16, (rank, key)
            assert torch.equal(as_bits(got), as_bits(expected)), f"rank {rank}, {key}: node output differs"


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_over_a_node_table_equals_a_cpu_table(world_size, seed, tiny_checkpoint, tmp_path):
    mp.spawn(_group_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), seed,
                                  str(tiny_checkpoint.directory)), nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    layers = len(tiny_checkpoint.spec.layer_ids)
    steps, sp = range(len(tokens_per_step(world_size, 0))), range(len(sp_steps(world_size)))
    keys = ({(path, step) for path in ("eager", "plan") for step in steps} | {("sequence", step) for step in sp}
            | {("memory", step, index) for step in steps for index in range(2 * layers)}
            | {("memory sequence", step, index) for step in sp for index in range(layers)}
            | {("memory peer", step, index) for step in steps for index in range(2 * layers)})
    check_results(results, keys)
    # the cases happened: no tokens on rank 0 while others had some, one rank alone, empty shards
    counts = [[results[rank][("eager", step)][2] for rank in range(world_size)] for step in steps]
    assert counts[1][0] == 0 and sum(counts[1]) > 0 and sum(n > 0 for n in counts[2]) == 1
    assert len({n for n in counts[0]}) == world_size
    shards = [results[rank][("sequence", 1)][2] for rank in range(world_size)]
    assert 0 in shards and sum(shards) == 7


# ---------------------------------------------------------------------------
# 4 processes: tensor parallel pairs {0, 1} and {2, 3}; each column shard spread over {0, 2} or {1, 3}
# ---------------------------------------------------------------------------
# name -> (sp over "pair" (one group), "col" (the mesh) or None, steps of (replica 0's T, replica 1's T,
# sp_token_counts or None)); with "col" the four ranks hold the same ids and replica 1 is sp rank 1.
MESH_SCENARIOS = {
    "tensor": (None, [(0, 5, None), (3, 0, None), (2, 7, None), (0, 0, None)]),
    "sequence+tensor": ("pair", [(0, 5, None), (3, 5, None), (5, 5, [0, 5]), (0, 0, None)]),
    "sequence x tensor": ("col", [(5, 5, [0, 5]), (6, 6, [6, 0]), (1, 1, None), (0, 0, None)]),
}


def _mesh_worker(rank: int, world_size: int, init_file: str, out_dir: str, seed: int, checkpoint_dir: str) -> None:
    init(rank, world_size, init_file)
    try:
        pairs = [dist.new_group([0, 1], timeout=TIMEOUT), dist.new_group([2, 3], timeout=TIMEOUT)]
        cols = [dist.new_group([0, 2], timeout=TIMEOUT), dist.new_group([1, 3], timeout=TIMEOUT)]
        pair, col, replica = pairs[rank // 2], cols[rank % 2], rank // 2
        groups = {"pair": pair, "col": col}
        results: dict = {}
        shared = torch.Generator().manual_seed(seed)
        weights = layer_weights(shared)
        for index, (name, (sp_key, steps)) in enumerate(MESH_SCENARIOS.items()):
            # each scenario its own rows: a lookup paired with another scenario's on a peer reads wrong rows
            values, scales = fp8_table(torch.Generator().manual_seed(seed + 1000 * (index + 1)))
            parallel = {"tp_group": pair}
            if sp_key is not None:
                parallel.update(sequence_parallel=True, sp_group=groups[sp_key])
            node, plain = layer_pair(weights, values, scales, col, **parallel)
            assert node.mode == name and node.collective
            for step, (*tokens_of, counts) in enumerate(steps):
                # the ids of this rank's tensor-parallel pair (with "col" the two pairs' are the same)
                ids_seed = seed + 1 + 100 * step + (0 if sp_key == "col" else 10 * (1 + replica))
                hidden, ids, mask = step_inputs(tokens_of[replica], torch.Generator().manual_seed(ids_seed))
                sp_rank = dist.get_rank(groups[sp_key]) if sp_key else 0
                sizes = [ids.shape[0]] if sp_key is None else counts or sequence_parallel_sizes(ids.shape[0], 2)
                start, count = sum(sizes[:sp_rank]), sizes[sp_rank]
                mine = hidden[start:start + count]
                assert node.prefetch(ids, sp_token_counts=counts if sp_key else None) is None
                kwargs = {"sp_token_counts": counts} if sp_key else {}
                results[(name, step)] = (node(mine, ids, mask, **kwargs), plain(mine, ids, mask, **kwargs), count)
        # EngramMemory: this pair's column shards, each spread over its column group
        memories = [EngramMemory.from_pretrained(checkpoint_dir, placement=placement, device="cpu", progress=False,
                                                 tp_group=pair,
                                                 placement_options={"group": col} if placement == "node" else None)
                    for placement in ("node", "cpu")]
        for step, (*tokens_of, _counts) in enumerate(MESH_SCENARIOS["tensor"][1]):
            generator = torch.Generator().manual_seed(seed + 7 + 100 * step + replica)
            for index, pair_out in enumerate(run_memories(*memories, tokens_of[replica], generator)):
                results[("memory", step, index)] = (*pair_out, tokens_of[replica])
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


def test_tensor_parallel_layers_over_node_tables_per_column_shard(seed, tiny_checkpoint, tmp_path):
    world_size = 4
    mp.spawn(_mesh_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), seed,
                                 str(tiny_checkpoint.directory)), nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    layers = len(tiny_checkpoint.spec.layer_ids)
    keys = {(name, step) for name, (_, steps) in MESH_SCENARIOS.items() for step in range(len(steps))}
    keys |= {("memory", step, index) for step in range(len(MESH_SCENARIOS["tensor"][1])) for index in range(layers)}
    check_results(results, keys)
    # a column group's two ranks looked up different numbers of tokens, one of them none
    for name in MESH_SCENARIOS:
        assert results[0][(name, 0)][2] == 0 and results[2][(name, 0)][2] > 0


# ---------------------------------------------------------------------------
# one process: which lookups the layer makes of a collective table
# ---------------------------------------------------------------------------
class RecordingTable:
    """A whole-columns table that records the token count of each lookup; ``collective`` as given."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, collective: bool):
        self.plain = EngramTable(values, scales, num_columns_total=COLUMNS)
        self.collective, self.column_start, self.column_end = collective, 0, COLUMNS
        self.calls: list[tuple[str, int]] = []

    def prefetch(self, hash_ids):
        self.calls.append(("prefetch", hash_ids.shape[0]))
        return None

    def lookup(self, hash_ids, prefetch=None):
        self.calls.append(("lookup", hash_ids.shape[0]))
        return self.plain.lookup(hash_ids)

    def lookup_packed(self, hash_ids, prefetch=None):
        self.calls.append(("lookup_packed", hash_ids.shape[0]))
        return self.plain.lookup_packed(hash_ids)


@pytest.mark.parametrize("collective", [True, False])
def test_a_collective_table_is_looked_up_with_no_tokens_and_never_prefetched(collective, seed):
    generator = torch.Generator().manual_seed(seed)
    values, scales = fp8_table(generator)
    weights = layer_weights(generator)
    table = RecordingTable(values, scales, collective)
    layer = Engram(table, WkvProjection(weights["wkv"]), weights["q"], weights["k"], eps=EPS, num_columns=COLUMNS)
    reference = Engram(table.plain, WkvProjection(weights["wkv"]), weights["q"], weights["k"], eps=EPS,
                       num_columns=COLUMNS)
    assert layer.collective is collective
    for tokens in (3, 0):
        hidden, ids, mask = step_inputs(tokens, generator)
        handle = layer.prefetch(ids)
        out = layer(hidden, ids, mask, prefetch=handle)
        assert torch.equal(as_bits(out), as_bits(reference(hidden, ids, mask)))
        layer.plan(hidden, ids, mask).run(hidden, ids, mask)
        packed = layer.gather_packed_rows(ids, [tokens], [0], torch.device("cpu"))
        assert packed.shape == (tokens, COLUMNS, HEAD_DIM + HEAD_DIM // 32)
        looked_up = 1 if tokens or collective else 0
        expected = ([] if collective or not tokens else [("prefetch", tokens)]) + [("lookup", tokens)] * (2 * looked_up)
        expected += [("lookup_packed", tokens)] * looked_up
        assert table.calls == expected, (tokens, table.calls)
        table.calls.clear()
    if collective:
        with pytest.raises(ValueError, match="kv_ahead: the table .* serves lookups as collectives"):
            layer.kv_ahead(ids)
    else:
        layer.kv_ahead(ids)


def test_resolve_placement_runs_node_tables_on_the_cpu():
    assert resolve_placement("node", "cpu") == ("node", torch.device("cpu"))
    if not torch.cuda.is_available():
        assert resolve_placement("node") == ("node", torch.device("cpu"))


# ---------------------------------------------------------------------------
# a rank that refuses its arguments: the others raise too, nobody waits
# ---------------------------------------------------------------------------
def _refusing_worker(rank: int, world_size: int, init_file: str, out_dir: str, seed: int) -> None:
    init(rank, world_size, init_file)
    try:
        generator = torch.Generator().manual_seed(seed)  # the same table and weights on every rank
        values, scales = fp8_table(generator)
        weights = layer_weights(generator)
        node, plain = layer_pair(weights, values, scales, dist.group.WORLD)
        own = torch.Generator().manual_seed(seed + 1 + rank)
        messages = {}
        hidden, ids, mask = step_inputs(5, own)
        bad_ids = ids.clone()
        bad_ids[1, 2] = COLUMNS * BUCKET + 7  # outside the layer's rows: validation refuses it
        bad_hidden = hidden[:, :1]            # [T, 1, D]: the layer refuses the shape
        for case, (table_ids, layer_hidden) in {"table": (bad_ids, hidden), "layer": (ids, bad_hidden)}.items():
            try:
                if case == "table":
                    node.table.lookup(table_ids if rank == world_size - 1 else ids)
                else:
                    node(layer_hidden if rank == world_size - 1 else hidden, ids, mask)
                messages[case] = None
            except ValueError as error:
                messages[case] = str(error)
            # the group is still in step: the next lookup and forward serve every rank
            hidden, ids, mask = step_inputs(3 + rank, own)
            messages[f"{case}_after"] = bool(torch.equal(as_bits(node(hidden, ids, mask)),
                                                         as_bits(plain(hidden, ids, mask))))
        torch.save(messages, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_refuses_its_arguments_makes_every_rank_raise(world_size, seed, tmp_path):
    """The last rank's ids are outside the table (the table refuses them) or its hidden states have the
    wrong shape (the layer refuses them): it raises its own error, every other rank raises one naming it,
    within the lookup's first collective instead of the group's timeout; the next step serves all ranks."""
    mp.spawn(_refusing_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path), seed),
             nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    refusing = world_size - 1
    assert "outside the layer's table rows" in results[refusing]["table"]
    assert "hidden_states: expected shape" in results[refusing]["layer"]
    for rank in range(refusing):
        for case in ("table", "layer"):
            assert results[rank][case] is not None and f"rank(s) [{refusing}]" in results[rank][case], (rank, case)
    assert all(result[f"{case}_after"] for result in results for case in ("table", "layer"))
