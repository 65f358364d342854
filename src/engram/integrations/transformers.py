"""DeepSeek-V4.1's Engram layers on 🤗 transformers' ``DeepseekV4ForCausalLM``.

``handle = attach_engram(model, memory)`` hooks the model so that its forward (and so
``generate()``) runs every Engram layer of ``memory``; ``handle.remove()`` undoes it.
``load_model(model_dir)`` reads a V4.1 checkpoint directory: the model through
transformers, the Engram tensors through :meth:`EngramMemory.from_pretrained`.

Where the update goes. transformers' decoder layer takes the hyper-connection
stream ``hidden_states [B, S, hc_mult, D]`` and mixes it first thing
(``attn_hc``); V4.1 updates the whole stream just before that:
``h <- h + g * value`` (docs/design.md §1), so a forward pre-hook on
``model.model.layers[i]`` replaces the layer's input stream.

Hash ids. A pre-hook on ``model.model`` hashes the forward's ``input_ids`` once for
all Engram layers. Each batch row is one request with its own row of the
per-request history (:meth:`NgramHasher.bind_request_history`); token ``j`` of a
forward sits at position ``past + j``, where ``past`` is the cache's length
(every row of a padded batch has the same length). The cache is the forward's
``cache`` argument (transformers >= 5.24) or ``past_key_values`` (up to 5.23, and
5.24's deprecated spelling of ``cache``): read under the name the model's forward
takes. Positions whose ``attention_mask`` is 0 (padding, left or right) are dead
tokens: no n-gram crosses them and their stream passes through unchanged, so a
padded row's ids equal the row's alone. A forward that starts at position 0 starts clean; beam
search's ``cache.reorder_cache(beam_idx)`` reorders the history rows too.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import weakref
from typing import Any

import torch

from engram.hashing import NgramHasher
from engram.memory import EngramMemory

__all__ = ["EngramHandle", "attach_engram", "load_model"]

_HANDLE_ATTRIBUTE = "engram_handle"
# The forward's cache argument: ``cache`` from transformers 5.24 on (which still renames a
# ``past_key_values`` keyword to it), ``past_key_values`` before. The first of these in the
# forward's signature is its own name; a later one is an older spelling it may still take.
_CACHE_ARGUMENTS = ("cache", "past_key_values")


def _decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding ``layers`` (``model.model`` of a causal LM, or the base model itself)."""
    inner = getattr(model, "model", None)
    for candidate in (inner, model):
        if isinstance(candidate, torch.nn.Module) and isinstance(getattr(candidate, "layers", None), torch.nn.ModuleList):
            return candidate
    raise ValueError(f"model: expected a DeepseekV4ForCausalLM (or DeepseekV4Model) with decoder layers at "
                     f"model.model.layers, found {type(model).__name__} without them")


def _check_model(model: torch.nn.Module, stack: torch.nn.Module, memory: EngramMemory) -> None:
    """The model's config and layers must match the Engram spec; a clear error otherwise."""
    spec = memory.spec
    config = getattr(model, "config", None)
    name = type(model).__name__
    hc_mult = getattr(config, "hc_mult", None)
    has_stream = all(hasattr(layer, "attn_hc") for layer in stack.layers)
    if hc_mult is None or not has_stream:
        raise ValueError(f"model: {name} has no hyper-connection stream (config field 'hc_mult' "
                         f"{'missing' if hc_mult is None else hc_mult}, decoder layers without 'attn_hc'); Engram "
                         f"updates the [B, S, hc_mult, hidden] stream of DeepseekV4ForCausalLM")
    for field, found, expected in (("hidden_size", getattr(config, "hidden_size", None), spec.hidden_size),
                                   ("hc_mult", hc_mult, spec.hc_mult)):
        if found != expected:
            raise ValueError(f"model config field {field!r} is {found!r}, the Engram spec has {expected}")
    vocab_size = getattr(config, "vocab_size", None)
    spec_vocab = spec.extra.get("vocab_size", (spec.extra.get("text_config") or {}).get("vocab_size"))
    if isinstance(spec_vocab, int) and vocab_size != spec_vocab:
        raise ValueError(f"model config field 'vocab_size' is {vocab_size!r}, the Engram config has {spec_vocab}")
    if not isinstance(vocab_size, int) or vocab_size < memory.vocab.vocab_size:
        raise ValueError(f"model config field 'vocab_size' is {vocab_size!r}, the Engram tokenizer has "
                         f"{memory.vocab.vocab_size} ids (expected at least as many)")
    num_layers = len(stack.layers)
    outside = [layer_id for layer_id in spec.layer_ids if layer_id >= num_layers]
    if outside:
        raise ValueError(f"Engram layer ids {outside} (config field 'engram_layer_ids' = {list(spec.layer_ids)}) "
                         f"are beyond the model's {num_layers} decoder layers")


def _argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str) -> Any:
    """``name``'s value in a call ``(args, kwargs)`` of a function with ``signature`` (None if absent)."""
    if name in kwargs:
        return kwargs[name]
    try:
        return signature.bind_partial(*args).arguments.get(name)
    except TypeError:
        return None


def _cache_parameter(signature: inspect.Signature, owner: str) -> str:
    """The name under which a forward with ``signature`` takes its KV cache (see ``_CACHE_ARGUMENTS``)."""
    for name in _CACHE_ARGUMENTS:
        if name in signature.parameters:
            return name
    raise ValueError(f"{owner}.forward: expected a KV-cache argument named one of {list(_CACHE_ARGUMENTS)}, found "
                     f"parameters {list(signature.parameters)}; Engram needs the cache to know each token's position")


def _cache_argument(signature: inspect.Signature, parameter: str, args: tuple, kwargs: dict) -> Any:
    """The cache a forward call ``(args, kwargs)`` passes: under ``parameter`` (its own name), else under an
    older spelling that comes after it in ``_CACHE_ARGUMENTS`` (renamed to ``parameter`` inside the forward;
    as there, ``parameter`` wins when both are given). None when the call passes no cache."""
    if parameter not in kwargs:
        for older in _CACHE_ARGUMENTS[_CACHE_ARGUMENTS.index(parameter) + 1:]:
            if older in kwargs:
                return kwargs[older]
    return _argument(signature, args, kwargs, parameter)


def _output_cache(output: Any) -> Any:
    """The cache a forward returned (``output.cache`` from transformers 5.24 on, ``output.past_key_values``
    before; read without touching 5.24's deprecated alias). None for a tuple output or no cache."""
    present = set(output.keys()) if isinstance(output, dict) else set()   # a ModelOutput is a dict
    for name in _CACHE_ARGUMENTS:
        if name in present:
            return output[name]
    return None


class _Step:
    """What one forward hashed: ids ``[B*S, L, C]`` and live tokens ``[B*S]`` on the memory's device, and
    the prefetch of every layer's rows (None until it is called: once the decoder layer before the first
    Engram layer has run, or right after hashing where that is layer 0)."""

    def __init__(self, batch: int, length: int, hash_ids: torch.Tensor, token_mask: torch.Tensor, prefetch):
        self.batch, self.length = batch, length
        self.hash_ids, self.token_mask = hash_ids, token_mask
        self.prefetch = prefetch
        self.layers_run = 0


class EngramHandle:
    """The hooks :func:`attach_engram` put on a model; :meth:`remove` takes them off.

    Attributes:
        model, memory: what was joined.
        hasher: this handle's :class:`NgramHasher` (its own per-request history, one row per batch row).
        hash_ids: int ``[B, S, L, C]`` of the last forward (None before one), as every layer used them.
        token_mask: bool ``[B, S]`` of the last forward (False = padding: dead, passes through).
        timings: seconds spent hashing (``"hash"``) and in the Engram layers (``"layers"``), and the
            number of forwards (``"forwards"``), since :meth:`reset_timings`. With ``profile=True``
            the clock waits for the device (CUDA) before each reading.
    """

    def __init__(self, model: torch.nn.Module, memory: EngramMemory, *, validate: bool | None = None,
                 profile: bool = False):
        self.model, self.memory = model, memory
        self._stack = _decoder_stack(model)
        _check_model(model, self._stack, memory)
        if getattr(model, _HANDLE_ATTRIBUTE, None) is not None:
            raise ValueError(f"model: Engram is already attached to this {type(model).__name__}; "
                             f"call its handle's remove() first")
        base = memory.hasher
        self.hasher = NgramHasher(memory.layout, memory.vocab, device=memory.device,
                                  validate=base.validate if validate is None else validate, backend=base.backend)
        self.profile = profile
        self.hash_ids: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None
        self.timings: dict[str, float] = {}
        self.reset_timings()
        self._step: _Step | None = None
        self._rows: torch.Tensor | None = None     # int64 [B] history rows of the running sequence
        self._next_position = 0                    # where the running sequence continues
        self._cache_ref: weakref.ref | None = None  # the running sequence's cache
        self._patched_caches: weakref.WeakSet = weakref.WeakSet()
        self._signature = inspect.signature(self._stack.forward)
        self._cache_name = _cache_parameter(self._signature, type(self._stack).__name__)
        self._hooks = [
            self._stack.register_forward_pre_hook(self._before_model, with_kwargs=True),
            self._stack.register_forward_hook(self._after_model, with_kwargs=True, always_call=True),
        ]
        for layer_id in memory.layer_ids:
            hook = functools.partial(self._before_layer, layer_id)
            self._hooks.append(self._stack.layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True))
        # The prefetch is called once the decoder layers before the first Engram layer are enqueued: its
        # host time then overlaps their GPU work, and its reads still start right after hashing (H200,
        # T = 8192: +0.08% over HBM tables a step, +0.67% called right after hashing; docs/benchmarks.md "What
        # Engram costs a served step").
        self._prefetch_after = min(memory.layer_ids) - 1  # -1: right after hashing
        if self._prefetch_after >= 0:
            self._hooks.append(self._stack.layers[self._prefetch_after].register_forward_hook(self._start_prefetch))
        setattr(model, _HANDLE_ATTRIBUTE, self)

    # ---- lifetime --------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def remove(self) -> None:
        """Take every hook off (the model computes exactly what it did before); idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for cache in list(self._patched_caches):
            if getattr(cache.__dict__.get("reorder_cache"), "_engram_handle", None) is self:
                del cache.__dict__["reorder_cache"]
        if getattr(self.model, _HANDLE_ATTRIBUTE, None) is self:
            delattr(self.model, _HANDLE_ATTRIBUTE)
        self._step = None

    def reset_timings(self) -> None:
        self.timings = {"hash": 0.0, "layers": 0.0, "forwards": 0}

    def _clock(self) -> float:
        if self.profile and self.memory.device.type == "cuda":
            torch.cuda.synchronize(self.memory.device)
        return time.perf_counter()

    # ---- per forward -----------------------------------------------------------
    def _before_model(self, module, args: tuple, kwargs: dict):
        """Hash the forward's tokens once, for every Engram layer."""
        started = self._clock()
        read = functools.partial(_argument, self._signature, args, kwargs)
        input_ids, attention_mask = read("input_ids"), read("attention_mask")
        cache = _cache_argument(self._signature, self._cache_name, args, kwargs)
        if input_ids is None:
            raise ValueError("input_ids: Engram hashes token ids, found None (a forward with inputs_embeds only "
                             "cannot run Engram layers)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            found = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids: expected an integer tensor [batch, sequence], found {found}")
        batch, length = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        rows = self._sequence_rows(batch, past)
        device = self.hasher.device
        positions = (torch.arange(length, device=device) + past).repeat(batch)
        query_start_loc = torch.arange(batch + 1, device=device, dtype=torch.int64) * length
        live = self._live_tokens(attention_mask, batch, length).to(device)
        hash_ids = self.hasher(input_ids.reshape(-1).to(device), positions, query_start_loc,
                               dead_mask=~live.reshape(-1), request_rows=rows)
        self._next_position = past + length
        # Every layer's rows are prefetched once per forward (host placements), each consumed by its own layer only.
        self._step = _Step(batch, length, hash_ids, live.reshape(-1), None)
        if self._prefetch_after < 0:
            self._step.prefetch = self.memory.prefetch(hash_ids)
        self.hash_ids = hash_ids.view(batch, length, *hash_ids.shape[1:])
        self.token_mask = live
        self.timings["hash"] += self._clock() - started
        self.timings["forwards"] += 1
        return None

    def _sequence_rows(self, batch: int, past: int) -> torch.Tensor:
        """History rows ``[0, batch)``: fresh ones when the forward starts a sequence (``past == 0``),
        else those of the running sequence, which must continue exactly where it stopped."""
        if past == 0:
            history = self.hasher.request_history
            if history is None or history.max_requests < batch:
                self.hasher.bind_request_history(max(batch, 1), max_draft_tokens=0)
            self._rows = torch.arange(batch, dtype=torch.int64, device=self.hasher.device)
            self.hasher.request_history.reset(self._rows)
            return self._rows
        if self._rows is None or past != self._next_position:
            held = "no sequence" if self._rows is None else f"positions up to {self._next_position - 1}"
            raise ValueError(f"{self._cache_name}: the cache holds {past} tokens, but Engram's history holds {held}; "
                             f"run the sequence from its first token with Engram attached")
        if batch != len(self._rows):
            raise ValueError(f"input_ids: batch of {batch} rows continues a sequence of {len(self._rows)} rows "
                             f"(Engram keeps one history row per batch row)")
        return self._rows

    @staticmethod
    def _live_tokens(attention_mask: Any, batch: int, length: int) -> torch.Tensor:
        """bool ``[B, S]``: the forward's tokens whose ``attention_mask`` column is not 0."""
        if attention_mask is None:
            return torch.ones(batch, length, dtype=torch.bool)
        if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
                or attention_mask.shape[0] != batch or attention_mask.shape[1] < length):
            found = (f"shape {list(attention_mask.shape)}" if isinstance(attention_mask, torch.Tensor)
                     else type(attention_mask).__name__)
            raise ValueError(f"attention_mask: Engram needs the 2-D padding mask [{batch}, past + {length}] to know "
                             f"the padding tokens, found {found}")
        return attention_mask[:, -length:] != 0

    def _start_prefetch(self, module, args: tuple, output: Any) -> None:
        """After the decoder layer before the first Engram layer: the forward's prefetch (once)."""
        step = self._step
        if step is not None and step.prefetch is None and step.layers_run == 0:
            step.prefetch = self.memory.prefetch(step.hash_ids)

    def _before_layer(self, layer_id: int, module, args: tuple, kwargs: dict):
        """Replace the layer's input stream ``[B, S, hc, D]`` by ``h + g * value``."""
        step = self._step
        if step is None:
            raise ValueError(f"decoder layer {layer_id} ran outside the model's forward: Engram has no hash ids "
                             f"for it (call the model, not the layer)")
        started = self._clock()
        in_kwargs = "hidden_states" in kwargs
        hidden = kwargs["hidden_states"] if in_kwargs else args[0]
        spec = self.memory.spec
        expected = [step.batch, step.length, spec.hc_mult, spec.hidden_size]
        if not isinstance(hidden, torch.Tensor) or list(hidden.shape) != expected:
            found = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden_states of decoder layer {layer_id}: expected the hc stream {expected} "
                             f"(batch, sequence, hc_mult, hidden), found {found}")
        flat = hidden.reshape(-1, spec.hc_mult, spec.hidden_size).to(self.memory.device)
        out = self.memory.forward_layer(layer_id, flat, step.hash_ids, step.token_mask, prefetch=step.prefetch)
        step.layers_run += 1
        out = out.to(hidden.device, hidden.dtype).view_as(hidden)
        self.timings["layers"] += self._clock() - started
        if in_kwargs:
            return args, {**kwargs, "hidden_states": out}
        return (out, *args[1:]), kwargs

    def _after_model(self, module, args: tuple, kwargs: dict, output: Any):
        """The forward is over: a row cache learns from its reads (placement ``"cached"``; a no-op for the
        others, and skipped for a forward that failed or is being captured); beam search may now reorder
        its cache, and the history follows."""
        step, self._step = self._step, None
        capturing = self.memory.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if step is not None and output is not None and step.layers_run == len(self.memory.layer_ids) and not capturing:
            self.memory.update_cache(step.hash_ids)
        cache = _output_cache(output)
        if cache is None:
            cache = _cache_argument(self._signature, self._cache_name, args, kwargs)
        if cache is not None and hasattr(cache, "reorder_cache"):
            self._cache_ref = weakref.ref(cache)
            if cache not in self._patched_caches:
                self._patch_reorder(cache)
        return None

    # ---- beam search -------------------------------------------------------------
    def _patch_reorder(self, cache: Any) -> None:
        """``cache.reorder_cache(beam_idx)`` also reorders the history rows (instance attribute,
        taken off by :meth:`remove`)."""
        original = cache.reorder_cache
        handle_ref = weakref.ref(self)
        cache_ref = weakref.ref(cache)

        def reorder_cache(beam_idx: torch.LongTensor, *args, **kwargs):
            result = original(beam_idx, *args, **kwargs)
            handle = handle_ref()
            if handle is not None and handle.attached and handle._cache_ref is not None \
                    and handle._cache_ref() is cache_ref():
                handle._reorder_history(beam_idx)
            return result

        reorder_cache._engram_handle = self
        cache.__dict__["reorder_cache"] = reorder_cache
        self._patched_caches.add(cache)

    def _reorder_history(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` of the running sequence takes the history of row ``beam_idx[i]``."""
        rows = self._rows
        if rows is None:
            return
        beam_idx = torch.as_tensor(beam_idx).to(self.hasher.device).long().reshape(-1)
        if beam_idx.numel() != len(rows):
            raise ValueError(f"beam_idx: expected {len(rows)} entries (one per batch row), found {beam_idx.numel()}")
        history = self.hasher.request_history
        sources = rows[beam_idx]
        history.values[rows] = history.values[sources].clone()
        history.tags[rows] = history.tags[sources].clone()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "removed"
        return f"EngramHandle({type(self.model).__name__}, layers={list(self.memory.layer_ids)}, {state})"


def attach_engram(model: torch.nn.Module, memory: EngramMemory, *, validate: bool | None = None,
                  profile: bool = False) -> EngramHandle:
    """Run ``memory``'s Engram layers inside ``model`` (a ``DeepseekV4ForCausalLM``).

    Args:
        model: the transformers model; its ``hidden_size``, ``hc_mult`` and ``vocab_size`` must
            match the Engram config, and every Engram layer id must be one of its decoder layers.
        memory: an :class:`EngramMemory` (e.g. from :meth:`EngramMemory.from_pretrained`).
        validate: check every batch in the hasher (None: as ``memory.hasher`` does: on for CPU).
        profile: make :attr:`EngramHandle.timings` wait for the device before reading the clock.

    Returns the :class:`EngramHandle`; ``handle.remove()`` restores the model. Works with
    ``forward`` and ``generate()`` (cached or ``use_cache=False``, greedy, sampling, beam
    search, padded batches); the forward must get ``input_ids`` and, with padding, the
    2-D ``attention_mask``.
    """
    if not isinstance(memory, EngramMemory):
        raise ValueError(f"memory: expected an EngramMemory, found {type(memory).__name__}")
    return EngramHandle(model, memory, validate=validate, profile=profile)


@functools.cache
def _model_class():
    """``DeepseekV4ForCausalLM`` that expects the Engram tensors in its files and leaves them to engram."""
    from transformers import DeepseekV4ForCausalLM

    class DeepseekV41ForCausalLM(DeepseekV4ForCausalLM):
        _keys_to_ignore_on_load_unexpected = [*(DeepseekV4ForCausalLM._keys_to_ignore_on_load_unexpected or []),
                                              r"(^|\.)layers\.\d+\.engram\."]

    DeepseekV41ForCausalLM.__module__ = __name__
    DeepseekV41ForCausalLM.__qualname__ = "DeepseekV41ForCausalLM"
    return DeepseekV41ForCausalLM


def _check_model_dir(model_dir) -> None:
    """A local checkpoint directory with a config.json, and what transformers needs to load it:
    one ValueError before transformers reads anything (it would take a missing path for a hub id)."""
    import importlib.util
    import json
    from pathlib import Path

    if not isinstance(model_dir, (str, os.PathLike)):
        raise ValueError(f"model_dir: expected a checkpoint directory path, found {type(model_dir).__name__}")
    path = Path(model_dir)
    if not path.exists():
        raise ValueError(f"model_dir {str(path)!r} does not exist; expected a checkpoint directory "
                         f"(config.json, tokenizer.json, *.safetensors)")
    if not path.is_dir():
        raise ValueError(f"model_dir {str(path)!r} is not a directory; expected a checkpoint directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model_dir {str(path)!r}: config file {str(config_path)!r} does not exist")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"config file {str(config_path)!r} is not valid JSON: {error}") from None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if quantization and importlib.util.find_spec("accelerate") is None:
        raise ValueError(f"config file {str(config_path)!r} has a quantization_config (FP8 weights), and transformers "
                         f"loads those only with accelerate, which is not installed: pip install 'engram[transformers]'")


def load_model(model_dir: str | os.PathLike, *, placement: str = "auto", engram_device: Any = None,
               validate: bool | None = None, progress: bool = True, **from_pretrained_kwargs: Any):
    """A V4.1 checkpoint directory -> a ``DeepseekV4ForCausalLM`` with its Engram layers attached.

    The model's own weights load through ``from_pretrained(model_dir, **from_pretrained_kwargs)``
    (which skips the ``layers.{i}.engram.*`` tensors); the Engram tensors through
    :meth:`EngramMemory.from_pretrained` (tables memory-mapped, streamed into ``placement``):
    each tensor of each file is read once. ``engram_device``: where the Engram layers run
    (default: the device of the model's first parameter). The handle is ``model.engram_handle``.
    """
    _check_model_dir(model_dir)
    model = _model_class().from_pretrained(model_dir, **from_pretrained_kwargs)
    device = engram_device
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    memory = EngramMemory.from_pretrained(model_dir, placement=placement, device=device, validate=validate,
                                          progress=progress)
    attach_engram(model, memory)
    return model
