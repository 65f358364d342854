"""Row-gather benchmark (GPU): the Triton gather kernels against the torch-native path
(``lookup_reference``: index_select + dequantize), V4.1-Flash geometry: C = 24 columns
x D = 256 from a full-size table of 384,006,168 rows in HBM (~101 GB).

The table is allocated once per process (``torch.empty``) and reused; only the rows
the random ids touch are filled with random bytes (random scales near 2**0), fresh
for every token count. Each timing cycles through 4 id sets (int32, the layer's
non-contiguous view ``ids[:, l]`` of a ``[T, 2, C]`` tensor); ``do_bench`` clears the
L2 before every call. GB/s counts row bytes read plus output bytes written.

Triton times are CUDA-graph replays (one graph per id set, as an engine runs a step):
launched eagerly, a ~40 us kernel is shorter than its host-side launch on a busy host,
and do_bench then times the host (seen on an H200 VM: packed 38 us replaced by 75-90 us
medians in whole phases of a run). Eager medians are reported beside them; the
torch-native path is timed eagerly, as it runs.

:func:`bench_peer_gather` times the peer gather (placement ``"node"``, lookup ``"peer"``) on one GPU:
the same rows split into 8 shards allocated on this GPU (the kernel reads them through its pointer
table exactly as it reads peers' HBM), against the device gather of the one-piece table, both at
100,000,000 rows (two copies fit in HBM), bit-exactness checked.

    PYTHONPATH=src python benchmarks/kernels/kernels_gather.py           # sweep + table, JSON to $OUT
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

from common import copy_ceiling_gbps  # noqa: E402

from engram.table import lookup_reference  # noqa: E402
from engram.table.host_memory.rows import packed_row_bytes  # noqa: E402
from engram.table.kernels.gather import GatherConfig, default_config, gather_rows, gather_rows_packed  # noqa: E402
from engram.table.kernels.peer_gather import PeerShards, peer_gather_rows, peer_gather_rows_packed, shard_rows  # noqa: E402

V41_TABLE_ROWS = 384_006_168
ID_SETS = 4
_TABLES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def big_table(table_rows: int = V41_TABLE_ROWS, head_dim: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values uint8 [rows, D], scales uint8 [rows, D // 32])`` on the GPU, allocated once per
    process (unfilled: callers fill the rows they read with :func:`random_id_sets`)."""
    key = (table_rows, head_dim)
    if key not in _TABLES:
        _TABLES.clear()
        torch.cuda.empty_cache()
        values = torch.empty((table_rows, head_dim), dtype=torch.uint8, device="cuda")
        scales = torch.empty((table_rows, head_dim // 32), dtype=torch.uint8, device="cuda")
        _TABLES[key] = (values, scales)
    return _TABLES[key]


def random_id_sets(tokens: int, columns: int, values: torch.Tensor, scales: torch.Tensor, generator: torch.Generator,
                   count: int = ID_SETS) -> list[torch.Tensor]:
    """``count`` fresh id sets, each the view ``[:, 0]`` of an int32 ``[T, 2, C]`` tensor of uniform
    random rows; the rows they name get random value bytes and scale bytes 112..141."""
    table_rows, head_dim = values.shape
    id_sets = []
    for _ in range(count):
        ids = torch.randint(0, table_rows, (tokens, 2, columns), device="cuda", generator=generator)
        rows = ids[:, 0].reshape(-1)
        values[rows] = torch.randint(0, 256, (rows.numel(), head_dim), dtype=torch.uint8, device="cuda",
                                     generator=generator)
        scales[rows] = torch.randint(112, 142, (rows.numel(), head_dim // 32), dtype=torch.uint8, device="cuda",
                                     generator=generator)
        id_sets.append(ids.to(torch.int32)[:, 0])
    torch.cuda.synchronize()
    return id_sets


def _graphed(calls: list) -> list | None:
    """Each call captured once in its own CUDA graph -> the graphs' replay functions (None if
    capture fails). The calls run once first on a side stream (compile, allocator warm-up)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for call in calls:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            graphs.append(graph)
    except RuntimeError as error:
        print(f"CUDA graph capture failed ({error}); timing eagerly", flush=True)
        return None
    return [graph.replay for graph in graphs]


def _time_us(calls: list, *, graph: bool, rep_ms: int = 200) -> tuple[float, float, float]:
    """(median, 10th, 90th percentile) microseconds of one call, cycling through ``calls`` (one
    per id set); ``graph``: replays of each call's CUDA graph (falls back to eager calls)."""
    if graph:
        calls = _graphed(calls) or calls
    state = [0]

    def step():
        calls[state[0] % len(calls)]()
        state[0] += 1

    p10, p50, p90 = triton.testing.do_bench(step, warmup=25, rep=rep_ms, quantiles=[0.1, 0.5, 0.9])
    return p50 * 1e3, p10 * 1e3, p90 * 1e3


def _bf16_bit_exact(found: torch.Tensor, expected: torch.Tensor) -> bool:
    """NaN at the same places, every other bf16 bit pattern equal."""
    found_nan, expected_nan = torch.isnan(found), torch.isnan(expected)
    same = found.view(torch.int16) == expected.view(torch.int16)
    return bool(torch.equal(found_nan, expected_nan) and (same | expected_nan).all())


def _bytes(rows: int, head_dim: int) -> tuple[int, int]:
    """(bf16 mode, packed mode) bytes moved: row bytes read + output bytes written."""
    row_bytes = head_dim + head_dim // 32
    return rows * (row_bytes + 2 * head_dim), rows * 2 * row_bytes


def bench_gather(T_values, *, table_rows: int = V41_TABLE_ROWS, columns: int = 24, head_dim: int = 256,
                 bf16_config: GatherConfig | None = None, packed_config: GatherConfig | None = None,
                 seed: int = 0) -> list[dict]:
    """Per token count: median us and GB/s of the Triton bf16 and packed gathers (default launch
    shapes unless given; CUDA-graph replays, eager medians beside them) and of the torch-native
    ``lookup_reference`` (eager), plus a bit-exactness check of both modes against it."""
    values, scales = big_table(table_rows, head_dim)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    bf16_config = default_config(packed=False) if bf16_config is None else bf16_config
    packed_config = default_config(packed=True) if packed_config is None else packed_config
    results = []
    for tokens in T_values:
        id_sets = random_id_sets(tokens, columns, values, scales, generator)
        rows = tokens * columns
        bf16_bytes, packed_bytes = _bytes(rows, head_dim)

        expected = lookup_reference(values, scales, id_sets[0])
        found = gather_rows(values, scales, id_sets[0], config=bf16_config)
        packed_values, packed_scales = gather_rows_packed(values, scales, id_sets[0], config=packed_config)
        local = id_sets[0].long()
        bit_exact = (_bf16_bit_exact(found, expected) and torch.equal(packed_values, values[local])
                     and torch.equal(packed_scales, scales[local]))
        del expected, found, packed_values, packed_scales

        bf16_calls = [lambda ids=ids: gather_rows(values, scales, ids, config=bf16_config) for ids in id_sets]
        packed_calls = [lambda ids=ids: gather_rows_packed(values, scales, ids, config=packed_config)
                        for ids in id_sets]
        bf16_us = _time_us(bf16_calls, graph=True)[0]
        packed_us = _time_us(packed_calls, graph=True)[0]
        bf16_eager_us = _time_us(bf16_calls, graph=False)[0]
        packed_eager_us = _time_us(packed_calls, graph=False)[0]
        torch_us = _time_us([lambda ids=ids: lookup_reference(values, scales, ids) for ids in id_sets], graph=False)[0]
        results.append({
            "T": tokens, "rows": rows, "bit_exact": bit_exact,
            "bytes_bf16": bf16_bytes, "bytes_packed": packed_bytes,
            "triton_bf16_us": bf16_us, "triton_bf16_GBps": bf16_bytes / bf16_us / 1e3,
            "triton_packed_us": packed_us, "triton_packed_GBps": packed_bytes / packed_us / 1e3,
            "triton_bf16_eager_us": bf16_eager_us, "triton_packed_eager_us": packed_eager_us,
            "torch_us": torch_us, "torch_GBps": bf16_bytes / torch_us / 1e3,
            "speedup_bf16_vs_torch": torch_us / bf16_us,
            "config_bf16": _config_name(bf16_config), "config_packed": _config_name(packed_config),
        })
        print(f"gather T={tokens}: bf16 {bf16_us:.1f} us (eager {bf16_eager_us:.1f}), packed {packed_us:.1f} us "
              f"(eager {packed_eager_us:.1f}), torch {torch_us:.1f} us, bit_exact={bit_exact}", flush=True)
        del id_sets
    return results


PEER_TABLE_ROWS = 100_000_000


def _fill_shards(shards: list[torch.Tensor], values: torch.Tensor, scales: torch.Tensor, id_sets) -> None:
    """Copy the rows the id sets name from the one-piece table into their shards."""
    table_rows, head_dim = values.shape
    rows = torch.cat([ids.reshape(-1).long() for ids in id_sets]).unique()
    for index, shard in enumerate(shards):
        start, end = shard_rows(table_rows, len(shards), index)
        mine = rows[(rows >= start) & (rows < end)]
        shard[mine - start, :head_dim] = values[mine]
        shard[mine - start, head_dim:head_dim + head_dim // 32] = scales[mine]


def bench_peer_gather(T_values, *, table_rows: int = PEER_TABLE_ROWS, num_shards: int = 8, columns: int = 24,
                      head_dim: int = 256, seed: int = 1) -> list[dict]:
    """Per token count: median us (CUDA-graph replays) of the peer gather over ``num_shards`` shards on this
    GPU against the device gather of the same rows in one piece, bf16 and packed, and their bit-exactness."""
    values, scales = big_table(table_rows, head_dim)
    row_bytes = packed_row_bytes(head_dim)
    shards = [torch.empty(end - start, row_bytes, dtype=torch.uint8, device="cuda")
              for start, end in (shard_rows(table_rows, num_shards, s) for s in range(num_shards))]
    peer = PeerShards(shards, table_rows, head_dim, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    results = []
    for tokens in T_values:
        id_sets = random_id_sets(tokens, columns, values, scales, generator)
        _fill_shards(shards, values, scales, id_sets)
        rows = tokens * columns
        bf16_bytes, packed_bytes = _bytes(rows, head_dim)
        expected = gather_rows(values, scales, id_sets[0])
        expected_packed = gather_rows_packed(values, scales, id_sets[0])
        found_packed = peer_gather_rows_packed(peer, id_sets[0])
        bit_exact = (_bf16_bit_exact(peer_gather_rows(peer, id_sets[0]), expected)
                     and torch.equal(found_packed[0], expected_packed[0])
                     and torch.equal(found_packed[1], expected_packed[1]))
        del expected, expected_packed, found_packed
        timings = {
            "device_bf16_us": [lambda ids=ids: gather_rows(values, scales, ids) for ids in id_sets],
            "peer_bf16_us": [lambda ids=ids: peer_gather_rows(peer, ids) for ids in id_sets],
            "device_packed_us": [lambda ids=ids: gather_rows_packed(values, scales, ids) for ids in id_sets],
            "peer_packed_us": [lambda ids=ids: peer_gather_rows_packed(peer, ids) for ids in id_sets],
        }
        row = {"T": tokens, "rows": rows, "table_rows": table_rows, "shards": num_shards, "bit_exact": bit_exact,
               "bytes_bf16": bf16_bytes, "bytes_packed": packed_bytes}
        for name, calls in timings.items():
            row[name] = _time_us(calls, graph=True)[0]
        row["peer_bf16_eager_us"] = _time_us(timings["peer_bf16_us"], graph=False)[0]
        row["peer_vs_device_bf16"] = row["peer_bf16_us"] / row["device_bf16_us"]
        row["peer_vs_device_packed"] = row["peer_packed_us"] / row["device_packed_us"]
        results.append(row)
        print(f"peer gather T={tokens} ({num_shards} shards): bf16 {row['peer_bf16_us']:.1f} us against device "
              f"{row['device_bf16_us']:.1f} ({row['peer_vs_device_bf16']:.2f}x), packed {row['peer_packed_us']:.1f} "
              f"against {row['device_packed_us']:.1f}, bit_exact={bit_exact}", flush=True)
        del id_sets
    del shards, peer
    return results


def _config_name(config: GatherConfig) -> str:
    name = f"rows{config.block_rows}-w{config.num_warps}"
    if config.vector != 8:
        name += f"-v{config.vector}"
    if config.chunk_outer:
        name += "-chunk_outer"
    if config.decode != "integer":
        name += f"-{config.decode}"
    if config.value_eviction:
        name += f"-{config.value_eviction}"
    if config.out_cache:
        name += f"-st{config.out_cache}"
    return name


def _bf16_sweep() -> list[GatherConfig]:
    configs = []
    for decode in ("fp8", "integer"):
        configs += [GatherConfig(block_rows=r, num_warps=w, decode=decode) for r, w in
                    ((8, 2), (8, 4), (16, 4), (16, 8), (32, 8))]
        configs += [GatherConfig(block_rows=r, num_warps=w, vector=16, decode=decode) for r, w in
                    ((8, 2), (8, 4), (16, 4), (32, 8))]
        configs += [GatherConfig(block_rows=r, num_warps=w, chunk_outer=True, decode=decode) for r, w in
                    ((8, 2), (16, 2), (16, 4), (32, 4), (32, 8), (64, 8))]
    configs += [GatherConfig(block_rows=r, num_warps=w, chunk_outer=True, decode="fp8_nan_select") for r, w in
                ((16, 4), (32, 8))]
    configs += [GatherConfig(block_rows=16, num_warps=4, chunk_outer=True, decode="fp8", value_eviction="evict_first"),
                GatherConfig(block_rows=16, num_warps=4, chunk_outer=True, decode="fp8", out_cache=".cs")]
    return configs


SWEEP_BF16 = _bf16_sweep()
SWEEP_PACKED = [GatherConfig(block_rows=r, num_warps=w) for r, w in
                ((4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8), (64, 8))] + [
    GatherConfig(block_rows=8, num_warps=2, value_eviction="evict_first"),
    GatherConfig(block_rows=16, num_warps=4, value_eviction="evict_first", out_cache=".cs"),
]


def sweep(tokens: int = 8192, *, columns: int = 24, head_dim: int = 256, table_rows: int = V41_TABLE_ROWS,
          bf16_configs=SWEEP_BF16, packed_configs=SWEEP_PACKED, seed: int = 1, preallocated: bool = False,
          graph: bool = True, rep_ms: int = 100) -> list[dict]:
    """Median (and 10th/90th percentile) us, GB/s and bit-exactness of every launch shape at one
    token count; ``preallocated``: the launchers write into outputs allocated once (``out=``);
    ``graph``: time CUDA-graph replays (else eager calls)."""
    values, scales = big_table(table_rows, head_dim)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    id_sets = random_id_sets(tokens, columns, values, scales, generator)
    bf16_bytes, packed_bytes = _bytes(tokens * columns, head_dim)
    expected = lookup_reference(values, scales, id_sets[0])
    local = id_sets[0].long()
    expected_values, expected_scales = values[local], scales[local]
    results = []
    for mode, configs in (("bf16", bf16_configs), ("packed", packed_configs)):
        for config in configs:
            if mode == "bf16":
                launcher, num_bytes = gather_rows, bf16_bytes
                found = launcher(values, scales, id_sets[0], config=config)
                ok = _bf16_bit_exact(found, expected)
            else:
                launcher, num_bytes = gather_rows_packed, packed_bytes
                found = launcher(values, scales, id_sets[0], config=config)
                ok = torch.equal(found[0], expected_values) and torch.equal(found[1], expected_scales)
            out = found if preallocated else None
            calls = [lambda ids=ids, launcher=launcher, config=config: launcher(values, scales, ids, out=out,
                                                                                 config=config)
                     for ids in id_sets]
            p50, p10, p90 = _time_us(calls, graph=graph, rep_ms=rep_ms)
            del found, calls
            results.append({"mode": mode, "config": _config_name(config), "config_fields": dataclasses.asdict(config),
                            "T": tokens, "seed": seed, "preallocated": preallocated, "graph": graph,
                            "us": p50, "us_p10": p10,
                            "us_p90": p90, "GBps": num_bytes / p50 / 1e3, "bit_exact": ok})
            print(f"sweep {mode:6s} {_config_name(config):40s} {p50:7.1f} us (p10 {p10:6.1f}, p90 {p90:6.1f}) "
                  f"{num_bytes / p50 / 1e3:6.0f} GB/s {'ok' if ok else 'MISMATCH'}"
                  f"{' prealloc' if preallocated else ''}{'' if graph else ' eager'} seed {seed}", flush=True)
    return results


def _fastest(rows: list[dict], mode: str) -> GatherConfig:
    best = min((r for r in rows if r["mode"] == mode and r["bit_exact"]), key=lambda r: r["us"])
    return GatherConfig(**best["config_fields"])


def main() -> None:
    ceiling = copy_ceiling_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"HBM copy ceiling {ceiling:,.0f} GB/s", flush=True)
    sweep_rows = sweep()
    best_bf16, best_packed = _fastest(sweep_rows, "bf16"), _fastest(sweep_rows, "packed")
    default_bf16, default_packed = default_config(packed=False), default_config(packed=True)
    # Spread: the fastest and the default shapes again on fresh ids, graph replays and eager calls.
    repeats = []
    for seed in (2, 3, 4):
        for graph in (True, False):
            repeats += sweep(bf16_configs=[best_bf16, default_bf16], packed_configs=[best_packed, default_packed],
                             seed=seed, graph=graph)
    token_counts = [int(t) for t in os.environ.get("GATHER_BENCH_T", "1,64,1024,8192,32768").split(",")]
    rows = bench_gather(token_counts)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_ceiling_GBps": ceiling, "sweep_T8192": sweep_rows, "repeats_T8192": repeats, "gather": rows,
    }
    out_dir = Path(os.environ.get("OUT", BENCHMARKS / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gather-h200.json").write_text(json.dumps(report, indent=2))

    print(f"\nsweep at T={sweep_rows[0]['T']} (ceiling {ceiling:,.0f} GB/s), fastest first:")
    for mode in ("bf16", "packed"):
        for row in sorted((r for r in sweep_rows if r["mode"] == mode), key=lambda r: r["us"])[:8]:
            print(f"  {mode:6s} {row['config']:40s} {row['us']:7.1f} us {row['GBps']:6.0f} GB/s "
                  f"{100 * row['GBps'] / ceiling:4.0f}% {'' if row['bit_exact'] else 'MISMATCH'}")
    print("repeats (median us per seed; g = graph replays, e = eager calls):")
    for mode, config in (("bf16", best_bf16), ("bf16", default_bf16), ("packed", best_packed), ("packed", default_packed)):
        name = _config_name(config)
        times = [f"{r['us']:.1f}{'g' if r['graph'] else 'e'}" for r in repeats if r["mode"] == mode and r["config"] == name]
        print(f"  {mode:6s} {name:40s} {' '.join(times)}")
    print(f"\n{'T':>6} {'bf16 us':>8} {'GB/s':>6} {'packed us':>9} {'GB/s':>6} {'torch us':>8} {'x torch':>7} exact"
          f"   (default shapes: bf16 {_config_name(default_bf16)}, packed {_config_name(default_packed)})")
    for row in rows:
        print(f"{row['T']:>6} {row['triton_bf16_us']:8.1f} {row['triton_bf16_GBps']:6.0f} "
              f"{row['triton_packed_us']:9.1f} {row['triton_packed_GBps']:6.0f} {row['torch_us']:8.1f} "
              f"{row['speedup_bf16_vs_torch']:7.1f} {row['bit_exact']}")


if __name__ == "__main__":
    main()
