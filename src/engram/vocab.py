"""Token compression (docs/design.md §2): tokens that normalize alike share one compressed id.

``TokenCompressor.from_tokenizer(x)`` decodes every token id alone, normalizes the
text with a HF ``tokenizers`` normalizer chain and numbers the distinct keys in
order of first appearance. The map depends only on the tokenizer, so it is
cached on disk keyed by the sha256 of the tokenizer's JSON.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

from engram.spec import EngramSpec
from engram.environment import cache_directory

__all__ = ["TokenCompressor", "compression_normalizer", "cache_dir"]

# Bump when the compression rule changes: old cache files are then ignored.
_RULE_VERSION = "v1"
_SENTINEL = "\ue000"  # private-use character protecting a text that is exactly one space
_REPLACEMENT_CHARACTER = "\ufffd"


def compression_normalizer() -> normalizers.Normalizer:
    """NFKC, NFD, strip accents, lowercase, collapse ``[ \\t\\r\\n]+`` to one space,
    protect a lone space, strip, restore the lone space."""
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def cache_dir() -> Path:
    """``$ENGRAM_CACHE_DIR``, else ``$XDG_CACHE_HOME/engram``, else ``~/.cache/engram``."""
    return cache_directory()


def _resolve_tokenizer(source: Any) -> tuple[Callable[[], Tokenizer], bytes]:
    """A loader of the raw fast tokenizer (parsed only on a cache miss) and the bytes
    that identify it (its JSON)."""
    if isinstance(source, Tokenizer):
        return (lambda: source), source.to_str().encode("utf-8")
    backend = getattr(source, "backend_tokenizer", None)  # a transformers fast tokenizer
    if isinstance(backend, Tokenizer):
        return (lambda: backend), backend.to_str().encode("utf-8")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer path {str(path)!r} does not exist (expected a tokenizer.json or a directory holding one)")
        data = path.read_bytes()

        def parse() -> Tokenizer:
            try:
                return Tokenizer.from_str(data.decode("utf-8"))
            except Exception as error:  # tokenizers raises its own Exception type
                raise ValueError(f"tokenizer file {str(path)!r} could not be parsed: {error}") from None

        return parse, data
    raise ValueError(
        f"tokenizer: expected a tokenizer.json path, a model directory, a tokenizers.Tokenizer or a "
        f"transformers fast tokenizer, found {type(source).__name__}"
    )


def build_token_map(tokenizer: Tokenizer) -> np.ndarray:
    """int32 ``[vocab]``: compressed id of every token id (added tokens included)."""
    num_ids = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(num_ids)], skip_special_tokens=False)
    normalizer = compression_normalizer()
    key_to_id: dict[str, int] = {}
    token_map = np.empty(num_ids, dtype=np.int32)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHARACTER in text:  # a partial UTF-8 byte token: keep the raw token string
            key = tokenizer.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return token_map


class TokenCompressor:
    """Map raw token ids to compressed ids.

    Attributes:
        token_map: int32 numpy ``[vocab]``, compressed id per token id.
        size: number of compressed ids (``max(token_map) + 1``).
        fingerprint: sha256 of the tokenizer JSON the map was built from.
    """

    def __init__(self, token_map: np.ndarray, fingerprint: str = ""):
        token_map = np.ascontiguousarray(token_map, dtype=np.int32)
        if token_map.ndim != 1 or token_map.size == 0:
            raise ValueError(f"token_map: expected a non-empty 1-D array, found shape {token_map.shape}")
        if token_map.min() < 0:
            raise ValueError(f"token_map: compressed ids must be >= 0, found {int(token_map.min())}")
        self.token_map = token_map
        self.size = int(token_map.max()) + 1
        self.fingerprint = fingerprint
        self._device_maps: dict[torch.device, torch.Tensor] = {}

    @property
    def vocab_size(self) -> int:
        """Raw token ids accepted: ``len(token_map)``."""
        return int(self.token_map.size)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, spec: EngramSpec | None = None, *, use_cache: bool = True) -> "TokenCompressor":
        """Build (or load from the on-disk cache) the map of a tokenizer.

        ``tokenizer``: a tokenizer.json path, a model directory, a
        ``tokenizers.Tokenizer`` or a transformers fast tokenizer. With ``spec``
        the compressed size must equal ``engram_compressed_vocab_size``.
        """
        load_tokenizer, identity = _resolve_tokenizer(tokenizer)
        fingerprint = hashlib.sha256(identity).hexdigest()
        cache_file = cache_dir() / f"token_map-{_RULE_VERSION}-{fingerprint}.npz"
        token_map = _load_cached(cache_file, fingerprint) if use_cache else None
        if token_map is None:
            token_map = build_token_map(load_tokenizer())
            if use_cache:
                _store_cached(cache_file, token_map, fingerprint)
        compressor = cls(token_map, fingerprint)
        if spec is not None:
            compressor.check_spec(spec)
        return compressor

    def check_spec(self, spec: EngramSpec) -> None:
        """Raise unless the map agrees with the config: ``engram_compressed_vocab_size``
        compressed ids, and ``engram_pad_token_id`` among the token ids."""
        if self.size != spec.compressed_vocab_size:
            raise ValueError(
                f"config field 'engram_compressed_vocab_size' is {spec.compressed_vocab_size}, but the tokenizer "
                f"compresses {self.vocab_size} token ids to {self.size}"
            )
        if spec.pad_token_id >= self.vocab_size:
            raise ValueError(
                f"config field 'engram_pad_token_id' is {spec.pad_token_id}, beyond the tokenizer's {self.vocab_size} ids"
            )

    def compress(self, token_ids: np.ndarray) -> np.ndarray:
        """Compressed ids (int64, same shape) of raw token ids; raises on ids out of range."""
        token_ids = np.asarray(token_ids)
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.vocab_size):
            bad = token_ids[(token_ids < 0) | (token_ids >= self.vocab_size)].flat[0]
            raise ValueError(f"token_ids: id {int(bad)} is outside the tokenizer's range [0, {self.vocab_size})")
        return self.token_map[token_ids].astype(np.int64)

    def device_map(self, device: torch.device | str) -> torch.Tensor:
        """The map as an int32 tensor on ``device`` (kept, one copy per device)."""
        import torch  # here only: the token map itself (``engram hash``) needs no torch

        device = torch.device(device)
        if device not in self._device_maps:
            self._device_maps[device] = torch.from_numpy(self.token_map).to(device)
        return self._device_maps[device]

    def __repr__(self) -> str:
        return f"TokenCompressor(vocab_size={self.vocab_size}, size={self.size})"


def _cache_digest(token_map: np.ndarray, fingerprint: str) -> str:
    """sha256 of the tokenizer's fingerprint and the map's bytes: what a cache file must carry."""
    return hashlib.sha256(fingerprint.encode("ascii") + token_map.tobytes()).hexdigest()


def _load_cached(path: Path, fingerprint: str) -> np.ndarray | None:
    """The cached map, or None when absent, damaged or not the map of this tokenizer (its
    digest of fingerprint and map disagrees): then it is rebuilt and the file replaced."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            token_map, digest = archive["token_map"], str(archive["digest"])
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None
    if token_map.dtype != np.int32 or token_map.ndim != 1 or token_map.size == 0 or token_map.min() < 0:
        return None
    if digest != _cache_digest(token_map, fingerprint):
        return None
    # Ids are numbered in order of first appearance: each new id is one above the running max.
    running_max = np.maximum.accumulate(token_map)
    if token_map[0] != 0 or np.any(np.diff(running_max) > 1):
        return None
    return token_map


def _store_cached(path: Path, token_map: np.ndarray, fingerprint: str) -> None:
    """Write the map and its digest atomically (temp file + rename); a read-only cache dir is not an error."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz.tmp", delete=False) as handle:
            temporary = handle.name
            np.savez(handle, token_map=token_map, digest=np.array(_cache_digest(token_map, fingerprint)))
        os.replace(temporary, path)
        temporary = None
    except OSError:
        pass
    finally:
        if temporary is not None:  # any failure after the temp file was made: it goes too
            try:
                os.unlink(temporary)
            except OSError:
                pass
