"""The node section of ``bench_parallel.py`` (``--mode node``): placement ``"node"`` against
``"device"`` and ``"host"``, per rank, one process per GPU (or per CPU process over gloo).

Table: V4.1-Flash layer 1's geometry (24 columns, head_dim 256, rows of 256 E4M3 bytes + 8 scale
bytes), with ``R`` rows: the layer's 384,006,168 where a GPU holds, beside the whole table as
``"device"`` (``R * 264`` B), one node shard of each lookup (``ceil(R / W) * (272 + 264)`` B) and a
reserve for the others' CUDA contexts and the buffers (else ``R`` is scaled down to fit, the same
on every rank; ``--small``: the small geometry of ``bench_parallel.small_spec``). Ids are the
layer's (per column its own row range, ``draw % prime + offset``) scaled to ``R``; each rank draws
its own ``[T, 24]`` (``ID_SETS`` sets per T, in rotation), as data-parallel ranks serve their own
tokens. Every row any rank's ids touch holds bytes that are a hash of its row id (E4M3 without
NaN, scale bytes 112..141), so each rank fills its tables alone and all agree.

Placements, one after the other, timed on the same ids (``lookup``: bf16 ``[T, 24, 256]``;
``lookup_packed``: the FP8 bytes):

* ``device``: the whole table in the rank's HBM (placement ``"cpu"`` over gloo);
* ``host``: placement ``"host"`` over one node-wide copy of the table in ``/dev/shm``
  (``allocate_host_buffer`` with a share key: rank 0 fills it, the others map it, the name is removed
  once all have); skipped with a note where there is no CUDA (gloo), with ``--no-host``, or where
  the copy or its registration fails (``/dev/shm`` too small, the pinned-memory limit);
* ``peer``: ``"node"`` with ``lookup="peer"`` (each rank maps the others' shards; the peer gather
  reads every row from its owner, no collective);
* ``exchange``: ``"node"`` with ``lookup="exchange"`` (ids all-gathered, rows all-to-all'd: a
  collective of every rank).

Each call of every placement is lined up across ranks (``StageTimer`` with ``collective``), so all
ranks look up at once, as in serving; times are median, p10 and p90 of ``--iterations`` calls, GB/s
the rows delivered, ``T * 24 * 264`` bytes, over the median. Checks: every lookup and packed lookup
of ``host``, ``peer`` and ``exchange`` equals ``device``'s bit for bit, on every rank and every id
set.

The peer copy ceiling, measured with the ``peer`` table before its lookups: per rank, the time to
copy ``min(1 GiB, a shard)`` from each rank's shard into local memory (``Tensor.copy_``; round ``k``
copies from rank ``(rank + k) % W``, so every rank reads a different rank at once; round 0 is the
rank's own shard, an HBM copy), the same bytes split over all the peers at once, and the peer
gather reading consecutive rows of every peer at once (``lookup_packed`` of consecutive ids: the
kernel's NVLink rate without random rows). The ceiling is the fastest of the peer measurements;
``peer`` GB/s is reported as a fraction of it. torch runs a cross-GPU ``copy_`` on the source GPU's
stream (in this process's context there) and enables peer access from this GPU to it on first use.
With one rank the "peers" are the rank's own shard (``ceiling["peers"]`` false).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import common  # noqa: E402
import engram  # noqa: E402
from engram.layout import EngramLayout  # noqa: E402
from engram.table import EngramTable  # noqa: E402
from engram.table.host_memory.buffers import allocate_host_buffer, remove_shared_buffer  # noqa: E402
from engram.table.host_memory.rows import PackedRows, packed_row_bytes  # noqa: E402
from engram.table.placements.node import owned_rows  # noqa: E402

PLACEMENTS = ("device", "host", "peer", "exchange")
CALLS = ("lookup", "lookup_packed")
COPY_BYTES = 1 << 30
# HBM left free beside the tables: every other rank's CUDA context on this GPU (its mapping of this
# rank's shard opens one), the L2 flush, the copy buffers, outputs and the exchange's send/receive.
RESERVE_BYTES = 8 << 30
RESERVE_PER_PEER_BYTES = 1 << 30
FILL_CHUNK_ROWS = 1 << 16
_MASK31 = (1 << 31) - 1
_MIX = (0x2545F491, 0x5BD1E995, 0x27D4EB2F)


# ---------------------------------------------------------------------------
# table content and ids
# ---------------------------------------------------------------------------
def row_content(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[N]`` row ids -> ``(uint8 [N, D], uint8 [N, D // 32])``: a hash of (row, byte), the same
    on every device; values are E4M3 bytes other than 0x7F / 0xFF (NaN), scale bytes 112..141."""
    width = head_dim + head_dim // 32
    x = rows.to(torch.int64).unsqueeze(1) * width + torch.arange(width, device=rows.device)
    state = (x & _MASK31) ^ (x >> 31)
    for multiplier in _MIX:
        state = (state * multiplier) & _MASK31  # < 2**31 * 2**32: no int64 overflow
        state = state ^ (state >> 13)
    values = state[:, :head_dim] % 254
    values = values + (values >= 127).to(torch.int64)
    scales = 112 + state[:, head_dim:] % 30
    return values.to(torch.uint8), scales.to(torch.uint8)


def fill_rows(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> None:
    """Write :func:`row_content` into rows ``rows`` (int64 ``[N]``) of ``values`` / ``scales``."""
    rows = rows.to(values.device)
    for start in range(0, rows.numel(), FILL_CHUNK_ROWS):
        chunk = rows[start:start + FILL_CHUNK_ROWS]
        values[chunk], scales[chunk] = row_content(chunk, values.shape[1])


def draw_ids(layout: EngramLayout, rows: int, tokens: int, rank: int, seed: int) -> list[torch.Tensor]:
    """``ID_SETS`` int64 ``[T, C]`` (CPU) of rank ``rank``: layer 1's ids scaled to ``rows``."""
    primes = torch.from_numpy(layout.column_primes[common.LAYER_INDEX]).to(torch.int64)
    offsets = torch.from_numpy(layout.column_offsets[common.LAYER_INDEX]).to(torch.int64)
    layer_rows = layout.num_embeddings[common.LAYER_INDEX]
    generator = torch.Generator().manual_seed(seed * 1_000_003 + tokens * 8_191 + rank)
    sets = []
    for _ in range(common.ID_SETS):
        draws = torch.randint(0, 1 << 40, (tokens, primes.numel()), generator=generator)
        sets.append((draws % primes + offsets) * rows // layer_rows)
    return sets


def table_rows(spec: engram.EngramSpec, layer_rows: int, world_size: int, device: torch.device) -> int:
    """Rows of the benchmark's table: the layer's, or fewer where a GPU (the least free one of the
    group) could not hold the device table, one node shard of each lookup and the reserve."""
    if device.type != "cuda":
        return layer_rows
    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    budget = int(free.item()) - RESERVE_BYTES - (world_size - 1) * RESERVE_PER_PEER_BYTES
    row_bytes = spec.row_bytes + (packed_row_bytes(spec.head_dim) + spec.row_bytes) / world_size
    rows = min(layer_rows, int(budget // row_bytes))
    if rows < world_size:
        raise RuntimeError(f"{int(free.item()):,} bytes free on the least free GPU: too little for a table "
                           f"({RESERVE_BYTES + (world_size - 1) * RESERVE_PER_PEER_BYTES:,} bytes are kept free)")
    return rows


# ---------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------
@dataclass
class NodeSetup:
    """One rank's inputs and its device table.

    ``values`` uint8 ``[R, D]`` and ``scales`` uint8 ``[R, D / 32]``: the whole table on the rank's
    device, filled at every row any rank's ids touch; ``ids[T]``: the rank's ``ID_SETS`` int32 ``[T, C]``
    on the device; ``touched`` int64 ``[K]`` (CPU, sorted): those rows."""

    rank: int
    world_size: int
    device: torch.device
    spec: engram.EngramSpec
    rows: int
    layer_rows: int
    values: torch.Tensor
    scales: torch.Tensor
    device_table: EngramTable
    ids: dict[int, list[torch.Tensor]]
    touched: torch.Tensor
    setup_s: dict = field(default_factory=dict)

    def table(self, placement: str, placement_options: dict | None = None, values=None, scales=None) -> EngramTable:
        """A whole-table ``EngramTable`` of placement ``placement`` (default: over the device table's bytes)."""
        on_device = placement in ("device", "host")
        return EngramTable(self.values if values is None else values, self.scales if scales is None else scales,
                           num_columns_total=self.spec.num_columns, placement=placement,
                           device=self.device if on_device else None, validate=False,
                           placement_options=placement_options, check_values=False)  # untouched rows unfilled


def setup_node_rank(rank: int, world_size: int, device: torch.device, placement: str, options: dict) -> NodeSetup:
    """Draw every rank's ids, allocate the whole table on the device (``torch.empty``), fill the rows
    they touch and build the device table."""
    started = time.perf_counter()
    spec = common.small_spec() if options["small"] else engram.EngramSpec.from_hf_config(common.V41_CONFIG)
    layout = EngramLayout(spec)
    layer_rows = layout.num_embeddings[common.LAYER_INDEX]
    rows = table_rows(spec, layer_rows, world_size, device)
    ids, touched = {}, []
    for tokens in options["tokens"]:
        for other in range(world_size):
            sets = draw_ids(layout, rows, tokens, other, options["seed"])
            touched.extend(ids_set.reshape(-1) for ids_set in sets)
            if other == rank:
                ids[tokens] = [ids_set.to(torch.int32).to(device) for ids_set in sets]
    touched = torch.unique(torch.cat(touched))
    head_dim = spec.head_dim
    values = torch.empty(rows, head_dim, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, head_dim // 32, dtype=torch.uint8, device=device)
    fill_rows(values, scales, touched)
    setup = NodeSetup(rank, world_size, device, spec, rows, layer_rows, values, scales, None, ids, touched)
    setup.device_table = setup.table(placement)
    setup.setup_s["device"] = time.perf_counter() - started
    return setup


def time_lookups(setup: NodeSetup, timer: common.StageTimer, table: EngramTable) -> dict[int, dict]:
    """Per T: each call of ``table`` timed (lined up across ranks) and compared with the device table's."""
    results = {}
    row_bytes = setup.spec.row_bytes
    for tokens, id_sets in setup.ids.items():
        entry = {}
        for call in CALLS:
            method = getattr(table, call)
            timing = timer.time(lambda i, method=method: method(id_sets[i % common.ID_SETS]), collective=True)
            timing["GBps"] = tokens * setup.spec.num_columns * row_bytes / timing["us"] / 1e3
            entry[call] = timing
        if table is not setup.device_table:
            equal = True
            for id_set in id_sets:  # every rank in the same order: the exchange's lookups are collectives
                rows, reference = table.lookup(id_set), setup.device_table.lookup(id_set)
                (values, scales), (ref_values, ref_scales) = table.lookup_packed(id_set), \
                    setup.device_table.lookup_packed(id_set)
                equal &= (torch.equal(rows.view(torch.int16), reference.view(torch.int16))
                          and torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
                          and torch.equal(scales, ref_scales))
            entry["equals_device"] = bool(equal)
        results[tokens] = entry
    return results


def _flush_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def build_host_table(setup: NodeSetup, options: dict) -> tuple[EngramTable | None, object, str | None]:
    """``(table, its host buffer, None)``, or ``(None, None, why)`` on every rank alike: placement
    ``"host"`` over one copy of the table per node (rank 0 fills it from its device table)."""
    if setup.device.type != "cuda":
        return None, None, "placement 'host' needs a CUDA device to read pinned host memory: not measured here"
    if options.get("no_host"):
        return None, None, "--no-host: not measured"
    rank, rows, head_dim = setup.rank, setup.rows, setup.spec.head_dim
    row_bytes = packed_row_bytes(head_dim)
    nbytes = (rows + 1) * row_bytes
    key = f"bench-parallel-node-{rows}-{options['seed']}-{setup.world_size}-{'-'.join(map(str, options['tokens']))}"

    def fill(buffer: torch.Tensor) -> None:
        packed = PackedRows(buffer[:nbytes].view(rows + 1, row_bytes), head_dim)  # a new file reads as zeros
        for start in range(0, setup.touched.numel(), FILL_CHUNK_ROWS * 16):
            chunk = setup.touched[start:start + FILL_CHUNK_ROWS * 16]
            on_device = chunk.to(setup.device)
            packed.values[chunk] = setup.values[on_device].cpu()
            packed.scales[chunk] = setup.scales[on_device].cpu()

    def refuse(buffer: torch.Tensor) -> None:
        raise RuntimeError("rank 0 fills the shared host table; it was not there")

    problem, host_buffer, table = None, None, None
    try:
        if rank == 0:
            try:
                remove_shared_buffer(key)  # a file a killed run left
                host_buffer = allocate_host_buffer(nbytes, fill=fill, share_key=key, row_bytes=row_bytes)
            except (ValueError, OSError, MemoryError, RuntimeError) as error:
                problem = f"rank 0: {error}"
        filled: list = [None] * setup.world_size
        dist.all_gather_object(filled, problem)
        if filled[0] is not None:
            return None, None, filled[0]
        try:
            if rank != 0:
                host_buffer = allocate_host_buffer(nbytes, fill=refuse, share_key=key, row_bytes=row_bytes,
                                                   wait_timeout_s=60.0)
            packed = PackedRows(host_buffer.tensor[:nbytes].view(rows + 1, row_bytes), head_dim)
            threads = max(1, (os.cpu_count() or 1) // setup.world_size)
            table = setup.table("host", {"gather_threads": threads}, packed.values, packed.scales)
        except (ValueError, OSError, MemoryError, RuntimeError, TimeoutError) as error:
            problem = f"rank {rank}: {error}"
        problems: list = [None] * setup.world_size
        dist.all_gather_object(problems, problem)
    finally:
        if rank == 0:
            try:
                remove_shared_buffer(key)  # every rank has it mapped (or failed): the name can go
            except (ValueError, OSError) as error:
                print(f"node: could not remove the shared host table {key!r}: {error}", flush=True)
    failed = [message for message in problems if message is not None]
    if failed:
        return None, None, "; ".join(failed)
    return table, host_buffer, None


def close_host_table(table: EngramTable, host_buffer) -> None:
    torch.cuda.synchronize(table.device)
    table.storage.registration.close()
    host_buffer.close()


def copy_ceiling(setup: NodeSetup, timer: common.StageTimer, peer: EngramTable) -> dict:
    """The peer copy ceiling of this rank (see the module docstring)."""
    rank, world_size, device = setup.rank, setup.world_size, setup.device
    shards = peer.storage._mapping.shards  # shards[r]: rank r's packed rows, as this rank maps them
    sources = [r for r in range(world_size) if r != rank] or [rank]
    nbytes = min(COPY_BYTES, min(shard.numel() for shard in shards)) // 16 * 16
    result = {"peers": world_size > 1, "copy_bytes": nbytes, "copy_per_source": [], "copy_all_sources": None,
              "gather_sequential": None, "GBps": None}
    if nbytes == 0:
        return result
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for step in range(world_size):  # every rank in step: each reads a different rank at once
        source = (rank + step) % world_size
        flat = shards[source].view(-1)[:nbytes]
        timing = timer.time(lambda i, flat=flat: target.copy_(flat), collective=True)
        result["copy_per_source"].append({"source": source, "local": source == rank, **timing,
                                          "GBps": nbytes / timing["us"] / 1e3})
    chunk = nbytes // len(sources) // 16 * 16
    pieces = [(target[k * chunk:(k + 1) * chunk], shards[source].view(-1)[:chunk]) for k, source in enumerate(sources)]

    def all_sources(i: int) -> None:
        for piece, flat in pieces:
            piece.copy_(flat)  # each on its source GPU's stream: they overlap

    timing = timer.time(all_sources, collective=True)
    result["copy_all_sources"] = {**timing, "bytes": chunk * len(sources),
                                  "GBps": chunk * len(sources) / timing["us"] / 1e3}
    columns = setup.spec.num_columns
    per_source = min(chunk // shards[rank].shape[1], min(shards[source].shape[0] for source in sources))
    first = [owned_rows(setup.rows, world_size, source)[0] for source in sources]
    consecutive = torch.cat([torch.arange(start, start + per_source) for start in first])
    count = consecutive.numel() // columns * columns
    if count:
        ids = consecutive[:count].view(-1, columns).to(torch.int32).to(device)
        timing = timer.time(lambda i: peer.lookup_packed(ids), collective=True)
        result["gather_sequential"] = {**timing, "rows": count,
                                       "GBps": count * setup.spec.row_bytes / timing["us"] / 1e3}
    measured = [entry["GBps"] for entry in result["copy_per_source"] if entry["local"] != result["peers"]]
    measured += [result["copy_all_sources"]["GBps"]]
    if result["gather_sequential"] is not None:
        measured.append(result["gather_sequential"]["GBps"])
    result["GBps"] = max(measured)
    return result


def run_node_rank(rank: int, world_size: int, device: torch.device, placement: str, options: dict) -> dict:
    """This rank's numbers: setup, the copy ceiling, and per T every placement's timings and checks."""
    setup = setup_node_rank(rank, world_size, device, placement, options)
    timer = common.StageTimer(device, options["iterations"], options["warmup"])
    timings = {"device": time_lookups(setup, timer, setup.device_table)}
    if rank == 0:
        print(f"node: {setup.rows:,} rows ({setup.touched.numel():,} filled), device table timed", flush=True)

    started = time.perf_counter()
    host, host_buffer, host_note = build_host_table(setup, options)
    setup.setup_s["host"] = time.perf_counter() - started
    if host is not None:
        timings["host"] = time_lookups(setup, timer, host)
        close_host_table(host, host_buffer)
        del host, host_buffer
        _flush_device(device)
    elif rank == 0:
        print(f"node: host skipped ({host_note})", flush=True)

    started = time.perf_counter()
    group = dist.group.WORLD
    peer = setup.table("node", {"group": group, "lookup": "peer"})
    setup.setup_s["peer"] = time.perf_counter() - started
    ceiling = copy_ceiling(setup, timer, peer)  # before the lookups: see the module docstring
    timings["peer"] = time_lookups(setup, timer, peer)
    owned = peer.storage.owned
    shard_bytes = {"peer": peer.storage.nbytes}
    peer.close()  # a collective: every rank drops the mappings
    del peer
    _flush_device(device)
    if rank == 0:
        print("node: peer timed", flush=True)

    started = time.perf_counter()
    exchange = setup.table("node", {"group": group, "lookup": "exchange"})
    setup.setup_s["exchange"] = time.perf_counter() - started
    timings["exchange"] = time_lookups(setup, timer, exchange)
    shard_bytes["exchange"] = exchange.storage.nbytes
    del exchange
    _flush_device(device)

    block = max(1, -(-setup.rows // world_size))
    per_tokens = []
    for tokens, id_sets in setup.ids.items():
        owners = torch.cat([id_set.reshape(-1).to(torch.int64) for id_set in id_sets]) // block
        row = {"T": tokens, "rank": rank, "rows_per_lookup": tokens * setup.spec.num_columns,
               "bytes_per_lookup": tokens * setup.spec.num_columns * setup.spec.row_bytes,
               "remote_rows_fraction": float((owners != rank).to(torch.float64).mean())}
        for name in PLACEMENTS:
            row[name] = timings[name][tokens] if name in timings else None
        if ceiling["GBps"]:
            row["peer_fraction_of_ceiling"] = row["peer"]["lookup"]["GBps"] / ceiling["GBps"]
            row["peer_packed_fraction_of_ceiling"] = row["peer"]["lookup_packed"]["GBps"] / ceiling["GBps"]
        per_tokens.append(row)
    memory = {}
    if device.type == "cuda":
        memory = {"max_memory_allocated_GB": torch.cuda.max_memory_allocated(device) / 1e9,
                  "free_GB_at_end": torch.cuda.mem_get_info(device)[0] / 1e9}
    return {"rank": rank, "rows": setup.rows, "layer_rows": setup.layer_rows, "owned": list(owned),
            "touched_rows": setup.touched.numel(), "shard_bytes": shard_bytes,
            "device_table_bytes": setup.values.numel() + setup.scales.numel(), "setup_s": setup.setup_s,
            "host_note": host_note, "ceiling": ceiling, "memory": memory, "results": per_tokens}


# ---------------------------------------------------------------------------
# report (rank 0)
# ---------------------------------------------------------------------------
def summarize(per_rank: list[dict], tokens: int) -> dict:
    """The slowest rank's numbers and the checks at ``T = tokens``."""
    rows = [next(r for r in rank["results"] if r["T"] == tokens) for rank in per_rank]
    slowest = {}
    for name in PLACEMENTS:
        if rows[0][name] is None:
            continue
        for call in CALLS:
            slowest[f"{name}_{call}_us"] = max(r[name][call]["us"] for r in rows)
            slowest[f"{name}_{call}_GBps"] = min(r[name][call]["GBps"] for r in rows)
    checks = {f"{name}_equals_device": all(r[name]["equals_device"] for r in rows)
              for name in PLACEMENTS[1:] if rows[0][name] is not None}
    entry = {"T": tokens, "slowest_rank": slowest, "checks": checks, "ranks": rows}
    if all("peer_fraction_of_ceiling" in r for r in rows):
        entry["peer_fraction_of_ceiling_min"] = min(r["peer_fraction_of_ceiling"] for r in rows)
    return entry


def report_node(per_rank: list[dict], options: dict, device: torch.device) -> Path:
    """Write ``parallel-<device>-node<W>.json`` and print the tables; returns the JSON's path."""
    import json

    world_size = options["world_size"]
    spec = common.small_spec() if options["small"] else engram.EngramSpec.from_hf_config(common.V41_CONFIG)
    first = per_rank[0]
    result = {
        **common.report_header("node", device, options, world_size),
        "geometry": {"columns": spec.num_columns, "head_dim": spec.head_dim, "row_bytes": spec.row_bytes,
                     "table_rows": first["rows"], "layer_rows": first["layer_rows"],
                     "rows_scaled_to_fit": first["rows"] < first["layer_rows"],
                     "device_table_GB": first["device_table_bytes"] / 1e9,
                     "node_shard_GB": {name: max(r["shard_bytes"][name] for r in per_rank) / 1e9
                                       for name in ("peer", "exchange")},
                     "host_table_GB": (first["rows"] + 1) * packed_row_bytes(spec.head_dim) / 1e9},
        "timing": {"iterations": options["iterations"], "warmup": options["warmup"], "id_sets": common.ID_SETS,
                   "method": ("CUDA events, eager, L2 flushed before each call" if device.type == "cuda"
                              else "perf_counter, eager") + "; every call lined up across ranks",
                   "GBps": "rows delivered (T x columns x row_bytes) over the median"},
        "seed": options["seed"],
        "host": {"measured": first["results"][0]["host"] is not None, "note": first["host_note"]},
        "peer_access_note": "the node placement enables each rank's peer access to every mapped shard at "
                            "setup (engram.table.peer_memory.enable_peer_access), before the copy ceiling",
        "ranks": [{key: rank[key] for key in ("rank", "owned", "touched_rows", "shard_bytes", "setup_s",
                                              "ceiling", "memory")} for rank in per_rank],
        "results": [summarize(per_rank, tokens) for tokens in options["tokens"]],
    }
    out_dir = Path(options["output"] or os.environ.get("OUT") or common.HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"parallel-{common.device_slug(device)}-node{world_size}.json"
    path.write_text(json.dumps(result, indent=2))
    print_node_tables(result)
    print(f"wrote {path}")
    return path


def _rate(gbps: float | None) -> str:
    return "-" if gbps is None else f"{gbps:,.1f}" if gbps >= 1 else f"{gbps:.3f}"


def _cell(timing: dict | None) -> str:
    return "-" if timing is None else f"{timing['us']:,.1f} ({_rate(timing['GBps'])})"


def print_node_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=180)
    table = Table(title=f"Engram placement 'node' over {result['world_size']} ranks on {result['device']} "
                        f"({result['backend']}; {result['geometry']['table_rows']:,} rows); median us (GB/s) per rank")
    for column in ("T", "rank", "call", "device", "host", "node peer", "of ceiling", "node exchange", "== device"):
        table.add_column(column, justify="right")
    for entry in result["results"]:
        for row in entry["ranks"]:
            for call in CALLS:
                fraction = row.get("peer_fraction_of_ceiling" if call == "lookup" else "peer_packed_fraction_of_ceiling")
                equal = all(row[name]["equals_device"] for name in PLACEMENTS[1:] if row[name] is not None)
                table.add_row(str(row["T"]), str(row["rank"]), call,
                              *(_cell(None if row[name] is None else row[name][call]) for name in PLACEMENTS[:3]),
                              "-" if fraction is None else f"{fraction:.1%}", _cell(row["exchange"][call]),
                              str(equal))
        table.rows[-1].end_section = True
    console.print(table)
    ceilings = Table(title="peer copy ceiling per rank, GB/s (copy of min(1 GiB, a shard); sequential: the peer "
                           "gather over consecutive rows)")
    for column in ("rank", "own shard", "per peer (min-max)", "all peers at once", "gather sequential", "ceiling"):
        ceilings.add_column(column, justify="right")
    for rank in result["ranks"]:
        ceiling = rank["ceiling"]
        local = [e["GBps"] for e in ceiling["copy_per_source"] if e["local"]]
        peers = [e["GBps"] for e in ceiling["copy_per_source"] if not e["local"]]
        every = ceiling["copy_all_sources"]
        sequential = ceiling["gather_sequential"]
        ceilings.add_row(str(rank["rank"]), _rate(local[0]) if local else "-",
                         f"{_rate(min(peers))}-{_rate(max(peers))}" if peers else "-",
                         _rate(None if every is None else every["GBps"]),
                         _rate(None if sequential is None else sequential["GBps"]), _rate(ceiling["GBps"]))
    console.print(ceilings)
    if not result["host"]["measured"]:
        print(f"host: {result['host']['note']}")
    for entry in result["results"]:
        fraction = entry.get("peer_fraction_of_ceiling_min")
        print(f"T={entry['T']}: {', '.join(f'{k} {v}' for k, v in entry['checks'].items())}"
              + ("" if fraction is None else f"; peer at {fraction:.1%} of the copy ceiling (slowest rank)"))
