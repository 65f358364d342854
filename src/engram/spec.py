"""EngramSpec: the Engram keys of a model's ``config.json``, parsed and validated.

Keys may sit at the top level or under ``text_config`` (docs/design.md §2). Every error
names the field, what was expected and what was found.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engram.checks import check_int
from engram.primes import bucket_primes

__all__ = ["EngramSpec"]

_PAD_KEYS = ("engram_pad_token_id", "engram_pad_id")


def _lookup(config: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """Find ``key`` at the top level or under ``text_config``; both present must agree."""
    text_config = config.get("text_config") or {}
    in_top, in_text = key in config, key in text_config
    if in_top and in_text and config[key] != text_config[key]:
        raise ValueError(
            f"config field {key!r} disagrees: top level has {config[key]!r}, "
            f"text_config has {text_config[key]!r}"
        )
    if in_top:
        return True, config[key]
    if in_text:
        return True, text_config[key]
    return False, None


def _require(config: Mapping[str, Any], key: str) -> Any:
    found, value = _lookup(config, key)
    if not found:
        raise ValueError(f"config field {key!r} is missing (looked at the top level and under text_config)")
    return value


# Bounds of every field, checked before any work that grows with them (the prime search, the
# tables, the kernels' tile sizes). Each comfortably holds DeepSeek-V4.1's value (in brackets)
# and refuses what no model needs and would only make `engram info` or the hasher run for minutes.
_MAX_LAYERS = 64                   # Engram layers [2]; also a decoder layer index below 4096
_MAX_LAYER_ID = 4095               # [1, 14]; below num_hidden_layers when the config gives it
_MAX_NGRAM_SIZE = 8                # [4]: the hasher keeps N - 1 tokens of history per request
_MAX_HEADS = 64                    # [8] heads per n-gram order
_MAX_TOTAL_COLUMNS = 1024          # layers x (N - 1) x heads [48]: one prime each, found one by one
_MAX_HEAD_DIM = 4096               # [256], a multiple of 32
_MAX_VOCAB_SIZE = 2**31 - 1        # engram_vocab_size [16,000,000]: where the primes start
_MAX_COMPRESSED_VOCAB = 2**24      # [99,092]: compressed ids of a tokenizer
_MAX_ROWS = 2**40                  # rows of one table [384,016,682]; 2**40 rows is ~280 TB
_MAX_HIDDEN_SIZE = 65536           # [5120]
_MAX_HC_MULT = 64                  # [4] hyper-connection copies
_MAX_BLOCK = 4096                  # quantization_config.weight_block_size entries [128, 128]
_MAX_DECODER_LAYERS = 4096         # num_hidden_layers [43]


def _as_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    return check_int(f"config field {key!r}", value, minimum, maximum=maximum)


def _as_int_list(key: str, value: Any, minimum: int, maximum: int | None = None, max_entries: int | None = None
                 ) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"config field {key!r}: expected a non-empty list of integers, found {value!r}")
    if max_entries is not None and len(value) > max_entries:
        raise ValueError(f"config field {key!r}: expected at most {max_entries} entries, found {len(value)}")
    return tuple(_as_int(f"{key}[{i}]", v, minimum, maximum) for i, v in enumerate(value))


@dataclass(frozen=True)
class EngramSpec:
    """The Engram geometry of one model.

    ``num_embeddings[i]`` is the row count of the table of layer ``layer_ids[i]``;
    ``vocab_size`` is where the prime search starts (``engram_vocab_size``).
    """

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int
    compressed_vocab_size: int
    pad_token_id: int
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float
    # [rows, cols] of the FP8 block scales of ``wkv`` when the checkpoint is quantized.
    weight_block_size: tuple[int, int] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_orders(self) -> int:
        """n-gram orders 2..N: ``N - 1`` of them."""
        return self.max_ngram_size - 1

    @property
    def num_columns(self) -> int:
        """Hash columns per layer: ``C = (N - 1) * n_heads``."""
        return self.num_orders * self.n_heads

    @property
    def kv_dim(self) -> int:
        """Output width of ``wkv``: ``(hc_mult + 1) * hidden_size``."""
        return (self.hc_mult + 1) * self.hidden_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one FP8 table row: E4M3 values plus one UE8M0 scale per 32."""
        return self.head_dim + self.head_dim // 32

    def layer_index(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(f"layer_id {layer_id} is not an Engram layer; engram_layer_ids = {list(self.layer_ids)}") from None

    # ---- construction --------------------------------------------------------
    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any], *, check_rows: bool = True) -> "EngramSpec":
        """Parse a ``config.json`` path, a model directory holding one, or a dict.

        With ``check_rows`` (the default) the row counts are checked against the
        prime rule of docs/design.md §2.
        """
        config = _load_config(source)
        if isinstance(source, Mapping):
            return cls._from_config(config, check_rows)
        try:
            return cls._from_config(config, check_rows)
        except ValueError as error:  # a field's error names the file it came from
            raise ValueError(f"config file {str(_config_path(source))!r}: {error}") from None

    @classmethod
    def _from_config(cls, config: Mapping[str, Any], check_rows: bool) -> "EngramSpec":
        layer_ids = _as_int_list("engram_layer_ids", _require(config, "engram_layer_ids"), 0, _MAX_LAYER_ID,
                                 _MAX_LAYERS)
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"config field 'engram_layer_ids': expected distinct layer ids, found {list(layer_ids)}")
        found, decoder_layers = _lookup(config, "num_hidden_layers")
        if found:
            decoder_layers = _as_int("num_hidden_layers", decoder_layers, 1, _MAX_DECODER_LAYERS)
            beyond = [layer_id for layer_id in layer_ids if layer_id >= decoder_layers]
            if beyond:
                raise ValueError(f"config field 'engram_layer_ids': layer ids {beyond} are beyond the model's "
                                 f"decoder layers 0..{decoder_layers - 1} (num_hidden_layers = {decoder_layers})")

        raw_rows = _require(config, "engram_num_embeddings")
        if isinstance(raw_rows, int) and not isinstance(raw_rows, bool):
            raw_rows = [raw_rows]
        num_embeddings = _as_int_list("engram_num_embeddings", raw_rows, 1, _MAX_ROWS, _MAX_LAYERS)
        if len(num_embeddings) != len(layer_ids):
            raise ValueError(
                f"config field 'engram_num_embeddings': expected {len(layer_ids)} entries "
                f"(one per engram_layer_ids), found {len(num_embeddings)}"
            )

        max_ngram_size = _as_int("engram_max_ngram_size", _require(config, "engram_max_ngram_size"), 2,
                                 _MAX_NGRAM_SIZE)
        n_heads = _as_int("engram_n_heads", _require(config, "engram_n_heads"), 1, _MAX_HEADS)
        total_columns = len(layer_ids) * (max_ngram_size - 1) * n_heads
        if total_columns > _MAX_TOTAL_COLUMNS:
            raise ValueError(f"config fields 'engram_layer_ids', 'engram_max_ngram_size', 'engram_n_heads': "
                             f"{len(layer_ids)} layers x {max_ngram_size - 1} orders x {n_heads} heads = "
                             f"{total_columns} hash columns, expected at most {_MAX_TOTAL_COLUMNS}")
        head_dim = _as_int("engram_head_dim", _require(config, "engram_head_dim"), 32, _MAX_HEAD_DIM)
        if head_dim % 32:
            raise ValueError(f"config field 'engram_head_dim': expected a multiple of 32 (one UE8M0 scale per 32), found {head_dim}")
        vocab_size = _as_int("engram_vocab_size", _require(config, "engram_vocab_size"), 2, _MAX_VOCAB_SIZE)
        compressed = _as_int("engram_compressed_vocab_size", _require(config, "engram_compressed_vocab_size"), 1,
                             _MAX_COMPRESSED_VOCAB)

        pad_found = [(k, v) for k in _PAD_KEYS for found, v in [_lookup(config, k)] if found]
        if not pad_found:
            raise ValueError(f"config field 'engram_pad_token_id' is missing (also looked for {_PAD_KEYS[1]!r})")
        if len(pad_found) == 2 and pad_found[0][1] != pad_found[1][1]:
            raise ValueError(
                f"config fields {_PAD_KEYS[0]!r} = {pad_found[0][1]!r} and {_PAD_KEYS[1]!r} = {pad_found[1][1]!r} disagree"
            )
        pad_token_id = _as_int(pad_found[0][0], pad_found[0][1], 0, _MAX_VOCAB_SIZE)

        hidden_size = _as_int("hidden_size", _require(config, "hidden_size"), 1, _MAX_HIDDEN_SIZE)
        hc_mult = _as_int("hc_mult", _require(config, "hc_mult"), 1, _MAX_HC_MULT)
        eps = _require(config, "rms_norm_eps")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"config field 'rms_norm_eps': expected a number in (0, 1), found {eps!r}")

        spec = cls(
            layer_ids=layer_ids,
            num_embeddings=num_embeddings,
            max_ngram_size=max_ngram_size,
            n_heads=n_heads,
            head_dim=head_dim,
            vocab_size=vocab_size,
            compressed_vocab_size=compressed,
            pad_token_id=pad_token_id,
            hidden_size=hidden_size,
            hc_mult=hc_mult,
            rms_norm_eps=float(eps),
            weight_block_size=_weight_block_size(config),
            extra=dict(config),
        )
        if check_rows:
            spec.check_row_counts()
        return spec

    def check_row_counts(self) -> None:
        """Raise unless ``num_embeddings`` equals the sums of primes of docs/design.md §2."""
        primes_per_layer = bucket_primes(len(self.layer_ids), self.max_ngram_size, self.n_heads, self.vocab_size)
        for index, (layer_id, primes) in enumerate(zip(self.layer_ids, primes_per_layer)):
            expected = sum(sum(order) for order in primes)
            if expected != self.num_embeddings[index]:
                raise ValueError(
                    f"config field 'engram_num_embeddings[{index}]' (layer {layer_id}): the prime rule gives "
                    f"{expected} rows, the config says {self.num_embeddings[index]}"
                )

    def to_hf_config(self) -> dict[str, Any]:
        """The Engram keys as they appear at the top level of ``config.json``."""
        config: dict[str, Any] = {
            "engram_layer_ids": list(self.layer_ids),
            "engram_num_embeddings": list(self.num_embeddings),
            "engram_max_ngram_size": self.max_ngram_size,
            "engram_n_heads": self.n_heads,
            "engram_head_dim": self.head_dim,
            "engram_vocab_size": self.vocab_size,
            "engram_compressed_vocab_size": self.compressed_vocab_size,
            "engram_pad_token_id": self.pad_token_id,
            "hidden_size": self.hidden_size,
            "hc_mult": self.hc_mult,
            "rms_norm_eps": self.rms_norm_eps,
        }
        if self.weight_block_size is not None:
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                             "weight_block_size": list(self.weight_block_size)}
        return config


def _weight_block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    found, quant = _lookup(config, "quantization_config")
    if not found or quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"config field 'quantization_config': expected an object such as "
                         f"{{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}}, found {quant!r}")
    # What this package reads: FP8 E4M3 weights with UE8M0 (or float) block scales.
    for key, accepted in (("quant_method", ("fp8",)), ("fmt", ("e4m3",)), ("scale_fmt", ("ue8m0",))):
        if key in quant and quant[key] not in accepted:
            raise ValueError(f"config field 'quantization_config.{key}': expected "
                             f"{' or '.join(repr(a) for a in accepted)} (FP8 E4M3 weights with UE8M0 block scales), "
                             f"found {quant[key]!r}")
    block = quant.get("weight_block_size")
    if block is None:
        return None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= _MAX_BLOCK for b in block)):
        raise ValueError(f"config field 'quantization_config.weight_block_size': expected two integers in "
                         f"[1, {_MAX_BLOCK}], found {block!r}")
    return (int(block[0]), int(block[1]))


def _config_path(source: str | os.PathLike) -> Path:
    """The config.json of a path: the file itself, or the one a model directory holds."""
    path = Path(source)
    return path / "config.json" if path.is_dir() else path


def _load_config(source: str | os.PathLike | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    path = _config_path(source)
    if not path.exists():
        raise ValueError(f"config path {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"config path {str(path)!r} is a directory; expected a config.json file")
    if not path.is_file():
        raise ValueError(f"config path {str(path)!r} is not a regular file; expected a config.json or a model "
                         f"directory holding one")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"config file {str(path)!r} cannot be read ({error.strerror or error})") from None
    if not data.strip():
        raise ValueError(f"config file {str(path)!r} is empty; expected a JSON object")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte {data[error.start]:#04x} at offset "
                         f"{error.start}); expected a JSON object") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"config file {str(path)!r}: expected a JSON object, found {type(config).__name__}")
    return config
