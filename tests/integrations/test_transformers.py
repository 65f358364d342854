"""Engram on 🤗 transformers' DeepseekV4ForCausalLM, driven by its own generate().

A tiny random V4.1 model (every attention kind, Engram layers 1 and 3, fp32) is written
by :func:`engram.tools.testing.write_transformers_checkpoint` and loaded with
:func:`engram.integrations.transformers.load_model`. Inputs come from a fresh seed
each run (``ENGRAM_TEST_SEED`` replays one); every assertion message names it.
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch

from conftest import missing_dependency

try:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover - reported by the fixture below
    DeepseekV4ForCausalLM = None

from engram import hash_ngrams
from engram.integrations.transformers import EngramHandle, _cache_argument, _cache_parameter, attach_engram, load_model
from engram.tools.testing import TINY_DEEPSEEK_V4, write_transformers_checkpoint

PAD = 2
FIRST_WORD = 4  # ids 0..3 are the word tokenizer's specials


def _seed() -> int:
    from conftest import fresh_seed

    return fresh_seed(__name__)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if DeepseekV4ForCausalLM is None:
        missing_dependency("transformers >= 5.23 with DeepseekV4ForCausalLM (pip install -e '.[transformers]')")
    return write_transformers_checkpoint(tmp_path_factory.mktemp("deepseek-v4.1-tiny"), seed=11)


@pytest.fixture
def model(checkpoint):
    model = load_model(checkpoint.directory, progress=False).eval()
    yield model
    model.engram_handle.remove() if getattr(model, "engram_handle", None) else None


def _prompts(rng: np.random.Generator, vocab_size: int, lengths) -> list[torch.Tensor]:
    return [torch.from_numpy(rng.integers(FIRST_WORD, vocab_size, n)) for n in lengths]


def _pad(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` ``[B, max length]`` padded with the pad id on ``side``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[b, span], mask[b, span] = row, 1
    return ids, mask


def _cache_spellings(model) -> list[str]:
    """The keywords a forward of ``model`` takes its cache under: its own parameter (``cache`` from
    transformers 5.24 on, ``past_key_values`` before), then ``past_key_values`` if that is 5.24's
    deprecated spelling of it."""
    own = _cache_parameter(inspect.signature(model.forward), type(model).__name__)
    return list(dict.fromkeys([own, "past_key_values"]))


def _returned_cache(out):
    """The cache in a forward's or generate()'s output: ``cache`` (5.24) or ``past_key_values`` (5.23)."""
    return out["cache"] if "cache" in set(out.keys()) else out["past_key_values"]


@torch.no_grad()
def _forward_with_cache(model, ids: torch.Tensor, cache, spelling: str):
    """``model(ids, <spelling>=cache, use_cache=True)``; 5.24's deprecation warning for the old spelling is expected."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
        return model(ids, use_cache=True, **{spelling: cache})


def _record_layer_calls(handle: EngramHandle) -> list[dict]:
    """Every memory.forward_layer call the handle makes: layer, hash ids, mask, input and output."""
    calls = []
    original = handle.memory.forward_layer

    def forward_layer(layer_id, hidden_states, hash_ids, token_mask=None, **kwargs):
        out = original(layer_id, hidden_states, hash_ids, token_mask, **kwargs)
        calls.append({"layer": layer_id, "hash_ids": hash_ids.clone(), "token_mask": token_mask.clone(),
                      "hidden": hidden_states.clone(), "out": out.clone()})
        return out

    handle.memory.forward_layer = forward_layer
    return calls


@torch.no_grad()
def _full_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    return model(sequences, attention_mask=attention_mask, use_cache=False).logits


def _tolerance(logits: torch.Tensor) -> float:
    return 1e-3 * float(logits.abs().max())


# ---------------------------------------------------------------------------
# generate() against a full forward
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["greedy", "sample", "no_cache"])
def test_incremental_generate_matches_full_forward(model, mode):
    seed = _seed()
    rng = np.random.default_rng(seed)
    vocab_size = model.config.vocab_size
    prompt_length, new_tokens = int(rng.integers(5, 19)), int(rng.integers(6, 13))
    prompts = torch.stack(_prompts(rng, vocab_size, [prompt_length] * int(rng.integers(1, 4))))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=mode == "sample",
                             use_cache=mode != "no_cache", output_logits=True, return_dict_in_generate=True,
                             pad_token_id=PAD)
    steps = torch.stack(out.logits, dim=1)                                   # [B, new, V]
    full = _full_logits(model, out.sequences)[:, prompt_length - 1:-1]        # the same positions, one forward
    tolerance = _tolerance(full)
    difference = float((steps - full).abs().max())
    assert difference <= tolerance, (f"seed={seed} mode={mode}: generate's logits differ from a full forward "
                                     f"by {difference:.3g} > {tolerance:.3g}")

    handle = model.engram_handle
    handle.remove()
    plain = _full_logits(model, out.sequences)[:, prompt_length - 1:-1]
    moved = float((plain - full).abs().max())
    assert moved > 100 * tolerance, f"seed={seed}: attaching Engram moved the logits only by {moved:.3g}"


def test_chunked_prefill_through_the_cache_matches_full_forward(model):
    """Forwards of uneven chunks on one DynamicCache: each chunk's first tokens take their
    n-grams from the per-request history. The cache goes in under every keyword the model's
    forward takes it by (``cache`` and the deprecated ``past_key_values`` on transformers 5.24)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    spellings = _cache_spellings(model)
    for spelling in spellings:
        ids = torch.stack(_prompts(rng, model.config.vocab_size, [int(rng.integers(12, 40))] * int(rng.integers(1, 4))))
        cuts = sorted({0, ids.shape[1], *rng.integers(1, ids.shape[1], int(rng.integers(1, 8))).tolist()})
        cache, pieces = None, []
        for start, end in zip(cuts[:-1], cuts[1:]):
            out = _forward_with_cache(model, ids[:, start:end], cache, spelling)
            cache = _returned_cache(out)
            pieces.append(out.logits)
        assert cache.get_seq_length() == ids.shape[1], f"seed={seed} {spelling}=: the model did not use the cache"
        chunked, full = torch.cat(pieces, dim=1), _full_logits(model, ids)
        difference, tolerance = float((chunked - full).abs().max()), _tolerance(full)
        assert difference <= tolerance, (f"seed={seed} {spelling}= chunks at {cuts}: logits differ from a full forward "
                                         f"by {difference:.3g} > {tolerance:.3g}")


def test_beam_search_beams_match_full_forward(model):
    seed = _seed()
    rng = np.random.default_rng(seed)
    prompt_length, new_tokens, beams = int(rng.integers(4, 12)), int(rng.integers(6, 10)), 3
    prompts = torch.stack(_prompts(rng, model.config.vocab_size, [prompt_length] * 2))
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams,
                             num_return_sequences=beams, do_sample=False, output_logits=True, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=PAD, length_penalty=1.0)
    full = _full_logits(model, out.sequences)                               # [B * beams, P + new, V]
    tolerance = _tolerance(full)
    steps = out.beam_indices.shape[1]
    for b in range(out.sequences.shape[0]):
        for t in range(steps):
            row = int(out.beam_indices[b, t])
            assert row >= 0, f"seed={seed}: beam {b} ended early at step {t}"
            difference = float((out.logits[t][row] - full[b, prompt_length - 1 + t]).abs().max())
            assert difference <= tolerance, (f"seed={seed}: beam {b} step {t} (running row {row}) differs from a "
                                             f"full forward of its sequence by {difference:.3g} > {tolerance:.3g}")
        log_probs = torch.log_softmax(full[b, prompt_length - 1:-1].double(), dim=-1)
        total = float(log_probs.gather(1, out.sequences[b, prompt_length:, None]).sum()) / new_tokens
        assert abs(total - float(out.sequences_scores[b])) <= 1e-3 * max(1.0, abs(total)), (
            f"seed={seed}: beam {b} score {float(out.sequences_scores[b]):.6f}, full forward gives {total:.6f}")
    # The beams did move between rows, so the history had to follow reorder_cache.
    assert bool((out.beam_indices[:, 1:] != out.beam_indices[:, :-1]).any()), f"seed={seed}: beams never reordered"


# ---------------------------------------------------------------------------
# padding
# ---------------------------------------------------------------------------
def test_right_padded_batch_gives_each_row_its_own_logits(model):
    seed = _seed()
    rng = np.random.default_rng(seed)
    rows = _prompts(rng, model.config.vocab_size, rng.integers(3, 24, 4))
    ids, mask = _pad(rows, "right")
    handle = model.engram_handle
    calls = _record_layer_calls(handle)
    batch = _full_logits(model, ids, mask)
    alone = [_full_logits(model, row[None])[0] for row in rows]
    for call in calls[: len(model.engram_handle.memory.layer_ids)]:  # the batch's forward: pads pass through
        dead = ~call["token_mask"]
        assert torch.equal(dead, (mask == 0).reshape(-1)), f"seed={seed}: padding not marked dead"
        assert torch.equal(call["out"][dead], call["hidden"][dead]), f"seed={seed}: a pad's stream changed"
    memory = handle.memory
    handle.remove()
    plain_batch = _full_logits(model, ids, mask)
    plain_alone = [_full_logits(model, row[None])[0] for row in rows]
    attach_engram(model, memory)

    checked = 0
    for b, row in enumerate(rows):
        n = len(row)
        tolerance = _tolerance(alone[b])
        plain_agrees = (plain_batch[b, :n] - plain_alone[b]).abs().amax(dim=-1) <= tolerance
        difference = (batch[b, :n] - alone[b]).abs().amax(dim=-1)
        bad = plain_agrees & (difference > tolerance)
        assert not bool(bad.any()), (f"seed={seed}: row {b} (length {n}) differs from itself alone at positions "
                                     f"{bad.nonzero().flatten().tolist()} by up to {float(difference.max()):.3g}")
        checked += int(plain_agrees.sum())
    assert checked == sum(len(r) for r in rows), f"seed={seed}: transformers' model itself is not right-pad invariant"


def test_left_padded_generate_hashes_each_row_as_alone(model):
    """The hash ids every Engram layer used, over prefill and every decode step of a
    left-padded generate(), equal hash_ngrams of the row's own tokens; a generate() on
    another batch just before must leave nothing behind."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    handle = model.engram_handle
    memory = handle.memory
    vocab_size = model.config.vocab_size
    with torch.no_grad():  # an earlier, larger batch on the same model
        model.generate(torch.stack(_prompts(rng, vocab_size, [9] * 5)), max_new_tokens=3, pad_token_id=PAD)
    rows = _prompts(rng, vocab_size, rng.integers(1, 14, 3))
    ids, mask = _pad(rows, "left")
    new_tokens = int(rng.integers(4, 9))
    calls = _record_layer_calls(handle)
    with torch.no_grad():
        sequences = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=PAD)
    batch = len(rows)
    for index, layer_id in enumerate(memory.layer_ids):
        used = [c for c in calls if c["layer"] == layer_id]
        assert len(used) == new_tokens, f"seed={seed}: layer {layer_id} ran {len(used)} times"
        ids_used = torch.cat([c["hash_ids"].view(batch, -1, *c["hash_ids"].shape[1:])[:, :, index] for c in used], 1)
        live = torch.cat([c["token_mask"].view(batch, -1) for c in used], 1)
        for call in used:
            dead = ~call["token_mask"]
            assert torch.equal(call["out"][dead], call["hidden"][dead]), f"seed={seed}: a pad's stream changed"
        for b, row in enumerate(rows):
            pads = ids.shape[1] - len(row)
            tokens = sequences[b, pads:-1]                                    # every token a forward hashed
            assert not bool(live[b, :pads].any()) and bool(live[b, pads:].all()), f"seed={seed}: row {b} mask"
            reference = hash_ngrams(tokens.numpy(), memory.layout, memory.vocab)[:, index]
            got = ids_used[b, pads:].long().numpy()
            assert np.array_equal(got, reference), (
                f"seed={seed}: layer {layer_id} row {b} ({len(row)} prompt tokens after {pads} pads): hash ids differ "
                f"from hash_ngrams at positions {np.nonzero((got != reference).any(1))[0].tolist()}")


# ---------------------------------------------------------------------------
# attaching and removing
# ---------------------------------------------------------------------------
def test_attach_changes_logits_and_remove_restores_them_bit_for_bit(model):
    seed = _seed()
    rng = np.random.default_rng(seed)
    ids = torch.stack(_prompts(rng, model.config.vocab_size, [int(rng.integers(2, 30))] * 2))
    handle = model.engram_handle
    memory = handle.memory
    handle.remove()
    handle.remove()  # idempotent
    own = _full_logits(model, ids)
    again = attach_engram(model, memory)
    with_engram = _full_logits(model, ids)
    assert float((with_engram - own).abs().max()) > 100 * _tolerance(own), f"seed={seed}: Engram changed nothing"
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, num_beams=2, pad_token_id=PAD, return_dict_in_generate=True)
    cache = _returned_cache(out)
    assert "reorder_cache" in vars(cache), "the cache's reorder_cache is not followed"
    again.remove()
    assert "reorder_cache" not in vars(cache), "remove() left the cache patched"
    assert not hasattr(model, "engram_handle")
    restored = _full_logits(model, ids)
    assert torch.equal(restored, own), f"seed={seed}: remove() did not restore the model's own logits"


def test_load_model_reads_the_checkpoint_once(checkpoint, model):
    from safetensors import safe_open

    assert isinstance(model, DeepseekV4ForCausalLM)
    assert not any(".engram." in name for name in model.state_dict()), "Engram tensors became model weights"
    memory = model.engram_handle.memory
    assert memory.layer_ids == tuple(checkpoint.spec.layer_ids)
    for layer_id in memory.layer_ids:
        name = f"model.layers.{layer_id}.engram.q_weight"
        with safe_open(str(checkpoint.directory / checkpoint.weight_map[name]), framework="pt") as handle:
            assert torch.equal(memory.layer(layer_id).q_weight, handle.get_tensor(name))
    from engram.integrations.transformers import _model_class

    _, info = _model_class().from_pretrained(checkpoint.directory, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info  # Engram tensors are engram's, quietly
    name = "model.layers.0.attn_hc.fn"
    with safe_open(str(checkpoint.directory / checkpoint.weight_map[name]), framework="pt") as handle:
        assert torch.equal(model.model.layers[0].attn_hc.fn.detach(), handle.get_tensor(name))


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
def _tiny_model(**overrides):
    fields = {**TINY_DEEPSEEK_V4, "vocab_size": 1000, "hidden_size": 64, "hc_mult": 4, **overrides}
    return DeepseekV4ForCausalLM(DeepseekV4Config(**fields))


@pytest.mark.parametrize("field,value", [("hidden_size", 32), ("hc_mult", 2), ("vocab_size", 100)])
def test_mismatched_model_is_refused(model, field, value):
    memory = model.engram_handle.memory
    other = _tiny_model(**{field: value})
    with pytest.raises(ValueError, match=f"'{field}' is {value}"):
        attach_engram(other, memory)


def test_model_without_hc_stream_is_refused(model):
    memory = model.engram_handle.memory
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="no hyper-connection stream"):
        attach_engram(llama, memory)


def test_misuse_gets_clear_errors(model):
    memory = model.engram_handle.memory
    with pytest.raises(ValueError, match="already attached"):
        attach_engram(model, memory)
    ids = torch.randint(FIRST_WORD, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(_seed()))
    with torch.no_grad(), pytest.raises(ValueError, match="input_ids: Engram hashes token ids"):
        model(inputs_embeds=model.model.embed_tokens(ids))
    memory_handle = model.engram_handle
    memory_handle.remove()
    with torch.no_grad():
        cache = _returned_cache(model(ids, use_cache=True))        # tokens Engram never saw
    attach_engram(model, memory)
    own = _cache_spellings(model)[0]
    for target in (model, model.model):  # the causal LM, and its base model (whose own hook reads the call)
        for spelling in _cache_spellings(target):
            with pytest.raises(ValueError, match=f"^{own}: the cache holds 6 tokens, but Engram's history holds no "):
                _forward_with_cache(target, ids[:, :1], cache, spelling)


def test_cache_argument_follows_the_forwards_own_name():
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (still renaming the old
    keyword inside the forward, ``cache`` winning when both come); 5.23's forward takes
    ``past_key_values`` and drops an unknown ``cache`` keyword into ``**kwargs``."""
    def new(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs): ...
    def old(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs): ...
    def none(self, input_ids=None, **kwargs): ...
    given, other = object(), object()
    for forward, own, calls in (
            (new, "cache", [((), {"cache": given}, given), ((), {"past_key_values": given}, given),
                            ((None, None, None, None, given), {}, given), ((), {}, None),
                            ((), {"cache": given, "past_key_values": other}, given),
                            ((), {"cache": None, "past_key_values": other}, None)]),
            (old, "past_key_values", [((), {"past_key_values": given}, given), ((), {"cache": other}, None),
                                      ((None, None, None, None, given), {}, given)])):
        signature = inspect.signature(forward)
        assert _cache_parameter(signature, "Model") == own
        for args, kwargs, expected in calls:
            found = _cache_argument(signature, own, args, kwargs)
            assert found is expected, f"{forward.__name__}{args, kwargs}: read {found!r}, expected {expected!r}"
    with pytest.raises(ValueError, match=r"Model.forward: expected a KV-cache argument named one of \['cache', "
                                         r"'past_key_values'\], found parameters \['self', 'input_ids', 'kwargs'\]"):
        _cache_parameter(inspect.signature(none), "Model")


@pytest.mark.slow
def test_demo_generates_from_real_text(checkpoint, deepseek_tokenizer_path, capsys):
    from engram.tools.cli import main

    assert main(["demo", "--transformers", "--texts", "2", "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    printed = capsys.readouterr().out
    assert "Engram hash" in printed and "decode" in printed and "match" in printed


# ---------------------------------------------------------------------------
# prefetch and row-cache updates
# ---------------------------------------------------------------------------
def test_generate_prefetches_each_forward_and_updates_the_cache_after_it(model, monkeypatch):
    """Each forward prefetches its rows once, after the decoder layer before the first Engram layer has
    run (so its host time overlaps that layer's GPU work), every Engram layer is given that step's
    handle, and the row cache (placement "cached"; a no-op here) learns from the forward's ids once it
    is over."""
    memory = model.engram_handle.memory
    events: list = []
    before_first = min(memory.layer_ids) - 1
    assert before_first >= 0, memory.layer_ids
    marker = model.engram_handle._stack.layers[before_first].register_forward_pre_hook(
        lambda module, args: events.append(("decoder layer", None, None)))
    prefetch, forward_layer, update_cache = memory.prefetch, memory.forward_layer, memory.update_cache

    def spy_prefetch(hash_ids, **kwargs):
        handle = prefetch(hash_ids, **kwargs)
        events.append(("prefetch", hash_ids, handle))
        return handle

    def spy_forward_layer(layer_id, hidden, hash_ids, token_mask=None, **kwargs):
        events.append(("layer", hash_ids, kwargs.get("prefetch")))
        return forward_layer(layer_id, hidden, hash_ids, token_mask, **kwargs)

    def spy_update_cache(hash_ids):
        events.append(("update", hash_ids, None))
        return update_cache(hash_ids)

    monkeypatch.setattr(memory, "prefetch", spy_prefetch)
    monkeypatch.setattr(memory, "forward_layer", spy_forward_layer)
    monkeypatch.setattr(memory, "update_cache", spy_update_cache)
    rng = np.random.default_rng(_seed())
    ids = torch.stack(_prompts(rng, model.config.vocab_size, [6, 6]))
    try:
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=PAD)
    finally:
        marker.remove()
    layers = len(memory.layer_ids)
    forwards = [events[k:k + layers + 3] for k in range(0, len(events), layers + 3)]
    assert len(forwards) == 3 and len(events) == 3 * (layers + 3)
    for forward in forwards:
        kinds = [kind for kind, _, _ in forward]
        assert kinds == ["decoder layer", "prefetch"] + ["layer"] * layers + ["update"]
        hash_ids, handle = forward[1][1], forward[1][2]
        assert all(step_ids is hash_ids for _, step_ids, _ in forward[1:])
        assert all(given is handle for _, _, given in forward[2:-1])


def test_engram_at_layer_zero_prefetches_right_after_hashing(tmp_path, monkeypatch):
    """With an Engram layer at decoder layer 0 no layer runs before it: the forward prefetches right after
    hashing, before any decoder layer, and layer 0 is given that handle."""
    if DeepseekV4ForCausalLM is None:
        missing_dependency("transformers >= 5.23 with DeepseekV4ForCausalLM (pip install -e '.[transformers]')")
    zero = write_transformers_checkpoint(tmp_path / "engram-at-0", seed=12, layer_ids=(0, 2))
    model = load_model(zero.directory, progress=False).eval()
    try:
        memory, events = model.engram_handle.memory, []
        prefetch, forward_layer = memory.prefetch, memory.forward_layer

        def spy_prefetch(hash_ids, **kwargs):
            handle = prefetch(hash_ids, **kwargs)
            events.append(("prefetch", handle))
            return handle

        def spy_forward_layer(layer_id, hidden, hash_ids, token_mask=None, **kwargs):
            events.append((f"layer {layer_id}", kwargs.get("prefetch")))
            return forward_layer(layer_id, hidden, hash_ids, token_mask, **kwargs)

        monkeypatch.setattr(memory, "prefetch", spy_prefetch)
        monkeypatch.setattr(memory, "forward_layer", spy_forward_layer)
        layers = model.engram_handle._stack.layers
        marker = layers[1].register_forward_pre_hook(lambda module, args: events.append(("decoder layer 1", None)))
        rng = np.random.default_rng(_seed())
        try:
            model(torch.stack(_prompts(rng, model.config.vocab_size, [5])))
        finally:
            marker.remove()
        assert [kind for kind, _ in events] == ["prefetch", "layer 0", "decoder layer 1", "layer 2"]
        assert events[1][1] is events[0][1] and events[3][1] is events[0][1]
    finally:
        model.engram_handle.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_load_model_cached_serves_hits_during_generate(checkpoint):
    """placement "cached" through load_model: generate() updates the row cache after each forward, so a
    second generate() of the same prompt reads rows the first admitted (hits), and its tokens equal
    placement "device"'s."""
    rng = np.random.default_rng(_seed())
    cached = load_model(checkpoint.directory, placement="cached", engram_device="cuda", progress=False).eval()
    on_device = load_model(checkpoint.directory, placement="device", engram_device="cuda", progress=False).eval()
    ids = torch.stack(_prompts(rng, cached.config.vocab_size, [12, 12]))
    memory = cached.engram_handle.memory
    outputs = []
    for _ in range(2):
        outputs.append(cached.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD))
    expected = on_device.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD)
    hits = sum(int(memory.table(layer_id).storage.cache.stats[1]) for layer_id in memory.layer_ids)
    assert hits > 0, "the row cache served no read: update_cache never ran"
    assert all(torch.equal(out, expected) for out in outputs)
