"""Tensor-parallel Engram benchmark: per rank, the stages of one layer's forward at
V4.1-Flash shapes, one process per GPU over NCCL (or per CPU process over gloo).
``--mode node`` runs the node section instead: placement ``"node"`` (lookups ``peer`` and
``exchange``) against ``device`` and ``host`` on the same ids, with the peer copy ceiling
(``parallel_node.py`` says what it measures and how); ``--mode tp`` (the default) is this:

Shapes (default): the table of Engram layer 1 of V4.1-Flash, 384,006,168 rows x 256
FP8 values + 8 UE8M0 scale bytes (~101 GB), sharded by whole hash columns: rank ``r``
of ``tp`` owns columns ``[r * ceil(24 / tp), ...)`` and holds only their contiguous row
range (``EngramLayout.shard``; ~101 GB / tp) in its GPU's memory (``device``
placement). The shard is allocated with ``torch.empty`` and only the rows that the
random hash ids touch are filled (random E4M3 bytes without NaN, scale bytes
112..141), so nothing is timed on zeros. ``wkv`` is bf16 ``[25600, 6144]``
(hidden 5120, hc 4), ``q_weight``/``k_weight`` bf16 ``[4, 5120]``.
Token counts ``T`` in {64, 8192}; every rank gets the same hash ids (tensor parallelism).

Stages timed on every rank (median, 10th and 90th percentile of ``--iterations`` calls,
``ID_SETS`` input sets in rotation):

* ``lookup``: ``EngramTable.lookup`` of the rank's columns, ``[T, 24 / tp, 256]`` bf16
  (the Triton gather on CUDA);
* ``all_gather``: one ``all_gather_single`` (``all_gather_into_tensor`` before torch 2.13)
  of the padded ``[T, ceil(24 / tp), 256]`` bf16 rows, as ``Engram`` runs it; reported
  with the bytes each rank receives, ``(tp - 1) * T * ceil(24 / tp) * 512``, over its
  time (the bus bandwidth of an all-gather) and the whole output over its time
  (algorithm bandwidth);
* ``wkv``: the ``[T, 6144] x [6144, 25600]`` bf16 GEMM (TFLOP/s);
* ``gate``: the fused gate ``engram_gate_kv`` (bytes: h, kv, out);
* ``forward``: the whole ``Engram`` forward in tensor-parallel mode (lookup, pad,
  all-gather, unshard, wkv, gate); ``forward_sp``: ``Engram`` in sequence+tensor mode over
  the same group (each rank its ``ceil(T / tp)`` tokens; all-to-all of rows).
* the two tensor-parallel designs for the wkv: gather-first, the library's
  (``all_gather`` + the whole ``wkv``; with an FP8 wkv the rows travel as FP8 bytes,
  ``all_gather_fp8``: ``[T, ceil(24 / tp), 256 + 8]`` uint8), against partial kv sums
  (``partial_wkv``: the rank's columns times its K-slice of ``wkv``, then ``all_reduce_kv``:
  one all-reduce of the ``[T, 25600]`` bf16 partial kv).

Timing, CUDA: eager calls between CUDA events on the current stream, a 256 MB buffer
zeroed before every call (the L2 flush of ``triton.testing.do_bench``); before every
call of a stage that communicates, a one-element all-reduce on the same stream lines
the ranks up. Every rank makes the same number of calls (``do_bench`` picks its own
count per process, which would desynchronize collectives). gloo: ``perf_counter``
around each call, a barrier before the collective stages.

Checks, reported in the JSON: the ``forward`` output is identical on every rank and
equal bit for bit to the stages run one by one; ``forward_sp_matches_forward`` says
whether each rank's sequence+tensor tokens equal the tensor-parallel result (false
where the GPU's ``wkv`` GEMM is not row-invariant: see ``engram.layer.module``).

Output: a rich table (rank 0) and ``parallel-<device>-tp<N>.json`` (``--mode node``:
``parallel-<device>-node<N>.json``) in ``$OUT``, else ``benchmarks/results/``: device,
torch/Triton/NCCL versions, commit (``ENGRAM_COMMIT``), date, world size, per-T per-rank
numbers and the slowest rank's. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and
friends are set before the ranks start).

    PYTHONPATH=src ENGRAM_COMMIT=$(git rev-parse HEAD) python benchmarks/parallel/bench_parallel.py --world-size 8
    PYTHONPATH=src ENGRAM_COMMIT=$(git rev-parse HEAD) python benchmarks/parallel/bench_parallel.py --mode node
    PYTHONPATH=src python benchmarks/parallel/bench_parallel.py --backend gloo --world-size 2 --small   # CPU smoke run
    PYTHONPATH=src python benchmarks/parallel/bench_parallel.py --mode node --backend gloo --world-size 2 --small
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import engram  # noqa: E402
from engram.layer import Engram, WkvProjection, engram_gate_kv  # noqa: E402
from engram.layout import EngramLayout  # noqa: E402
from engram.parallel import NCCL_ENVIRONMENT, init_rank  # noqa: E402
from engram.table import EngramTable  # noqa: E402
from common import (ID_SETS, LAYER_INDEX, V41_CONFIG, StageTimer, device_slug, report_header,  # noqa: E402
                    small_spec)

TOKEN_COUNTS = (64, 8192)
SMALL_TOKEN_COUNTS = (16, 256)
# ``all_gather_single`` where torch has it (2.13+; ``all_gather_into_tensor`` is deprecated there), as Engram does.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
STAGES = ("lookup", "all_gather", "wkv", "gate", "forward", "forward_sp", "all_gather_fp8", "partial_wkv",
          "all_reduce_kv")
COLLECTIVE_STAGES = ("all_gather", "forward", "forward_sp", "all_gather_fp8", "all_reduce_kv")


# ---------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------
def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]``: sum and position-weighted sum of the int16 bit patterns of a bf16 tensor."""
    bits = tensor.contiguous().view(torch.int16).flatten().to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 65521
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _fill_touched_rows(values: torch.Tensor, scales: torch.Tensor, local_rows: torch.Tensor,
                       generator: torch.Generator) -> None:
    """Random E4M3 bytes without NaN (0x7F / 0xFF) and scale bytes 112..141 in rows ``local_rows``."""
    count, head_dim = local_rows.numel(), values.shape[1]
    device = values.device
    magnitude = torch.randint(0, 127, (count, head_dim), dtype=torch.uint8, device=device, generator=generator)
    sign = torch.randint(0, 2, (count, head_dim), dtype=torch.uint8, device=device, generator=generator) << 7
    values[local_rows] = magnitude | sign
    scales[local_rows] = torch.randint(112, 142, (count, scales.shape[1]), dtype=torch.uint8, device=device,
                                       generator=generator)


def _rank_main(rank: int, options: dict, init_file: str) -> None:
    world_size, backend = options["world_size"], options["backend"]
    device, placement = init_rank(rank, world_size, backend, init_file,
                                  cpu_threads=max(1, (os.cpu_count() or 1) // world_size),
                                  timeout=datetime.timedelta(minutes=5))
    try:
        if options.get("mode") == "node":
            from parallel_node import report_node, run_node_rank

            run, write = run_node_rank, report_node
        else:
            run, write = run_rank, report
        rows = run(rank, world_size, device, placement, options)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            write(gathered, options, device)
    finally:
        dist.destroy_process_group()


@dataclass
class RankSetup:
    """One rank's shard and layers.

    ``values`` uint8 ``[rows, head_dim]`` and ``scales`` uint8 ``[rows, head_dim / 32]``: the
    rank's rows ``[row_start, row_end)`` (unfilled until the inputs name them); ``layer`` the
    tensor-parallel ``Engram``, ``layer_sp`` the sequence+tensor one over the same group;
    ``q_weight``/``k_weight`` bf16 ``[hc, D]``."""

    rank: int
    world_size: int
    device: torch.device
    spec: engram.EngramSpec
    layout: EngramLayout
    column_start: int
    column_end: int
    row_start: int
    row_end: int
    values: torch.Tensor
    scales: torch.Tensor
    table: EngramTable
    wkv: WkvProjection
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    layer: Engram
    layer_sp: Engram
    setup_s: float

    @property
    def columns_per_rank(self) -> int:
        return -(-self.spec.num_columns // self.world_size)


def setup_rank(rank: int, world_size: int, device: torch.device, placement: str, options: dict) -> RankSetup:
    """Allocate this rank's shard of layer 1's table (``torch.empty``) and build its layers;
    the weights are the same on every rank (one seed)."""
    spec = small_spec() if options["small"] else engram.EngramSpec.from_hf_config(V41_CONFIG)
    layout = EngramLayout(spec)
    shard = layout.shard(rank, world_size)
    row_start, row_end = shard.row_ranges[LAYER_INDEX]
    columns, head_dim, hidden, hc_mult = spec.num_columns, spec.head_dim, spec.hidden_size, spec.hc_mult

    started = time.perf_counter()
    values = torch.empty((row_end - row_start, head_dim), dtype=torch.uint8, device=device)
    scales = torch.empty((row_end - row_start, head_dim // 32), dtype=torch.uint8, device=device)
    table = EngramTable.from_layout(layout, LAYER_INDEX, shard, values, scales, placement=placement,
                                    device=device if placement == "device" else None, validate=False,
                                    check_values=False)  # unfilled bytes: only timed
    generator = torch.Generator(device=device).manual_seed(options["seed"])
    in_features = columns * head_dim
    weight = (torch.randn(spec.kv_dim, in_features, device=device, generator=generator)
              / in_features ** 0.5).to(torch.bfloat16)
    q_weight = torch.randn(hc_mult, hidden, device=device, generator=generator).to(torch.bfloat16)
    k_weight = torch.randn(hc_mult, hidden, device=device, generator=generator).to(torch.bfloat16)
    wkv = WkvProjection(weight)
    group = dist.group.WORLD
    layer = Engram(table, wkv, q_weight, k_weight, eps=spec.rms_norm_eps, num_columns=columns, tp_group=group)
    layer_sp = Engram(table, wkv, q_weight, k_weight, eps=spec.rms_norm_eps, num_columns=columns, tp_group=group,
                      sequence_parallel=True, sp_group=group)
    return RankSetup(rank, world_size, device, spec, layout, shard.column_start, shard.column_end, row_start, row_end,
                     values, scales, table, wkv, q_weight, k_weight, layer, layer_sp, time.perf_counter() - started)


def run_rank(rank: int, world_size: int, device: torch.device, placement: str, options: dict) -> list[dict]:
    """Build this rank's shard and layers, time every stage at every T; one dict per T."""
    setup = setup_rank(rank, world_size, device, placement, options)
    timer = StageTimer(device, options["iterations"], options["warmup"])
    results = []
    for tokens in options["tokens"]:
        row = bench_tokens(setup, timer, tokens, options["seed"])
        results.append(row)
        if rank == 0:
            print(f"T={tokens}: forward {row['forward_us']:.1f} us, all-gather {row['all_gather_us']:.1f} us "
                  f"(rank 0)", flush=True)
    return results


def bench_tokens(setup: RankSetup, timer: StageTimer, tokens: int, seed: int) -> dict:
    """Time every stage at ``T = tokens`` on this rank and run the checks; the row of the JSON."""
    spec, device, world_size, rank = setup.spec, setup.device, setup.world_size, setup.rank
    columns, head_dim, hidden, hc_mult = spec.num_columns, spec.head_dim, spec.hidden_size, spec.hc_mult
    columns_per_rank, eps = setup.columns_per_rank, spec.rms_norm_eps
    primes = torch.from_numpy(setup.layout.column_primes[LAYER_INDEX])
    offsets = torch.from_numpy(setup.layout.column_offsets[LAYER_INDEX])

    # Inputs: identical on every rank (one CPU generator), then on the device; fill the rows they touch.
    cpu_generator = torch.Generator().manual_seed(seed * 1_000_003 + tokens)
    fill_generator = torch.Generator(device=device).manual_seed(seed + 7919 * tokens + rank)
    id_sets, hidden_sets, mask_sets = [], [], []
    for _ in range(ID_SETS):
        draws = torch.randint(0, 1 << 40, (tokens, columns), generator=cpu_generator)
        ids = (draws % primes + offsets).to(torch.int32).to(device)  # [T, C] global row ids
        local_rows = ids[:, setup.column_start:setup.column_end].to(torch.int64).flatten() - setup.row_start
        _fill_touched_rows(setup.values, setup.scales, local_rows, fill_generator)
        id_sets.append(ids)
        hidden_sets.append(torch.randn(tokens, hc_mult, hidden, generator=cpu_generator).to(torch.bfloat16).to(device))
        mask_sets.append((torch.rand(tokens, generator=cpu_generator) < 0.9).to(device))
    per_rank_tokens = -(-tokens // world_size)
    sp_counts = [max(0, min(tokens, (r + 1) * per_rank_tokens) - r * per_rank_tokens) for r in range(world_size)]
    sp_start, sp_count = sum(sp_counts[:rank]), sp_counts[rank]

    # Stage inputs, each the real output of the stage before (the all-gather's rows feed wkv).
    padded_sets = []
    for ids in id_sets:
        local = setup.table.lookup(ids)  # [T, C_local, hd]
        padded = local.new_zeros(tokens, columns_per_rank, head_dim)
        padded[:, : local.shape[1]] = local
        padded_sets.append(padded)
    received = torch.empty(world_size, tokens, columns_per_rank, head_dim, dtype=torch.bfloat16, device=device)

    def all_gather(i: int) -> None:
        ALL_GATHER(received.view(-1, columns_per_rank, head_dim), padded_sets[i % ID_SETS])

    full_rows_sets = []  # [T, C, hd] each, own storage (with one rank the unshard is a view of ``received``)
    for i in range(ID_SETS):
        all_gather(i)
        full_rows_sets.append(received.permute(1, 0, 2, 3).reshape(tokens, world_size * columns_per_rank, head_dim)
                              [:, :columns].clone(memory_format=torch.contiguous_format))
    kv_sets = [setup.wkv(full_rows) for full_rows in full_rows_sets]  # [T, (hc + 1) * D] each

    # The other tensor-parallel design: the rank's own columns times its K-slice of wkv, then an
    # all-reduce of the partial kv; and the FP8 rows the gather-first design exchanges with an FP8 wkv.
    local_flat_sets = [padded[:, : setup.column_end - setup.column_start].reshape(tokens, -1).contiguous()
                       for padded in padded_sets]
    weight_slice = setup.wkv.weight[:, setup.column_start * head_dim:setup.column_end * head_dim].contiguous()
    partial_kv = torch.zeros(tokens, spec.kv_dim, dtype=torch.bfloat16, device=device)
    packed_width = head_dim + head_dim // 32
    packed_sets = []
    for ids in id_sets:
        values, scales = setup.table.lookup_packed(ids)
        packed = torch.zeros(tokens, columns_per_rank, packed_width, dtype=torch.uint8, device=device)
        packed[:, : values.shape[1]] = torch.cat([values.view(torch.uint8), scales], dim=-1)
        packed_sets.append(packed)
    received_packed = torch.empty(world_size, tokens, columns_per_rank, packed_width, dtype=torch.uint8, device=device)

    stage_calls = {
        "lookup": lambda i: setup.table.lookup(id_sets[i % ID_SETS]),
        "all_gather": all_gather,
        "wkv": lambda i: setup.wkv(full_rows_sets[i % ID_SETS]),
        "gate": lambda i: engram_gate_kv(hidden_sets[i % ID_SETS], kv_sets[i % ID_SETS], setup.q_weight,
                                         setup.k_weight, eps, mask_sets[i % ID_SETS]),
        "forward": lambda i: setup.layer(hidden_sets[i % ID_SETS], id_sets[i % ID_SETS], mask_sets[i % ID_SETS]),
        "forward_sp": lambda i: setup.layer_sp(hidden_sets[i % ID_SETS][sp_start:sp_start + sp_count],
                                               id_sets[i % ID_SETS], mask_sets[i % ID_SETS]),
        "all_gather_fp8": lambda i: ALL_GATHER(received_packed.view(-1, columns_per_rank, packed_width),
                                               packed_sets[i % ID_SETS]),
        "partial_wkv": lambda i: torch.nn.functional.linear(local_flat_sets[i % ID_SETS], weight_slice),
        "all_reduce_kv": lambda i: dist.all_reduce(partial_kv),
    }
    timings = {stage: timer.time(stage_calls[stage], stage in COLLECTIVE_STAGES) for stage in STAGES}

    # Checks: the stages one by one == forward; forward identical on every rank; sp+tp tokens vs tp.
    forward_out = setup.layer(hidden_sets[0], id_sets[0], mask_sets[0])
    staged_out = engram_gate_kv(hidden_sets[0], kv_sets[0], setup.q_weight, setup.k_weight, eps, mask_sets[0])
    stages_match = torch.equal(forward_out.view(torch.int16), staged_out.view(torch.int16))
    fingerprints = torch.empty(world_size * 2, dtype=torch.int64, device=device)  # concatenated form: gloo too
    ALL_GATHER(fingerprints, _fingerprint(forward_out))
    identical_on_ranks = bool((fingerprints.view(world_size, 2) == fingerprints[:2]).all())
    sp_out = setup.layer_sp(hidden_sets[0][sp_start:sp_start + sp_count], id_sets[0], mask_sets[0])
    sp_matches = torch.equal(sp_out.view(torch.int16), forward_out[sp_start:sp_start + sp_count].view(torch.int16))
    flags = torch.tensor([int(sp_matches)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)

    chunk_bytes = tokens * columns_per_rank * head_dim * 2
    received_bytes = (world_size - 1) * chunk_bytes
    gate_bytes = tokens * (hc_mult * hidden * 2 * 2 + spec.kv_dim * 2)  # h read, out written, kv read (bf16)
    row = {
        "T": tokens, "rank": rank, "columns": [setup.column_start, setup.column_end],
        "rows": [setup.row_start, setup.row_end],
        "shard_GB": (setup.values.numel() + setup.scales.numel()) / 1e9, "setup_s": setup.setup_s,
        "lookup_bytes": tokens * (setup.column_end - setup.column_start) * (spec.row_bytes + 2 * head_dim),
        "all_gather_chunk_bytes": chunk_bytes, "all_gather_received_bytes": received_bytes,
        "all_gather_output_bytes": world_size * chunk_bytes,
        "wkv_flop": 2 * tokens * columns * head_dim * spec.kv_dim, "gate_bytes": gate_bytes,
        "sp_tokens": sp_count,
        "stages_match_forward": stages_match, "forward_identical_on_ranks": identical_on_ranks,
        "forward_sp_matches_forward": bool(flags.item()),
    }
    for stage, timing in timings.items():
        row.update({f"{stage}_{key}": value for key, value in timing.items()})
    row["lookup_GBps"] = row["lookup_bytes"] / row["lookup_us"] / 1e3
    row["all_gather_bus_GBps"] = received_bytes / row["all_gather_us"] / 1e3
    row["all_gather_algo_GBps"] = row["all_gather_output_bytes"] / row["all_gather_us"] / 1e3
    row["wkv_TFLOPs"] = row["wkv_flop"] / row["wkv_us"] / 1e6
    row["gate_GBps"] = gate_bytes / row["gate_us"] / 1e3
    row["all_reduce_kv_bytes"] = tokens * spec.kv_dim * 2
    row["all_gather_fp8_received_bytes"] = (world_size - 1) * tokens * columns_per_rank * packed_width
    row["gather_first_us"] = row["all_gather_us"] + row["wkv_us"]
    row["partial_sums_us"] = row["partial_wkv_us"] + row["all_reduce_kv_us"]
    if device.type == "cuda":
        row["max_memory_allocated_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    return row


# ---------------------------------------------------------------------------
# report (rank 0)
# ---------------------------------------------------------------------------
def report(per_rank: list[list[dict]], options: dict, device: torch.device) -> None:
    """Write the JSON and print the table from every rank's rows."""
    world_size = options["world_size"]
    spec = small_spec() if options["small"] else engram.EngramSpec.from_hf_config(V41_CONFIG)
    by_tokens = []
    for tokens in options["tokens"]:
        rows = [next(r for r in rank_rows if r["T"] == tokens) for rank_rows in per_rank]
        slowest = {f"{stage}_us": max(r[f"{stage}_us"] for r in rows) for stage in STAGES}
        slowest["all_gather_bus_GBps"] = min(r["all_gather_bus_GBps"] for r in rows)
        by_tokens.append({
            "T": tokens, "slowest_rank": slowest,
            "checks": {key: all(r[key] for r in rows)
                       for key in ("stages_match_forward", "forward_identical_on_ranks")},
            "forward_sp_matches_forward": all(r["forward_sp_matches_forward"] for r in rows),
            "ranks": rows,
        })
    result = {
        **report_header(None, device, options, world_size),
        "geometry": {"columns": spec.num_columns, "head_dim": spec.head_dim, "hidden": spec.hidden_size,
                     "hc_mult": spec.hc_mult, "table_rows": EngramLayout(spec).num_embeddings[LAYER_INDEX],
                     "wkv": [spec.kv_dim, spec.num_columns * spec.head_dim]},
        "timing": {"iterations": options["iterations"], "warmup": options["warmup"], "id_sets": ID_SETS,
                   "method": "CUDA events, eager, L2 flushed before each call" if device.type == "cuda"
                   else "perf_counter, eager"},
        "seed": options["seed"],
        "results": by_tokens,
    }
    out_dir = Path(options["output"] or os.environ.get("OUT") or BENCHMARKS / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"parallel-{device_slug(device)}-tp{world_size}.json"
    path.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {path}")


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Engram tensor parallel tp={result['world_size']} on {result['device']} "
                        f"({result['backend']}; torch {result['torch']}, Triton {result['triton']}); "
                        f"median us per rank")
    for column in ("T", "rank", "cols", "lookup", "GB/s", "all-gather", "bus GB/s", "wkv", "TFLOP/s", "gate",
                   "GB/s ", "forward", "fwd sp+tp"):
        table.add_column(column, justify="right")
    for entry in result["results"]:
        for row in entry["ranks"]:
            table.add_row(str(row["T"]), str(row["rank"]), f"{row['columns'][0]}-{row['columns'][1]}",
                          f"{row['lookup_us']:.1f}", f"{row['lookup_GBps']:,.1f}",
                          f"{row['all_gather_us']:.1f}", f"{row['all_gather_bus_GBps']:,.1f}",
                          f"{row['wkv_us']:.1f}", f"{row['wkv_TFLOPs']:.1f}",
                          f"{row['gate_us']:.1f}", f"{row['gate_GBps']:,.1f}",
                          f"{row['forward_us']:.1f}", f"{row['forward_sp_us']:.1f}")
        checks = entry["checks"]
        table.add_row(str(entry["T"]), "max", "", *(
            f"{entry['slowest_rank'][f'{stage}_us']:.1f}" if stage else ""
            for stage in ("lookup", None, "all_gather", None, "wkv", None, "gate", None, "forward", "forward_sp")),
            end_section=True)
        print(f"T={entry['T']}: stages == forward: {checks['stages_match_forward']}, forward identical on ranks: "
              f"{checks['forward_identical_on_ranks']}, sp+tp tokens == tp: {entry['forward_sp_matches_forward']}")
        slow = entry["slowest_rank"]
        print(f"T={entry['T']} wkv across ranks (slowest rank, bf16 GEMMs): gather-first all-gather "
              f"{slow['all_gather_us']:.1f} (FP8 rows {slow['all_gather_fp8_us']:.1f}) + wkv {slow['wkv_us']:.1f} us; "
              f"partial sums: own K-slice {slow['partial_wkv_us']:.1f} + all-reduce of kv {slow['all_reduce_kv_us']:.1f} us")
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("tp", "node"), default="tp",
                        help="tp: the tensor-parallel stages; node: placement 'node' against 'device' and 'host'")
    parser.add_argument("--no-host", action="store_true", help="--mode node: leave placement 'host' out")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks (default: every visible GPU for nccl, 2 for gloo)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--small", action="store_true", help="a tiny geometry (C = 24, head_dim 64, hidden 256)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"token counts (default {TOKEN_COUNTS}; with --small {SMALL_TOKEN_COUNTS})")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="directory of the JSON (default $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size: expected a positive number of ranks, got {args.world_size}")
    if args.iterations < 1 or args.warmup < 0:
        parser.error(f"--iterations must be positive and --warmup non-negative, got {args.iterations} and "
                     f"{args.warmup}")
    if args.tokens is not None and min(args.tokens) < 1:
        parser.error(f"--tokens: expected positive token counts, got {args.tokens}")

    if args.backend == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            parser.error("--backend nccl needs CUDA devices and torch.distributed with NCCL (use --backend gloo)")
        available = torch.cuda.device_count()
        world_size = args.world_size or available
        if world_size > available:
            parser.error(f"--world-size {world_size}: NCCL runs one rank per GPU, and {available} GPU(s) are visible")
        os.environ.update(NCCL_ENVIRONMENT)  # before the ranks start: they inherit it
    else:
        world_size = args.world_size or 2
    options = {"mode": args.mode, "no_host": args.no_host, "world_size": world_size, "backend": args.backend,
               "small": args.small,
               "tokens": tuple(args.tokens or (SMALL_TOKEN_COUNTS if args.small else TOKEN_COUNTS)),
               "iterations": args.iterations, "warmup": args.warmup, "seed": args.seed, "output": args.output}
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_rank_main, args=(options, os.path.join(directory, "init")), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
