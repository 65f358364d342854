"""The Engram module: single process against the float64 reference, and tensor /
sequence parallel runs (gloo, 4 CPU processes) bit for bit equal to one process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_group import end_group
import engram
from engram.layer import (Engram, WkvProjection, reference_engram, sequence_parallel_sizes,
                          tensor_parallel_columns)

BUCKET = 17   # rows per hash column in the stand-in tables
EPS = 1e-6
WORLD = 4


class ShardTable:
    """Stand-in for EngramTable: holds only the rows of columns [column_start, column_end)
    (column c owns global rows [c * BUCKET, (c + 1) * BUCKET))."""

    def __init__(self, rows: torch.Tensor, column_start: int, column_end: int):
        self.column_start, self.column_end = column_start, column_end
        self.rows = rows[column_start * BUCKET: column_end * BUCKET].clone()
        self.calls: list[int] = []
        self.prefetched: list[tuple] = []   # geometry of each prefetch's ids
        self.served: list[bool] = []        # per lookup given a handle: whether its ids are the prefetch's

    @staticmethod
    def _geometry(ids: torch.Tensor) -> tuple:
        return ids.data_ptr(), tuple(ids.shape), tuple(ids.stride())

    def prefetch(self, hash_ids: torch.Tensor) -> tuple:
        self.prefetched.append(self._geometry(hash_ids))
        return self.prefetched[-1]

    def lookup(self, hash_ids: torch.Tensor, prefetch=None) -> torch.Tensor:
        if prefetch is not None:
            self.served.append(prefetch == self._geometry(hash_ids))
        self.calls.append(hash_ids.shape[0])
        local = hash_ids[:, self.column_start:self.column_end].long() - self.column_start * BUCKET
        assert bool(((local >= 0) & (local < self.rows.shape[0])).all()), "hash id outside this shard"
        return self.rows[local]


@dataclass(frozen=True)
class Case:
    tokens: int
    columns: int
    hc_mult: int
    hidden: int
    head_dim: int
    fp8: bool
    seed: int


CASES = {
    "c10": Case(tokens=13, columns=10, hc_mult=2, hidden=64, head_dim=32, fp8=False, seed=1),
    "c10_t2": Case(tokens=2, columns=10, hc_mult=2, hidden=64, head_dim=32, fp8=False, seed=2),
    "c10_t0": Case(tokens=0, columns=10, hc_mult=2, hidden=64, head_dim=32, fp8=False, seed=3),
    "c9_fp8": Case(tokens=11, columns=9, hc_mult=4, hidden=64, head_dim=64, fp8=True, seed=4),
}

# name -> (case, tp group, sp group, sp_token_counts, expected mode); groups:
# "own" = {r}, "pair" = {0,1} / {2,3}, "col" = {0,2} / {1,3}, "world" = {0,1,2,3}.
SCENARIOS = {
    "tp1": ("c10", "own", None, None, "single"),
    "tp2": ("c10", "pair", None, None, "tensor"),
    "tp4_uneven": ("c10", "world", None, None, "tensor"),          # columns 3, 3, 3, 1
    "sp4": ("c10", None, "world", None, "sequence"),                # tokens 4, 4, 4, 1
    "sp4_counts": ("c10", None, "world", [5, 0, 3, 5], "sequence"),
    "sp2": ("c10", None, "col", None, "sequence"),
    "sp4_tp4": ("c10", "world", "world", None, "sequence+tensor"),
    "sp4_tp4_counts": ("c10", "world", "world", [5, 0, 3, 5], "sequence+tensor"),
    "sp2_tp2": ("c10", "pair", "pair", None, "sequence+tensor"),
    "mesh_tp2_sp2": ("c10", "pair", "col", None, "sequence x tensor"),
    "t2_sp4": ("c10_t2", None, "world", None, "sequence"),          # tokens 1, 1, 0, 0
    "t2_sp4_tp4": ("c10_t2", "world", "world", None, "sequence+tensor"),
    "t2_mesh": ("c10_t2", "pair", "col", [0, 2], "sequence x tensor"),
    "t0_tp4": ("c10_t0", "world", None, None, "tensor"),
    "t0_sp4_tp4": ("c10_t0", "world", "world", None, "sequence+tensor"),
    "t0_mesh": ("c10_t0", "pair", "col", None, "sequence x tensor"),
    "fp8_tp2_uneven": ("c9_fp8", "pair", None, None, "tensor"),     # columns 5, 4
    "fp8_sp2_tp2": ("c9_fp8", "pair", "pair", None, "sequence+tensor"),
    "fp8_mesh": ("c9_fp8", "pair", "col", [7, 4], "sequence x tensor"),
    "fp8_tp1": ("c9_fp8", "own", None, None, "single"),
}


def make_inputs(case: Case) -> dict:
    """Deterministic inputs of a case (the same in every process)."""
    generator = torch.Generator().manual_seed(case.seed)
    kv_dim, in_features = (case.hc_mult + 1) * case.hidden, case.columns * case.head_dim
    rows = torch.randn(case.columns * BUCKET, case.head_dim, generator=generator).to(torch.bfloat16)
    column_base = torch.arange(case.columns, dtype=torch.int32) * BUCKET
    hash_ids = torch.randint(0, BUCKET, (case.tokens, case.columns), generator=generator, dtype=torch.int32) + column_base
    if case.fp8:
        weight = (torch.randn(kv_dim, in_features, generator=generator) * 16).to(torch.float8_e4m3fn)
        block = (128, 128)
        scale_shape = (-(-kv_dim // block[0]), -(-in_features // block[1]))
        scale = torch.randint(118, 121, scale_shape, generator=generator, dtype=torch.int32).to(torch.uint8)
        scale = scale.view(torch.float8_e8m0fnu)
    else:
        weight = (torch.randn(kv_dim, in_features, generator=generator) / in_features ** 0.5).to(torch.bfloat16)
        scale, block = None, None
    return {
        "rows": rows,
        "hash_ids": hash_ids,
        "hidden_states": torch.randn(case.tokens, case.hc_mult, case.hidden, generator=generator).to(torch.bfloat16),
        "token_mask": torch.rand(case.tokens, generator=generator) < 0.8,
        "wkv_weight": weight,
        "wkv_scale": scale,
        "block_size": block,
        "q_weight": torch.randn(case.hc_mult, case.hidden, generator=generator).to(torch.bfloat16),
        "k_weight": torch.randn(case.hc_mult, case.hidden, generator=generator).to(torch.bfloat16),
    }


def build(case: Case, inputs: dict, *, tp_group=None, sequence_parallel=False, sp_group=None) -> Engram:
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    start, end = tensor_parallel_columns(case.columns, tp_rank, tp_size)
    wkv = WkvProjection(inputs["wkv_weight"], inputs["wkv_scale"], inputs["block_size"])
    return Engram(ShardTable(inputs["rows"], start, end), wkv, inputs["q_weight"], inputs["k_weight"], eps=EPS,
                  num_columns=case.columns, tp_group=tp_group, sequence_parallel=sequence_parallel, sp_group=sp_group)


# ---------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("case_name", ["c10", "c9_fp8"])
def test_single_process_matches_float64_reference(case_name):
    case = CASES[case_name]
    inputs = make_inputs(case)
    layer = build(case, inputs)
    assert layer.mode == "single" and layer.table.calls == []
    out = layer(inputs["hidden_states"], inputs["hash_ids"], inputs["token_mask"])
    assert out.dtype == torch.bfloat16 and out.shape == inputs["hidden_states"].shape
    assert layer.table.calls == [case.tokens]

    gathered = inputs["rows"][inputs["hash_ids"].long()]            # [T, C, head_dim]
    reference = reference_engram(inputs["hidden_states"], gathered, inputs["wkv_weight"], inputs["q_weight"],
                                 inputs["k_weight"], EPS, inputs["token_mask"], inputs["wkv_scale"],
                                 inputs["block_size"])
    hidden = inputs["hidden_states"].double()
    assert bool(((out.double() - reference).abs() <= 2 ** -7 * reference.abs() + 2e-2).all())
    update, reference_update = out.double() - hidden, reference - hidden
    assert (update - reference_update).norm() / reference_update.norm() < 1e-2
    mask = inputs["token_mask"]
    assert torch.equal(out[~mask].view(torch.int16), inputs["hidden_states"][~mask].view(torch.int16))


def test_from_weights_uses_spec_geometry():
    config = {
        "engram_layer_ids": [1], "engram_num_embeddings": [9 * BUCKET], "engram_max_ngram_size": 4,
        "engram_n_heads": 3, "engram_head_dim": 64, "engram_vocab_size": 1009,
        "engram_compressed_vocab_size": 40, "engram_pad_token_id": 2, "hidden_size": 64, "hc_mult": 4,
        "rms_norm_eps": EPS, "quantization_config": {"weight_block_size": [128, 128]},
    }
    spec = engram.EngramSpec.from_hf_config(config, check_rows=False)
    case = CASES["c9_fp8"]
    inputs = make_inputs(case)
    layer = Engram.from_weights(spec, ShardTable(inputs["rows"], 0, 9), wkv_weight=inputs["wkv_weight"],
                                wkv_scale=inputs["wkv_scale"], q_weight=inputs["q_weight"],
                                k_weight=inputs["k_weight"])
    expected = build(case, inputs)(inputs["hidden_states"], inputs["hash_ids"], inputs["token_mask"])
    out = layer(inputs["hidden_states"], inputs["hash_ids"], inputs["token_mask"])
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(ValueError, match=r"wkv_weight: expected shape \[320, 576\]"):
        Engram.from_weights(spec, ShardTable(inputs["rows"], 0, 9), wkv_weight=inputs["wkv_weight"][:10],
                            wkv_scale=inputs["wkv_scale"], q_weight=inputs["q_weight"], k_weight=inputs["k_weight"])


def test_column_and_token_splits():
    assert [tensor_parallel_columns(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [tensor_parallel_columns(9, r, 2) for r in range(2)] == [(0, 5), (5, 9)]
    with pytest.raises(ValueError, match="tp_group: rank 3 of 4 gets no hash column"):
        tensor_parallel_columns(9, 3, 4)         # 3, 3, 3, 0
    with pytest.raises(ValueError, match="tp_group: rank 3 of 4 gets no hash column"):
        tensor_parallel_columns(6, 3, 4)         # 2, 2, 2, 0
    assert sequence_parallel_sizes(13, 4) == [4, 4, 4, 1]
    assert sequence_parallel_sizes(2, 4) == [1, 1, 0, 0]
    assert sequence_parallel_sizes(0, 3) == [0, 0, 0]
    assert sequence_parallel_sizes(12, 4) == [3, 3, 3, 3]


def test_errors_name_the_argument():
    case = CASES["c10"]
    inputs = make_inputs(case)
    layer = build(case, inputs)
    hidden, hash_ids, mask = inputs["hidden_states"], inputs["hash_ids"], inputs["token_mask"]
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[13, 2, 64\].*found \[12, 2, 64\]"):
        layer(hidden[:12], hash_ids)
    with pytest.raises(ValueError, match="hidden_states: expected dtype"):
        layer(hidden.to(torch.float64), hash_ids)
    with pytest.raises(ValueError, match=r"hash_ids: expected shape \[T, 10\], found \[13, 9\]"):
        layer(hidden, hash_ids[:, :9])
    with pytest.raises(ValueError, match="hash_ids: expected dtype torch.int32 or torch.int64, found torch.float32"):
        layer(hidden, hash_ids.float())
    with pytest.raises(ValueError, match=r"token_mask: expected shape \[13\] \(T from hash_ids\), found \[5\]$"):
        layer(hidden, hash_ids, mask[:5])
    with pytest.raises(ValueError, match="token_mask: expected a torch.bool"):
        layer(hidden, hash_ids, mask.to(torch.uint8))
    with pytest.raises(ValueError, match="sp_token_counts: expected None"):
        layer(hidden, hash_ids, sp_token_counts=[13])
    wkv = WkvProjection(inputs["wkv_weight"])
    table = ShardTable(inputs["rows"], 0, 10)
    with pytest.raises(ValueError, match=r"table: expected hash columns \[0, 10\).*found \[0, 5\)"):
        Engram(ShardTable(inputs["rows"], 0, 5), wkv, inputs["q_weight"], inputs["k_weight"], eps=EPS, num_columns=10)
    with pytest.raises(ValueError, match="q_weight: expected a bfloat16 tensor"):
        Engram(table, wkv, inputs["q_weight"].float(), inputs["k_weight"], eps=EPS, num_columns=10)
    with pytest.raises(ValueError, match=r"wkv: expected \(hc \+ 1\) \* D = 96"):
        Engram(table, wkv, inputs["q_weight"][:, :32], inputs["k_weight"][:, :32], eps=EPS, num_columns=10)
    with pytest.raises(ValueError, match="num_columns: expected a divisor"):
        Engram(table, wkv, inputs["q_weight"], inputs["k_weight"], eps=EPS, num_columns=7)
    with pytest.raises(ValueError, match="eps: expected a positive number"):
        Engram(table, wkv, inputs["q_weight"], inputs["k_weight"], eps=0.0, num_columns=10)
    with pytest.raises(ValueError, match="sp_group: expected the sequence-parallel ProcessGroup"):
        Engram(table, wkv, inputs["q_weight"], inputs["k_weight"], eps=EPS, num_columns=10, sequence_parallel=True)

    class BadTable(ShardTable):
        def lookup(self, hash_ids):
            return super().lookup(hash_ids).float()

    bad = Engram(BadTable(inputs["rows"], 0, 10), wkv, inputs["q_weight"], inputs["k_weight"], eps=EPS, num_columns=10)
    with pytest.raises(ValueError, match="table.lookup: expected a bfloat16 tensor"):
        bad(hidden, hash_ids)


# ---------------------------------------------------------------------------
# tensor / sequence parallel over gloo
# ---------------------------------------------------------------------------
def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # Every rank creates every group, in the same order.
        own = [dist.new_group([r]) for r in range(world_size)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = {"own": own[rank], "pair": pairs[rank // 2], "col": cols[rank % 2], "world": dist.group.WORLD}

        results: dict = {}
        for case_name, case in CASES.items():
            inputs = make_inputs(case)
            single = build(case, inputs)(inputs["hidden_states"], inputs["hash_ids"], inputs["token_mask"])
            results[case_name] = single
        for index, (name, (case_name, tp_key, sp_key, counts, _mode)) in enumerate(SCENARIOS.items()):
            case = CASES[case_name]
            inputs = make_inputs(case)
            tp_group = groups[tp_key] if tp_key else None
            sp_group = groups[sp_key] if sp_key else None
            layer = build(case, inputs, tp_group=tp_group, sequence_parallel=sp_group is not None, sp_group=sp_group)
            sizes = [case.tokens] if sp_group is None else (
                counts if counts is not None else sequence_parallel_sizes(case.tokens, dist.get_world_size(sp_group)))
            sp_rank = 0 if sp_group is None else dist.get_rank(sp_group)
            start, count = sum(sizes[:sp_rank]), sizes[sp_rank]
            mask = inputs["token_mask"]
            if index % 2:  # half the scenarios pass this rank's slice of the mask, half the whole mask
                mask = mask[start:start + count]
            handle = layer.prefetch(inputs["hash_ids"], sp_token_counts=counts)
            out = layer(inputs["hidden_states"][start:start + count], inputs["hash_ids"], mask,
                        sp_token_counts=counts, prefetch=handle)
            results[name] = {"out": out, "start": start, "count": count, "mode": layer.mode,
                             "lookup_tokens": sum(layer.table.calls), "prefetched": layer.table.prefetched,
                             "served": layer.table.served, "lookups": len(layer.table.calls)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engram_parallel")
    mp.spawn(_worker, args=(WORLD, str(directory / "init"), str(directory)), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD)]


def test_single_process_results_agree_across_processes(parallel_results):
    for case_name in CASES:
        first = parallel_results[0][case_name]
        for results in parallel_results[1:]:
            assert torch.equal(results[case_name].view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_parallel_equals_single_process_bit_for_bit(parallel_results, scenario):
    case_name, tp_key, sp_key, _counts, mode = SCENARIOS[scenario]
    case = CASES[case_name]
    covered = set()
    for rank, results in enumerate(parallel_results):
        result = results[scenario]
        assert result["mode"] == mode
        single = results[case_name]
        start, count = result["start"], result["count"]
        out = result["out"]
        assert out.shape == (count, case.hc_mult, case.hidden) and out.dtype == torch.bfloat16
        assert torch.equal(out.view(torch.int16), single[start:start + count].view(torch.int16)), \
            f"rank {rank}: tokens [{start}, {start + count}) differ from the single-process result"
        covered.update(range(start, start + count))
        # The rank's prefetch read exactly the ids its lookup read (one prefetch, one lookup, or neither).
        assert len(result["prefetched"]) == result["lookups"] <= 1, f"rank {rank}"
        assert result["served"] == [True] * result["lookups"], f"rank {rank}: prefetch and lookup ids differ"
        # Lookups touch only the rank's own tokens where the table allows it.
        if mode in ("sequence", "sequence x tensor"):
            assert result["lookup_tokens"] == count
        elif case.tokens:
            assert result["lookup_tokens"] == case.tokens
    assert covered == set(range(case.tokens))
