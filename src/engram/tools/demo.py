"""``engram demo``: stream real English text through NgramHasher as an engine would
and check every hash id against the whole-sequence reference; then load a
checkpoint (a synthetic one in the real format unless given) with
:class:`EngramMemory` and run its Engram layers end to end on the streamed
batches (hash -> lookup -> wkv -> gate), checked against the float64 reference."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from engram.checks import check_int
from engram.common import as_device, resolve_device
from engram.tools.corpus import count_english_texts, english_texts
from engram.tools.outputs import CommandFailed, staged_directory, writable_directory
from engram.tools.defaults import default_tokenizer_path, packaged_config
from engram.layer.gate import engram_gate
from engram.layer.wkv import split_kv
from engram.hashing.batch import NgramHasher
from engram.layout import EngramLayout
from engram.tools.simulation import HISTORY_SOURCES, StreamingEngine
from engram.spec import EngramSpec
from engram.vocab import TokenCompressor

__all__ = ["run_demo", "run_layer_demo", "check_text_count"]

LAYER_STAGES = ("hash", "lookup", "wkv", "gate")
_REFERENCE_CHUNK_TOKENS = 4096
_UPDATE_TOLERANCE = 1e-2   # relative error of the update out - hidden against the float64 reference
_LAYER_DECODE_STEPS = None   # decode to the end (an int bounds the decode steps)


def _tokenize_requests(texts: list[tuple[str, str]], tokenizer_file: Path, seed: int
                       ) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, raw token ids int64 [n], dead flags bool [n]) per text; one dead span per
    text longer than 64 tokens, as an image would make."""
    from tokenizers import Tokenizer

    rng = np.random.default_rng(seed)
    raw_tokenizer = Tokenizer.from_file(str(tokenizer_file))
    requests = []
    for name, text in texts:
        token_ids = np.array(raw_tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        if token_ids.size == 0:
            continue  # nothing to hash
        dead = np.zeros(len(token_ids), dtype=bool)
        if len(token_ids) > 64:
            start = int(rng.integers(0, len(token_ids) - 32))
            dead[start:start + int(rng.integers(1, 32))] = True
        requests.append((name, token_ids, dead))
    return requests


def _tokenizer_file(tokenizer: str | Path | None) -> Path:
    path = Path(tokenizer) if tokenizer else default_tokenizer_path()
    return path / "tokenizer.json" if path.is_dir() else path


def run_demo(*, config: str | None = None, tokenizer: str | None = None, device: str = "cpu",
             num_texts: int = 6, max_chars: int = 20_000, seed: int = 0, console: Console | None = None,
             checkpoint: str | None = None, layers: bool = True, placement: str = "auto") -> bool:
    """Returns True when every id matched (and, with ``layers``, every layer passed its check).

    ``placement``: where a CUDA run keeps the tables (``"auto"``: ``"device"``; ``"host"``:
    pinned host memory read by the GPU; ``"cached"``: host memory with an HBM cache of hot
    rows, updated after every step); a CPU run always uses ``"cpu"``.

    ``checkpoint``: a model directory to run the layers of; when it holds no
    ``config.json`` a synthetic checkpoint is written there (default: a temporary directory).
    """
    console = console or Console()
    # Every argument is checked before the tokenizer loads (one clear error, no slow work first).
    for flag, value in (("--texts", num_texts), ("--max-chars", max_chars)):
        check_int(flag, value, 1)
    check_text_count(num_texts)
    check_seed(seed)
    resolve_device(device, "engram demo --device")
    if layers:
        check_layer_arguments(checkpoint, device, placement)
    spec = EngramSpec.from_hf_config(config or packaged_config())
    layout = EngramLayout(spec)
    started = time.perf_counter()
    vocab = TokenCompressor.from_tokenizer(tokenizer or default_tokenizer_path(), spec=spec)
    vocab_seconds = time.perf_counter() - started
    console.print(f"[bold]engram demo[/]: layers {list(spec.layer_ids)}, rows {layout.num_embeddings}, "
                  f"{spec.num_columns} hash columns per layer; tokenizer compresses {vocab.vocab_size} ids to "
                  f"{vocab.size} ({vocab_seconds:.2f} s, cached on disk)")

    texts = english_texts(max_texts=num_texts, max_chars=max_chars, seed=seed)
    if len(texts) < num_texts:
        console.print(f"note: {len(texts)} texts, not {num_texts}: the other files found hold only white space",
                      highlight=False)
    requests = _tokenize_requests(texts, _tokenizer_file(tokenizer), seed)
    listing = Table(title="requests (real English text, DeepSeek-V4 tokenizer)")
    for column in ("request", "tokens", "dead tokens"):
        listing.add_column(column, justify="right" if column != "request" else "left")
    for name, token_ids, dead in requests:
        listing.add_row(name, str(len(token_ids)), str(int(dead.sum())))
    console.print(listing)

    results = Table(title=f"streamed through NgramHasher on {device}: prefill in uneven chunks, then decode one token per step")
    for column in ("history source", "steps", "tokens hashed", "hash time (s)", "tokens/s", "ids checked", "result"):
        results.add_column(column, justify="right" if column not in ("history source", "result") else "left")
    all_match = True
    for source in HISTORY_SOURCES:
        hasher = NgramHasher(layout, vocab, device=torch.device(device))
        engine = _streaming_engine(hasher, source, requests, seed)
        engine.run_prefill_then_decode(prompt_fraction=0.9, chunk_sizes=(17, 700), max_batch_tokens=2048)
        total = sum(len(t) for _, t, _ in requests)
        ok = engine.mismatches == 0 and engine.tokens_checked == total
        all_match &= ok
        results.add_row(source, str(engine.steps), str(engine.tokens_hashed), f"{engine.hash_seconds:.2f}",
                        f"{engine.tokens_hashed / max(engine.hash_seconds, 1e-9):,.0f}",
                        f"{engine.tokens_checked} x {spec.num_layers * spec.num_columns}",
                        "[green]match[/]" if ok else f"[red]{_hash_verdict(engine.mismatches, engine.tokens_checked, total)}[/]")
    console.print(results)
    if layers:
        all_match &= run_layer_demo(texts, checkpoint=checkpoint, tokenizer=tokenizer, device=device, seed=seed,
                                    placement=placement,
                                    console=console)
    return all_match


def check_seed(seed) -> None:
    """``--seed``: an integer in [0, 2**63) (what numpy's and torch's generators take)."""
    check_int("--seed", seed, 0, below=2**63, shown="[0, 2**63)")


def check_text_count(num_texts: int) -> None:
    """``--texts``: at most the text files found on the machine (:func:`count_english_texts`)."""
    counts = count_english_texts()
    available = sum(counts.values())
    if num_texts > available:
        found = ", ".join(f"{count} of {source}" for source, count in counts.items())
        raise ValueError(f"--texts: expected at most {available:,}, the text files found on this machine ({found}), "
                         f"found {num_texts:,}")


def check_layer_arguments(checkpoint: str | None, device: str, placement: str) -> None:
    """``--checkpoint`` (a directory, or a path to create one at: made and probed now, so that a path
    that cannot be written is refused before any slow work) and ``--placement`` against the device."""
    if checkpoint is not None and Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise ValueError(f"--checkpoint: expected a checkpoint directory (or a path where a synthetic one is "
                         f"written), found a file at {checkpoint!r}")
    if checkpoint is not None and not (Path(checkpoint) / "config.json").exists():
        writable_directory("--checkpoint", checkpoint, keep=False)
    placements = ("auto", "device", "host", "cached")
    if placement not in placements:
        raise ValueError(f"--placement: expected one of {', '.join(placements)}, found {placement!r}")
    if as_device(device).type == "cpu" and placement in ("host", "cached"):
        raise ValueError(f"--placement {placement}: tables in host memory are read by a CUDA device; "
                         "use --device cuda, or the CPU's own placement (the default)")


def _hash_verdict(mismatches: int, checked: int, total: int) -> str:
    """What went wrong in a streamed run: tokens whose ids differ, or tokens never checked."""
    parts = [f"{mismatches} differ"] if mismatches else []
    if checked != total:
        parts.append(f"{checked} of {total} tokens checked")
    return ", ".join(parts)


def _streaming_engine(hasher: Any, source: str, requests, seed: int) -> StreamingEngine:
    engine = StreamingEngine(hasher, source, np.random.default_rng(seed), block_size=16,
                             num_blocks=sum(len(t) for _, t, _ in requests) // 16 + 8 * len(requests),
                             max_requests=len(requests))
    for name, token_ids, dead in requests:
        engine.add(name, token_ids, dead)
    return engine


# ---------------------------------------------------------------------------
# the layers, end to end
# ---------------------------------------------------------------------------
class _LayerRunner:
    """Stands in for the hasher inside :class:`StreamingEngine`: hashes each step's batch with
    the memory's hasher, then runs every layer on it stage by stage (each stage timed), with
    hidden states drawn at random in bf16 ``[T, hc, hidden]`` and dead tokens masked.
    Keeps per step what the reference check needs (CPU copies)."""

    def __init__(self, memory, generator: torch.Generator):
        self.memory = memory
        self.hasher = memory.hasher
        self.generator = generator
        self.seconds = dict.fromkeys(LAYER_STAGES, 0.0)
        self.tokens = 0
        self.steps: list[dict[str, Any]] = []

    def __getattr__(self, name: str):  # everything else is the hasher's (stores, layout, vocab, ...)
        return getattr(self.hasher, name)

    def _time(self, stage: str, started: float) -> float:
        if self.memory.device.type == "cuda":
            torch.cuda.synchronize(self.memory.device)
        now = time.perf_counter()
        self.seconds[stage] += now - started
        return now

    def __call__(self, input_ids, positions, query_start_loc, dead_mask=None, **kwargs):
        memory = self.memory
        started = time.perf_counter()
        hash_ids = self.hasher(input_ids, positions, query_start_loc, dead_mask=dead_mask, **kwargs)  # [T, L, C]
        started = self._time("hash", started)
        memory.prefetch(hash_ids)  # host placements: every layer's reads start now
        self._time("lookup", started)
        num_tokens = hash_ids.shape[0]
        spec = memory.spec
        hidden = torch.randn(num_tokens, spec.hc_mult, spec.hidden_size, generator=self.generator)
        hidden = hidden.to(torch.bfloat16).to(memory.device)
        token_mask = torch.ones(num_tokens, dtype=torch.bool, device=memory.device) if dead_mask is None else ~dead_mask
        outputs = []
        for index, layer_id in enumerate(memory.layer_ids):
            layer = memory.layer(layer_id)
            started = time.perf_counter()
            if layer.wkv.fp8:  # FP8 wkv on the GPU: FP8 rows, the path the module takes
                values, scales = layer.table.lookup_packed(hash_ids[:, index, :])   # [T, C, hd], [T, C, hd / 32]
                started = self._time("lookup", started)
                key, value = split_kv(layer.wkv.forward_fp8_rows(values, scales), layer.hc_mult)
            else:
                rows = layer.table.lookup(hash_ids[:, index, :])                 # bf16 [T, C, head_dim]
                started = self._time("lookup", started)
                key, value = layer.wkv.key_value(rows, layer.hc_mult)            # bf16 [T, hc, D], [T, D]
            started = self._time("wkv", started)
            outputs.append(engram_gate(hidden, key, value, layer.q_weight, layer.k_weight, layer.eps, token_mask))
            self._time("gate", started)
        started = time.perf_counter()
        memory.update_cache(hash_ids)  # placement "cached": admit this step's hot rows (else a no-op)
        self._time("lookup", started)
        self.tokens += num_tokens
        self.steps.append({"hash_ids": hash_ids.cpu(), "hidden": hidden.cpu(), "token_mask": token_mask.cpu(),
                           "outputs": [out.cpu() for out in outputs]})
        return hash_ids


def _prepare_checkpoint(checkpoint: str | None, tokenizer: str | None, seed: int, workspace: Path,
                        console: Console) -> Path:
    """The checkpoint directory to load: ``checkpoint`` as found when it holds a ``config.json``,
    else a synthetic checkpoint written there (or in ``workspace``, a temporary directory), every
    file staged first and ``config.json`` moved in last, so a failed write (a full disk) leaves no
    partial checkpoint for the next run to take as one."""
    from engram.tools.testing import write_synthetic_checkpoint

    directory = Path(checkpoint) if checkpoint else workspace
    if (directory / "config.json").exists():
        console.print(f"checkpoint: {directory} (as found)")
        return directory
    directory, made = writable_directory("--checkpoint", str(directory))
    started = time.perf_counter()
    with staged_directory("--checkpoint", directory, made, last="config.json") as staging:
        written = write_synthetic_checkpoint(staging, seed=seed, scale="small", tokenizer=_tokenizer_file(tokenizer),
                                             num_shards=2)
    spec = written.spec
    where = (f"to {directory}" if checkpoint else
             "for this run (a temporary directory, removed at exit; --checkpoint DIR keeps one)")
    console.print(f"checkpoint: wrote a synthetic one {where} in {time.perf_counter() - started:.2f} s: "
                  f"layers {list(spec.layer_ids)}, {spec.num_columns} hash columns of {spec.head_dim}, hidden "
                  f"{spec.hidden_size}, hc_mult {spec.hc_mult}, FP8 wkv {list(spec.weight_block_size or [])} blocks, "
                  f"tables {[f'{r:,}' for r in EngramLayout(spec).num_embeddings]} rows", highlight=False)
    return directory


def _load_memory(directory: Path, placement: str, device: str):
    """``EngramMemory.from_pretrained`` of the demo's checkpoint; a checkpoint it refuses is a problem
    found (:class:`CommandFailed`, exit 1) naming the directory and the loader's reason."""
    from engram.checkpoint import file_problem
    from engram.memory import EngramMemory

    try:
        for name, what in (("config.json", "config file"), ("tokenizer.json", "tokenizer file")):
            problem = file_problem(directory / name, what)
            if problem is not None:
                raise ValueError(problem)
        return EngramMemory.from_pretrained(directory, placement=placement,
                                            device=None if device == "cpu" else device, progress=False)
    except ValueError as error:
        raise CommandFailed(f"--checkpoint: {str(directory)!r} cannot be loaded: {error}") from None


def _check_layers(memory, runner: _LayerRunner, directory: Path) -> list[dict[str, Any]]:
    """Per layer: the module's forward equals the timed stages (first steps), the update
    ``out - hidden`` is within 1e-2 of the float64 reference, masked tokens are untouched."""
    from engram.checkpoint import SafetensorsCheckpoint, load_engram_layer_weights
    from engram.layer import reference_engram
    from engram.table import lookup_reference

    checkpoint = SafetensorsCheckpoint(directory)
    spec = memory.spec
    results = []
    for index, layer_id in enumerate(memory.layer_ids):
        weights = load_engram_layer_weights(checkpoint, spec, memory.layout, index)
        table = memory.table(layer_id).storage
        value_bytes, scale_bytes = table.value_bytes.cpu(), table.scale_bytes.cpu()
        module_equal = True
        for step in {id(s): s for s in (runner.steps[0], runner.steps[-1])}.values():  # a prefill and a decode step
            out = memory.forward_layer(layer_id, step["hidden"].to(memory.device), step["hash_ids"].to(memory.device),
                                       step["token_mask"].to(memory.device)).cpu()
            module_equal &= torch.equal(out.view(torch.int16), step["outputs"][index].view(torch.int16))
        hidden = torch.cat([s["hidden"] for s in runner.steps])
        hash_ids = torch.cat([s["hash_ids"][:, index, :] for s in runner.steps])
        mask = torch.cat([s["token_mask"] for s in runner.steps])
        out = torch.cat([s["outputs"][index] for s in runner.steps])
        error_squared = reference_squared = 0.0
        worst = 0.0
        for first in range(0, len(hidden), _REFERENCE_CHUNK_TOKENS):
            part = slice(first, first + _REFERENCE_CHUNK_TOKENS)
            rows = lookup_reference(value_bytes, scale_bytes, hash_ids[part])
            reference = reference_engram(hidden[part], rows, weights.wkv_weight, weights.q_weight, weights.k_weight,
                                         spec.rms_norm_eps, mask[part], weights.wkv_scale, spec.weight_block_size)
            live = mask[part]
            update = (out[part].double() - hidden[part].double())[live]
            reference_update = (reference - hidden[part].double())[live]
            difference = (update - reference_update).flatten(1).norm(dim=1)
            size = reference_update.flatten(1).norm(dim=1)
            error_squared += float(difference.square().sum())
            reference_squared += float(size.square().sum())
            if len(size):
                # torch's max keeps a NaN (Python's max would drop it against the running 0.0)
                worst = float(torch.tensor([worst, float((difference / size.clamp(min=1e-30)).max())]).max())
        relative_error = (error_squared / max(reference_squared, 1e-300)) ** 0.5
        masked_untouched = torch.equal(out[~mask].view(torch.int16), hidden[~mask].view(torch.int16))
        results.append({"layer": layer_id, "tokens": len(hidden), "masked": int((~mask).sum()),
                        "relative_error": relative_error, "worst_token": worst, "masked_untouched": masked_untouched,
                        "module_equal": module_equal,
                        "ok": relative_error < _UPDATE_TOLERANCE and masked_untouched and module_equal})
    return results


def run_layer_demo(texts: list[tuple[str, str]], *, checkpoint: str | None = None, tokenizer: str | None = None,
                   device: str = "cpu", seed: int = 0, console: Console | None = None,
                   placement: str = "auto") -> bool:
    """Load a checkpoint with :class:`EngramMemory`, stream ``texts`` through its hasher
    and layers as an engine would, print a per-stage timing table and the reference
    check; True when every layer passed."""
    console = console or Console()
    check_seed(seed)
    check_layer_arguments(checkpoint, device, placement)
    with tempfile.TemporaryDirectory(prefix="engram-demo-") as workspace:
        directory = _prepare_checkpoint(checkpoint, tokenizer, seed, Path(workspace), console)
        started = time.perf_counter()
        chosen = "cpu" if device == "cpu" else ("device" if placement == "auto" else placement)
        memory = _load_memory(directory, chosen, device)
        console.print(f"loaded {memory!r} in {time.perf_counter() - started:.2f} s")
        requests = _tokenize_requests(texts, directory / "tokenizer.json", seed)
        runner = _LayerRunner(memory, torch.Generator().manual_seed(seed))
        engine = _streaming_engine(runner, "slot_cache", requests, seed)
        engine.run_prefill_then_decode(prompt_fraction=0.9, chunk_sizes=(17, 700), max_batch_tokens=2048,
                                       max_decode_steps=_LAYER_DECODE_STEPS)
        hashes_ok = engine.mismatches == 0 and engine.tokens_checked == runner.tokens
        checks = _check_layers(memory, runner, directory)

    spec = memory.spec
    timing = Table(title=f"Engram layers end to end on {memory.device}: {runner.tokens:,} tokens, {engine.steps} steps")
    for column in ("stage", "time (ms)", "tokens/s"):
        timing.add_column(column, justify="right" if column != "stage" else "left")
    for stage in LAYER_STAGES:
        seconds = runner.seconds[stage]
        timing.add_row(stage, f"{seconds * 1e3:,.1f}", f"{runner.tokens / max(seconds, 1e-9):,.0f}")
    total = sum(runner.seconds.values())
    timing.add_row("total", f"{total * 1e3:,.1f}", f"{runner.tokens / max(total, 1e-9):,.0f}")
    console.print(timing)
    console.print(f"[dim]prefill chunks, then decode steps; hash covers all {spec.num_layers} layers at once, "
                  f"the other stages are summed over the layers[/]")

    verdict = Table(title="layer outputs against the float64 reference")
    for column in ("layer", "tokens", "masked", "update rel. error", "worst token", "masked untouched",
                   "module = stages", "result"):
        verdict.add_column(column, justify="right" if column not in ("result",) else "left")
    for check in checks:
        verdict.add_row(str(check["layer"]), f"{check['tokens']:,}", f"{check['masked']:,}",
                        f"{check['relative_error']:.2e}", f"{check['worst_token']:.2e}",
                        "yes" if check["masked_untouched"] else "[red]no[/]",
                        "yes" if check["module_equal"] else "[red]no[/]",
                        "[green]match[/]" if check["ok"] else "[red]differ[/]")
    console.print(verdict)
    console.print(f"[dim]update = out - hidden: relative error over all live tokens, tolerance {_UPDATE_TOLERANCE:g} "
                  f"(the worst single token for information); masked tokens must equal their input bit for bit; "
                  f"module = stages: Engram.forward equals the timed stages bit for bit[/]")
    console.print(f"hash ids of the streamed steps against the whole-sequence reference: "
                  f"{'[green]match[/]' if hashes_ok else '[red]differ[/]'} ({engine.tokens_checked:,} tokens)")
    return hashes_ok and all(check["ok"] for check in checks)
