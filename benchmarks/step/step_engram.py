"""The Engram side of ``bench_step.py``, built through the library's public API: a spec at V4.1
geometry with smaller tables, a synthetic token map, per placement one ``EngramTable`` per layer
(random FP8 bytes), ``Engram.from_weights`` with an FP8 wkv, one ``EngramMemory`` per placement,
and the step's token inputs.

Placements (``kinds``): ``"device"`` (HBM), ``"host"``, ``"cached"`` (host rows + the default HBM
cache of 2% of rows), ``"seed"`` (placement ``"host"`` with every lookup on the direct path: the GPU
reads every row over PCIe in the gather kernel, on the main stream, the seed's design) and, without
CUDA, ``"cpu"``. Kinds for real-text ids, each its own tables over the same rows (a host gather's
dedup choice and a cache's content follow the ids they see): ``"host_realtext"`` and
``"cached_realtext"`` / ``"cached_realtext_neighbors"`` (an HBM cache of as many slots as 2% of V4.1's
real rows: the hit rate of real text depends on the slots, not on this smaller table's fraction), and
``"disk_realtext_ram10"`` / ``"disk_realtext_ram30"`` (placement ``"disk"``: the rows in a row file under a RAM
cache of 10% / 30% of the rows and an HBM cache of the real-text caches' fraction; :data:`DISK_KINDS`).
``host``, ``cached`` and ``seed`` share one pinned copy of each layer's rows; the ``device`` tables are a
copy of the same bytes and the disk tables' row files hold them too (:func:`disk_row_file`, written once
per layer), so every placement returns the same rows.

Real text (:class:`TextStream`, :class:`RealTextInputs`): the token ids of ``real_text.py stream``
(``.bench-data/cache_stream_v41.npz``) through the DeepSeek-V4 tokenizer's token map. The step's
synthetic map sends raw id ``c`` to ``c`` for every ``c`` below the compressed vocabulary (99,092 at V4.1),
so feeding the compressed ids as raw ids gives the real text's hash ids at this layout exactly.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]
sys.path.insert(0, str(BENCHMARKS / "layer"))  # bench_layer

import engram  # noqa: E402
from engram import EngramLayout, EngramMemory, EngramSpec, EngramTable, NgramHasher, TokenCompressor  # noqa: E402
from engram.layer import Engram  # noqa: E402

CONFIG = Path(engram.__file__).parent / "configs" / "deepseek-v4.1-flash.json"
RAW_VOCAB = 129280          # V4.1's token ids
SEED_DIRECT_ROWS = 1 << 62  # every lookup "decode-sized": the direct path
V41_ROWS = (384_006_168, 384_016_682)  # V4.1-Flash's real rows per Engram layer
REALTEXT_CACHE_SHARE = 0.02  # the real-text caches hold as many slots as this share of V4.1's rows
REALTEXT_KINDS = ("host_realtext", "cached_realtext", "cached_realtext_neighbors")
DISK_KINDS = {"disk_realtext_ram10": 0.1, "disk_realtext_ram30": 0.3}  # kind: its RAM cache's fraction of the rows
DISK_WARM_PIECE = 8192  # tokens per warm-up lookup of a disk table at decode
SMOKE_GEOMETRY = dict(engram_layer_ids=[1, 3], engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=64,
                      engram_vocab_size=1000, engram_compressed_vocab_size=500, engram_pad_token_id=2,
                      hidden_size=128, hc_mult=4, rms_norm_eps=1e-6,
                      quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                           "weight_block_size": [128, 128]})


def make_spec(engram_vocab_size: int | None, smoke: bool) -> EngramSpec:
    """V4.1-Flash's Engram keys with ``engram_vocab_size`` replaced (the row counts follow from the
    prime rule), or the smoke run's tiny geometry."""
    config = dict(SMOKE_GEOMETRY) if smoke else json.loads(CONFIG.read_text())
    if engram_vocab_size is not None:
        config["engram_vocab_size"] = engram_vocab_size
    config["engram_num_embeddings"] = [1] * len(config["engram_layer_ids"])
    config["engram_num_embeddings"] = EngramLayout(EngramSpec.from_hf_config(config, check_rows=False)).num_embeddings
    return EngramSpec.from_hf_config(config)


def head_dim(smoke: bool) -> int:
    """The table rows' head_dim of :func:`make_spec` (before the spec is made)."""
    return SMOKE_GEOMETRY["engram_head_dim"] if smoke else json.loads(CONFIG.read_text())["engram_head_dim"]


def synthetic_vocab(spec: EngramSpec, raw_size: int = RAW_VOCAB) -> TokenCompressor:
    """``raw_size`` token ids onto the spec's compressed ids (token ``i`` -> ``i mod size``)."""
    return TokenCompressor((np.arange(raw_size) % spec.compressed_vocab_size).astype(np.int32))


def v41_vocab_size_for(table_gib: float) -> int:
    """The ``engram_vocab_size`` whose tables take about ``table_gib`` GiB each as packed host rows
    (24 columns of primes just above it, 272 B per row)."""
    return int(table_gib * 2**30 / 272 / 24)


@dataclass
class LayerWeights:
    """One Engram layer's checkpoint tensors: FP8 wkv + UE8M0 block scales, bf16 q / k weights."""

    wkv_weight: torch.Tensor
    wkv_scale: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor


def layer_weights(spec: EngramSpec, generator: torch.Generator, device) -> dict[int, LayerWeights]:
    """Random weights of every Engram layer (``bench_layer.fp8_weight``'s FP8 wkv)."""
    from bench_layer import fp8_weight

    weights = {}
    for layer_id in spec.layer_ids:
        wkv, scale = fp8_weight(generator, spec.kv_dim, spec.num_columns * spec.head_dim, device)
        q, k = (torch.randn(spec.hc_mult, spec.hidden_size, device=device, generator=generator).to(torch.bfloat16)
                for _ in range(2))
        weights[layer_id] = LayerWeights(wkv, scale, q, k)
    return weights


def _seed_table(layout, index, values, scales, device, facts: dict) -> EngramTable:
    """Placement ``"host"`` with every lookup on the direct path: through the placement option where the
    library takes it, else by setting the placement's attribute."""
    try:
        table = EngramTable.from_layout(layout, index, None, values, scales, placement="host", device=device,
                                        validate=False, placement_options={"direct_max_rows": SEED_DIRECT_ROWS},
                                        check_values=False)
        facts["seed_direct_rows_via"] = "placement_options"
    except ValueError as error:
        table = EngramTable.from_layout(layout, index, None, values, scales, placement="host", device=device,
                                        validate=False, check_values=False)
        table.storage.direct_max_rows = SEED_DIRECT_ROWS
        facts["seed_direct_rows_via"] = "storage.direct_max_rows"
        facts["seed_placement_options_error"] = str(error)
    return table


def realtext_cache_fraction(rows: int, index: int, smoke: bool) -> float:
    """``cache_fraction`` of a real-text cache on a table of ``rows`` rows (layer ``index``): the slots of 2% of
    V4.1's real rows (at most half the table); at smoke sizes 2% of the table's own rows."""
    if smoke:
        return REALTEXT_CACHE_SHARE
    return min(0.5, REALTEXT_CACHE_SHARE * V41_ROWS[min(index, len(V41_ROWS) - 1)] / rows)


def cpu_table_rows(rows: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows of a placement ``"cpu"`` table, a function of the arguments alone: ``(values uint8 [rows,
    head_dim]`` below E4M3's NaN, ``scales uint8 [rows, head_dim // 32]`` in 110..126)``."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 0x7F, (rows, head_dim), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 127, (rows, head_dim // 32), dtype=torch.uint8, generator=generator)
    return values, scales


def layer_rows(layout: EngramLayout, index: int, cuda: bool, distinct_rows: int) -> tuple:
    """Layer ``index``'s rows as every placement of the step serves them: ``(values uint8 [rows, D], scales
    uint8 [rows, D // 32], digest, base)``. On CUDA a ``common.host_table`` (``base``, whose pinned rows
    ``values`` / ``scales`` view; ``digest`` names its bytes by the arguments that determine them), else
    :func:`cpu_table_rows` (``base`` None, ``digest`` "": the row file hashes the bytes)."""
    rows, head_dim = layout.num_embeddings[index], layout.spec.head_dim
    if not cuda:
        return (*cpu_table_rows(rows, head_dim, index), "", None)
    from common import host_table

    base = host_table(rows, head_dim, seed=index, distinct_rows=distinct_rows)
    packed = base.storage.rows
    # host_table's bytes: torch's CUDA generator seeded with index, distinct_rows drawn and repeated
    digest = (f"common.host_table rows={rows} head_dim={head_dim} seed={index} distinct_rows={distinct_rows} "
              f"torch={torch.__version__} gpu={torch.cuda.get_device_name()!r}")
    return packed.values, packed.scales, digest, base


def disk_row_file(values: torch.Tensor, scales: torch.Tensor, directory, layer_id: int, digest: str = "",
                  progress: bool = False, write: bool = True):
    """The row file of one layer's rows (``values uint8 [rows, D]``, ``scales uint8 [rows, D // 32]`` on the
    CPU) in ``directory``: reused where a complete valid one of these rows is there, else written (``write``;
    else FileNotFoundError). ``digest`` names the bytes ("": a BLAKE2b of them). Returns ``(RowFile, seconds,
    written)``; a sample of its rows is compared with the tensors (ValueError: a file of that name holds
    other bytes)."""
    from engram.table.disk.row_file import open_row_file
    from engram.table.disk.writing import TensorTableSource, ensure_row_file, row_file_path, source_fingerprint

    started = time.perf_counter()
    source = TensorTableSource(values, scales, description=f"bench-step-layer-{layer_id}", digest=digest)
    fingerprint = source_fingerprint(source)
    path = row_file_path(source, directory, fingerprint)
    existed = path.is_file()
    if write:
        path = ensure_row_file(source, directory, progress=progress)
    try:
        row_file = open_row_file(path, fingerprint, source.num_rows, source.head_dim)
    except ValueError as error:
        if write:
            raise
        raise FileNotFoundError(f"{error} (write the row files first: --write-disk-tables)") from None
    check_row_file_sample(row_file, values, scales)
    return row_file, time.perf_counter() - started, not existed


def check_row_file_sample(row_file, values: torch.Tensor, scales: torch.Tensor, count: int = 64) -> None:
    """Compare ``count`` rows of ``row_file`` (spread over the table, the last one included) with the tensors."""
    layout = row_file.layout
    head_dim = layout.head_dim
    ids = np.unique(np.linspace(0, layout.num_rows - 1, num=min(count, layout.num_rows), dtype=np.int64))
    fd = os.open(row_file.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for row in ids.tolist():
            stored = os.pread(fd, head_dim + head_dim // 32, int(layout.row_offset(row)))
            expected = values[row].numpy().tobytes() + scales[row].numpy().tobytes()
            if stored != expected:
                raise ValueError(f"{row_file.path}: row {row} differs from the table's rows (a file of this name "
                                 "holds other bytes): remove it and write it again (--write-disk-tables)")
    finally:
        os.close(fd)


def disk_options(rows: int, index: int, ram_fraction: float, directory, read_threads: int, smoke: bool,
                 hbm_fraction: float | None = None) -> dict:
    """Placement options of a disk table: its RAM cache's fraction and an HBM cache of ``hbm_fraction`` of its
    rows (None: :func:`realtext_cache_fraction`, the cached real-text variant's slots)."""
    if hbm_fraction is None:
        hbm_fraction = realtext_cache_fraction(rows, index, smoke)
    return {"directory": str(directory), "ram_cache_fraction": ram_fraction, "cache_fraction": hbm_fraction,
            "read_threads": read_threads}


def disk_table(layout: EngramLayout, index: int, row_file, device, options: dict) -> EngramTable:
    """Layer ``index``'s table of placement ``"disk"`` over ``row_file``, its caches empty, with ``options``
    (:func:`disk_options`)."""
    from engram.table.disk.writing import row_file_placeholders

    values, scales = row_file_placeholders(row_file)
    return EngramTable.from_layout(layout, index, None, values, scales, placement="disk", device=device,
                                   validate=False, check_values=False, placement_options=options)


def disk_tables(layout: EngramLayout, row_files: dict, device, options: dict[int, dict]) -> dict[int, EngramTable]:
    """``{layer_id: disk_table(...)}`` over each layer's row file ``row_files[layer_id]`` with ``options[layer_id]``."""
    return {layer_id: disk_table(layout, index, row_files[layer_id], device, options[layer_id])
            for index, layer_id in enumerate(layout.spec.layer_ids)}


def build_tables(spec: EngramSpec, layout: EngramLayout, kinds: list[str], device, *, distinct_rows: int,
                 generator: torch.Generator, host_options: dict | None = None, smoke: bool = False,
                 cpu_rows: dict | None = None, disk: dict | None = None,
                 row_files: dict | None = None) -> tuple[dict[str, dict[int, EngramTable]], dict, list]:
    """``({kind: {layer_id: table}}, facts, keep)``; ``keep`` holds what must outlive the tables (the
    pinned rows). On CUDA the rows are random packed host rows (``common.host_table``,
    ``distinct_rows`` drawn and repeated); on the CPU random bytes for placement ``"cpu"``
    (:func:`cpu_table_rows`, seeded by the layer's index; ``cpu_rows``, if given, gets each layer's
    ``(values, scales)``). ``host_options``: placement options of the host and cached tables
    (``gather_threads``, ...). The kinds of :data:`DISK_KINDS` need ``disk`` (``directory``,
    ``read_threads``, ``write``): each layer's row file (:func:`disk_row_file`; ``row_files``, if given, gets
    them); where one is missing and ``write`` is false, no disk kind is built and ``facts["disk_missing"]``
    says why."""
    tables: dict[str, dict[int, EngramTable]] = {kind: {} for kind in kinds}
    facts: dict = {"table_rows": list(layout.num_embeddings), "row_bytes": spec.row_bytes}
    keep = []
    head_dim = spec.head_dim
    disk_kinds = [kind for kind in kinds if kind in DISK_KINDS]
    files = {}
    for index, layer_id in enumerate(spec.layer_ids):
        rows = layout.num_embeddings[index]
        values, scales, digest, base = layer_rows(layout, index, "cpu" not in kinds, distinct_rows)
        if disk_kinds and "disk_missing" not in facts:
            try:
                row_file, seconds, written = disk_row_file(values, scales, disk["directory"], layer_id, digest,
                                                           write=disk.get("write", True))
            except FileNotFoundError as error:
                facts["disk_missing"] = str(error)
            else:
                files[layer_id] = row_file
                facts.setdefault("disk_row_files", []).append({"path": str(row_file.path), "seconds": seconds,
                                                               "bytes": row_file.layout.file_bytes, "written": written})
        if "cpu" in kinds:
            tables["cpu"][layer_id] = EngramTable.from_layout(layout, index, None, values, scales, placement="cpu",
                                                              validate=False)
            if cpu_rows is not None:
                cpu_rows[layer_id] = (values, scales)
            continue
        keep.append(base)
        packed = base.storage.rows
        facts.setdefault("huge_pages", []).append(bool(base.storage.host_buffer.huge_pages))
        for kind in kinds:
            if kind in DISK_KINDS:
                continue
            if kind == "device":
                on_device = packed.packed.to(device)
                values, scales = on_device[:-1, :head_dim], on_device[:-1, head_dim: head_dim + head_dim // 32]
                table = EngramTable.from_layout(layout, index, None, values, scales, placement="device", device=device,
                                                validate=False, check_values=False)  # common.host_table's rows
            elif kind in ("host", "cached") + REALTEXT_KINDS:
                options = dict(host_options or {})
                if kind.startswith("cached_realtext"):
                    options["cache_fraction"] = realtext_cache_fraction(rows, index, smoke)
                    facts.setdefault("realtext_cache_fraction", []).append(options["cache_fraction"])
                table = EngramTable.from_layout(layout, index, None, packed.values, packed.scales,
                                                placement=kind.split("_")[0], device=device, validate=False,
                                                check_values=False, placement_options=options)
            elif kind == "seed":
                table = _seed_table(layout, index, packed.values, packed.scales, device, facts)
            else:
                raise ValueError(f"kinds: unknown table kind {kind!r}")
            tables[kind][layer_id] = table
    for kind in disk_kinds:
        if "disk_missing" in facts:
            del tables[kind]
            continue
        for index, layer_id in enumerate(spec.layer_ids):
            options = disk_options(layout.num_embeddings[index], index, DISK_KINDS[kind], disk["directory"],
                                   disk["read_threads"], smoke, disk.get("hbm_fraction"))
            tables[kind][layer_id] = disk_table(layout, index, files[layer_id], device, options)
            facts.setdefault("disk_options", {}).setdefault(kind, []).append(options)
    if row_files is not None:
        row_files.update(files)
    return tables, facts, keep


def build_memories(spec: EngramSpec, layout: EngramLayout, vocab: TokenCompressor,
                   tables: dict[str, dict[int, EngramTable]], weights: dict[int, LayerWeights],
                   device) -> dict[str, EngramMemory]:
    """One ``EngramMemory`` per table kind, all with one hasher (hashing runs once per step)."""
    hasher = NgramHasher(layout, vocab, device=device, validate=False)
    memories = {}
    for kind, by_layer in tables.items():
        layers = {layer_id: Engram.from_weights(spec, table, wkv_weight=weights[layer_id].wkv_weight,
                                                wkv_scale=weights[layer_id].wkv_scale,
                                                q_weight=weights[layer_id].q_weight,
                                                k_weight=weights[layer_id].k_weight)
                  for layer_id, table in by_layer.items()}
        placement = "host" if kind == "seed" else kind.split("_")[0]
        memories[kind] = EngramMemory(spec, layout, vocab, hasher, layers, by_layer, placement=placement,
                                      device=torch.device(device))
    return memories


def prefetch_api(memory: EngramMemory) -> dict:
    """What this version's prefetch takes: ``kv_ahead`` (``memory.prefetch(ids, kv_ahead=True)``) and
    whether ``forward_layer`` takes the handle a prefetch returns (``prefetch=``)."""
    return {"kv_ahead": "kv_ahead" in inspect.signature(memory.prefetch).parameters,
            "forward_layer_takes_prefetch": "prefetch" in inspect.signature(memory.forward_layer).parameters}


class StepInputs:
    """One step's static input tensors for ``T`` tokens (graphs read them in place), refreshed per step
    from a seeded generator: raw token ids ``[T]``, their n-gram history ``lookback [R, N - 1]``,
    positions, request starts, and the residual ``h [T, hc, hidden]`` the first layer reads.

    ``decode``: ``T`` requests of one token each; else requests of ``chunk`` tokens (a chunked prefill
    continuing earlier chunks)."""

    def __init__(self, spec: EngramSpec, tokens: int, decode: bool, device, generator: torch.Generator,
                 chunk: int = 2048, raw_vocab: int = RAW_VOCAB):
        self.tokens, self.generator, self.raw_vocab = tokens, generator, raw_vocab
        per_request = 1 if decode else min(chunk, tokens)
        requests = -(-tokens // per_request)
        starts = [min(tokens, r * per_request) for r in range(requests + 1)]
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        offsets = torch.arange(tokens, device=device) - torch.repeat_interleave(
            self.query_start_loc[:-1].long(), torch.diff(self.query_start_loc.long()))
        history = 4096  # each request continues a sequence this long
        self.positions = (history + offsets).to(torch.int32)
        self.input_ids = torch.empty(tokens, dtype=torch.int64, device=device)
        self.lookback = torch.empty(requests, spec.max_ngram_size - 1, dtype=torch.int64, device=device)
        self.hidden = torch.randn(tokens, spec.hc_mult, spec.hidden_size, device=device,
                                  generator=generator).to(torch.bfloat16)
        self.refresh()

    def refresh(self) -> None:
        """Fresh token ids and history (the step's hash ids and rows change with them)."""
        torch.randint(0, self.raw_vocab, self.input_ids.shape, generator=self.generator, out=self.input_ids,
                      device=self.input_ids.device)
        torch.randint(0, self.raw_vocab, self.lookback.shape, generator=self.generator, out=self.lookback,
                      device=self.lookback.device)

    def hash(self, memory: EngramMemory) -> torch.Tensor:
        """``memory.hasher`` on this step's tokens: int32 ``[T, L, C]``."""
        return memory.hasher(self.input_ids, self.positions, self.query_start_loc, lookback_token_ids=self.lookback)


# ---------------------------------------------------------------------------
# real text
# ---------------------------------------------------------------------------
@dataclass
class TextStream:
    """Compressed token ids of a text, int64 ``[N]``, files laid end to end (one stream: n-grams span the
    few file ends), fed to the step as raw ids (the synthetic map is the identity below its size)."""

    ids: np.ndarray
    corpus: str
    source: str  # the file read, or "synthetic"
    folded: bool = False  # ids folded into a smaller compressed vocabulary (the smoke geometry)

    def __len__(self) -> int:
        return len(self.ids)

    def facts(self) -> dict:
        return {"corpus": self.corpus, "source": self.source, "tokens": len(self.ids), "folded": self.folded}


def synthetic_text(tokens: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """``int64 [tokens]`` Zipf-skewed token ids below ``vocab_size`` (a stand-in where no stored text is found):
    each popularity rank drawn goes to its own random id."""
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.3, size=tokens), vocab_size) - 1
    return rng.permutation(vocab_size)[ranks].astype(np.int64)


def load_text_stream(path: Path, spec: EngramSpec, *, synthetic_tokens: int | None = None) -> TextStream:
    """The stored stream (``real_text.py stream``'s ``tokens`` through its ``token_map``) as compressed ids
    of ``spec``; ids at or above the spec's compressed vocabulary (the smoke geometry) are folded into it.
    Without the file: a synthetic Zipf stream of ``synthetic_tokens`` (None: FileNotFoundError)."""
    size = spec.compressed_vocab_size
    if not path.is_file():
        if synthetic_tokens is None:
            raise FileNotFoundError(path)
        return TextStream(synthetic_text(synthetic_tokens, size), "synthetic-zipf", "synthetic")
    with np.load(path) as stored:
        missing = {"tokens", "token_map"} - set(stored.files)
        if missing:
            raise ValueError(f"{path}: expected arrays tokens and token_map, missing {sorted(missing)}")
        tokens, token_map = stored["tokens"].astype(np.int64), stored["token_map"].astype(np.int64)
        corpus = str(stored["corpus"]) if "corpus" in stored.files else path.stem
    if tokens.size == 0 or tokens.min() < 0 or tokens.max() >= token_map.size:
        raise ValueError(f"{path}: token ids outside its token map of {token_map.size} ids")
    ids = token_map[tokens]
    folded = bool(ids.max() >= size)
    if folded:
        ids = ids % size
    return TextStream(ids, corpus, str(path), folded)


@dataclass(frozen=True)
class TextPlan:
    """Where a phase reads the stream: ``warm`` tokens from the start warm each real-text cache; after
    them, prefill steps of ``T`` consecutive tokens, or, at decode, ``T`` requests each at its own
    cursor (``cursors``) with its prompt (the ``prompt`` tokens before it, also warmed) and one token a
    step. ``steps``: how many steps the text holds (the first one is the warm-up steps')."""

    warm: int
    cursors: tuple[int, ...]
    prompt: int
    steps: int


def text_plan(length: int, tokens: int, decode: bool, warm_tokens: int, prompt_tokens: int = 2048) -> TextPlan:
    """The phase's :class:`TextPlan` on a stream of ``length`` tokens: ``warm_tokens`` of warm-up (half the
    stream at most), at decode prompts of ``prompt_tokens`` (half a request's share of the rest at most);
    ValueError when the rest holds no step."""
    warm = min(warm_tokens, length // 2)
    rest = length - warm
    if decode:
        stride = rest // tokens
        prompt = min(prompt_tokens, stride // 2)
        cursors = tuple(warm + prompt + j * stride for j in range(tokens))
        steps = stride - prompt
    else:
        cursors, prompt, steps = (warm,), 0, rest // tokens
    if steps < 1:
        raise ValueError(f"a text stream of {length} tokens holds no step of {tokens} tokens after its "
                         f"{warm} warm-up tokens")
    return TextPlan(warm, cursors, prompt, steps)


def _window(ids: np.ndarray, start: int, count: int) -> np.ndarray:
    """``ids[start:start + count]``, -1 where the index is below 0."""
    out = np.full(count, -1, dtype=np.int64)
    first = max(start, 0)
    if first < start + count:
        out[first - start:] = ids[first:start + count]
    return out


class RealTextInputs(StepInputs):
    """:class:`StepInputs` whose token ids come from a :class:`TextStream` in order instead of at random:
    the first step (the warm-up steps') at the plan's cursors, each :meth:`refresh` the next one. Prefill:
    ``T`` consecutive tokens in requests of ``chunk``; decode: ``T`` requests, one token each at its cursor.
    Positions are stream positions and the lookback the stream's tokens before each request, so the hash
    ids equal those of the whole stream hashed at once. :attr:`exhausted`: the text holds no further step."""

    def __init__(self, spec: EngramSpec, tokens: int, decode: bool, device, generator: torch.Generator,
                 text: TextStream, plan: TextPlan, chunk: int = 2048):
        self.text, self.plan, self.decode, self.step = text, plan, decode, -1
        super().__init__(spec, tokens, decode, device, generator, chunk=chunk)

    @property
    def exhausted(self) -> bool:
        return self.step + 1 >= self.plan.steps

    def starts(self, step: int) -> list[int]:
        """Stream position of each request's first token at ``step``."""
        if self.decode:
            return [cursor + step for cursor in self.plan.cursors]
        first = self.plan.cursors[0] + step * self.tokens
        return [first + begin for begin in self._bounds()[:-1]]

    def _bounds(self) -> list[int]:
        if getattr(self, "_request_bounds", None) is None:
            self._request_bounds = self.query_start_loc.tolist()  # once: a host copy
        return self._request_bounds

    def refresh(self) -> None:
        if self.exhausted:
            raise RuntimeError(f"the text stream holds {self.plan.steps} steps of {self.tokens} tokens; all are used")
        self.step += 1
        starts = self.starts(self.step)
        bounds = self._bounds()
        width = self.lookback.shape[1]
        ids = np.concatenate([self.text.ids[s:s + (b - a)] for s, a, b in zip(starts, bounds[:-1], bounds[1:])])
        positions = np.concatenate([np.arange(s, s + (b - a)) for s, a, b in zip(starts, bounds[:-1], bounds[1:])])
        lookback = np.stack([_window(self.text.ids, s - width, width)[::-1] for s in starts])  # [:, j]: start - 1 - j
        self.input_ids.copy_(torch.from_numpy(ids))
        self.positions.copy_(torch.from_numpy(positions.astype(np.int32)))
        self.lookback.copy_(torch.from_numpy(np.ascontiguousarray(lookback)))


def warm_segments(plan: TextPlan) -> list[tuple[int, int]]:
    """``(start, length)`` of the text a phase's real-text caches see before its steps: the warm-up text,
    then each decode request's prompt."""
    segments = [(0, plan.warm)] if plan.warm else []
    if plan.prompt:
        segments += [(cursor - plan.prompt, plan.prompt) for cursor in plan.cursors]
    return segments


def hash_text(memory, text: TextStream, start: int, count: int, device) -> torch.Tensor:
    """Hash ids of ``count`` stream tokens from ``start`` as one request continuing the stream (the
    memory's hasher): int ``[count, L, C]``."""
    width = memory.spec.max_ngram_size - 1
    ids = torch.from_numpy(text.ids[start:start + count].copy()).to(device)
    positions = torch.arange(start, start + count, dtype=torch.int32).to(device)
    starts = torch.tensor([0, count], dtype=torch.int32).to(device)
    lookback = torch.from_numpy(np.ascontiguousarray(_window(text.ids, start - width, width)[::-1])).view(1, width)
    return memory.hasher(ids, positions, starts, lookback_token_ids=lookback.to(device))


def warm_cache(memory, text: TextStream, plan: TextPlan, device, step_tokens: int) -> int:
    """Empty ``memory``'s row caches, then ``update_cache`` on the phase's warm-up text
    (:func:`warm_segments`) in pieces of at most ``step_tokens``; returns the updates made."""
    for cache in row_caches(memory):
        cache.clear()
    updates = 0
    for start, length in warm_segments(plan):
        for first in range(start, start + length, step_tokens):
            count = min(step_tokens, start + length - first)
            memory.update_cache(hash_text(memory, text, first, count, device))
            updates += 1
    return updates


def disk_warm_segments(plan: TextPlan, tokens: int, decode: bool, steps: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the text a phase's disk tables look up before its steps (their own warm-up,
    ``steps`` lookups of about :data:`DISK_WARM_PIECE` or ``T`` tokens): at prefill the ``steps x T`` tokens
    just before the first step; at decode the last ``min(prompt, steps x DISK_WARM_PIECE // T)`` tokens of
    each request's prompt."""
    if steps <= 0:
        return []
    if decode:
        length = min(plan.prompt, steps * DISK_WARM_PIECE // tokens)
        return [(cursor - length, length) for cursor in plan.cursors] if length else []
    first = max(0, plan.warm - steps * tokens)
    return [(first, plan.warm - first)] if plan.warm > first else []


def warm_disk(memory, text: TextStream, segments: list[tuple[int, int]], device, piece: int) -> dict:
    """Lookups of every layer's table of a disk memory on the hash ids of ``segments`` (each hashed as the
    stream continues), ``piece`` tokens a lookup: both caches admit what they serve. ``{"tokens", "lookups"}``."""
    if not segments:
        return {"tokens": 0, "lookups": 0}
    hash_ids = torch.cat([hash_text(memory, text, start, length, device) for start, length in segments])
    lookups = 0
    for first in range(0, hash_ids.shape[0], piece):
        part = hash_ids[first:first + piece]
        for index, layer_id in enumerate(memory.layer_ids):
            memory.table(layer_id).lookup_packed(part[:, index, :])
        lookups += 1
    return {"tokens": int(hash_ids.shape[0]), "lookups": lookups}


def disk_counts(memory) -> dict:
    """A disk memory's counters summed over its layers' tables: ``hbm_*`` and ``ram_*`` (``calls``, ``hits``,
    ``misses``, ``admitted``, over each lookup's distinct ids; the RAM cache's lookups are the HBM cache's
    misses), ``prefetched_rows``, ``reread_rows``, ``direct_reads`` and each cache's slots."""
    total: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        total[key] = total.get(key, 0) + int(value)

    for layer_id in memory.layer_ids:
        storage = memory.table(layer_id).storage
        hbm = storage.hbm_cache
        for key in ("calls", "hits", "misses", "admitted"):
            add(f"ram_{key}", storage.reads.cache.stats[key])
            add(f"hbm_{key}", 0 if hbm is None else hbm.stats[key])
        for key, value in storage.stats.items():
            add(key, value)
        add("ram_slots", storage.reads.cache.num_slots)
        add("hbm_slots", 0 if hbm is None else hbm.num_slots)
    return total


def close_tables(memory) -> None:
    """Close a disk memory's tables (reader threads, files, both caches)."""
    for layer_id in memory.layer_ids:
        memory.table(layer_id).storage.close()


# ---------------------------------------------------------------------------
# row caches: the cached placement's, or a CPU stand-in
# ---------------------------------------------------------------------------
class StandInCachedMemory:
    """Placement ``"cached"`` stood in for on the CPU (where it needs CUDA): lookups by a placement ``"cpu"``
    memory, and beside it a :class:`RowCache` per layer (the placement's own class and policy, its torch
    path) that ``update_cache`` feeds the step's ids as the placement would: the same hit and miss counts,
    without the HBM lookups."""

    def __init__(self, memory: EngramMemory, rows: dict[int, tuple[torch.Tensor, torch.Tensor]], fraction: float):
        from engram.table.placements.row_cache import RowCache

        self._memory, self._rows = memory, rows
        self.caches = {layer_id: RowCache(max(1, int(values.shape[0] * fraction)), memory.spec.head_dim, "cpu",
                                          recency=True) for layer_id, (values, _) in rows.items()}

    def __getattr__(self, name):
        return getattr(self._memory, name)

    def update_cache(self, hash_ids: torch.Tensor) -> None:
        for index, layer_id in enumerate(self._memory.spec.layer_ids):
            values, scales = self._rows[layer_id]
            self.caches[layer_id].update(hash_ids[:, index, :].to(torch.int64), values, scales)


def row_caches(memory) -> list:
    """Each layer's :class:`RowCache` of a cached memory (or its stand-in); empty for other placements."""
    if isinstance(memory, StandInCachedMemory):
        return [memory.caches[layer_id] for layer_id in memory.spec.layer_ids]
    found = []
    for layer_id in memory.layer_ids:
        cache = getattr(memory.table(layer_id).storage, "cache", None)
        if cache is not None:
            found.append(cache)
    return found


def cache_counts(memory) -> dict | None:
    """The caches' counters summed over layers (:attr:`RowCache.stats`: reads, hits, distinct rows per step,
    distinct missed rows per step); one host sync. None without caches."""
    caches = row_caches(memory)
    if not caches:
        return None
    total = sum(cache.stats.cpu() for cache in caches)
    reads, hits, distinct, missed = (int(v) for v in total.tolist())
    return {"reads": reads, "hits": hits, "distinct": distinct, "distinct_missed": missed,
            "slots": sum(cache.num_slots for cache in caches)}


def zero_cache_counts(memory) -> None:
    for cache in row_caches(memory):
        cache.stats.zero_()


def direct_max_rows(memory) -> int | None:
    """The row count up to which the memory's first table reads host memory directly (None: it has no
    such switch, as placement ``"cpu"``)."""
    return getattr(memory.table(memory.layer_ids[0]).storage, "direct_max_rows", None)
