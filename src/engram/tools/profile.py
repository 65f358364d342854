"""Row-read traces of real text, hot sets built from them, and cache replays
(``engram profile build|eval|plot``).

A *trace* is what an engine reads when it serves a corpus: every text file is tokenized and hashed
as one stream (``hash_ngrams``: n-grams never cross files), the files follow one another, and each
layer's reads are the ``[T, C]`` hash ids flattened token-major. A *hot set* (``HOT.npz``) is, per
layer, the most-read rows of a trace, hottest first, with their read counts. Replays go through
:mod:`engram.tools.cache_policy`.
"""

from __future__ import annotations

import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engram.checks import check_int
from engram.layout import EngramLayout
from engram.tools.cache_policy import (
    CompactStream,
    DynamicParams,
    best_static_hits,
    capacity_for,
    replay,
)

__all__ = ["DEFAULT_STEP_TOKENS", "DEFAULT_FRACTIONS", "Trace", "HotSet", "corpus_files", "read_trace",
           "build_hot_set", "evaluate", "prepare_streams", "replay_streams", "corpus_warnings", "replaced_warnings"]

DEFAULT_STEP_TOKENS = 4096
DEFAULT_FRACTIONS = (0.001, 0.005, 0.01, 0.02, 0.05)


def corpus_files(paths: list[str]) -> list[Path]:
    """The files of ``--corpus`` paths, in order: a file as given, a directory's files recursed
    (sorted, hidden ones skipped), each real file once. Errors name the flag and the path."""
    if not paths:
        raise ValueError("--corpus: expected at least one file or directory, found none")
    files: list[Path] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*"))
                      if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        else:
            raise ValueError(f"--corpus: {given!r} is neither a file nor a directory")
    unique = []
    for path in files:  # a file reached twice (a symbolic link beside it, a path given twice) counts once
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


MAX_BAD_BYTES = 0.01
"""Share of a file's bytes that may be invalid UTF-8 (each read as U+FFFD); more: not a UTF-8 text."""
MIN_STEPS = 10
"""Fewer engine steps than this and most reads come before any policy has acted (:func:`corpus_warnings`)."""


def _text(path: Path) -> tuple[str, int] | None:
    """``(text, invalid bytes)`` of a UTF-8 text file, invalid bytes read as U+FFFD (a stray
    cp1252 apostrophe in a long text); None for a file with a NUL byte or more than
    :data:`MAX_BAD_BYTES` of its bytes invalid (binary, or another encoding)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    bad = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
    if bad > MAX_BAD_BYTES * len(data):
        return None
    return data.decode("utf-8", errors="replace"), bad


@dataclass
class Trace:
    """Row reads of a corpus: ``reads[l]`` int64 ``[tokens * C]`` for layer index ``l``;
    ``replaced``: (file, invalid bytes) of the files read with U+FFFD for invalid UTF-8."""

    reads: list[np.ndarray]
    tokens: int
    files: int
    skipped: int
    seconds: float
    replaced: list[tuple[Path, int]] = field(default_factory=list)


def _bar(total: int, description: str, unit: str, enabled: bool):
    """A bar on stderr, as loading has (:func:`engram.progress.progress_bar`: whole lines when stderr is
    not a terminal), cleared from a terminal when done."""
    from engram.progress import progress_bar

    return progress_bar(total, description, unit=unit, enabled=enabled, leave=False)


def read_trace(paths: list[str], layout: EngramLayout, vocab, tokenizer, *, max_tokens: int | None = None,
               progress: bool = False) -> Trace:
    """Tokenize and hash the text files under ``paths`` (one stream per file) up to ``max_tokens``
    tokens; files that are not UTF-8 text are skipped (counted), a few invalid bytes in a text are
    read as U+FFFD (``Trace.replaced``). ``tokenizer``: a ``tokenizers.Tokenizer``.
    ``progress``: a bar of the files' bytes on stderr."""
    if max_tokens is not None:
        check_int("--max-tokens", max_tokens, 1)
    started = time.perf_counter()
    files = corpus_files(paths)
    per_layer: list[list[np.ndarray]] = [[] for _ in range(layout.spec.num_layers)]
    replaced: list[tuple[Path, int]] = []
    bar = _bar(sum(p.stat().st_size for p in files), "hashing text", "B", progress)
    try:
        tokens, used, skipped = _hash_files(files, layout, vocab, tokenizer, max_tokens, per_layer, replaced, bar)
    finally:
        bar.close()
    if used == 0:
        raise ValueError(f"--corpus: no text files found in {list(paths)!r} ({len(files)} files, {skipped} not "
                         "plain UTF-8)")
    reads = [np.concatenate(chunks) for chunks in per_layer]
    return Trace(reads, tokens, used, skipped, time.perf_counter() - started, replaced)


def _hash_files(files, layout, vocab, tokenizer, max_tokens, per_layer, replaced, bar) -> tuple[int, int, int]:
    """Hash each file into ``per_layer`` (:func:`read_trace`); ``(tokens, files used, files skipped)``."""
    from engram.hashing.reference import hash_ngrams

    tokens = used = skipped = 0
    for path in files:
        if max_tokens is not None and tokens >= max_tokens:
            bar.total = bar.n   # stopped at --max-tokens: what was read is the whole
            break
        bar.update(path.stat().st_size)
        read = _text(path)
        if read is None:
            skipped += 1
            continue
        text, bad = read
        if bad:
            replaced.append((path, bad))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if max_tokens is not None:
            ids = ids[:max_tokens - tokens]
        if not ids:
            continue
        hashed = hash_ngrams(np.asarray(ids, dtype=np.int64), layout, vocab)  # [T, L, C]
        for l in range(layout.spec.num_layers):
            per_layer[l].append(hashed[:, l, :].reshape(-1))
        tokens += len(ids)
        used += 1
    return tokens, used, skipped


@dataclass
class HotSet:
    """Per layer index ``l``: ``rows[l]`` int64 ``[H]`` hottest first and ``counts[l]`` their reads
    in the profile; ``steps``: the profile's steps (of ``step_tokens`` tokens)."""

    layer_ids: list[int]
    num_rows: list[int]
    rows: list[np.ndarray]
    counts: list[np.ndarray]
    fraction: float
    tokens: int
    step_tokens: int

    @property
    def steps(self) -> int:
        return max(1, -(-self.tokens // self.step_tokens))

    def save(self, path: str | Path) -> None:
        """Write a NumPy ``.npz`` archive to exactly ``path`` (no ``.npz`` is added to the name)."""
        arrays = {f"rows_{l}": r for l, r in enumerate(self.rows)} | {f"counts_{l}": c for l, c in enumerate(self.counts)}
        with open(path, "wb") as handle:
            self._write(handle, arrays)

    def _write(self, handle, arrays) -> None:
        np.savez_compressed(handle, layer_ids=np.array(self.layer_ids), num_rows=np.array(self.num_rows),
                            fraction=np.array(self.fraction), tokens=np.array(self.tokens),
                            step_tokens=np.array(self.step_tokens), **arrays)

    @classmethod
    def load(cls, path: str | Path, layout: EngramLayout) -> "HotSet":
        """Read ``path`` and check it was built for ``layout`` (errors name ``--hot`` and both values)."""
        if not Path(path).is_file():
            raise ValueError(f"--hot: {str(path)!r} is not a file")
        if Path(path).stat().st_size == 0:
            raise ValueError(f"--hot: {str(path)!r} is empty; expected a hot set written by engram profile build")
        try:
            data = np.load(path, allow_pickle=False)
        except ValueError:  # a text file: numpy's advice to load it "unsafely" is none to follow
            raise ValueError(f"--hot: {str(path)!r} is not a hot set written by engram profile build (not a NumPy "
                             f"archive)") from None
        except (OSError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(f"--hot: {str(path)!r} is not a hot set written by engram profile build "
                             f"({error or type(error).__name__})") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(f"--hot: {str(path)!r} is not a hot set written by engram profile build (a single "
                             f"NumPy array, not an .npz archive)")
        try:
            layer_ids = [int(x) for x in data["layer_ids"]]
            num_rows = [int(x) for x in data["num_rows"]]
            hot = cls(layer_ids, num_rows, [data[f"rows_{l}"].astype(np.int64) for l in range(len(layer_ids))],
                      [data[f"counts_{l}"].astype(np.int64) for l in range(len(layer_ids))],
                      float(data["fraction"]), int(data["tokens"]), int(data["step_tokens"]))
        except (OSError, KeyError, IndexError, ValueError, EOFError, zipfile.BadZipFile, TypeError) as error:
            raise ValueError(f"--hot: {str(path)!r} is not a hot set written by engram profile build "
                             f"({error or type(error).__name__})") from None
        expected = (list(layout.spec.layer_ids), [int(n) for n in layout.num_embeddings])
        if (hot.layer_ids, hot.num_rows) != expected:
            raise ValueError(f"--hot: {str(path)!r} was built for layers {hot.layer_ids} with rows {hot.num_rows}, "
                             f"the config has layers {expected[0]} with rows {expected[1]}")
        for l in range(len(layer_ids)):
            _check_hot_rows(str(path), l, data[f"rows_{l}"], data[f"counts_{l}"], hot.num_rows[l])
        return hot


def _check_hot_rows(path: str, layer: int, rows: np.ndarray, counts: np.ndarray, num_rows: int) -> None:
    """A hot set's layer: distinct integer rows in ``[0, num_rows)``, one integer count >= 0 each."""
    where = f"--hot: {path!r}"
    for name, values in ((f"rows_{layer}", rows), (f"counts_{layer}", counts)):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValueError(f"{where}: {name} must be a 1-D array of integers, found dtype {values.dtype} and shape "
                             f"{list(values.shape)}")
    if len(counts) != len(rows):
        raise ValueError(f"{where}: rows_{layer} has {len(rows)} rows but counts_{layer} {len(counts)} counts")
    bad = np.flatnonzero((rows < 0) | (rows >= num_rows))
    if bad.size:
        raise ValueError(f"{where}: rows_{layer}[{bad[0]}] = {rows[bad[0]]} is outside the layer's table rows "
                         f"[0, {num_rows})")
    negative = np.flatnonzero(counts < 0)
    if negative.size:
        raise ValueError(f"{where}: counts_{layer}[{negative[0]}] = {counts[negative[0]]} is negative")
    unique, first = np.unique(rows, return_index=True)
    if unique.size != rows.size:
        seen = np.zeros(rows.size, dtype=bool)
        seen[first] = True
        again = int(np.flatnonzero(~seen)[0])
        raise ValueError(f"{where}: rows_{layer}[{again}] = {rows[again]} appears twice; expected distinct rows")


def build_hot_set(trace: Trace, layout: EngramLayout, fraction: float, step_tokens: int = DEFAULT_STEP_TOKENS) -> HotSet:
    """Per layer, the ``capacity_for(fraction, rows)`` most-read rows of ``trace`` (ties: smaller row first)."""
    rows, counts = [], []
    for l, reads in enumerate(trace.reads):
        capacity = capacity_for(fraction, int(layout.num_embeddings[l]))
        unique, count = np.unique(reads, return_counts=True)
        order = np.lexsort((unique, -count))[:capacity]
        rows.append(unique[order].astype(np.int64))
        counts.append(count[order].astype(np.int64))
    return HotSet(list(layout.spec.layer_ids), [int(n) for n in layout.num_embeddings], rows, counts, float(fraction),
                  trace.tokens, step_tokens)


def evaluate(trace: Trace, layout: EngramLayout, fractions, policies, *, hot: HotSet | None = None,
             step_tokens: int = DEFAULT_STEP_TOKENS, params: DynamicParams = DynamicParams(),
             progress: bool = False) -> list[dict]:
    """Replay ``trace`` under each policy at each fraction (the hot set, when given, as the starting
    content). One dict per (policy, fraction): ``hit_rate`` (reads served from HBM / all reads, all
    layers), ``ceiling`` (1 - first touches / reads), ``best_static_hit_rate`` (the fraction's
    most-read rows of this very trace), ``host_fetch_ratio`` (host rows fetched with the cache /
    without, deduplicated per step), their counts (``reads``, ``hits``, ``fetches``, ``fetch_hits``),
    ``replay_seconds``, and ``layers`` (the same per layer id). ``progress``: bars on stderr."""
    streams = prepare_streams(trace, layout, fractions, policies, hot=hot, step_tokens=step_tokens,
                              progress=progress)
    return replay_streams(streams, layout, fractions, policies, hot=hot, params=params, progress=progress)


def prepare_streams(trace: Trace, layout: EngramLayout, fractions, policies, *, hot: HotSet | None = None,
                    step_tokens: int = DEFAULT_STEP_TOKENS, progress: bool = False) -> list[CompactStream]:
    """Per layer, ``trace``'s reads cut into steps of ``step_tokens`` tokens (one pass over the ids),
    for any number of :func:`replay_streams` at fractions up to the largest of ``fractions``."""
    check_int("--step-tokens", step_tokens, 1)
    for fraction in fractions:
        capacity_for(fraction, 1)  # the range check, before any work
    if "static" in policies and hot is None:
        raise ValueError("--policy static: needs --hot HOT.npz (the static set is built by engram profile build)")
    streams = []
    step_reads = step_tokens * layout.spec.num_columns
    bar = _bar(sum(-(-len(reads) // step_reads) for reads in trace.reads), "preparing steps", "step", progress)
    try:
        for l, reads in enumerate(trace.reads):
            most = max(capacity_for(f, int(layout.num_embeddings[l])) for f in fractions)
            extra = None if hot is None else hot.rows[l][:most]
            streams.append(CompactStream(reads, step_reads, extra_rows=extra, progress=bar))
    finally:
        bar.close()
    return streams


def replay_streams(streams: list[CompactStream], layout: EngramLayout, fractions, policies, *,
                   hot: HotSet | None = None, params: DynamicParams = DynamicParams(),
                   progress: bool = False) -> list[dict]:
    """:func:`evaluate`'s dicts for streams made by :func:`prepare_streams` (with the same ``hot``)."""
    bar = _bar(len(policies) * len(fractions) * sum(stream.num_steps for stream in streams), "replaying steps",
               "step", progress)
    try:
        return _replays(streams, layout, fractions, policies, hot, params, bar)
    finally:
        bar.close()


def _replays(streams, layout: EngramLayout, fractions, policies, hot, params, bar) -> list[dict]:
    results = []
    for policy in policies:
        for fraction in fractions:
            layers, totals = {}, np.zeros(6, dtype=np.int64)
            started = time.perf_counter()
            for l, stream in enumerate(streams):
                capacity = capacity_for(fraction, int(layout.num_embeddings[l]))
                kwargs = {} if hot is None else dict(initial=True, initial_counts=hot.counts[l],
                                                     profile_steps=hot.steps)
                result = replay(stream, capacity, policy, params=params, progress=bar, **kwargs)
                best = best_static_hits(stream, capacity)
                counts = np.array([result.reads, result.hits, stream.first_touches, best, result.fetches,
                                   result.fetch_hits])
                totals += counts
                layers[str(layout.spec.layer_ids[l])] = _figures(counts, capacity)
            seconds = time.perf_counter() - started
            results.append({"policy": policy, "fraction": fraction, **_figures(totals, None),
                            "replay_seconds": round(seconds, 3), "layers": layers})
    return results


def _figures(counts: np.ndarray, capacity: int | None) -> dict:
    reads, hits, first, best, fetches, fetch_hits = (int(x) for x in counts)
    figures = {"hit_rate": hits / reads, "ceiling": 1 - first / reads, "best_static_hit_rate": best / reads,
               "host_fetch_ratio": (fetches - fetch_hits) / fetches, "reads": reads, "hits": hits,
               "distinct_rows": first, "fetches": fetches, "fetch_hits": fetch_hits}
    if capacity is not None:
        figures["capacity_rows"] = capacity
    return figures


def corpus_warnings(trace: Trace, results: list[dict], step_tokens: int, name: str = "the corpus") -> list[str]:
    """What makes a replay of ``trace`` say little (each a whole sentence; none when it is fine): files
    read with U+FFFD for invalid bytes, fewer than :data:`MIN_STEPS` steps, a cache that holds every
    distinct row the text reads (any policy that keeps what it reads then reaches the ceiling)."""
    warnings = replaced_warnings(trace, name)
    steps = -(-trace.tokens // step_tokens)
    if steps < MIN_STEPS:
        warnings.append(f"{name}: {trace.tokens:,} tokens make {steps} step(s) of {step_tokens} tokens, fewer than "
                        f"{MIN_STEPS}: the cache changes only between steps, so most reads come before any policy "
                        f"acts; use more text or a smaller --step-tokens")
    full = sorted({r["fraction"] for r in results
                   if r["layers"] and all(layer["capacity_rows"] >= layer["distinct_rows"]
                                          for layer in r["layers"].values())})
    if full:
        distinct = max(layer["distinct_rows"] for r in results for layer in r["layers"].values())
        warnings.append(f"{name}: a cache of {full[0]:g} of the rows already holds every distinct row the text reads "
                        f"(up to {distinct:,} per layer): from there no row needs evicting, and a policy that keeps "
                        f"every row it reads serves every read of a row read in an earlier step (less than the "
                        f"ceiling, which also counts a row's repeats within the step of {step_tokens} tokens of its "
                        f"first read); the text is too small to compare policies")
    return warnings


def replaced_warnings(trace: Trace, name: str = "the corpus") -> list[str]:
    """One sentence naming the files read with U+FFFD for invalid UTF-8 bytes (none: no sentence)."""
    if not trace.replaced:
        return []
    listed = ", ".join(f"{str(path)!r} ({bad} byte{'s' if bad > 1 else ''})" for path, bad in trace.replaced[:5])
    more = f" and {len(trace.replaced) - 5} more" if len(trace.replaced) > 5 else ""
    return [f"{name}: {len(trace.replaced)} file(s) not valid UTF-8, read with U+FFFD in place of their invalid "
            f"bytes: {listed}{more}"]
