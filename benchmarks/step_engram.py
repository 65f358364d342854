"""The Engram side of ``bench_step.py``, built through the library's public API: a spec at V4.1
geometry with smaller tables, a synthetic token map, per placement one ``EngramTable`` per layer
(random FP8 bytes), ``Engram.from_weights`` with an FP8 wkv, one ``EngramMemory`` per placement,
and the step's token inputs.

Placements (``kinds``): ``"device"`` (HBM), ``"host"``, ``"cached"`` (host rows + the default HBM
cache of 2% of rows), ``"seed"`` (placement ``"host"`` with every lookup on the direct path: the GPU
reads every row over PCIe in the gather kernel, on the main stream, the seed's design) and, without
CUDA, ``"cpu"``. ``host``, ``cached`` and ``seed`` share one pinned copy of each layer's rows; the
``device`` tables are a copy of the same bytes, so every placement returns the same rows.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import engram
from engram import EngramLayout, EngramMemory, EngramSpec, EngramTable, NgramHasher, TokenCompressor
from engram.layer import Engram

CONFIG = Path(engram.__file__).parent / "configs" / "deepseek-v4.1-flash.json"
RAW_VOCAB = 129280          # V4.1's token ids
SEED_DIRECT_ROWS = 1 << 62  # every lookup "decode-sized": the direct path
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


def build_tables(spec: EngramSpec, layout: EngramLayout, kinds: list[str], device, *, distinct_rows: int,
                 generator: torch.Generator, host_options: dict | None = None
                 ) -> tuple[dict[str, dict[int, EngramTable]], dict, list]:
    """``({kind: {layer_id: table}}, facts, keep)``; ``keep`` holds what must outlive the tables (the
    pinned rows). On CUDA the rows are random packed host rows (``common.host_table``,
    ``distinct_rows`` drawn and repeated); on the CPU random bytes for placement ``"cpu"``.
    ``host_options``: placement options of the ``host`` and ``cached`` tables (``gather_threads``, ...)."""
    tables: dict[str, dict[int, EngramTable]] = {kind: {} for kind in kinds}
    facts: dict = {"table_rows": list(layout.num_embeddings), "row_bytes": spec.row_bytes}
    keep = []
    head_dim = spec.head_dim
    for index, layer_id in enumerate(spec.layer_ids):
        rows = layout.num_embeddings[index]
        if "cpu" in kinds:
            values = torch.randint(0, 0x7F, (rows, head_dim), dtype=torch.uint8, generator=generator)
            scales = torch.randint(110, 127, (rows, head_dim // 32), dtype=torch.uint8, generator=generator)
            tables["cpu"][layer_id] = EngramTable.from_layout(layout, index, None, values, scales, placement="cpu",
                                                              validate=False)
            continue
        from common import host_table

        base = host_table(rows, head_dim, seed=index, distinct_rows=distinct_rows)
        keep.append(base)
        packed = base.storage.rows
        facts.setdefault("huge_pages", []).append(bool(base.storage.host_buffer.huge_pages))
        for kind in kinds:
            if kind == "device":
                on_device = packed.packed.to(device)
                values, scales = on_device[:-1, :head_dim], on_device[:-1, head_dim: head_dim + head_dim // 32]
                table = EngramTable.from_layout(layout, index, None, values, scales, placement="device", device=device,
                                                validate=False, check_values=False)  # common.host_table's rows
            elif kind in ("host", "cached"):
                table = EngramTable.from_layout(layout, index, None, packed.values, packed.scales, placement=kind,
                                                device=device, validate=False, check_values=False,
                                                placement_options=dict(host_options or {}))
            elif kind == "seed":
                table = _seed_table(layout, index, packed.values, packed.scales, device, facts)
            else:
                raise ValueError(f"kinds: unknown table kind {kind!r}")
            tables[kind][layer_id] = table
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
        placement = "host" if kind == "seed" else kind
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
